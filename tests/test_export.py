"""hvd-train export: SavedModel, TFLite and ONNX files that answer as `hvd-train predict` does.

Each export is run in its own runtime: the SavedModel by TensorFlow in a
fresh process that never imports hvd_train (as TensorFlow Serving would load
it), TFLite by LiteRT and ONNX by ONNX Runtime (``--check``).
"""

import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (
    HVD_TRAIN,
    TINY_MODEL,
    cli,
    kill_group,
    output_of,
    png_with_a_corrupt_middle,
    read_json,
    run,
    run_at_once,
    start,
    write_images,
)

COLOURS = {"blue": 20, "green": 20, "red": 20}  # write_images: one colour per class, learnt in a few steps


def training(data, out, *extra):
    program = [*HVD_TRAIN, "train", "--data", data, "--output", out, "--weights", "none", "--image-size", "32"]
    return [*program, "--no-tensorboard", "--threads-per-rank", "2", "--val-split", "0.25", *extra]


def train(data, out, *extra):
    proc = run(training(data, out, *extra))
    assert proc.returncode == 0, output_of(proc)
    return out


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("colours"), COLOURS, size=40)


@pytest.fixture(scope="module")
def large_colours(colours, tmp_path_factory):
    """The colours as 160-pixel JPEGs: over 4x the training size, so predict decodes them at 1/4 scale."""
    from PIL import Image

    root = tmp_path_factory.mktemp("large")
    for path in colours.rglob("*.png"):
        target = root / path.parent.name / (path.stem + ".jpg")
        target.parent.mkdir(exist_ok=True)
        with Image.open(path) as im:
            im.convert("RGB").resize((160, 160), Image.BICUBIC).save(target, quality=95)
    return root


@pytest.fixture(scope="module")
def colour_run(colours, tmp_path_factory):
    """The tests' backbone trained on the colours: its exports are quick, and the Keras applications'
    exports are the other backbones' below."""
    out = tmp_path_factory.mktemp("colour_run") / "run"
    program = ["--model", TINY_MODEL, "--batch-size", "8", "--epochs", "6", "--base-lr", "0.01", "--deterministic"]
    train(colours, out, *program)
    # A network that tells the classes apart: an untrained one answers ~1/3 everywhere, and
    # every export would agree with it trivially.
    assert read_json(out / "summary.json")["val_accuracy"] >= 0.9
    return out


def export(run_dir, *extra):
    return cli(["export", run_dir, *extra])


@pytest.fixture(scope="module")
def exports(colour_run, colours, tmp_path_factory):
    """The run exported three ways with --check, at once (each process mostly waits on one core):
    ``{"every format": (folder, proc), "float16": ..., "int8": ...}``.

    int8 calibrates on given images among which two cannot be decoded: they are left out, as training
    leaves them out. (Without --calibration-data the run's own training images are used: the stopped
    export below shows it.) float16 is checked on all 60 images, given as a CSV of labels kept apart
    from them.
    """
    root = tmp_path_factory.mktemp("exported")
    calibration = root / "calibration"
    shutil.copytree(colours, calibration)
    png_with_a_corrupt_middle(calibration / "red" / "middle.png")
    (calibration / "blue" / "empty.jpg").write_bytes(b"")
    rows = [f"{p.relative_to(colours).as_posix()},{p.parent.name}" for p in sorted(colours.rglob("*.png"))]
    (root / "colours.csv").write_text("\n".join(["file,colour", *rows]) + "\n")
    quantized = ["--format", "tflite,onnx", "--check", "--quantize"]
    table = ["--check-data", root / "colours.csv", "--image-root", colours, "--label-column", "colour"]
    extra = {
        "every format": ["--check"],
        "float16": [*quantized, "float16", *table],
        "int8": [*quantized, "int8", "--calibration-data", calibration],
    }
    folders = {name: root / name.replace(" ", "-") / "export" for name in extra}
    procs = run_at_once(*([*HVD_TRAIN, "export", colour_run, "--output", folders[n], *extra[n]] for n in extra))
    return {name: (folders[name], proc) for name, proc in zip(extra, procs)}


@pytest.fixture(scope="module")
def exported(exports):
    """The run exported in every format: its test reads it, the stopped export replaces a copy."""
    folder, proc = exports["every format"]
    assert proc.returncode == 0, output_of(proc)
    return folder, proc


@pytest.mark.both_kerases
def test_every_format_answers_as_predict_does(colour_run, exported, colours, tmp_path):
    folder, proc = exported
    manifest = read_json(folder / "manifest.json")
    summary = read_json(colour_run / "summary.json")
    assert manifest["source"]["weights_digest"] == summary["weights_digest"]
    assert [e["path"] for e in manifest["formats"]] == ["saved_model/1", "model.tflite", "model.onnx"]
    # Every file of the folder, with its SHA-256.
    on_disk = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert manifest["files"] == on_disk and "saved_model/1/saved_model.pb" in on_disk
    assert {"tensorflow", "tf2onnx", "onnxruntime", "ai-edge-litert"} <= set(manifest["versions"])
    assert json.loads((folder / "labels.json").read_text()) == sorted(COLOURS)
    readme = (folder / "README.md").read_text()
    assert "image_bytes" in readme and "uint8 [batch, 32, 32, 3]" in readme and "0.875" in readme
    # Each format ran on the 15 held-out images in its runtime and met the float32 goals.
    check = manifest["check"]
    assert check["images"] == 15
    for result in check["formats"]:
        assert result["passed"] and result["top1_agreement"] == 1.0 and result["max_abs_diff"] <= 1e-4, result
        assert result["accuracy"] == result["predict_accuracy"]
    assert "parity with predict on 15 images" in proc.stderr

    # The SavedModel on its own, as a server loads it: no hvd_train, encoded files in (PNG, JPEG,
    # BMP, an RGBA PNG with a transparent corner), class names out, the answers of `hvd-train predict`.
    images = _client_images(colours, tmp_path / "client")
    predicted, done = run_at_once(
        [*HVD_TRAIN, "predict", "--model-dir", colour_run, *images, "--output", tmp_path / "p.csv"],
        [sys.executable, "-c", SERVE, folder / "saved_model" / "1", *images],
    )
    assert predicted.returncode == 0, output_of(predicted)
    with open(tmp_path / "p.csv", newline="") as f:
        expected = [(r["label"], float(r["probability"])) for r in csv.DictReader(f)]
    assert done.returncode == 0, output_of(done)
    assert "hvd_train" not in done.stderr
    served = json.loads(done.stdout.splitlines()[-1])
    assert [label for label, _ in served] == [label for label, _ in expected]
    assert np.allclose([p for _, p in served], [p for _, p in expected], atol=2e-6)
    assert all(label == "red" and p > 0.5 for label, p in served), served

    # The run's report lists the export with its parity.
    proc = cli(["report", colour_run])
    assert proc.returncode == 0, output_of(proc)
    page = (colour_run / "report.html").read_text()
    assert "Exports (hvd-train export)" in page and "model.onnx" in page and "passed" in page


def _client_images(colours, folder):
    from PIL import Image

    folder.mkdir()
    source = sorted((colours / "red").glob("*.png"))[0]
    with Image.open(source) as im:
        rgb = im.convert("RGB")
    rgba = rgb.convert("RGBA")
    rgba.putpixel((0, 0), (0, 0, 0, 0))
    paths = [folder / "a.png", folder / "b.jpg", folder / "c.bmp", folder / "d.png"]
    for path in paths[:3]:
        rgb.save(path)
    rgba.save(paths[3])
    return paths


SERVE = """
import json, sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
out = serve(image_bytes=tf.constant([open(p, "rb").read() for p in sys.argv[2:]]))
names = [row[0].decode() for row in out["top_k_classes"].numpy()]
print(json.dumps([[n, float(p)] for n, p in zip(names, out["top_k_scores"].numpy()[:, 0])]))
"""


@pytest.mark.parametrize("quantize", ["float16", "int8"])
def test_quantized_files_meet_their_goals_calibrated_without_undecodable_images(quantize, colour_run, exports):
    folder, proc = exports[quantize]
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, output_of(proc)
    manifest = read_json(folder / "manifest.json")
    names = [f"model-{quantize}.tflite", f"model-{quantize}.onnx"]
    assert [e["path"] for e in manifest["formats"]] == names
    assert all((folder / n).stat().st_size < (colour_run / "model.keras").stat().st_size / 1.5 for n in names)
    for result in manifest["check"]["formats"]:
        assert result["passed"], result
        assert result["top1_agreement"] >= (0.98 if quantize == "int8" else 0.995)
    if quantize == "float16":  # checked on the images its CSV names
        assert manifest["check"]["images"] == 60 and manifest["check"]["source"].endswith("colours.csv")
    if quantize == "int8":
        # Calibrated on the 60 images that can be decoded, for both files, recorded.
        assert "int8 calibration: skipping 2 image(s) that cannot be decoded" in proc.stderr
        calibration = folder.parent.parent / "calibration"
        assert manifest["calibration"]["images"] == 60 and str(calibration) in manifest["calibration"]["source"]
        assert "int8 calibration: 60 images" in (folder / "README.md").read_text()


BACKBONES = {
    # Caffe-mode preprocessing (BGR, ImageNet means) and a frozen backbone, so a layer-normalised head:
    # VGG16's is the preprocess_input of ResNet50 too, and its 13 convolutions trace and convert in a
    # fraction of ResNet50's time (benchmarks/RESULTS.md records ResNet50's exports).
    "VGG16": ["--freeze-backbone", "--batch-size", "16", "--epochs", "3"],
    # Preprocessing inside the model, as EfficientNet's (benchmarks/RESULTS.md records EfficientNetB0's
    # exports): MobileNetV3Small's graph exports in half the time. It must tell the classes apart with a
    # margin: where an image sits on the line, serving_uint8's box average may flip it. Its held-out
    # score swings from epoch to epoch (BatchNorm over batches of 8), and where it ends depends on the
    # machine's kernels: the best epoch by held-out loss is saved, not the last.
    "MobileNetV3Small": [
        *("--precision", "mixed_float16", "--batch-size", "8", "--epochs", "14"),
        *("--early-stop", "3", "--early-stop-metric", "val_loss"),
    ],
}


@pytest.fixture(scope="module")
def backbone_exports(colours, large_colours, tmp_path_factory):
    """Each of ``BACKBONES`` trained, then exported in every format, checked on given images (all 60, as
    JPEGs 5x the training size) rather than the run's held-out ones: both signatures of the SavedModel,
    the encoded files and their whole pixels. The two runs train at once, then export at once.
    ``{model: (run, export folder, training proc, export proc)}``."""
    root = tmp_path_factory.mktemp("backbones")
    runs = {model: root / model / "run" for model in BACKBONES}
    trained = run_at_once(
        *(training(colours, runs[m], "--model", m, "--deterministic", *extra) for m, extra in BACKBONES.items())
    )
    formats = ["--format", "savedmodel,tflite,onnx", "--check-data", large_colours, "--check"]
    exported = run_at_once(
        *([*HVD_TRAIN, "export", runs[m], "--output", root / m / "export", *formats] for m in BACKBONES)
    )
    return {m: (runs[m], root / m / "export", t, e) for m, t, e in zip(BACKBONES, trained, exported)}


@pytest.mark.parametrize("model", BACKBONES)
def test_other_backbones_frozen_and_mixed_precision_runs_export_alike(model, backbone_exports, large_colours, tmp_path):
    out, folder, trained, proc = backbone_exports[model]
    assert trained.returncode == 0, output_of(trained)
    assert read_json(out / "summary.json")["val_accuracy"] > 0.5, "a network that tells the classes apart"
    assert proc.returncode == 0, output_of(proc)
    manifest = read_json(folder / "manifest.json")
    assert manifest["source"]["model"] == model and len(manifest["formats"]) == 3
    assert manifest["check"]["images"] == 60 and manifest["check"]["source"] == str(large_colours)
    assert all(r["passed"] and r["top1_agreement"] == 1.0 for r in manifest["check"]["formats"]), manifest["check"]
    served = manifest["check"]["formats"][0]
    assert served["max_abs_diff"] <= 1e-4 and served["serving_uint8"]["top1_agreement"] == 1.0, served
    assert "serving_uint8 top-1 agreement 100.00%" in proc.stderr
    # A large PNG is shrunk by the same box average whether the SavedModel decodes it or is given its
    # pixels: the two signatures agree to float rounding (a plain resize of the pixels does not).
    from PIL import Image

    from hvd_train.compat import tf
    from hvd_train.results.export.formats import run_savedmodel, run_savedmodel_uint8

    pngs = []
    for i, path in enumerate(sorted(large_colours.rglob("*.jpg"))[::10]):
        with Image.open(path) as im:
            im.save(tmp_path / f"{i}.png")
        pngs.append(str(tmp_path / f"{i}.png"))
    saved = tf.saved_model.load(str(folder / manifest["formats"][0]["path"]))
    # One image a batch, as serving_uint8 is given them: a batch of another size may sum in another order
    # (oneDNN picks its kernels by shape), which moved MobileNetV3Small's probabilities by 2.5e-6.
    decoded = run_savedmodel(saved, pngs, batch_size=1)
    assert np.allclose(decoded, run_savedmodel_uint8(saved, pngs, "white"), rtol=0, atol=1e-6)
    if "mixed_float16" in BACKBONES[model]:
        assert manifest["source"]["precision"] == "mixed_float16"
        import onnx

        graph = onnx.load(folder / "model.onnx").graph
        assert not any(t.data_type == onnx.TensorProto.FLOAT16 for t in graph.initializer), "float32 weights"


def test_bad_input_is_one_clear_line_and_leaves_no_export(colour_run, tmp_path):
    proc = export(colour_run, "--format", "savedmodel,pdf")  # refused before TensorFlow loads
    assert proc.returncode == 2 and "unknown format 'pdf'" in proc.stderr and "savedmodel,tflite,onnx" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    folder = tmp_path / "export"
    # --output is made anew only where it holds an earlier export (or nothing): never a user's folder.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    # Each of these stops at its own first error, after TensorFlow has loaded: they run at once.
    no_run, no_calibration, not_theirs = run_at_once(
        [*HVD_TRAIN, "export", empty],
        [*HVD_TRAIN, "export", colour_run, "--output", folder, "--format", "tflite", "--quantize", "int8",
         "--calibration-data", empty],
        [*HVD_TRAIN, "export", colour_run, "--output", theirs, "--format", "tflite"],
    )  # fmt: skip
    assert no_run.returncode != 0 and "has no model.keras" in no_run.stderr, output_of(no_run)
    assert "Traceback" not in no_run.stderr
    proc = no_calibration
    assert proc.returncode != 0 and f"folder {empty} holds no images" in proc.stderr, output_of(proc)
    assert not folder.exists() and not list(tmp_path.glob("export.tmp-*")), "nothing half-written"
    assert not_theirs.returncode == 2, output_of(not_theirs)
    assert f"--output {theirs} exists and is not a folder hvd-train export wrote" in not_theirs.stderr
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_a_stopped_export_leaves_the_earlier_one_as_it_was_and_int8_calibrates_on_the_training_images(
    colour_run, exported, tmp_path
):
    folder = tmp_path / "export"
    shutil.copytree(exported[0], folder)  # an earlier export: a copy of the one in every format
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    # A new export into the same folder, stopped once its SavedModel is written and its converters run.
    # It is int8 without --calibration-data, and says what it calibrates on before it writes a file.
    program = ["--output", folder, "--format", "savedmodel,tflite,onnx", "--quantize", "int8"]
    proc = start([*HVD_TRAIN, "export", colour_run, *program])
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob("export.tmp-*/saved_model/1/saved_model.pb")) and proc.poll() is None:
            assert time.monotonic() < deadline, "the export never wrote its SavedModel"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    # The run's own training images, all 45 of them (fewer than --calibration-images).
    assert "int8: 45 calibration images from 45 of the run's training images" in err, err[-3000:]
    assert f"export stopped by SIGTERM before it was complete; {folder} was left as it was" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "no staging folder left"
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_a_stop_held_back_while_the_export_is_put_in_place_ends_after_it(tmp_path, monkeypatch):
    from hvd_train.results.export import folder as exporting

    folder, staging = tmp_path / "export", tmp_path / "export.tmp-1"
    for path, text in ((folder, "old"), (staging, "new")):
        path.mkdir()
        (path / "manifest.json").write_text(text)
    renames, real_replace = [], os.replace

    def replace_as_a_stop_arrives(src, dst):  # the real rename; the SIGTERM comes as the first one starts
        if not renames:
            os.kill(os.getpid(), signal.SIGTERM)
        renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(exporting.os, "replace", replace_as_a_stop_arrives)
    done = []
    with pytest.raises(exporting.Stopped, match="once it was complete; the new export is in") as stopped:
        with exporting.stops_as_errors(str(folder)) as stops:
            exporting.replace(str(staging), str(folder), stops)
            done.append("exports.json")  # what export() does next: it is not cut short
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert done == ["exports.json"]
    assert (folder / "manifest.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"], "no old export or staging folder left"


def test_a_stop_that_keras_turns_into_an_error_of_its_own_still_stops_the_export(tmp_path):
    # Keras 3's Lambda infers its output's shape under a bare ``except:``: a stop that lands there (as the
    # TFLite model of a stopped export was being built) comes out as a NotImplementedError.
    from hvd_train.compat import keras
    from hvd_train.results.export import folder as exporting

    def shape_inferred_as_a_stop_arrives(t):
        os.kill(os.getpid(), signal.SIGTERM)
        return t * 2

    with pytest.raises(exporting.Stopped, match="before it was complete") as stopped:
        with exporting.stops_as_errors(str(tmp_path / "export")):
            keras.layers.Lambda(shape_inferred_as_a_stop_arrives)(keras.Input((3,)))
    assert stopped.value.exit_code == 128 + signal.SIGTERM


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost stop, by design
def test_a_stop_lost_in_a_finalizer_still_stops_the_export_before_the_swap(tmp_path):
    # Seen once in a whole run: the SIGTERM's handler ran while TensorFlow freed a converted function
    # (a __del__), where Python only prints what is raised, and the export went on to replace the
    # earlier one and exit 0.
    from hvd_train.results.export import folder as exporting

    folder, staging = tmp_path / "export", tmp_path / "export.tmp-1"
    for path, text in ((folder, "old"), (staging, "new")):
        path.mkdir()
        (path / "manifest.json").write_text(text)

    class Freed:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the finalizer
            sum(range(10))

    with pytest.raises(exporting.Stopped, match="before it was complete") as stopped:
        with exporting.stops_as_errors(str(folder)) as stops:
            Freed()  # freed at once: its finalizer swallows the stop's exception
            exporting.replace(str(staging), str(folder), stops)
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert (folder / "manifest.json").read_text() == "old", "the earlier export is left as it was"


def test_a_stop_while_a_converter_calls_the_model_is_the_export_stop(tmp_path):
    # Keras turns what a layer's call raises into a new exception (a RuntimeError when it cannot
    # make one of the same class): the stop must still end the export as a stop.
    from hvd_train.compat import keras
    from hvd_train.results.export import folder as exporting

    class SignalledInside(keras.layers.Layer):
        def call(self, inputs):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, inside the layer's call
            return inputs

    with pytest.raises(exporting.Stopped, match="before it was complete") as stopped:
        with exporting.stops_as_errors(str(tmp_path / "export")):
            SignalledInside()(np.zeros((1, 2), "float32"))
    assert stopped.value.exit_code == 128 + signal.SIGTERM


_STOP_IN_A_FINALIZER = """
import os, signal, sys
from hvd_train.results.export.folder import Stopped, replace, stops_as_errors

class Freed:  # as TensorFlow's functions are freed: the stop comes while a finalizer runs
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        sum(range(100000))  # Python runs the handler here, inside the finalizer

staging, folder = sys.argv[1], sys.argv[2]
os.makedirs(staging)
try:
    with stops_as_errors(folder) as stops:
        Freed()
        print("the export went on", flush=True)
        replace(staging, folder, stops)
except Stopped as e:
    print(e, flush=True)
"""


def test_a_stop_that_lands_in_a_finalizer_stops_the_export_before_the_swap_without_a_traceback(tmp_path):
    staging, folder = tmp_path / "export.tmp-1", tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-c", _STOP_IN_A_FINALIZER, str(staging), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "the export went on",
        f"export stopped by SIGTERM before it was complete; {folder} was left as it was",
    ], proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not folder.exists()
