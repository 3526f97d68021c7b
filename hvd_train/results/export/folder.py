"""The export folder: written beside its place, described (manifest, README), and put in place whole."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time

from hvd_train.errors import UserError
from hvd_train.files import read_json, sha256, write_json
from hvd_train.log import get_logger
from hvd_train.results.export.formats import SAVEDMODEL_DIR, file_name, write_onnx, write_savedmodel, write_tflite
from hvd_train.results.export.parity import Images, check_folder
from hvd_train.results.export.serving import pixels
from hvd_train.results.inference import Trained

log = get_logger("export")


def files_of(folder: str) -> dict[str, str]:
    """SHA-256 of every file of the export (the manifest itself aside), by path inside it."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != "manifest.json":
                found[rel] = sha256(path)
    return dict(sorted(found.items()))


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    from hvd_train.compat import KERAS_MAJOR

    keras = "tf-keras" if KERAS_MAJOR == 2 else "keras"
    for name in ("hvd_train", "tensorflow", keras, "tf2onnx", "onnx", "onnxruntime", "ai-edge-litert"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return found


def contract(trained: Trained, top_k: int) -> dict:
    """What each format takes and gives, from the run."""
    size = trained.image_size
    cut = (
        f"the centre square of side {trained.crop_fraction:g} x the shorter side, shrunk by 2, 4 or 8 while its "
        f"side stays at least {size} (a box average; a JPEG's DCT scaling in training), then resized to "
        f"{size}x{size} (bilinear, no antialiasing), RGB, transparent pixels composited over "
        f"{trained.alpha_background}"
    )
    multi = (
        f"; a multi-label run's: over_threshold bool [batch, classes], probabilities >= {trained.threshold:g}"
        if trained.multi_label
        else ""
    )
    return {
        "task": "multi_label" if trained.multi_label else "single_label",
        **({"threshold": trained.threshold} if trained.multi_label else {}),
        "classes": len(trained.classes),
        "image_size": size,
        "crop_fraction": trained.crop_fraction,
        "alpha_background": trained.alpha_background,
        "top_k": top_k,
        "savedmodel": {
            "serving_default": "image_bytes: string [batch], encoded JPEG, PNG, GIF (first frame) or BMP files",
            "serving_uint8": "images: uint8 [batch, height, width, 3], RGB, any size (one size per batch)",
            "outputs": "probabilities float32 [batch, classes], top_k_scores float32 [batch, k], "
            f"top_k_indices int32 [batch, k], top_k_classes string [batch, k]{multi}",
            "inside": f"decoding, {cut}, the backbone's own scaling",
        },
        "tflite_onnx": {
            "input": f"image: uint8 [batch, {size}, {size}, 3], {cut}",
            "output": "probabilities float32 [batch, classes], in the order of labels.json"
            + (
                f" (a sigmoid per class: a label applies where its probability is >= {trained.threshold:g})"
                if trained.multi_label
                else ""
            ),
            "inside": "the backbone's own scaling",
        },
    }


def write_readme(folder: str, manifest: dict) -> None:
    c = manifest["input"]
    size = c["image_size"]
    lines = [
        f"# {manifest['source']['model']} classifier, {c['classes']} classes",
        "",
        f"Exported by hvd-train {manifest['versions'].get('hvd_train', '')} from {manifest['source']['run']} "
        f"(weights digest {manifest['source']['weights_digest']}). Class names, in output order: labels.json. "
        "Files, their SHA-256 and the versions used: manifest.json.",
        "",
    ]
    formats = {e["format"] for e in manifest["formats"]}
    if "savedmodel" in formats:
        lines += [
            f"## SavedModel ({SAVEDMODEL_DIR}/)",
            "",
            "Give it what you have; decoding, cropping, resizing and scaling happen inside.",
            "",
            f"- `serving_default`: {c['savedmodel']['serving_default']}",
            f"- `serving_uint8`: {c['savedmodel']['serving_uint8']}",
            f"- outputs: {c['savedmodel']['outputs']}",
            "",
            "TensorFlow Serving (`--model_base_path` = the `saved_model` folder), REST:",
            "",
            "```",
            "POST /v1/models/NAME:predict",
            '{"signature_name": "serving_default", "instances": [{"image_bytes": {"b64": "<base64 of the file>"}}]}',
            "```",
            "",
        ]
    fixed = sorted(e["path"] for e in manifest["formats"] if e["format"] != "savedmodel")
    if fixed:
        lines += [
            f"## {', '.join(fixed)}",
            "",
            f"Input `image`: uint8 [batch, {size}, {size}, 3]. Cut each image as training did: "
            f"{c['tflite_onnx']['input'].split(', ', 1)[1]}. The backbone's scaling is inside.",
            f"Output `probabilities`: {c['tflite_onnx']['output']}.",
            "",
        ]
    if manifest.get("calibration"):
        cal = manifest["calibration"]
        lines += [f"int8 calibration: {cal['images']} images from {cal['source']}.", ""]
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))


def record_in_run(run_dir: str, folder: str, manifest: dict) -> None:
    """Adds this export to ``RUN_DIR/exports.json``, which ``hvd-train report`` lists."""
    path = os.path.join(run_dir, "exports.json")
    known = read_json(path, [])
    folder = os.path.abspath(folder)
    if not isinstance(known, list):  # not a file this command wrote: started again
        known = []
    known = [e for e in known if isinstance(e, dict) and e.get("folder") != folder]
    known.append({"folder": folder, "time": manifest["time"], "formats": manifest["formats"]})
    write_json(path, known)


def is_export(folder: str) -> bool:
    """Whether ``folder`` holds an export this command wrote (it may be replaced) or nothing."""
    if not os.listdir(folder):
        return True
    manifest = read_json(os.path.join(folder, "manifest.json"), None)
    return isinstance(manifest, dict) and {"source", "formats", "files"} <= set(manifest)


class Stopped(UserError):
    """SIGTERM or SIGINT came while the export was being written: nothing of it was kept.

    Or (``complete``) the stop came while the new export was put in place:
    that finished first, and the command ends with the signal's status after it.
    """

    def __init__(self, signum: int, folder: str, complete: bool = False):
        name = signal.Signals(signum).name
        if complete:
            message = f"export stopped by {name} once it was complete; the new export is in {folder}"
        else:
            message = f"export stopped by {name} before it was complete; {folder} was left as it was"
        super().__init__(message)
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """A stop signal, raised by the handler wherever the main thread is.

    Not an ``Exception``: nothing on the way may catch it as an error of its
    own. Keras, for one, turns what a layer's call raises into a new
    exception of the same class, or a RuntimeError where that class takes
    other arguments (a stop that came while a converter called the model).
    ``stops_as_errors`` makes it ``Stopped``.
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _Stops:
    """What ``stops_as_errors`` knows: whether the swap has begun, and a stop that came since."""

    def __init__(self):
        self.committed = False
        self.pending: int | None = None
        self.raised: int | None = None  # a stop raised before the swap


@contextlib.contextmanager
def stops_as_errors(folder: str):
    """SIGTERM and SIGINT raise ``Stopped`` while the export is written, so its staging folder goes.

    Once ``replace`` has put the new export in place, a stop no longer
    interrupts: the old export is removed and the run's ``exports.json``
    updated, then ``Stopped`` (complete) is raised on the way out.
    """
    stops = _Stops()
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return

    def stop(signum, frame):
        if stops.committed:  # the swap has begun: it ends first, and the stop after it
            stops.pending = signum
            return
        stops.raised = signum
        raise _Signalled(signum)

    hook = sys.unraisablehook

    def lost(unraisable):
        # A stop raised in a finalizer (TensorFlow's, as it frees a converted function) is lost
        # there: ``replace`` stops the export with it. Python would print it as a traceback.
        if not isinstance(unraisable.exc_value, _Signalled):
            hook(unraisable)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    sys.unraisablehook = lost
    try:
        yield stops
    except _Signalled as e:
        raise Stopped(e.signum, folder) from None
    except Exception:
        # The stop, made an error of another kind on its way out: Keras 3's Lambda infers its output's
        # shape under a bare ``except:``, which turns whatever it meets into a NotImplementedError.
        if stops.raised is not None:
            raise Stopped(stops.raised, folder) from None
        raise
    finally:
        sys.unraisablehook = hook
        for s, handler in before.items():
            signal.signal(s, handler)
    if stops.pending is not None:
        raise Stopped(stops.pending, folder, complete=True)


def replace(staging: str, folder: str, stops: _Stops) -> None:
    """Puts the finished ``staging`` folder at ``folder``, the old export there removed after.

    From the first rename on, a stop is held by ``stops`` (the handler only
    notes it): the swap, the removal of the old export and the run's record
    end first. A signal may reach any thread of the process, and Python runs
    the handler in the main thread at its next instruction whatever that
    thread's signal mask, so the flag, not a mask, is what holds it.

    A stop raised before, but lost on its way (Python only prints an
    exception raised in a finalizer, such as TensorFlow's when it frees a
    converted function), stops the export here, before anything is moved.
    """
    if stops.raised is not None:
        raise _Signalled(stops.raised)
    stops.committed = True
    old = None
    if os.path.exists(folder):
        old = f"{folder}.old-{os.getpid()}"
        os.replace(folder, old)
    os.replace(staging, folder)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def export(
    run_dir: str,
    trained: Trained,
    summary: dict,
    formats: list[str],
    quantize: str,
    folder: str,
    top_k: int,
    calibration: Images | None,
    check: Images | None,
) -> dict:
    """Writes the exports into ``folder`` (made anew), then checks them; returns the manifest.

    The folder is written beside its final place and moved there whole, so
    a failed or stopped export leaves no half-written one behind, and an
    earlier export at ``folder`` stays until the new one is complete.
    """
    folder = os.path.abspath(folder)
    staging = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with stops_as_errors(folder) as stops:
            os.makedirs(staging)
            manifest = _write(run_dir, trained, summary, formats, quantize, staging, top_k, calibration, check)
            replace(staging, folder, stops)
            record_in_run(run_dir, folder, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _write(run_dir, trained, summary, formats, quantize, staging, top_k, calibration, check) -> dict:
    calibration_pixels = None
    if quantize == "int8":
        started = time.perf_counter()
        calibration_pixels = pixels(trained, calibration.paths)
        log.info("int8: %d calibration images from %s (%.1f s)", len(calibration_pixels), calibration.source,
                 time.perf_counter() - started)  # fmt: skip
    entries = []
    for fmt in formats:
        q = "none" if fmt == "savedmodel" else quantize
        path = file_name(fmt, q)
        started = time.perf_counter()
        target = os.path.join(staging, path)
        if fmt == "savedmodel":
            write_savedmodel(trained, top_k, target)
        elif fmt == "tflite":
            write_tflite(trained, q, calibration_pixels, target)
        else:
            write_onnx(trained, q, calibration_pixels, target)
        log.info("%s%s: %s (%.1f s)", fmt, "" if q == "none" else f" {q}", path, time.perf_counter() - started)
        entries.append({"format": fmt, "quantize": q, "path": path})
    write_json(os.path.join(staging, "labels.json"), trained.classes)
    manifest = {
        "source": {
            "run": os.path.abspath(run_dir),
            "weights_digest": summary.get("weights_digest", ""),
            "model": summary.get("model", ""),
            "precision": summary.get("precision", ""),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "input": contract(trained, top_k),
        "formats": entries,
        "calibration": None
        if calibration_pixels is None
        else {"images": len(calibration_pixels), "source": calibration.source},
        "versions": versions(),
    }
    write_readme(staging, manifest)
    if check is not None:
        manifest["check"] = check_folder(staging, trained, manifest, check)
        for entry, result in zip(manifest["formats"], manifest["check"]["formats"]):
            entry["parity"] = result
    manifest["files"] = files_of(staging)
    write_json(os.path.join(staging, "manifest.json"), manifest)
    return manifest
