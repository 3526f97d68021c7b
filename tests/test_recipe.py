"""The recipe options that change the step: weight decay, label smoothing, class weights.

Each is tested for its effect, in one process of its own (Horovod's
optimizer, the compiled steps), and once through ``train`` with a resume.
"""

import json
import sys

import numpy as np
import pytest
import yaml

from conftest import TINY, cli, output_of, run

_RECIPE = """
import json
import numpy as np
from hvd_train import config
from hvd_train.distributed import start
from hvd_train.model.network import Net
from hvd_train.compat import keras, tf
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.training.schedules import WarmupSchedule

ctx = start.init(1)
out = {}


def cfg(**optim):
    return config.build({
        "data": {"train": "unused"}, "run": {"output": "unused"}, "optim": {"base_lr": 0.1, **optim},
        "compute": {"steps_per_call": 10},
    })


def net_of(features=6, classes=3, counts=None, precision="fp32", **optim):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="relu")(inputs))
    outputs = keras.layers.Dense(classes, activation="softmax", name=HEAD_LAYER)(hidden)
    return Net(keras.Model(inputs, outputs), cfg(**optim), 0, 0, precision, class_counts=counts)


def train(net, xs, ys, steps, lr=0.1, batch=16):
    rates = WarmupSchedule(lr, lr, 0, 1).parameters()
    ids = np.arange(len(xs), dtype=np.int64)
    data = tf.data.Dataset.from_tensor_slices((xs, ys, ids)).shuffle(len(xs), seed=0).batch(batch, drop_remainder=True)
    iterator = iter(data.repeat())
    for done in range(0, steps, 10):
        net.run_steps(iterator, 10, (False, False, 0.0), (0, 0, batch, batch * steps, batch * steps), rates)
    return net


# Weight decay with zero gradients: kernels shrink by lr x decay, rank-1 variables stay.
for name, optim, precision in (("sgd", {}, "fp32"), ("adam", {"optimizer": "adam"}, "fp32"),
                               ("adamw", {"optimizer": "adamw"}, "fp32"), ("sgd_mixed", {}, "mixed_float16")):
    net = net_of(precision=precision, weight_decay=0.1, **optim)
    net.optimizer.learning_rate.assign(0.5)
    variables = net.model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    net.optimizer.apply_gradients(zip([tf.zeros_like(v) for v in variables], variables))
    out[f"decay_{name}"] = [[v.shape.rank, float(np.max(np.abs(v.numpy() - 0.95 * b))),
                             float(np.max(np.abs(v.numpy() - b)))] for v, b in zip(variables, before)]

rng = np.random.default_rng(0)
centres = rng.normal(size=(3, 6)) * 4
ys = np.arange(240) % 3
xs = (centres[ys] + rng.normal(size=(240, 6))).astype("float32")
ys = ys.astype("int32")

# Label smoothing: the loss against the formula, and how sure the trained model is.
probs = tf.constant([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
labels = tf.constant([0, 2])
out["smoothed_loss"] = float(net_of(label_smoothing=0.3).model.compute_loss(None, labels, probs))
out["plain_loss"] = float(net_of().model.compute_loss(None, labels, probs))
for s in (0.0, 0.3):
    net = train(net_of(label_smoothing=s), xs, ys, 150)
    out[f"max_prob_{s}"] = float(np.mean(np.max(net.model(xs, training=False).numpy(), axis=1)))

# Weight decay while training: the kernels' norm.
for wd in (0.0, 0.05):
    net = train(net_of(weight_decay=wd), xs, ys, 150)
    out[f"kernel_norm_{wd}"] = float(sum(np.sum(v.numpy() ** 2) for v in net.model.trainable_variables
                                         if v.shape.rank > 1) ** 0.5)

# Class weights on an unbalanced set of two overlapping classes (90 % against 10 %): minority recall.
major = rng.normal(0.0, 1.0, size=(450, 2))
minor = rng.normal(1.2, 1.0, size=(50, 2))
xu = np.concatenate([major, minor]).astype("float32")
yu = np.array([0] * 450 + [1] * 50, np.int32)
test_minor = rng.normal(1.2, 1.0, size=(400, 2)).astype("float32")
for weights in ("none", "auto"):
    net = train(net_of(features=2, classes=2, counts=[450, 50], class_weights=weights), xu, yu, 300, batch=25)
    out[f"minority_recall_{weights}"] = float(np.mean(np.argmax(net.model(test_minor, training=False), 1) == 1))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def recipe():
    proc = run([sys.executable, "-c", _RECIPE], timeout=600)
    assert proc.returncode == 0, output_of(proc)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["sgd", "adam", "adamw", "sgd_mixed"])
def test_weight_decay_shrinks_kernels_by_lr_times_decay_and_leaves_norms_and_biases(recipe, case):
    variables = recipe[f"decay_{case}"]
    assert {rank for rank, _, _ in variables} == {1, 2}
    for rank, off_decayed, off_kept in variables:
        if rank > 1:
            assert off_decayed < 1e-6 and off_kept > 1e-4  # x 0.95
        else:
            assert off_kept == 0.0  # a bias, a BatchNorm scale or offset


def test_label_smoothing_is_cross_entropy_against_smoothed_targets(recipe):
    p = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    q = np.array([[1, 0, 0], [0, 0, 1]]) * 0.7 + 0.1
    assert recipe["smoothed_loss"] == pytest.approx(float(np.mean(-np.sum(q * np.log(p), axis=1))), rel=1e-4)
    assert recipe["plain_loss"] == pytest.approx(float(np.mean(-np.log([0.7, 0.8]))), rel=1e-4)


def test_label_smoothing_makes_the_trained_model_less_sure(recipe):
    assert recipe["max_prob_0.0"] > 0.97
    # Smoothed targets put 0.8 on the label: the model learns to say about that.
    assert recipe["max_prob_0.3"] < 0.9


def test_weight_decay_keeps_the_kernels_smaller(recipe):
    assert recipe["kernel_norm_0.05"] < 0.9 * recipe["kernel_norm_0.0"]


def test_class_weights_raise_the_minority_class_recall(recipe):
    assert recipe["minority_recall_auto"] > recipe["minority_recall_none"] + 0.2, recipe


def test_the_recipe_options_go_through_train_and_a_resume(tmp_path, demo_small):
    out = tmp_path / "run"
    options = ["--optimizer", "adamw", "--weight-decay", "0.05", "--label-smoothing", "0.1", "--class-weights", "auto"]
    first = cli(["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *TINY, *options])
    assert first.returncode == 0, output_of(first)
    recorded = yaml.safe_load((out / "run_config.yaml").read_text())["optim"]
    chosen = [recorded[k] for k in ("optimizer", "weight_decay", "label_smoothing", "class_weights")]
    assert chosen == ["adamw", 0.05, 0.1, "auto"]
    more = [*TINY[:-1], "2"]
    second = cli(["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *more, *options])
    assert second.returncode == 0, output_of(second)
    assert "resuming from" in second.stderr, output_of(second)


def test_adamw_without_weight_decay_is_refused(tmp_path, demo_small):
    proc = cli(["train", "--data", demo_small, "--output", tmp_path, *TINY, "--optimizer", "adamw"])
    assert proc.returncode == 2 and "--optimizer adamw decays weights" in proc.stderr, output_of(proc)
