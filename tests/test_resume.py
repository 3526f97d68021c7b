"""What a rerun finds and keeps: --no-resume, changed images, a disk that fills up at an epoch end.

Single processes through the real CLI, on the demo's patterns.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from conftest import TINY, cli, kill_group, output_of, small_file_system, start

RUN = [*TINY, "--val-split", "0.2", "--deterministic"]


def copy_tree(src, dst):
    shutil.copytree(src, dst)
    return dst


DESCRIBE = ("model.keras", "labels.json", "run_config.yaml", "summary.json")


def test_a_failed_rerun_leaves_the_model_and_what_describes_it_and_inference_checks_they_agree(demo_small, tmp_path):
    out = tmp_path / "run"
    first = cli(["train", "--data", demo_small, "--output", out, *RUN, "--epochs", "1"])
    assert first.returncode == 0, output_of(first)
    assert (out / "checkpoints" / "epoch-0001").is_dir()
    before = {name: (out / name).read_bytes() for name in DESCRIBE}
    # A mistyped --data with another backbone, crop and --no-resume: the run never starts; the
    # checkpoints stay, and so does every file that describes the model (not the new labels and crop).
    other = ["--model", "ResNet50", "--crop-fraction", "0.5", "--alpha-background", "black"]
    typo = cli(["train", "--data", tmp_path / "dmeo", "--output", out, *RUN, *other, "--no-resume"])
    assert typo.returncode == 2 and "does not exist" in typo.stderr, output_of(typo)
    assert (out / "checkpoints" / "epoch-0001").is_dir()
    assert {name: (out / name).read_bytes() for name in DESCRIBE} == before
    # A resume refused for another seed leaves them too.
    refused = cli(["train", "--data", demo_small, "--output", out, *RUN, "--epochs", "2", "--seed", "7"])
    assert refused.returncode == 2, output_of(refused)
    [error] = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert "--seed 42 then, 7 now" in error and "Give --seed 42 --grad-accum 1 to resume" in error, error
    assert {name: (out / name).read_bytes() for name in DESCRIBE} == before

    # Labels of another run beside the model: one class fewer than its outputs (as an older
    # hvd_train left after a failed rerun, with no digests in summary.json) ...
    image = sorted(demo_small.rglob("*.png"))[0]
    labels = json.loads(before["labels.json"])
    summary = json.loads(before["summary.json"])
    assert set(summary["model_files"]) == {"model.keras", "labels.json", "run_config.yaml"}
    del summary["model_files"]
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "labels.json").write_text(json.dumps(labels[:-1]))
    proc = cli(["predict", "--model-dir", out, image])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, output_of(proc)
    assert f"names {len(labels) - 1} classes but {out / 'model.keras'} has {len(labels)} outputs" in proc.stderr
    # ... or as many classes in another order, and another crop: summary.json's digests tell.
    (out / "summary.json").write_bytes(before["summary.json"])
    (out / "labels.json").write_text(json.dumps(labels[::-1]))
    config = before["run_config.yaml"].decode()
    assert "crop_fraction: 0.875" in config
    (out / "run_config.yaml").write_text(config.replace("crop_fraction: 0.875", "crop_fraction: 0.5"))
    proc = cli(["export", out, "--format", "tflite"])  # as predict and evaluate: one loader
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, output_of(proc)
    [error] = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "labels.json and run_config.yaml in" in error and "not what its run wrote" in error, error
    assert not (out / "export").exists()

    # The same command with the right folder: the checkpoints go when training starts, and the
    # log says so; the new model comes with its own labels and configuration.
    again = cli(["train", "--data", demo_small, "--output", out, *RUN, "--epochs", "1", "--no-resume"])
    assert again.returncode == 0, output_of(again)
    assert "--no-resume: removed 1 checkpoint(s) of an earlier run" in again.stderr
    assert "resuming from" not in again.stderr
    assert json.loads((out / "labels.json").read_text()) == labels
    written, first_config = (yaml.safe_load(t) for t in ((out / "run_config.yaml").read_text(), config))
    assert written == {**first_config, "run": {**first_config["run"], "resume": False}}


def test_changed_images_are_refused_unless_allowed_and_then_the_epoch_starts_over(demo_small, tmp_path):
    data = copy_tree(demo_small, tmp_path / "data")
    # Names that are not UTF-8 (Latin-1, as an older tool writes them), in training and held
    # out alike: they train, are checkpointed (the list's digest), resume and evaluate as any other.
    latin1 = []
    for folder in sorted(data.iterdir()):
        for image in sorted(folder.glob("*.png"))[-4:]:
            os.rename(image, os.fsencode(folder) + b"/caf\xe9-" + os.fsencode(image.name))
            latin1.append(os.fsdecode(os.fsencode(folder) + b"/caf\xe9-" + os.fsencode(image.name)))
    out = tmp_path / "run"
    first = cli(["train", "--data", data, "--output", out, *RUN, "--epochs", "1"])
    assert first.returncode == 0, output_of(first)
    assert json.loads((out / "summary.json").read_text())["skipped_images"] == []
    predicted = cli(["predict", "--model-dir", out, latin1[0], "--output", tmp_path / "p.csv"])
    assert predicted.returncode == 0, output_of(predicted)
    assert os.fsencode(latin1[0]) in (tmp_path / "p.csv").read_bytes(), "the name as the file system has it"
    # One image renamed: the count is the same, the list is not.
    victim = sorted((data / "dots").glob("shape-*.png"))[0]
    victim.rename(victim.with_name("zz-" + victim.name))
    refused = cli(["train", "--data", data, "--output", out, *RUN, "--epochs", "2"])
    assert refused.returncode == 2, output_of(refused)
    [error] = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert "the images differ from those checkpoint" in error and "--allow-data-change" in error
    assert "training images: 90 images" in error and "held-out images" in error
    allowed = cli(["train", "--data", data, "--output", out, *RUN, "--epochs", "2", "--allow-data-change"])
    assert allowed.returncode == 0, output_of(allowed)
    assert "--allow-data-change: the images differ" in allowed.stderr
    assert "resuming from" in allowed.stderr and (out / "checkpoints" / "epoch-0002").is_dir()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["val_images"] == 25 and summary["skipped_images"] == []


@pytest.fixture
def small_disk(tmp_path):
    """An 80 MB tmpfs: room for a run of TINY's MobileNet (25 MB a checkpoint) and its next checkpoint."""
    with small_file_system(tmp_path, "80m") as mount:
        yield mount


def fill(folder):
    """Writes zeros into folder/filler until the file system is full (to the last byte).

    Unbuffered: a buffered file that hit the full disk would raise again when closed.
    """
    with open(folder / "filler", "wb", buffering=0) as f:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                pass


def test_a_disk_that_fills_up_during_an_epoch_is_one_clear_line_and_the_rerun_continues(demo_small, small_disk):
    out = small_disk / "run"
    command = ["train", "--data", demo_small, "--output", out, *RUN, "--epochs", "2", "--keep-checkpoints", "1"]
    from conftest import HVD_TRAIN

    proc = start([*HVD_TRAIN, *command])
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / "epoch-0001").is_dir():
            assert proc.poll() is None and time.time() < deadline, output_of(proc)
            time.sleep(0.01)
        fill(small_disk)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    # The checkpoint comes first, then metrics.csv: whichever the full disk stops, one line says it.
    assert proc.returncode == 2, f"{stdout[-2000:]}\n{stderr[-4000:]}"
    assert "Traceback" not in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if "ERROR error:" in line]
    assert len(errors) == 1, stderr[-4000:]
    assert "No space left on device" in errors[0] and "free some space" in errors[0], stderr[-4000:]
    assert not list((out / "checkpoints").glob(".*")), "no half-written checkpoint is left"
    os.remove(small_disk / "filler")
    again = cli(command)
    assert again.returncode == 0, output_of(again)
    assert f"resuming from {out / 'checkpoints'}" in again.stderr
    rows = (out / "metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"], rows  # epoch 1's row too, from its checkpoint


def test_an_unwritable_metrics_file_is_one_clear_line(demo_small, tmp_path):
    out = tmp_path / "run"
    (out / "metrics.csv").mkdir(parents=True)  # a folder where the file goes
    proc = cli(["train", "--data", demo_small, "--output", out, *RUN, "--epochs", "1"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, output_of(proc)
    [error] = [line for line in proc.stderr.splitlines() if "ERROR error:" in line]
    assert f"cannot write {out / 'metrics.csv'}" in error and "choose another --output" in error, error


_THREADS_AFTER_TRAINING = """
import argparse, json, sys, threading
from hvd_train import config
from hvd_train.distributed import start
from hvd_train.training.run import run
parser = argparse.ArgumentParser()
config.add_arguments(parser)
cfg = config.from_sources(parser.parse_args(sys.argv[1:]))
ctx = start.init(cfg.horovod.threads_per_rank)
for epochs in (1, 2):  # two runs in one process, as an elastic job makes a new loop at each reset
    run(config.build({**cfg.to_dict(), "run": {**cfg.to_dict()["run"], "epochs": epochs}}), ctx)
print(json.dumps([t.name for t in threading.enumerate()]))
"""


def test_no_painter_thread_outlives_its_run(demo_small, tmp_path):
    args = ["--data", demo_small, "--output", tmp_path / "run", *RUN]
    proc = subprocess.run(
        [sys.executable, "-c", _THREADS_AFTER_TRAINING, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    threads = json.loads(proc.stdout.splitlines()[-1])
    assert "curves" not in threads, threads
