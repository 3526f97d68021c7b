import argparse
import re

import numpy as np
import pytest

from hvd_train.compat import keras
from hvd_train.config import ModelConfig
from hvd_train.errors import UserError
from hvd_train.model.catalogue import available_models, build_model, get_spec, resolve_bn


def test_registry_has_the_keras_applications():
    names = available_models()
    for name in ("ResNet50", "MobileNetV2", "EfficientNetB0", "InceptionV3", "ConvNeXtTiny", "VGG16"):
        assert name in names
    assert names["InceptionV3"].default_size == 299
    assert get_spec("mobilenetv2").name == "MobileNetV2"


@pytest.mark.parametrize(
    "typed, name",
    [
        ("resnet50", "ResNet50"),
        ("RESNET50", "ResNet50"),
        ("mobilenet_v2", "MobileNetV2"),
        ("MobileNetV2", "MobileNetV2"),
        ("mobilenet-v2", "MobileNetV2"),
        ("efficientnet-b0", "EfficientNetB0"),
        ("EfficientNetB0", "EfficientNetB0"),
        ("efficientnet_v2_s", "EfficientNetV2S"),
        ("inception_v3", "InceptionV3"),  # a Keras module name with one model in it
        ("vgg16", "VGG16"),
    ],
)
def test_names_people_type(typed, name):
    assert get_spec(typed).name == name


@pytest.mark.parametrize(
    "typed, candidates",
    [
        ("resnet", "ResNet50, ResNet101, ResNet152"),
        ("mobilenet_v3", "MobileNetV3Large, MobileNetV3Small"),
        ("efficientnet", "EfficientNetB0, EfficientNetB1"),
    ],
)
def test_a_module_name_with_several_models_is_ambiguous(typed, candidates):
    with pytest.raises(UserError, match=f"model name '{typed}' .*is ambiguous: it names {candidates}") as e:
        get_spec(typed)
    assert "\n" not in str(e.value)


def test_unknown_model_suggests_close_names():
    with pytest.raises(UserError, match="unknown model 'ResNet5' .*Did you mean .*ResNet50"):
        get_spec("ResNet5")


def test_bn_defaults_depend_on_pretrained_weights():
    assert resolve_bn(ModelConfig(weights="imagenet")) == ("inference", 0.0)
    assert resolve_bn(ModelConfig(weights="none")) == ("train", 0.9)
    assert resolve_bn(ModelConfig(weights="none", bn_mode="inference", bn_momentum=0.5)) == ("inference", 0.5)


def _moving_means(model):
    return [w.numpy().copy() for w in model.weights if "moving_mean" in w.name]


def _one_train_step(model):
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="sparse_categorical_crossentropy")
    x = np.random.default_rng(0).uniform(0, 1, (4, 32, 32, 3)).astype("float32")
    model.train_on_batch(x, np.array([0, 1, 2, 0]))


@pytest.mark.parametrize("mode, changes", [("inference", False), ("train", True)])
def test_bn_mode_controls_moving_statistics(mode, changes):
    model = build_model(ModelConfig(name="MobileNetV2", weights="none", bn_mode=mode), 3, 32)
    before = _moving_means(model)
    _one_train_step(model)
    after = _moving_means(model)
    moved = any(not np.allclose(a, b) for a, b in zip(before, after))
    assert moved is changes


def test_scratch_bn_momentum_is_applied():
    model = build_model(ModelConfig(name="MobileNetV2", weights="none"), 3, 32)
    backbone = model.layers[1]
    momenta = {layer.momentum for layer in backbone.layers if isinstance(layer, keras.layers.BatchNormalization)}
    assert momenta == {0.9}


@pytest.mark.both_kerases
def test_freeze_and_trainable_layers():
    frozen = build_model(ModelConfig(name="MobileNetV2", weights="none", freeze_backbone=True), 3, 32)
    # tf-keras names a variable by its path (``head_norm/gamma:0``), Keras 3 keeps the path apart.
    assert [getattr(v, "path", v.name).split(":")[0] for v in frozen.trainable_variables] == [
        "head_norm/gamma",
        "head_norm/beta",
        "predictions/kernel",
        "predictions/bias",
    ]
    partial = build_model(ModelConfig(name="MobileNetV2", weights="none", trainable_layers=4), 3, 32)
    backbone = partial.layers[1]
    assert [layer.trainable for layer in backbone.layers[-4:]] == [True] * 4
    assert not any(layer.trainable for layer in backbone.layers[:-4])


def test_weights_file_made_here_is_loaded(tmp_path):
    source = keras.applications.MobileNetV2(include_top=False, weights=None, input_shape=(32, 32, 3))
    path = tmp_path / "backbone.weights.h5"  # the name both Kerases write HDF5 weights to
    source.save_weights(path)
    model = build_model(ModelConfig(name="MobileNetV2", weights=str(path)), 3, 32)
    loaded = model.layers[1].get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(loaded, source.get_weights()))


def test_missing_weights_file(tmp_path):
    with pytest.raises(UserError, match="weights file .*nope.h5 does not exist; check --weights"):
        build_model(ModelConfig(name="MobileNetV2", weights=str(tmp_path / "nope.h5")), 3, 32)
    # Ranks that receive the weights by broadcast do not need the file.
    build_model(ModelConfig(name="MobileNetV2", weights=str(tmp_path / "nope.h5")), 3, 32, load_weights=False)


def test_weights_file_that_does_not_fit(tmp_path):
    other = keras.applications.ResNet50(include_top=False, weights=None, input_shape=(32, 32, 3))
    path = tmp_path / "resnet.weights.h5"
    other.save_weights(path)
    with pytest.raises(UserError, match=f"weights file {path} does not fit MobileNetV2 .*--weights none"):
        build_model(ModelConfig(name="MobileNetV2", weights=str(path)), 3, 32)
    junk = tmp_path / "junk.weights.h5"
    junk.write_bytes(b"not hdf5")
    with pytest.raises(UserError, match="does not fit MobileNetV2"):
        build_model(ModelConfig(name="MobileNetV2", weights=str(junk)), 3, 32)


def test_imagenet_download_failure_names_the_fix(tmp_path, monkeypatch):
    # No internet here: Keras' real download fails, as it does behind a firewall.
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    monkeypatch.setattr("socket.getaddrinfo", _no_network)
    with pytest.raises(UserError, match="could not download the ImageNet weights of MobileNetV2 .*--weights PATH"):
        build_model(ModelConfig(name="MobileNetV2", weights="imagenet"), 3, 96)


def _no_network(*args, **kwargs):
    import socket

    raise socket.gaierror(-2, "Name or service not known")


def test_input_too_small_for_the_model():
    with pytest.raises(UserError, match="cannot build InceptionV3 at --image-size 32"):
        build_model(ModelConfig(name="InceptionV3", weights="none"), 3, 32)


def test_fast_preprocessing_gives_the_numbers_of_keras_own_for_every_model():
    import importlib

    import numpy as np
    import tensorflow as tf

    from hvd_train.model.catalogue import _caffe, available_models, fast_preprocess

    batch = np.random.default_rng(3).uniform(0, 255, (4, 9, 11, 3)).astype("float32")
    chosen = set()
    for spec in available_models().values():
        own = importlib.import_module(spec.module).preprocess_input
        fast = fast_preprocess(spec.module)
        chosen.add(fast.__name__)
        np.testing.assert_array_equal(fast(tf.constant(batch)), own(tf.constant(batch)), err_msg=spec.name)
    assert fast_preprocess(available_models()["ResNet50"].module) is _caffe
    assert {"_caffe", "_tf_mode", "_torch", "_identity"} <= chosen


@pytest.mark.parametrize(
    "freeze, head_norm, expected",
    [(True, "auto", True), (False, "auto", False), (False, "layer", True), (True, "none", False)],
)
def test_head_norm_is_layer_normalisation_for_frozen_backbones_by_default(freeze, head_norm, expected):
    cfg = ModelConfig(name="MobileNetV2", weights="none", freeze_backbone=freeze, head_norm=head_norm)
    model = build_model(cfg, num_classes=3, image_size=32)
    names = [layer.name for layer in model.layers]
    assert ("head_norm" in names) is expected
    if expected:  # between the pooling and the new Dense layer
        assert names.index("avg_pool") < names.index("head_norm") < names.index("predictions")


OWN = """
import keras  # the run's Keras (hvd_train makes it tf_keras under HVD_TRAIN_KERAS=2)

def backbone(input_shape):
    images = keras.Input(input_shape)
    return keras.Model(images, keras.layers.Conv2D(4, 3, strides=2, name="conv")(images))

def flat(input_shape):
    images = keras.Input(input_shape)
    return keras.Model(images, keras.layers.GlobalAveragePooling2D()(images))

def broken(input_shape):
    raise ValueError("no such layer")
"""


def test_a_backbone_of_your_own_from_a_file_or_a_module(tmp_path, monkeypatch):
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "small.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    spec = get_spec("nets/small.py:backbone")
    model = build_model(ModelConfig(name=spec.name, weights="none"), 3, 32)
    assert model.name == "backbone_classifier" and model.output_shape == (None, 3)
    assert model.layers[1].get_layer("conv").kernel.shape == (3, 3, 3, 4)
    # No preprocess_input in the module: pixels are scaled to [-1, 1].
    assert np.allclose(spec.preprocess_input()(np.array([0.0, 255.0])), [-1.0, 1.0])
    # The same file as a module on the path, with a preprocess_input of its own.
    (tmp_path / "nets" / "small.py").write_text(OWN + "\ndef preprocess_input(x):\n    return x / 255.0\n")
    monkeypatch.syspath_prepend(str(tmp_path / "nets"))
    spec = get_spec("small:backbone")
    assert np.allclose(spec.preprocess_input()(np.array([0.0, 255.0])), [0.0, 1.0])
    weights = tmp_path / "own.weights.h5"
    model.layers[1].save_weights(weights)
    loaded = build_model(ModelConfig(name="small:backbone", weights=str(weights)), 3, 32)
    assert np.array_equal(
        loaded.layers[1].get_layer("conv").kernel.numpy(), model.layers[1].get_layer("conv").kernel.numpy()
    )


def test_a_relative_model_file_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    from hvd_train.config import from_sources

    monkeypatch.chdir(tmp_path)
    flags = {"data.train": "d", "run.output": "o", "model.name": "nets/a.py:f", "model.weights": "none"}
    cfg = from_sources(argparse.Namespace(**flags))
    assert cfg.model.name == f"{tmp_path / 'nets' / 'a.py'}:f"
    # Its default --weights imagenet is refused at once, naming the fix.
    with pytest.raises(UserError, match=re.escape("weights='imagenet'; --model nets/a.py:f is a backbone of your own")):
        from_sources(argparse.Namespace(**{"data.train": "d", "run.output": "o", "model.name": "nets/a.py:f"}))


@pytest.mark.parametrize(
    "name, weights, message",
    [
        ("nets/nope.py:backbone", "none", "the file nets/nope.py does not exist"),
        ("no_such_module_here:backbone", "none", "importing no_such_module_here failed: ModuleNotFoundError"),
        ("nets/small.py:other", "none", "nets/small.py has no function other"),
        ("nets/small.py:", "none", "FILE.py:FUNCTION or PACKAGE.MODULE:FUNCTION"),
        ("nets/small.py:backbone", "imagenet", "no ImageNet weights; pass --weights none"),
        ("nets/small.py:flat", "none", "whose output is feature maps (batch, height, width, channels)"),
        ("nets/small.py:broken", "none", "failed to build at input (32, 32, 3): ValueError: no such layer"),
    ],
)
def test_a_backbone_of_your_own_that_cannot_be_used_is_one_clear_error(tmp_path, monkeypatch, name, weights, message):
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "small.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=re.escape(message)):
        build_model(ModelConfig(name=get_spec(name).name, weights=weights), 3, 32)
