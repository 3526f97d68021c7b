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

from conftest import HVD_TRAIN, TINY, cli, kill_group, output_of, run_at_once, small_file_system, start

RUN = [*TINY, "--val-split", "0.2", "--deterministic"]


def copy_tree(src, dst):
    shutil.copytree(src, dst)
    return dst


DESCRIBE = ("model.keras", "labels.json", "run_config.yaml", "summary.json")


@pytest.fixture(scope="module")
def trained(demo_small, tmp_path_factory):
    """A first run of one epoch (its images, the run, and its Latin-1 names relative to the images).

    The tests below change what they are given: each takes a copy of the run (and of the images,
    where it changes them), not a run of its own.
    """
    root = tmp_path_factory.mktemp("trained")
    data = copy_tree(demo_small, root / "data")
    # Names that are not UTF-8 (Latin-1, as an older tool writes them), in training and held
    # out alike: they train, are checkpointed (the list's digest), resume and evaluate as any other.
    latin1 = []
    for folder in sorted(data.iterdir()):
        for image in sorted(folder.glob("*.png"))[-4:]:
            name = b"caf\xe9-" + os.fsencode(image.name)
            os.rename(image, os.fsencode(folder) + b"/" + name)
            latin1.append(os.fsencode(folder.name) + b"/" + name)
    out = root / "run"
    first = cli(["train", "--data", data, "--output", out, *RUN, "--epochs", "1"])
    assert first.returncode == 0, output_of(first)
    return data, out, latin1


def test_a_failed_rerun_leaves_the_model_and_what_describes_it_and_inference_checks_they_agree(
    demo_small, trained, tmp_path
):
    data, first, _ = trained
    out = copy_tree(first, tmp_path / "run")
    assert (out / "checkpoints" / "epoch-0001").is_dir()
    before = {name: (out / name).read_bytes() for name in DESCRIBE}
    # Two failed reruns in the run's folder, and inference on two copies of it whose files disagree
    # (below): four processes that change nothing another one reads, started at once.
    # A mistyped --data with another backbone, crop and --no-resume: the run never starts; the
    # checkpoints stay, and so does every file that describes the model (not the new labels and crop).
    other = ["--model", "ResNet50", "--crop-fraction", "0.5", "--alpha-background", "black"]
    typo_command = ["train", "--data", tmp_path / "dmeo", "--output", out, *RUN, *other, "--no-resume"]
    # A resume refused for another seed leaves them too.
    refused_command = ["train", "--data", data, "--output", out, *RUN, "--epochs", "2", "--seed", "7"]

    # Labels of another run beside the model: one class fewer than its outputs (as an older
    # hvd_train left after a failed rerun, with no digests in summary.json) ...
    image = sorted(demo_small.rglob("*.png"))[0]
    labels = json.loads(before["labels.json"])
    summary = json.loads(before["summary.json"])
    assert set(summary["model_files"]) == {"model.keras", "labels.json", "run_config.yaml"}
    del summary["model_files"]
    fewer = copy_tree(first, tmp_path / "fewer-labels")
    (fewer / "summary.json").write_text(json.dumps(summary))
    (fewer / "labels.json").write_text(json.dumps(labels[:-1]))
    # ... or as many classes in another order, and another crop: summary.json's digests tell.
    reordered = copy_tree(first, tmp_path / "reordered")
    (reordered / "labels.json").write_text(json.dumps(labels[::-1]))
    config = before["run_config.yaml"].decode()
    assert "crop_fraction: 0.875" in config
    (reordered / "run_config.yaml").write_text(config.replace("crop_fraction: 0.875", "crop_fraction: 0.5"))
    export_command = ["export", reordered, "--format", "tflite"]  # as predict and evaluate: one loader
    predict_command = ["predict", "--model-dir", fewer, image]

    typo, refused, predicted, exported = run_at_once(
        *([*HVD_TRAIN, *args] for args in (typo_command, refused_command, predict_command, export_command))
    )
    assert typo.returncode == 2 and "does not exist" in typo.stderr, output_of(typo)
    assert refused.returncode == 2, output_of(refused)
    [error] = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert "--seed 42 then, 7 now" in error and "Give --seed 42 --grad-accum 1 to resume" in error, error
    assert (out / "checkpoints" / "epoch-0001").is_dir()
    assert {name: (out / name).read_bytes() for name in DESCRIBE} == before
    assert predicted.returncode == 2 and "Traceback" not in predicted.stderr, output_of(predicted)
    assert f"names {len(labels) - 1} classes but {fewer / 'model.keras'} has {len(labels)} outputs" in (
        predicted.stderr
    )
    assert exported.returncode == 2 and "Traceback" not in exported.stderr, output_of(exported)
    [error] = [line for line in exported.stderr.splitlines() if "error:" in line]
    assert "labels.json and run_config.yaml in" in error and "not what its run wrote" in error, error
    assert not (reordered / "export").exists()

    # The same command with the right folder: the checkpoints go when training starts, and the
    # log says so; the new model comes with its own labels and configuration.
    again = cli(["train", "--data", data, "--output", out, *RUN, "--epochs", "1", "--no-resume"])
    assert again.returncode == 0, output_of(again)
    assert "--no-resume: removed 1 checkpoint(s) of an earlier run" in again.stderr
    assert "resuming from" not in again.stderr
    assert json.loads((out / "labels.json").read_text()) == labels
    written, first_config = (yaml.safe_load(t) for t in ((out / "run_config.yaml").read_text(), config))
    # (The first run wrote its configuration in the folder this one is a copy of.)
    assert written == {**first_config, "run": {**first_config["run"], "resume": False, "output": str(out)}}


def test_changed_images_are_refused_unless_allowed_and_then_the_epoch_starts_over(trained, tmp_path):
    data = copy_tree(trained[0], tmp_path / "data")
    out = copy_tree(trained[1], tmp_path / "run")
    latin1 = [os.fsdecode(os.fsencode(data) + b"/" + name) for name in trained[2]]
    assert json.loads((out / "summary.json").read_text())["skipped_images"] == []
    # One image renamed: the count is the same, the list is not. (Inference on an image of the
    # first run, by its Latin-1 name, reads nothing the renaming changes: both run at once.)
    victim = sorted((data / "dots").glob("shape-*.png"))[0]
    victim.rename(victim.with_name("zz-" + victim.name))
    predicted, refused = run_at_once(
        [*HVD_TRAIN, "predict", "--model-dir", out, latin1[0], "--output", tmp_path / "p.csv"],
        [*HVD_TRAIN, "train", "--data", data, "--output", out, *RUN, "--epochs", "2"],
    )
    assert predicted.returncode == 0, output_of(predicted)
    assert os.fsencode(latin1[0]) in (tmp_path / "p.csv").read_bytes(), "the name as the file system has it"
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
    """An 8 MB tmpfs: room for a run of TINY (under 100 KB a checkpoint), filled in moments."""
    with small_file_system(tmp_path, "8m") as mount:
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
