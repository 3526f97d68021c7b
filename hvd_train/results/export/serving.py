"""What a client gives each export: the SavedModel's signatures, the fixed-size model inside TFLite and ONNX."""

from __future__ import annotations

import numpy as np

from hvd_train.compat import keras, keras_3, tf
from hvd_train.results.inference import Trained


def variables_of(model) -> tf.Module:
    """A module that holds ``model``'s variables and nothing else, for a SavedModel of functions that call it.

    Saving the Keras model itself (as ``from_keras_model`` and a module holding the model do) traces every
    layer's call for Keras's own loader, which serving never uses: most of an export's time.
    """
    holder = tf.Module()
    # Keras 3's variables each hold a ``tf.Variable``, which the traced functions capture: the module holds
    # those (holding the Keras ones, TFLite's converter froze no values into the file: it computed NaN).
    holder.weights = [getattr(v, "_value", v) if keras_3() else v for v in model.variables]
    return holder


class Serving(tf.Module):
    """The SavedModel's signatures around the trained Keras model."""

    def __init__(self, trained: Trained, top_k: int):
        super().__init__()
        from hvd_train.data.images import decode_window, reduce_crop
        from hvd_train.data.pipeline import center_window

        model = trained.model
        self.weights = variables_of(model)
        self.class_names = tf.constant(trained.classes)
        size, k = trained.image_size, top_k
        window = center_window(trained.crop_fraction)
        preprocess, background = trained.preprocess, trained.alpha_background
        threshold = trained.threshold if trained.multi_label else None

        def classify(pixels):  # float32 [B, size, size, 3] in 0..255, as predict's pipeline makes them
            probs = tf.cast(model(preprocess(pixels), training=False), tf.float32)
            scores, indices = tf.math.top_k(probs, k=k)
            out = {
                "probabilities": probs,
                "top_k_scores": scores,
                "top_k_indices": indices,
                "top_k_classes": tf.gather(self.class_names, indices),
            }
            if threshold is not None:  # a multi-label run: each class's decision, as predict takes it
                out["over_threshold"] = probs >= threshold
            return out

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
            from_bytes, input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")], autograph=False
        )
        self.serve_uint8 = tf.function(
            from_uint8, input_signature=[tf.TensorSpec([None, None, None, 3], tf.uint8, name="images")], autograph=False
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
