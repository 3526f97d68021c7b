"""The real command line, one process: outputs, evaluate, predict, and bad input."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from hvd_train.config.choices import STEPS_PER_CALL

from conftest import (
    HVD_TRAIN,
    TINY,
    TINY_APP,
    cli,
    output_of,
    png_with_a_corrupt_middle,
    read_json,
    run,
    run_at_once,
    write_images,
)


@pytest.fixture(scope="module")
def trained_run(demo_small, tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "run"
    program = [*HVD_TRAIN, "train", "--data", demo_small, "--output", out, *TINY, "--epochs", "2", "--val-split", "0.2"]
    # Every phase before the first step says how far it got (here every 0.2 s instead of 5).
    proc = run([*program, "--tensorboard", "--log-every", "3"], HVD_TRAIN_TICK_SECONDS="0.2")
    assert proc.returncode == 0, output_of(proc)
    return out, proc


def test_outputs_of_a_run(trained_run, demo_small):
    out, proc = trained_run
    classes = json.loads((out / "labels.json").read_text())
    assert classes == sorted(p.name for p in demo_small.iterdir() if p.is_dir())
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == [
        "epoch",
        "loss",
        "accuracy",
        "val_loss",
        "val_accuracy",
        "val_top5",
        "lr",
        "images_per_sec",
        "epoch_seconds",
    ]
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert all(float(r["images_per_sec"]) > 0 and r["val_accuracy"] != "" for r in rows)
    summary = read_json(out / "summary.json")
    assert summary["val_images"] == 25 and summary["world_size"] == 1
    assert summary["horovod_environment"]["HOROVOD_CYCLE_TIME"] == "100"  # one process: Horovod's thread idles
    assert summary["global_batch"] == 8 and summary["tensorflow"] and summary["horovod"] == "0.28.1"
    assert summary["val_accuracy"] == pytest.approx(float(rows[-1]["val_accuracy"]), abs=1e-5)
    config = yaml.safe_load((out / "run_config.yaml").read_text())
    assert config["data"]["train"] == str(demo_small) and config["run"]["epochs"] == 2
    assert (out / "model.keras").stat().st_size > 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["epoch-0001", "epoch-0002"]
    assert "held-out accuracy" in proc.stderr
    assert summary["val_seconds"] > 0
    assert "first step: building the training graph, filling the input pipeline: still at it after" in proc.stderr
    # Progress every 3 steps, in the log and in TensorBoard alike: at the end of the first call of the
    # steps (--steps-per-call) that reaches it, the epoch's end excepted.
    n = int(next(line for line in proc.stdout.splitlines() if re.match(r"\d+/\d+ - ", line)).split("/")[0])
    every = []
    for done in range(STEPS_PER_CALL, n, STEPS_PER_CALL):
        if done - (every[-1] if every else 0) >= 3:
            every.append(done)
    assert every
    steps = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == [f"{k}/{n}" for k in every] * 2, proc.stdout
    from hvd_train.compat import tf

    tags = {}
    for events in (out / "tensorboard" / "train").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(events)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(event.step)
    assert tags["step_loss"] == tags["step_images_per_sec"] == every + [n + k for k in every]
    assert sum(map(sum, summary["val_confusion_matrix"])) == 25
    assert list(summary["val_per_class_accuracy"]) == classes
    for name, size in (("curves.png", (1100, 700)), ("confusion.png", None)):
        with Image.open(out / name) as im:
            im.load()
            assert im.format == "PNG" and (size is None or im.size == size), name
    # Every output has the mode a plain open() gives (0666 less the umask): a team can read them.
    umask = os.umask(0o022)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir() if p.is_file()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_report_in_a_real_browser(trained_run, tmp_path):
    from browser import render

    out, _ = trained_run
    proc = cli(["report", out, "--output", tmp_path / "report.html"])
    assert proc.returncode == 0, output_of(proc)
    seen = render(tmp_path / "report.html", tmp_path / "screenshot.png")
    assert seen.console_errors == [] and seen.failed == []
    assert seen.requests == [(tmp_path / "report.html").as_uri()]  # self-contained: nothing else is fetched
    assert [alt for alt, *_ in seen.images] == ["training curves", "confusion matrix, held-out (25 images)"]
    assert all(complete and width > 300 and height > 300 for _, complete, width, height in seen.images)
    summary = read_json(out / "summary.json")
    for text in ("Summary", f"{summary['val_accuracy']:.4f}", "Accuracy per class, worst first", "tensorflow"):
        assert text.lower() in seen.text.lower(), text
    for name in json.loads((out / "labels.json").read_text()):
        assert name in seen.text
    with Image.open(tmp_path / "screenshot.png") as shot:
        assert shot.size[0] == 1280 and shot.size[1] > 2000
        assert len(shot.convert("L").getcolors(1 << 16)) > 50  # drawn, not blank


def test_predict_writes_csv_and_skips_unreadable_files(trained_run, demo_small, tmp_path):
    out, _ = trained_run
    folder = demo_small / "dots"
    one_file = next((demo_small / "checkerboard").glob("*.png"))
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"")
    proc = cli(["predict", "--model-dir", out, one_file, folder, broken])
    assert proc.returncode == 0, output_of(proc)
    # The CSV on stdout, and nothing else there; the unreadable file is named on stderr, with no row.
    paths = [line.split(",")[0] for line in proc.stdout.splitlines()]
    assert paths[:2] == ["path", str(one_file)]
    assert sorted(paths[2:]) == sorted(str(p) for p in folder.rglob("*") if p.is_file())
    assert "broken.png: empty file" in proc.stderr
    rows = list(csv.DictReader(proc.stdout.splitlines()))
    assert len(rows) == 1 + len([p for p in folder.rglob("*") if p.is_file()])
    classes = json.loads((out / "labels.json").read_text())
    assert all(r["label"] in classes and 0 < float(r["probability"]) <= 1 for r in rows)


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, output_of(proc)
    assert "Traceback" not in proc.stderr, output_of(proc)
    errors = [line for line in proc.stderr.splitlines() if "ERROR error:" in line]
    assert len(errors) == 1, output_of(proc)
    for fragment in fragments:
        assert fragment in errors[0], output_of(proc)


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """Commands refused with one clear line, run at once (each process spends most of its time
    starting TensorFlow, on one core): ``{name: (folder, proc)}``, the folder holding its inputs."""
    from hvd_train.compat import keras

    root = tmp_path_factory.mktemp("refused")
    folders = {name: root / name.replace(" ", "-") for name in REFUSED}
    for folder in folders.values():
        folder.mkdir()
    write_images(folders["single class"] / "d", {"only": 3})
    bad = write_images(folders["bad image"] / "d", {"a": 4, "b": 4})
    (bad / "a" / "broken.jpg").write_bytes(b"")
    broken = write_images(folders["broken in training"] / "d", {"a": 4, "b": 4})
    png_with_a_corrupt_middle(broken / "b" / "middle.png")
    weights = folders["weights"] / "resnet.weights.h5"
    keras.applications.ResNet50(include_top=False, weights=None, input_shape=(32, 32, 3)).save_weights(weights)
    write_images(folders["weights"] / "d", {"a": 3, "b": 3})
    commands = [[*HVD_TRAIN, *REFUSED[name](folders[name])] for name in REFUSED]
    return dict(zip(REFUSED, zip(folders.values(), run_at_once(*commands))))


def _train(folder, *extra, data="d"):
    return ["train", "--data", folder / data, "--output", folder / "o", *extra]


REFUSED = {
    "missing data": lambda f: _train(f, *TINY, data="nope"),
    "single class": lambda f: _train(f, *TINY),
    "unknown model": lambda f: _train(f, "--model", "ResNet5O"),
    "model names": lambda f: _train(f, "--model", "mobilenet_v2"),
    "invalid option": lambda f: _train(f, "--val-split", "2"),
    "elastic": lambda f: _train(f, "--elastic"),
    "bad image": lambda f: _train(f, *TINY, "--on-bad-image", "fail"),
    "broken in training": lambda f: _train(f, *TINY, "--val-split", "0", "--on-bad-image", "fail"),
    "weights": lambda f: _train(f, *TINY_APP, "--weights", f / "resnet.weights.h5"),
    "evaluate": lambda f: ["evaluate", "--model-dir", f, "--data", f],
    "lr-find in s3": lambda f: ["lr-find", "--data", f / "d", "--output", "s3://b/runs/x"],
    "sweep in s3": lambda f: ["sweep", f / "sweep.yaml", "--output", "s3://b/runs/x"],
}


def test_predict_into_a_pipe_whose_reader_is_gone_ends_quietly(trained_run, demo_small):
    # `hvd-train predict ... | head`: the reader closed its end before the rows came.
    out, _ = trained_run
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [*HVD_TRAIN, "predict", "--model-dir", out, demo_small],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
        )
    finally:
        os.close(write)
    assert proc.returncode == 128 + signal.SIGPIPE, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-4000:]


def test_lr_find_and_sweep_refuse_an_output_in_s3(refused):
    in_s3 = "give --output a folder, not s3://b/runs/x"
    assert_one_line_error(refused["lr-find in s3"][1], in_s3, "train --base-lr auto")
    assert_one_line_error(refused["sweep in s3"][1], in_s3)


def test_missing_data_folder(refused):
    assert_one_line_error(refused["missing data"][1], "does not exist", "--data")


def test_single_class_folder(refused):
    assert_one_line_error(refused["single class"][1], "at least 2")


def test_unknown_model(refused):
    assert_one_line_error(refused["unknown model"][1], "unknown model 'ResNet5O'", "ResNet50")


def test_model_names_people_type_are_accepted(refused):
    # resolved before any data is read: the error is then about the data, not the name
    folder, proc = refused["model names"]
    assert_one_line_error(proc, str(folder / "d"))
    assert "--model" not in proc.stderr


def test_help_lists_the_choices_of_every_option():
    import argparse

    from hvd_train.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    checked = 0
    for name, sub in commands.items():
        text = sub.format_help()
        flat = "".join(text.split())  # argparse wraps lines, also at hyphens
        for action in sub._actions:
            if action.choices and action.option_strings:
                listed = " | ".join(str(c) for c in action.choices)
                assert "".join(f"one of: {listed}".split()) in flat, (name, action.option_strings)
                checked += 1
    assert checked >= 15


def test_invalid_option_value(refused):
    assert_one_line_error(refused["invalid option"][1], "`--val-split`", "val_split=2.0")


def test_elastic_without_an_elastic_launcher_is_refused(refused):
    folder, proc = refused["elastic"]
    assert_one_line_error(proc, "--elastic needs an elastic launcher", "--host-discovery-script")
    plain_mpirun = ["mpirun", "-np", "1", "-x", "PATH", *HVD_TRAIN]
    proc = run([*plain_mpirun, *_train(folder, "--elastic")], timeout=120)
    assert_one_line_error(proc, "plain mpirun", "has no elastic mode", "horovodrun --min-np")


def test_bad_image_fails_with_fail_policy(refused):
    folder, proc = refused["bad image"]
    assert_one_line_error(proc, "broken.jpg", "empty file", "--on-bad-image skip")
    assert not (folder / "o" / "checkpoints").exists()


def test_an_image_met_broken_in_training_with_fail_policy_stops_with_its_name(refused):
    assert_one_line_error(refused["broken in training"][1], "middle.png", "met during training", "--on-bad-image skip")


def test_weights_that_do_not_fit(refused):
    folder, proc = refused["weights"]
    assert_one_line_error(proc, f"weights file {folder / 'resnet.weights.h5'} does not fit MobileNet")


def test_evaluate_needs_a_finished_run(refused):
    assert_one_line_error(refused["evaluate"][1], "has no model.keras", "--model-dir")


def test_models_lists_names():
    proc = cli(["models"])
    assert proc.returncode == 0 and "ResNet50 " in proc.stdout and "EfficientNetB0" in proc.stdout
    assert "--model FILE.py:FUNCTION" in proc.stdout


def test_batch_size_must_be_positive(trained_run, demo_small):
    out, _ = trained_run
    proc = cli(["evaluate", "--model-dir", out, "--data", demo_small, "--batch-size", "0"])
    assert proc.returncode == 2 and "must be a whole number >= 1. Received: '0'" in proc.stderr


def test_a_config_file_run_skips_and_lists_bad_images_and_evaluate_reports_every_image(tmp_path):
    """One run for three things: options from a config file (a held-out folder; a flag wins over the file),
    bad images skipped and listed (before and during training, and again after a rerun), and evaluate
    counting every image of a folder that lacks one of the classes."""
    train = write_images(tmp_path / "train", {"a": 6, "b": 5, "c": 5})
    held_out = write_images(tmp_path / "held_out", {"a": 3, "c": 4}, seed=1)
    (train / "a" / "zero.png").write_bytes(b"")
    (train / "b" / "text.jpg").write_text("hello")
    Image.new("CMYK", (20, 20), (10, 200, 30, 0)).save(train / "b" / "cmyk.jpg")
    png_with_a_corrupt_middle(train / "a" / "middle.png")  # passes the quick check; met in training
    out = tmp_path / "out"
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"train": str(train), "val": str(held_out), "batch_size": 16},
                "model": {"name": "MobileNet", "weights": "none"},
                "run": {"output": str(out), "epochs": 1},
            }
        )
    )
    flags = ["--batch-size", "4", "--image-size", "32", "--no-tensorboard", "--threads-per-rank", "1"]
    proc = cli(["train", "--config", config, *flags, "--log-every", "1"])
    assert proc.returncode == 0, output_of(proc)
    written = yaml.safe_load((out / "run_config.yaml").read_text())
    assert written["data"]["batch_size"] == 4 and written["data"]["val"] == str(held_out)
    summary = read_json(out / "summary.json")
    # ceil(18 / 4): the 16 good images, the CMYK JPEG and the PNG broken in the middle.
    assert summary["val_images"] == 7 and summary["steps_per_epoch"] == 5
    # The bad images.
    assert "skipping 2 image(s)" in proc.stderr
    assert "zero.png: empty file" in proc.stderr and "text.jpg: Unknown image file format" in proc.stderr
    assert "cmyk.jpg" not in proc.stderr
    assert "skipped 1 image(s) met during training that cannot be decoded (given no weight)" in proc.stderr
    skipped = {Path(s["path"]).name: s for s in summary["skipped_images"]}
    assert {n: s["found"] for n, s in skipped.items()} == {
        "zero.png": "check",
        "text.jpg": "check",
        "middle.png": "training",
    }
    assert "CRC" in skipped["middle.png"]["reason"] or "PNG" in skipped["middle.png"]["reason"]
    # A rerun resumes from the checkpoint (every epoch done: it evaluates and writes the outputs
    # again): the images met in training before stay listed.
    again = cli(["train", "--config", config, *flags])
    assert again.returncode == 0 and "resuming from" in again.stderr, output_of(again)
    resumed = {Path(s["path"]).name: s for s in read_json(out / "summary.json")["skipped_images"]}
    assert resumed == skipped
    # In a log file (not a terminal), a progress line per --log-every: step, speed, loss, ETA.
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps and all(
        re.match(r"step \d+/\d+ - [\d.]+ images/s - loss: [\d.]+ - accuracy: [\d.]+ - ETA \d", s) for s in steps
    )
    # Evaluate: every image, the last batch not a whole one (7 = 4 + 3).
    report = tmp_path / "e.json"
    proc = cli(["evaluate", "--model-dir", out, "--data", held_out, "--batch-size", "4", "--report", report])
    assert proc.returncode == 0, output_of(proc)
    result = read_json(report)
    assert result["images"] == 7
    assert sum(map(sum, result["confusion_matrix"])) == 7
    assert set(result["per_class_accuracy"]) == set(result["classes"])
    per_class = result["per_class_accuracy"]
    assert per_class["b"] is None and per_class["a"] is not None  # b has no held-out images
    assert f"accuracy  {result['accuracy']:.4f}" in proc.stdout
    with Image.open(tmp_path / "confusion.png") as im:  # drawn beside the report
        assert im.format == "PNG"


ENDS = """
import atexit, sys, tempfile, threading, time
from hvd_train.distributed.exits import end_process

class Kept:
    def __del__(self):
        print("torn down")  # the interpreter's teardown would print this

kept = Kept()
folder = tempfile.TemporaryDirectory()  # removed by an exit handler, as at any exit
atexit.register(lambda: print("exit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
print(folder.name)
print("buffered", end="")
end_process(3)
"""


def test_a_process_ends_with_its_exit_handlers_and_threads_but_without_the_teardown():
    # A command that loaded TensorFlow ends so: about a second sooner, with the same effects.
    proc = run([sys.executable, "-c", ENDS], timeout=60)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1:] == ["bufferedthread finished", "exit handler ran"], proc.stdout
    assert not os.path.exists(lines[0]), "the temporary folder is removed"
