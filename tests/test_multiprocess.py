"""Real multi-process jobs: horovodrun (Gloo and MPI) and plain mpirun, 2 ranks on CPU."""

import csv
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import yaml

from conftest import (
    HVD_TRAIN,
    TINY,
    cli,
    kill_group,
    launch,
    launcher_command,
    output_of,
    png_with_a_corrupt_middle,
    read_json,
    run_at_once,
    start,
)

pytestmark = pytest.mark.multiprocess

DUMP = Path(__file__).parent / "launched" / "train_and_dump.py"
LAUNCHERS = ["horovodrun-gloo", "horovodrun-mpi", "mpirun"]


def train_and_dump(launcher, data, out, dump, *extra, timeout=600):
    dump.mkdir(parents=True, exist_ok=True)
    program = [sys.executable, DUMP, dump, "--data", data, "--output", out, *TINY, "--val-split", "0.2", *extra]
    return launch(launcher, 2, program, timeout=timeout, EXPECTED_SIZE="2")


def rank_weights(dump, rank):
    with np.load(dump / f"weights-rank{rank}.npz") as f:
        return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


class GlooRun(NamedTuple):
    data: Path
    out: Path
    dump: Path
    proc: subprocess.CompletedProcess


# The options of gloo_run beyond TINY and --val-split 0.2; a resume of it gives them again.
GLOO_OPTIONS = [
    # Nothing checked before training: the ranks meet the broken images of its data in their shares.
    "--check-images",
    "none",
    # Rank 0 sweeps the rate, every rank trains with it.
    "--base-lr",
    "auto",
    # Warmup over 3 epochs of a 2-epoch run: the rate rises by the same amount every epoch, so a
    # resumed optimizer that lost its iteration count would start the ramp again.
    "--lr-schedule",
    "constant",
    "--warmup-epochs",
    "3",
]


@pytest.fixture(scope="module")
def gloo_run(demo_small, tmp_path_factory):
    """One 2-rank Gloo job of 2 epochs for the tests that read it: the same weights on every rank and
    exact evaluation, images that cannot be decoded, --base-lr auto; evaluate and predict use its model
    and the resume test continues a copy of it."""
    root = tmp_path_factory.mktemp("gloo")
    data = root / "data"
    shutil.copytree(demo_small, data)
    whole = next((data / "dots").rglob("*.png"))
    (data / "dots" / "truncated.png").write_bytes(whole.read_bytes()[:100])
    (data / "checkerboard" / "empty.jpg").write_bytes(b"")
    png_with_a_corrupt_middle(data / "checkerboard" / "middle.png")
    proc = train_and_dump("horovodrun-gloo", data, root / "run", root / "dump", *GLOO_OPTIONS, "--epochs", "2")
    assert proc.returncode == 0, output_of(proc)
    return GlooRun(data, root / "run", root / "dump", proc)


def check_identical_and_exact(out, dump, proc, global_batch=16):
    w0, w1 = rank_weights(dump, 0), rank_weights(dump, 1)
    assert len(w0) == len(w1) > 10  # TINY has 17: 3 kernels, 4 arrays per BatchNorm, the head's 2
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1)), "ranks ended with different weights"
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["global_batch"] == global_batch
    assert summary["horovod_environment"]["HOROVOD_CYCLE_TIME"] is None  # Horovod's own: only one process slows it
    # 23 images x 5 classes, 20% held out per class: 25 images, not a multiple of the global batch.
    # (gloo_run's classes of 24 and 25 images hold out 5 too, and its broken images are all trained on.)
    assert summary["val_images"] == 25
    assert summary["weights_identical_across_ranks"] is True
    both = proc.stdout + proc.stderr
    assert both.count("held-out accuracy") == 1, "only rank 0 reports"
    assert re.search(r"rank 0/2 dumped \d+ arrays", both) and re.search(r"rank 1/2 dumped \d+ arrays", both)


@pytest.mark.both_kerases
def test_horovodrun_gloo(gloo_run):
    check_identical_and_exact(gloo_run.out, gloo_run.dump, gloo_run.proc)


@pytest.mark.both_kerases
def test_base_lr_auto_is_found_once_and_shared(gloo_run):
    both = gloo_run.proc.stdout + gloo_run.proc.stderr
    assert both.count("the learning-rate range test runs on rank 0") == 1
    summary = read_json(gloo_run.out / "summary.json")
    found = read_json(gloo_run.out / "lr_find.json")["suggested_base_lr"]
    assert summary["base_lr"] == found and summary["weights_identical_across_ranks"] is True


@pytest.mark.parametrize(
    "launcher, extra, global_batch",
    [
        ("horovodrun-mpi", ["--fp16-allreduce"], 16),
        ("mpirun", ["--grad-accum", "2", "--head-lr-mult", "10", "--clip-norm", "0.5", "--clip-value", "0.1"], 32),
    ],
)
@pytest.mark.both_kerases
def test_mpi_launchers(launcher, extra, global_batch, demo_small, tmp_path):
    proc = train_and_dump(launcher, demo_small, tmp_path / "run", tmp_path / "dump", "--epochs", "2", *extra)
    assert proc.returncode == 0, output_of(proc)
    check_identical_and_exact(tmp_path / "run", tmp_path / "dump", proc, global_batch)
    # Clipping, like every option, is recorded with the run (each rank clipped the same averaged gradients).
    optim = yaml.safe_load((tmp_path / "run" / "run_config.yaml").read_text())["optim"]
    assert (optim["clip_norm"], optim["clip_value"]) == ((0.5, 0.1) if "--clip-norm" in extra else (0.0, 0.0))


@pytest.mark.both_kerases
def test_evaluate_counts_every_image_once_across_ranks(gloo_run, demo_small, tmp_path):
    out = gloo_run.out
    # Both at once (they only read the run): the one process fills what the job leaves of the cores.
    two, one = run_at_once(
        [*launcher_command("horovodrun-gloo", 2), *HVD_TRAIN, "evaluate", "--model-dir", out, "--data", demo_small]
        + ["--batch-size", "4", "--report", tmp_path / "two.json"],
        [*HVD_TRAIN, "evaluate", "--model-dir", out, "--data", demo_small, "--report", tmp_path / "one.json"],
    )
    assert two.returncode == 0, output_of(two)
    assert one.returncode == 0, output_of(one)
    two_ranks, one_rank = read_json(tmp_path / "two.json"), read_json(tmp_path / "one.json")
    assert two_ranks["images"] == one_rank["images"] == 115  # 115 = 2 * 14 batches of 4 + 3
    assert two_ranks["world_size"] == 2
    assert abs(two_ranks["accuracy"] - one_rank["accuracy"]) <= 1 / 115
    assert np.abs(np.array(two_ranks["confusion_matrix"]) - one_rank["confusion_matrix"]).sum() <= 2


def test_predict_under_horovodrun_keeps_input_order(gloo_run, demo_small, tmp_path):
    out = gloo_run.out
    target = tmp_path / "pred.csv"
    proc = launch(
        "horovodrun-gloo",
        2,
        [
            *HVD_TRAIN,
            "predict",
            "--model-dir",
            out,
            demo_small / "stripes_vertical",
            demo_small / "dots",
            "--output",
            target,
        ],
    )
    assert proc.returncode == 0, output_of(proc)
    with open(target) as f:
        paths = [row["path"] for row in csv.DictReader(f)]
    expected = sorted(str(p) for p in (demo_small / "stripes_vertical").rglob("*.*"))
    expected += sorted(str(p) for p in (demo_small / "dots").rglob("*.*"))
    assert paths == expected


def metrics(out):
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.both_kerases
def test_resume_continues_at_the_right_epoch_and_learning_rate_and_keeps_the_base_lr_found(gloo_run, tmp_path):
    # gloo_run stopped after 2 of the 3 epochs of its warmup (GLOO_OPTIONS); a copy goes on to the third.
    resumed = shutil.copytree(gloo_run.out, tmp_path / "resumed")
    found = read_json(resumed / "lr_find.json")["suggested_base_lr"]
    first_lr = float(metrics(resumed)[0]["lr"])
    common = [*TINY, "--data", gloo_run.data, "--val-split", "0.2", *GLOO_OPTIONS, "--output", resumed]
    second = launch("horovodrun-gloo", 2, [*HVD_TRAIN, "train", *common, "--epochs", "3"])
    assert second.returncode == 0, output_of(second)
    assert "resuming from" in second.stderr and "2 epoch(s) done" in second.stderr
    assert "Epoch 3/3" in second.stdout and "Epoch 1/3" not in second.stdout
    # A resumed run keeps the rate its checkpoint was made with, rather than sweeping again.
    assert re.search(r"--base-lr auto: \S+, as found by this run's range test", second.stderr), output_of(second)
    assert read_json(resumed / "summary.json")["base_lr"] == found
    rows = metrics(resumed)
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    lrs = [float(r["lr"]) for r in rows]  # epochs 1-2 from the first run, 3 from the resumed one
    assert lrs[0] == first_lr
    assert 0 < lrs[0] < lrs[1] < lrs[2]
    assert lrs[2] - lrs[1] == pytest.approx(lrs[1] - lrs[0], rel=1e-4)
    assert read_json(resumed / "summary.json")["weights_identical_across_ranks"] is True
    # Once more, as one process: every epoch is done.
    third = cli(["train", *common, "--epochs", "3"])
    assert third.returncode == 0 and "all 3 epochs are done already" in third.stderr, output_of(third)
    assert [r["epoch"] for r in metrics(resumed)] == ["1", "2", "3"]


def test_bad_image_with_fail_policy_ends_every_rank(tmp_path, demo_small):
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    whole = next((data / "dots").rglob("*.png"))
    (data / "dots" / "truncated.png").write_bytes(whole.read_bytes()[:100])
    proc = launch(
        "horovodrun-gloo",
        2,
        [*HVD_TRAIN, "train", "--data", data, "--output", tmp_path / "o", *TINY, "--on-bad-image", "fail"],
        timeout=300,
    )
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR error:" in line]
    assert len(errors) == 1 and "truncated.png" in errors[0], output_of(proc)


def test_images_that_cannot_be_decoded_never_stop_a_rank(gloo_run):
    """With nothing checked before training, each rank meets broken images in its share; none fails or
    falls behind: they are trained on with no weight, not scored, and listed the same for all."""
    summary = read_json(gloo_run.out / "summary.json")
    assert summary["weights_identical_across_ranks"] is True
    skipped = {Path(s["path"]).name: s["found"] for s in summary["skipped_images"]}
    assert set(skipped) == {"truncated.png", "empty.jpg", "middle.png"}
    assert set(skipped.values()) <= {"training", "evaluation"}
    # Exact evaluation still: every held-out image is scored once, or listed.
    from hvd_train.data.folder import list_folder, split_per_class

    _, val = split_per_class(list_folder(str(gloo_run.data)), 0.2, 42)  # --val-split 0.2, the default --seed 42
    in_val = {Path(p).name for p in val.paths} & set(skipped)
    assert {n for n, found in skipped.items() if found == "evaluation"} == in_val
    assert summary["val_images"] == len(val) - len(in_val)


@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun"])
def test_image_deleted_during_training_ends_the_job(launcher, demo_small, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(demo_small, data)
    out = tmp_path / "o"
    program = [*HVD_TRAIN, "train", "--data", data, "--output", out, *TINY, "--epochs", "50", "--val-split", "0"]
    proc = start([*launcher_command(launcher, 2), *program])
    try:
        deadline = time.time() + 300
        # Any epoch's checkpoint: the first may be pruned again before a look finds it.
        while not list((out / "checkpoints").glob("epoch-*")):
            assert proc.poll() is None, output_of_popen(proc)
            assert time.time() < deadline, "no checkpoint after 300 s"
            time.sleep(0.5)
        for victim in list((data / "square").rglob("*.*"))[:1] + list((data / "dots").rglob("*.*"))[:1]:
            victim.unlink()
        stdout, stderr = proc.communicate(timeout=180)
    except BaseException:
        kill_group(proc)
        raise
    assert proc.returncode != 0
    assert "could not read its input during training" in stderr + stdout, stderr[-5000:]
    assert not (out / "checkpoints" / "epoch-0050").exists()


def output_of_popen(proc):
    kill_group(proc)
    stdout, stderr = proc.communicate()
    return f"exit {proc.returncode}\n{stdout[-3000:]}\n{stderr[-5000:]}"


def test_pack_under_horovodrun_writes_the_records_of_one_process_in_the_same_order(tmp_path, demo_small):
    """Each rank packs a part of the seeded order into shards of its own; rank 0's manifest lists them in rank
    order, so a reader sees the records as one process would have written them."""
    import json

    import tensorflow as tf

    def records(folder):
        manifest = json.loads((folder / "manifest.json").read_text())
        names = []
        for shard in manifest["shards"]:
            for record in tf.data.TFRecordDataset(str(folder / shard["file"])).as_numpy_iterator():
                names.append(tf.train.Example.FromString(record).features.feature["image/filename"].bytes_list.value[0])
        return manifest, names

    one, two = tmp_path / "one", tmp_path / "two"
    alone, proc = run_at_once(  # independent: the one process fills what the job leaves of the cores
        [*HVD_TRAIN, "pack", demo_small, one, "--shard-size", "64KB", "--seed", "7"],
        [*launcher_command("horovodrun-gloo", 2), *HVD_TRAIN, "pack", demo_small, two, "--shard-size", "64KB"]
        + ["--seed", "7"],
    )
    assert alone.returncode == 0, output_of(alone)
    assert proc.returncode == 0, output_of(proc)
    assert "on 2 process(es)" in proc.stdout + proc.stderr
    manifest_one, names_one = records(one)
    manifest_two, names_two = records(two)
    assert names_two == names_one and len(names_one) == manifest_one["images"] > 0
    assert manifest_two["class_counts"] == manifest_one["class_counts"]
    writers = {shard["file"].split("-")[1] for shard in manifest_two["shards"]}
    assert writers == {"000", "001"}, "both ranks wrote shards"
