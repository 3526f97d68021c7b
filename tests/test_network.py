import numpy as np
import pytest

from hvd_train.compat import keras
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.classifier import Classifier

pytestmark = pytest.mark.both_kerases


def one_step_deltas(mult):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, name="backbone")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name=HEAD_LAYER)(hidden)
    model = Classifier(inputs, outputs)
    model.head_lr_mult = mult
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    before = {name_of(w): w.numpy().copy() for w in model.trainable_weights}
    x = np.random.default_rng(1).normal(size=(8, 6)).astype("float32")
    model.train_on_batch(x, np.arange(8) % 3)
    return {name_of(w): w.numpy() - before[name_of(w)] for w in model.trainable_weights}


def name_of(weight) -> str:
    """``predictions/kernel``: Keras 3's path, tf-keras' name (Keras 3's name is the last part alone)."""
    return getattr(weight, "path", weight.name)


def test_head_lr_mult_scales_only_the_head_update():
    plain, boosted = one_step_deltas(1.0), one_step_deltas(10.0)
    for name in plain:
        factor = 10.0 if name.startswith(HEAD_LAYER) else 1.0
        assert np.abs(plain[name]).sum() > 0
        np.testing.assert_allclose(boosted[name], factor * plain[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mult", [1.0, 3.0])
def test_train_step_reports_loss_and_metrics(mult):
    inputs = keras.Input((4,))
    model = Classifier(inputs, keras.layers.Dense(2, activation="softmax", name=HEAD_LAYER)(inputs))
    model.head_lr_mult = mult
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    logs = model.train_on_batch(np.ones((4, 4), "float32"), np.array([0, 1, 0, 1]), return_dict=True)
    assert set(logs) == {"loss", "accuracy"} and logs["accuracy"] == pytest.approx(0.5)
