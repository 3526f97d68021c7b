"""Each format written by its converter (TensorFlow's own, tf2onnx), and run in its own runtime."""

from __future__ import annotations

import os

import numpy as np

from hvd_train.compat import tf
from hvd_train.results.export.serving import Serving, as_uint8, fixed_size_model, variables_of
from hvd_train.results.inference import Trained

ONNX_OPSET = 17
SAVEDMODEL_DIR = os.path.join("saved_model", "1")  # TensorFlow Serving: a base path holding numbered versions


def file_name(fmt: str, quantize: str) -> str:
    if fmt == "savedmodel":
        return SAVEDMODEL_DIR
    suffix = "" if quantize == "none" else f"-{quantize}"
    return f"model{suffix}.{fmt}"


def write_savedmodel(trained: Trained, top_k: int, path: str) -> None:
    serving = Serving(trained, top_k)
    tf.saved_model.save(serving, path, signatures=serving.signatures())


def write_tflite(trained: Trained, quantize: str, calibration: np.ndarray | None, path: str) -> None:
    # The converter saves what it is given as a SavedModel before converting it: the traced model and
    # its variables, not the Keras model (``variables_of``).
    model, size = fixed_size_model(trained), trained.image_size
    spec = tf.TensorSpec([None, size, size, 3], tf.uint8, name="image")
    serve = tf.function(
        lambda image: {"probabilities": model(image, training=False)}, input_signature=[spec], autograph=False
    )
    converter = tf.lite.TFLiteConverter.from_concrete_functions([serve.get_concrete_function()], variables_of(model))
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
    # A traced function, not ``from_keras`` (which reads tf-keras' internals and fails under Keras 3,
    # tensorflow-onnx#2348): the same graph on both Kerases.
    model = fixed_size_model(trained)
    serve = tf.function(lambda image: {"probabilities": model(image, training=False)}, autograph=False)
    tf2onnx.convert.from_function(serve, input_signature=spec, opset=ONNX_OPSET, output_path=plain)
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
