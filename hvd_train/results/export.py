"""Exports of a trained run that carry its preprocessing: SavedModel, TFLite and ONNX.

A served classifier fed raw pixels gives confident nonsense: the network
expects its backbone's scaling, the training image size and the centre crop
of evaluation. So every export starts where a client starts:

* the SavedModel takes encoded image bytes (``serving_default``: decoded,
  transparent pixels composited as in training, centre-cropped, resized,
  scaled) or a uint8 batch of any size (``serving_uint8``), and answers with
  the probabilities, the top-k class indices and the class names;
* TFLite and ONNX cannot decode, so they take a uint8 batch already cut to
  ``image_size`` x ``image_size`` (``image``) and scale it inside; the
  folder's README says how to cut it, and ``labels.json`` names the classes.

The converters are TensorFlow's own (SavedModel, TFLite) and tf2onnx;
``check`` runs each file in its own runtime (TensorFlow, LiteRT,
ONNX Runtime) on labelled images and compares it with ``hvd-train predict``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import keras, tf
from hvd_train.errors import UserError
from hvd_train.files import read_json, sha256, write_json
from hvd_train.log import get_logger
from hvd_train.results.inference import Trained

ONNX_OPSET = 17
# Goals of --check, by quantisation: least top-1 agreement with predict, largest |Δp| (None: not a goal).
GOALS = {"none": (1.0, 1e-4), "float16": (0.995, None), "int8": (0.98, None)}
INT8_ACCURACY_POINTS = 1.0  # int8 held-out accuracy within this many points of predict's
SAVEDMODEL_DIR = os.path.join("saved_model", "1")  # TensorFlow Serving: a base path holding numbered versions

log = get_logger("export")


@dataclass
class Images:
    """Labelled images to check exports on, or unlabelled ones to calibrate int8 with."""

    paths: list[str]
    labels: list[int] | None
    source: str


def file_name(fmt: str, quantize: str) -> str:
    if fmt == "savedmodel":
        return SAVEDMODEL_DIR
    suffix = "" if quantize == "none" else f"-{quantize}"
    return f"model{suffix}.{fmt}"


class Serving(tf.Module):
    """The SavedModel's signatures around the trained Keras model."""

    def __init__(self, trained: Trained, top_k: int):
        super().__init__()
        from hvd_train.data.images import decode_window, reduce_crop
        from hvd_train.data.pipeline import center_window

        self.model = trained.model
        self.class_names = tf.constant(trained.classes)
        size, k = trained.image_size, top_k
        window = center_window(trained.crop_fraction)
        preprocess, background = trained.preprocess, trained.alpha_background

        def classify(pixels):  # float32 [B, size, size, 3] in 0..255, as predict's pipeline makes them
            probs = tf.cast(self.model(preprocess(pixels), training=False), tf.float32)
            scores, indices = tf.math.top_k(probs, k=k)
            return {
                "probabilities": probs,
                "top_k_scores": scores,
                "top_k_indices": indices,
                "top_k_classes": tf.gather(self.class_names, indices),
            }

        def load(contents):  # the same steps as predict's pipeline, with TensorFlow's own GIF decoder
            image = decode_window(contents, window, min_side=size, background=background, portable=True)
            image = tf.image.resize(image, [size, size])
            image.set_shape([size, size, 3])
            return image

        def from_bytes(image_bytes):
            pixels = tf.map_fn(load, image_bytes, fn_output_signature=tf.TensorSpec([size, size, 3], tf.float32))
            return classify(pixels)

        def from_uint8(images):  # the same steps on pixels: the crop, shrunk as a large image is, resized
            top, left, height, width = tf.unstack(window(tf.shape(images)[1:3]))
            cut = reduce_crop(images[:, top : top + height, left : left + width, :], size)
            return classify(tf.image.resize(cut, [size, size]))

        self.serve_bytes = tf.function(
            from_bytes, input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")]
        )
        self.serve_uint8 = tf.function(
            from_uint8, input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")]
        )

    def signatures(self) -> dict:
        return {
            "serving_default": self.serve_bytes.get_concrete_function(),
            "serving_uint8": self.serve_uint8.get_concrete_function(),
        }


def fixed_size_model(trained: Trained):
    """A Keras model from a uint8 ``image`` batch already cut to size to float32 ``probabilities``."""
    size, preprocess = trained.image_size, trained.preprocess
    image = keras.Input((size, size, 3), dtype="uint8", name="image")
    scaled = keras.layers.Lambda(lambda t: preprocess(tf.cast(t, tf.float32)), name="preprocess")(image)
    probs = keras.layers.Lambda(lambda t: tf.cast(t, tf.float32), name="probabilities")(trained.model(scaled))
    return keras.Model(image, probs, name="classifier")


def pixels(trained: Trained, paths: list[str], batch_size: int = 32) -> np.ndarray:
    """Each image as predict's pipeline makes it before scaling: float32 [n, size, size, 3] in 0..255."""
    from hvd_train.data.pipeline import predict_dataset

    ds = predict_dataset(
        paths,
        batch_size=batch_size,
        image_size=trained.image_size,
        crop_fraction=trained.crop_fraction,
        preprocess=lambda x: x,
        alpha_background=trained.alpha_background,
    )
    return np.concatenate([b.numpy() for b in ds], axis=0)


def as_uint8(values: np.ndarray) -> np.ndarray:
    """What a client gives the fixed-size formats: the cut image's pixels, rounded to 8 bits."""
    return np.clip(np.round(values), 0, 255).astype(np.uint8)


def write_savedmodel(trained: Trained, top_k: int, path: str) -> None:
    serving = Serving(trained, top_k)
    tf.saved_model.save(serving, path, signatures=serving.signatures())


def write_tflite(trained: Trained, quantize: str, calibration: np.ndarray | None, path: str) -> None:
    converter = tf.lite.TFLiteConverter.from_keras_model(fixed_size_model(trained))
    if quantize == "float16":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.target_spec.supported_types = [tf.float16]
    elif quantize == "int8":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
        converter.representative_dataset = lambda: ([image[None]] for image in as_uint8(calibration))
        # Every operation in 8 bits, or an error naming the one that cannot be.
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    content = converter.convert()
    with open(path, "wb") as f:
        f.write(content)


def write_onnx(trained: Trained, quantize: str, calibration: np.ndarray | None, path: str) -> None:
    import tf2onnx

    size = trained.image_size
    spec = (tf.TensorSpec([None, size, size, 3], tf.uint8, name="image"),)
    plain = path if quantize == "none" else path + ".fp32"
    tf2onnx.convert.from_keras(fixed_size_model(trained), input_signature=spec, opset=ONNX_OPSET, output_path=plain)
    if quantize == "float16":
        import onnx
        from onnxruntime.transformers.float16 import convert_float_to_float16

        # Weights and computation in float16; the uint8 input and float32 output stay as they are.
        onnx.save(convert_float_to_float16(onnx.load(plain), keep_io_types=True), path)
    elif quantize == "int8":
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

        class Reader(CalibrationDataReader):
            def __init__(self):
                self.batches = iter(as_uint8(calibration)[i : i + 1] for i in range(len(calibration)))

            def get_next(self):
                batch = next(self.batches, None)
                return None if batch is None else {"image": batch}

        quantize_static(
            plain, path, Reader(), quant_format=QuantFormat.QDQ, activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8, per_channel=True,
        )  # fmt: skip
    if plain != path:
        os.remove(plain)


# --- Running an export in its own runtime --------------------------------------------------------


def run_savedmodel(saved, paths: list[str], batch_size: int = 32) -> np.ndarray:
    """``serving_default`` of the loaded SavedModel ``saved`` on the image files ``paths``."""
    serve = saved.signatures["serving_default"]
    out = []
    for i in range(0, len(paths), batch_size):
        contents = [open(p, "rb").read() for p in paths[i : i + batch_size]]
        out.append(serve(image_bytes=tf.constant(contents))["probabilities"].numpy())
    return np.concatenate(out, axis=0)


def run_savedmodel_uint8(saved, paths: list[str], background: str) -> np.ndarray:
    """``serving_uint8`` on each image's whole pixels, as a client that decodes its files gives them."""
    from hvd_train.data.images import decode
    from hvd_train.data.storage import os_bytes

    serve = saved.signatures["serving_uint8"]
    out = []
    for p in paths:  # one image a batch: one size per batch
        pixels = decode(tf.io.read_file(os_bytes(p)), background)
        out.append(serve(images=pixels[None])["probabilities"].numpy())
    return np.concatenate(out, axis=0)


def runner(fmt: str, path: str, threads: int | None = None):
    """A function from a uint8 batch to float32 probabilities that runs a TFLite or ONNX file in its runtime.

    ``threads``: the runtime's thread count (None: its own default).
    """
    if fmt == "tflite":
        from ai_edge_litert.interpreter import Interpreter

        interpreter = Interpreter(model_path=path, num_threads=threads)
        [given], [out] = interpreter.get_input_details(), interpreter.get_output_details()
        shape = []

        def run(images: np.ndarray) -> np.ndarray:
            if shape != list(images.shape):
                interpreter.resize_tensor_input(given["index"], list(images.shape))
                interpreter.allocate_tensors()
                shape[:] = images.shape
            interpreter.set_tensor(given["index"], images)
            interpreter.invoke()
            probs = interpreter.get_tensor(out["index"])
            if out["dtype"] != np.float32:  # a quantised output
                scale, zero = out["quantization"]
                probs = (probs.astype(np.float32) - zero) * scale
            return probs

        return run
    import onnxruntime

    options = onnxruntime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return lambda images: session.run(None, {"image": images})[0]


def parity(reference: np.ndarray, probs: np.ndarray, labels: list[int] | None, quantize: str) -> dict:
    """Agreement with predict, the largest probability difference, and whether the goals are met."""
    agree = float(np.mean(probs.argmax(1) == reference.argmax(1)))
    delta = float(np.max(np.abs(probs - reference)))
    least, most = GOALS[quantize]
    result = {"images": len(reference), "top1_agreement": agree, "max_abs_diff": delta}
    failed = []
    if not (np.isfinite(probs).all() and np.isfinite(reference).all()):
        failed.append("non-finite probabilities (NaN or inf) from the file or from predict")
    if agree < least:
        failed.append(f"top-1 agreement {agree:.2%} < {least:.1%}")
    if most is not None and delta > most:
        failed.append(f"max |Δp| {delta:.2e} > {most:.0e}")
    if labels is not None:
        truth = np.asarray(labels)
        result["accuracy"] = float(np.mean(probs.argmax(1) == truth))
        result["predict_accuracy"] = float(np.mean(reference.argmax(1) == truth))
        points = 100 * (result["predict_accuracy"] - result["accuracy"])
        if quantize == "int8" and points > INT8_ACCURACY_POINTS:
            failed.append(
                f"held-out accuracy {points:.1f} points below predict's (goal: within {INT8_ACCURACY_POINTS:g})"
            )
    result["passed"] = not failed
    result["failed"] = failed
    return result


# --- The folder ---------------------------------------------------------------------------------


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
    for name in ("hvd_train", "tensorflow", "tf-keras", "tf2onnx", "onnx", "onnxruntime", "ai-edge-litert"):
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
    return {
        "classes": len(trained.classes),
        "image_size": size,
        "crop_fraction": trained.crop_fraction,
        "alpha_background": trained.alpha_background,
        "top_k": top_k,
        "savedmodel": {
            "serving_default": "image_bytes: string [batch], encoded JPEG, PNG, GIF (first frame) or BMP files",
            "serving_uint8": "images: uint8 [batch, height, width, 3], RGB, any size (one size per batch)",
            "outputs": "probabilities float32 [batch, classes], top_k_scores float32 [batch, k], "
            "top_k_indices int32 [batch, k], top_k_classes string [batch, k]",
            "inside": f"decoding, {cut}, the backbone's own scaling",
        },
        "tflite_onnx": {
            "input": f"image: uint8 [batch, {size}, {size}, 3], {cut}",
            "output": "probabilities float32 [batch, classes], in the order of labels.json",
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


class _Stops:
    """What ``stops_as_errors`` knows: whether the swap has begun, and a stop that came since."""

    def __init__(self):
        self.committed = False
        self.pending: int | None = None


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
        raise Stopped(signum, folder)

    before = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stops
    finally:
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
    """
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


def check_folder(folder: str, trained: Trained, manifest: dict, images: Images) -> dict:
    """Runs every export of ``folder`` in its runtime on ``images``, against predict's probabilities.

    The SavedModel gets the image files, as predict does. TFLite and ONNX get
    each image cut to size as uint8, their input contract; predict keeps the
    resized pixels in float, so their reference is predict's model on those
    same 8-bit pixels, and what the rounding alone moves is reported apart
    (``rounding_max_abs_diff``): it is the input's, not the file's.
    """
    cut = pixels(trained, images.paths)
    uint8 = as_uint8(cut)

    def predict(batch):
        return trained.model.predict(trained.preprocess(tf.constant(batch, tf.float32)), verbose=0, batch_size=32)

    reference, reference_uint8 = predict(cut), predict(uint8)
    rounding = float(np.max(np.abs(reference_uint8 - reference)))
    results = []
    for entry in manifest["formats"]:
        path = os.path.join(folder, entry["path"])
        if entry["format"] == "savedmodel":
            saved = tf.saved_model.load(path)  # once, for both signatures
            result = parity(reference, run_savedmodel(saved, images.paths), images.labels, entry["quantize"])
            # serving_uint8 gets the whole decoded pixels. Where predict decodes a large JPEG at a
            # reduced scale in the DCT, the signature shrinks the pixels by a box average: close, not
            # the same numbers, so it is held to the top class, as float16 files are.
            probs = run_savedmodel_uint8(saved, images.paths, trained.alpha_background)
            pixels_in = result["serving_uint8"] = parity(reference, probs, images.labels, "float16")
            pixels_in["input"] = "uint8 pixels of the whole images"
            if not pixels_in["passed"]:
                result["passed"] = False
                result["failed"] += [f"serving_uint8: {why}" for why in pixels_in["failed"]]
        else:
            probs = runner(entry["format"], path)(uint8)
            result = parity(reference_uint8, probs, images.labels, entry["quantize"])
            result["input"] = "uint8 pixels of the images cut to size"
            result["rounding_max_abs_diff"] = rounding
        result["name"] = f"{entry['format']}{'' if entry['quantize'] == 'none' else ' ' + entry['quantize']}"
        results.append(result)
    return {"images": len(images.paths), "source": images.source, "formats": results}
