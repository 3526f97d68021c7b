"""Mixed precision and XLA on CPU with real horovodrun jobs (2 ranks)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, cli, launch, output_of, read_json, write_images

# Jobs of two ranks run alone (multiprocess); the one-process horovodrun check shares the machine.

LAUNCHED = Path(__file__).parent / "launched"


def rank_weights(dump, rank):
    with np.load(dump / f"weights-rank{rank}.npz") as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def train(data, out, dump, *extra, epochs=2):
    dump.mkdir(parents=True, exist_ok=True)
    program = [sys.executable, LAUNCHED / "train_and_dump.py", dump, "--data", data, "--output", out, *TINY]
    program += ["--val-split", "0.2", "--epochs", str(epochs), *extra]
    return launch("horovodrun-gloo", 2, program, EXPECTED_SIZE="2")


def identical(dump):
    w0, w1 = rank_weights(dump, 0), rank_weights(dump, 1)
    return len(w0) == len(w1) > 10 and all(np.array_equal(a, b) for a, b in zip(w0, w1))


@pytest.fixture(scope="module")
def few(tmp_path_factory):
    """30 images in 3 classes: 6 held out, 3 steps of 4 per rank. A CPU computes float16 at a few % of
    float32's speed, so the precision tests take as few steps as show what they check."""
    return write_images(tmp_path_factory.mktemp("few"), {"a": 10, "b": 10, "c": 10})


@pytest.mark.both_kerases
@pytest.mark.parametrize("precision", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.multiprocess
def test_mixed_precision_trains_resumes_and_saves_a_float32_model(precision, few, tmp_path):
    out = tmp_path / "run"
    small = ["--precision", precision, "--batch-size", "4"]
    proc = train(few, out, tmp_path / "dump", *small, epochs=1)
    assert proc.returncode == 0, output_of(proc)
    assert identical(tmp_path / "dump"), "ranks ended with different weights"
    summary = read_json(out / "summary.json")
    assert summary["precision"] == precision and summary["val_images"] == 6
    assert summary["steps_per_epoch"] == 3
    if precision == "mixed_float16":
        # Resume from the checkpoint (loss scale and all) and go one epoch further. (bfloat16 has no
        # loss scale: its checkpoint is a float32 run's, whose resume the other tests cover.)
        proc = train(few, out, tmp_path / "dump2", *small, epochs=2)
        assert proc.returncode == 0 and "resuming from" in proc.stderr, output_of(proc)
        assert identical(tmp_path / "dump2")
    # The saved model computes in float32, and evaluate / predict use it.
    from hvd_train.compat import keras

    model = keras.models.load_model(out / "model.keras", compile=False)
    assert {layer.dtype_policy.name for layer in model.layers} == {"float32"}
    assert model.predict(np.zeros((1, 32, 32, 3), "float32"), verbose=0).dtype == np.float32
    if precision != "mixed_float16":
        return  # a float32 model like the other: evaluated once is enough (predict: test_cli)
    proc = cli(["evaluate", "--model-dir", out, "--data", few, "--report", tmp_path / "eval.json"])
    assert proc.returncode == 0 and read_json(tmp_path / "eval.json")["images"] == 30, output_of(proc)


@pytest.mark.both_kerases
@pytest.mark.multiprocess
def test_an_inf_on_one_rank_lowers_the_loss_scale_and_every_rank_skips_that_step(tmp_path):
    proc = launch("horovodrun-gloo", 2, [sys.executable, LAUNCHED / "loss_scale_check.py", tmp_path])
    assert proc.returncode == 0, output_of(proc)
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in (0, 1)]
    assert ranks[0] == ranks[1], "both ranks saw the same scales and weights"
    *warmup, first, skipped, after = ranks[0]
    assert all(not s["changed"] for s in warmup) and warmup[0]["loss_scale"] < 32768  # random weights overflow
    assert first["changed"], "a finite step updates the weights"
    assert not skipped["changed"], "the step with an inf on rank 1 is skipped on every rank"
    assert skipped["iterations"] == first["iterations"] + 1
    assert skipped["loss_scale"] == first["loss_scale"] / 2
    assert after["changed"] and after["loss_scale"] == skipped["loss_scale"]
    # The skipped step's loss was nan on rank 1: under a loss scale that is no divergence (``divergence``).
    assert all(s["diverged"] == 0 for s in ranks[0])


@pytest.mark.both_kerases
@pytest.mark.multiprocess
def test_xla_jit_trains_with_identical_weights(demo_small, tmp_path):
    proc = train(demo_small, tmp_path / "run", tmp_path / "dump", "--xla", "jit", epochs=1)
    assert proc.returncode == 0, output_of(proc)
    assert identical(tmp_path / "dump")
    assert read_json(tmp_path / "run" / "summary.json")["xla"] == "jit"


@pytest.mark.multiprocess
def test_xla_auto_and_horovod_tuning_options_reach_the_run_and_its_outputs(demo_small, tmp_path):
    # One job for both: each is an option passed through to a run that must train as any other.
    out = tmp_path / "run"
    extra = ["--fusion-threshold-mb", "16", "--cycle-time-ms", "2.5", "--horovod-timeline", "--autotune"]
    proc = train(demo_small, out, tmp_path / "dump", "--xla", "auto", *extra, epochs=1)
    assert proc.returncode == 0, output_of(proc)
    assert identical(tmp_path / "dump")
    assert read_json(out / "summary.json")["xla"] == "auto"
    env = read_json(out / "summary.json")["horovod_environment"]
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(16 * 1024 * 1024) and env["HOROVOD_CYCLE_TIME"] == "2.5"
    timeline = (out / "horovod_timeline.json").read_text()
    assert timeline.startswith("[") and '"ph"' in timeline and "allreduce" in timeline.lower()
    assert (out / "horovod_autotune.csv").read_text().startswith("hierarchical_allreduce")
    import yaml

    written = yaml.safe_load((out / "run_config.yaml").read_text())["horovod"]
    assert written["fusion_threshold_mb"] == 16 and written["timeline"] is True


def test_every_train_option_passes_through_horovodrun():
    """horovodrun parses the whole command line and rejects a flag that abbreviates two of its own."""
    import argparse

    from hvd_train import config

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {"--timeline"})
    show = "import sys; print(sys.argv[1:])"
    proc = launch("horovodrun-gloo", 1, [sys.executable, "-c", show, *flags], timeout=120)
    assert proc.returncode == 0, output_of(proc)
    assert str(flags) in proc.stdout, "every flag reaches the program"
