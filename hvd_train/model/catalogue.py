"""Keras applications backbones with a new classification head.

Any model of ``keras.applications`` is available by its name; the list is
read from Keras itself, so a new Keras release brings its new models along.
A backbone of the user's own is named ``FILE.py:FUNCTION`` (``model.own``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import KERAS_MAJOR, keras, tf
from hvd_train.config import ModelConfig, own_model
from hvd_train.errors import UserError, first_line
from hvd_train.model import own

# Input sizes the ImageNet weights were trained at, where they differ from 224.
_DEFAULT_SIZES = {
    "InceptionV3": 299,
    "InceptionResNetV2": 299,
    "Xception": 299,
    "NASNetLarge": 331,
    "EfficientNetB1": 240,
    "EfficientNetB2": 260,
    "EfficientNetB3": 300,
    "EfficientNetB4": 380,
    "EfficientNetB5": 456,
    "EfficientNetB6": 528,
    "EfficientNetB7": 600,
    "EfficientNetV2B1": 240,
    "EfficientNetV2B2": 260,
    "EfficientNetV2B3": 300,
    "EfficientNetV2S": 384,
    "EfficientNetV2M": 480,
    "EfficientNetV2L": 480,
    "ResNetRS50": 160,
    "ResNetRS101": 192,
    "ResNetRS152": 256,
    "ResNetRS200": 256,
    "ResNetRS270": 256,
    "ResNetRS350": 288,
    "ResNetRS420": 320,
}

# keras.applications models tf-keras has and Keras 3 dropped (Keras 3.15 has the other 40, none new).
KERAS_2_ONLY = tuple(
    [
        f"RegNet{kind}{size}"
        for kind in "XY"
        for size in ("002", "004", "006", "008", "016", "032", "040", "064", "080", "120", "160", "320")
    ]
    + [f"ResNetRS{depth}" for depth in (50, 101, 152, 200, 270, 350, 420)]
)

# BatchNormalization momentum for backbones trained from scratch: the Keras
# applications use 0.99-0.999, whose moving averages trail the weights by
# hundreds of steps; on a short fine-tuning run evaluation then sees stale
# statistics and stays near chance while training accuracy rises.
SCRATCH_BN_MOMENTUM = 0.9

HEAD_LAYER = "predictions"


@dataclass(frozen=True)
class ModelSpec:
    """One keras.applications model.

    Attributes:
        name: its constructor's name, e.g. ``ResNet50``.
        constructor: the function that builds it.
        module: the module holding it and its ``preprocess_input``.
        default_size: input side its ImageNet weights were trained at.
        preprocess: the preprocessing of a model of the user's own (None: the module's, by ``fast_preprocess``).
    """

    name: str
    constructor: Callable
    module: str
    default_size: int
    preprocess: Callable | None = None

    def preprocess_input(self):
        """The model's ``preprocess_input``, as a fast equivalent where there is one (see ``fast_preprocess``)."""
        return self.preprocess or fast_preprocess(self.module)


_MEAN_BGR = (103.939, 116.779, 123.68)
_MEAN_RGB, _STD_RGB = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _caffe(x):
    # RGB -> BGR with tf.reverse: Keras' x[..., ::-1] is a strided gather, 2-5x slower on CPUs.
    return tf.reverse(x, axis=[-1]) + tf.constant([-m for m in _MEAN_BGR], x.dtype)


def _tf_mode(x):
    return x / 127.5 - 1.0


def _torch(x):
    return (x / 255.0 + tf.constant([-m for m in _MEAN_RGB], x.dtype)) / tf.constant(_STD_RGB, x.dtype)


def _identity(x):
    return x


_FAST = (_identity, _tf_mode, _caffe, _torch)
_PREPROCESS: dict[str, Callable] = {}


def fast_preprocess(module: str) -> Callable:
    """A keras.applications module's ``preprocess_input``, or a faster function giving the same numbers.

    The modules use one of a few formulas (caffe, tf, torch, none); which one
    is found by comparing outputs on a probe batch, so a module whose
    formula is not among them keeps its own function.
    """
    if module not in _PREPROCESS:
        own = importlib.import_module(module).preprocess_input
        probe = np.random.default_rng(0).uniform(0, 255, (2, 5, 7, 3)).astype("float32")
        expected = np.asarray(own(tf.constant(probe)))
        chosen = own
        for candidate in _FAST:
            got = np.asarray(candidate(tf.constant(probe)))
            if got.shape == expected.shape and np.array_equal(got, expected):
                chosen = candidate
                break
        _PREPROCESS[module] = chosen
    return _PREPROCESS[module]


def available_models() -> dict[str, ModelSpec]:
    """All keras.applications models, by name."""
    specs = {}
    for name, fn in inspect.getmembers(keras.applications, inspect.isfunction):
        if name[0].isupper() and "include_top" in inspect.signature(fn).parameters:
            specs[name] = ModelSpec(name, fn, fn.__module__, _DEFAULT_SIZES.get(name, 224))
    return specs


def fold(name: str) -> str:
    """The key names are matched by: lower case, without ``_``, ``-``, spaces and dots."""
    return re.sub(r"[-_ .]", "", name).lower()


def get_spec(name: str) -> ModelSpec:
    """The spec of model ``name``, typed as people type it.

    ``ResNet50``, ``resnet50``, ``mobilenet_v2``, ``MobileNetV2``,
    ``efficientnet-b0`` all name a model: case, ``_``, ``-``, spaces and
    dots are ignored.

    ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` names a backbone of the
    user's own (``model.own``); its module's ``preprocess_input`` prepares the
    pixels, or they are scaled to [-1, 1].

    Raises:
        UserError: no model, or several, answer to the name; the message
            lists the candidates.
    """
    if own_model.is_own(name):
        builder, module, preprocess = own.load(name)
        return ModelSpec(name, own.constructor(name, builder), module, 224, preprocess or _tf_mode)
    specs = available_models()
    if name in specs:
        return specs[name]
    key = fold(name)
    by_name = {fold(n): n for n in specs}
    if key in by_name:
        return specs[by_name[key]]
    dropped = {fold(n): n for n in KERAS_2_ONLY if n not in specs}
    if key in dropped:
        raise UserError(
            f"--model {dropped[key]} is one of Keras 2's applications that Keras {KERAS_MAJOR} dropped: run it with "
            f"HVD_TRAIN_KERAS=2 (tf-keras), or pick another (`hvd-train models`)"
        )
    # Keras' module names: keras.applications.mobilenet_v2 holds MobileNetV2 only,
    # keras.applications.resnet holds ResNet50, ResNet101 and ResNet152.
    by_module: dict[str, list[str]] = {}
    for n, spec in specs.items():
        by_module.setdefault(fold(spec.module.rsplit(".", 1)[-1]), []).append(n)
    found = sorted(by_module.get(key, []), key=_natural)
    if len(found) == 1:
        return specs[found[0]]
    if found:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        raise UserError(f"model name {name!r} (--model) is ambiguous: it names {shown}; give one of them.")
    import difflib

    starting = sorted((n for k, n in by_name.items() if key and k.startswith(key)), key=_natural)
    close = [by_name[k] for k in difflib.get_close_matches(key, list(by_name), n=3, cutoff=0.5)]
    candidates = list(dict.fromkeys(starting[:3] + close))[:4]
    hint = f" Did you mean {', '.join(candidates)}?" if candidates else ""
    raise UserError(f"unknown model {name!r} (--model);{hint} `hvd-train models` lists all.")


def _natural(name: str) -> list:
    """Sort key: ResNet50 before ResNet101."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def resolve_bn(cfg: ModelConfig) -> tuple[str, float]:
    """BatchNormalization mode and momentum after applying the ``auto`` defaults.

    Returns:
        ``(mode, momentum)``; momentum 0 means "keep the model's own".
    """
    pretrained = cfg.weights != "none"
    mode = cfg.bn_mode if cfg.bn_mode != "auto" else ("inference" if pretrained else "train")
    momentum = cfg.bn_momentum or (0.0 if pretrained else SCRATCH_BN_MOMENTUM)
    return mode, momentum


def resolve_head_norm(cfg: ModelConfig) -> str:
    """``--head-norm`` after ``auto``: ``layer`` for a frozen backbone, else ``none``.

    Measured (benchmarks/RESULTS.md): on a frozen VGG16 with large features the
    plain head diverges at SGD 0.01 and the normalised one does not; on the demo
    (MobileNetV2 from scratch) the normalised head fell from 0.99 to 0.69 held-out
    accuracy, as the backbone's gradients are scaled by 1/spread of its features.
    """
    if cfg.head_norm != "auto":
        return cfg.head_norm
    return "layer" if cfg.freeze_backbone else "none"


def head_activation(cfg) -> str:
    """The head's activation for the run ``cfg`` (a TrainConfig): sigmoid for a multi-label set, else softmax."""
    return "sigmoid" if cfg.data.multi_label else "softmax"


def build_model(
    cfg: ModelConfig, num_classes: int, image_size: int, load_weights: bool = True, activation: str = "softmax"
):
    """Builds backbone + head: GlobalAveragePooling2D, LayerNormalization (``--head-norm``), Dropout, Dense
    (``activation``: softmax, or sigmoid for a multi-label set).

    Args:
        cfg: the model section of the configuration.
        num_classes: outputs of the new head.
        image_size: side of the square input.
        load_weights: load ``cfg.weights``; other Horovod ranks pass False and
            receive rank 0's weights by broadcast.

    Returns:
        A functional ``keras.Model`` whose last layer is named ``predictions``.

    Raises:
        UserError: the weights cannot be downloaded or do not fit the model,
            or the input size is too small for it.
    """
    spec = get_spec(cfg.name)
    weights = cfg.weights if load_weights else "none"
    # Checked here, not in the configuration: only the rank that loads the
    # file needs it (on a cluster, other hosts may not have it).
    if weights not in ("imagenet", "none") and not os.path.isfile(weights):
        raise UserError(f"weights file {weights} does not exist; check --weights (imagenet, none, or a file path).")
    try:
        backbone = spec.constructor(
            include_top=False,
            weights=None if weights == "none" else weights,
            input_shape=(image_size, image_size, 3),
        )
    except UserError:
        raise
    except Exception as e:  # Keras raises bare Exception for download failures
        raise _weights_error(e, spec, cfg.weights, image_size) from None
    mode, momentum = resolve_bn(cfg)
    for layer in backbone.layers:
        if isinstance(layer, keras.layers.BatchNormalization) and momentum:
            layer.momentum = momentum
    if mode == "inference" and KERAS_MAJOR == 3:
        # Keras 3 passes the outer call's ``training`` to every layer, over the ``training=False`` given below:
        # its way to keep a BatchNormalization on its moving statistics is to make it not trainable (its scale
        # and offset then stay as loaded; tf-keras trains them).
        for layer in backbone.layers:
            if isinstance(layer, keras.layers.BatchNormalization):
                layer.trainable = False
    if cfg.freeze_backbone:
        backbone.trainable = False
    elif cfg.trainable_layers:
        for layer in backbone.layers[: -cfg.trainable_layers]:
            layer.trainable = False

    inputs = keras.Input((image_size, image_size, 3), name="image")
    # training=False keeps BatchNormalization on its moving statistics while the
    # convolutions still learn: Keras' advice for fine-tuning pretrained models.
    x = backbone(inputs, training=False) if mode == "inference" else backbone(inputs)
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    if resolve_head_norm(cfg) == "layer":
        # The backbone's features may be of any scale (VGG's are large): the head sees them normalised.
        x = keras.layers.LayerNormalization(name="head_norm")(x)
    if cfg.dropout:
        x = keras.layers.Dropout(cfg.dropout, name="head_dropout")(x)
    outputs = keras.layers.Dense(num_classes, activation=activation, dtype="float32", name=HEAD_LAYER)(x)
    # A model of the user's own is named after its function (a path is no Keras name).
    return keras.Model(inputs, outputs, name=f"{spec.name.rpartition(':')[2]}_classifier")


def _weights_error(e: Exception, spec: ModelSpec, weights: str, image_size: int) -> UserError:
    reason = first_line(e)
    if weights == "imagenet" and ("fetch" in reason.lower() or "url" in reason.lower()):
        cache = os.path.join(os.environ.get("KERAS_HOME", os.path.expanduser("~/.keras")), "models")
        return UserError(
            f"could not download the ImageNet weights of {spec.name} ({reason}); put the weights "
            f"file in the Keras cache folder {cache}, or pass --weights PATH to a weights file, "
            f"or --weights none to train from scratch."
        )
    if weights not in ("imagenet", "none"):
        return UserError(
            f"weights file {weights} does not fit {spec.name} without its top at "
            f"{image_size}x{image_size} ({reason}); pass a file saved from that model "
            f"(include_top=False), --weights imagenet or --weights none."
        )
    return UserError(f"cannot build {spec.name} at --image-size {image_size}: {reason}")
