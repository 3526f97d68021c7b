"""The recipe options that change the step: weight decay, label smoothing, class weights, EMA, mixup and CutMix.

Each is tested for its effect, in one process of its own (Horovod's
optimizer, the compiled steps), and once through ``train`` with a resume.
"""

import json
import shutil
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
from hvd_train.model import optimizers
from hvd_train.model.network import Net
from hvd_train.compat import keras, tf
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.schedules import WarmupSchedule

ctx = start.init(1)
out = {}


def cfg(data=None, horovod=None, **optim):
    return config.build({
        "data": {"train": "unused", **(data or {})}, "run": {"output": "unused"},
        "optim": {"base_lr": 0.1, **optim}, "compute": {"steps_per_call": 10}, "horovod": horovod or {},
    })


def net_of(features=6, classes=3, counts=None, precision="fp32", data=None, horovod=None, **optim):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((features,))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(8, activation="relu")(inputs))
    outputs = keras.layers.Dense(classes, activation="softmax", name=HEAD_LAYER)(hidden)
    return Net(keras.Model(inputs, outputs), cfg(data, horovod, **optim), 0, 0, precision, class_counts=counts)


def train(net, xs, ys, steps, lr=0.1, batch=16, per_call=10, seen=0):
    rates = WarmupSchedule(lr, lr, 0, 1).parameters()
    ids = np.arange(len(xs), dtype=np.int64)
    data = tf.data.Dataset.from_tensor_slices((xs, ys, ids)).shuffle(len(xs), seed=0).batch(batch, drop_remainder=True)
    iterator = iter(data.repeat())
    for done in range(0, steps, per_call):
        progress = (seen + done * batch, done, batch, batch * steps, batch * steps)
        net.run_steps(iterator, per_call, (False, False, 0.0), progress, rates)
    return net


def weights_of(net):
    return [v.numpy().copy() for v in net.model.trainable_variables]


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

# --optimizer adamw alone: Keras's AdamW with the default decay.
adamw = optimizers.make(cfg(optimizer="adamw").optim)
out["adamw_alone"] = [type(adamw).__name__, float(adamw.weight_decay)]

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

# EMA: after each update, average = decay x average + (1 - decay) x the new weights; the BatchNorm
# statistics' averages the same after each step; the decay warms up to --ema.
def statistics_of(net):
    return [v.numpy().copy() for v in net.batchnorm_statistics()]


for name, precision, horovod in (("fp32", "fp32", {}), ("mixed", "mixed_float16", {}),
                                 ("accum", "fp32", {"grad_accum": 2})):
    net = train(net_of(precision=precision, horovod=horovod, ema=0.9), xs, ys, 20)
    pairs = net.averages()
    trainable = len(net.model.trainable_variables)
    averages, raw = [a.numpy().copy() for _, a in pairs], weights_of(net) + statistics_of(net)
    # The decay warms up: min(0.9, (1 + n) / (10 + n)) after n updates (0.7 after 20).
    decay = min(0.9, (1 + int(net.optimizer.iterations.numpy())) / (10 + int(net.optimizer.iterations.numpy())))
    # One batch more: a whole update, or half of one under --grad-accum 2 (no update, no new average).
    train(net, xs, ys, 1, per_call=1, seen=320)
    moved = [float(np.max(np.abs(a.numpy() - b))) for (_, a), b in zip(pairs, averages)]
    half = {"weights": max(moved[:trainable]), "statistics": max(moved[trainable:])}
    after_half = [a.numpy().copy() for _, a in pairs]
    statistics_expected = [decay * a + (1 - decay) * w for a, w in zip(averages[trainable:], statistics_of(net))]
    if horovod:
        n = int(net.optimizer.iterations.numpy())
        decay = min(0.9, (1 + n) / (10 + n))
        train(net, xs, ys, 1, per_call=1, seen=336)
    expected = [decay * a + (1 - decay) * w for a, w in zip(averages, weights_of(net))]
    out[f"ema_{name}"] = {
        "trainable": trainable, "statistics": len(pairs) - trainable, "moved_by_half": half,
        "off_formula": float(max(np.max(np.abs(a.numpy() - e)) for (_, a), e in zip(pairs, expected))),
        "statistics_off_formula": float(max(np.max(np.abs(a - e)) for a, e in
                                            zip(after_half[trainable:], statistics_expected))),
        "moved": float(max(np.max(np.abs(a.numpy() - b)) for (_, a), b in zip(pairs, averages))),
        "apart_from_weights": float(max(np.max(np.abs(a - w)) for a, w in zip(averages, raw))),
        "decay": decay,
    }
    inside_before = weights_of(net) + statistics_of(net)
    with net.averaged():
        inside = weights_of(net) + statistics_of(net)
    out[f"ema_{name}"]["swap"] = [
        len(inside) == len(pairs) and all(np.array_equal(i, a.numpy()) for i, (_, a) in zip(inside, pairs)),
        all(np.array_equal(i, b) for i, b in zip(weights_of(net) + statistics_of(net), inside_before)),
    ]

# Mixup and CutMix on a batch of constant images 10, 20, 30, 40; the last a stand-in (no weight) of class 1.
from hvd_train.model.mixing import Mixer

values = np.array([10.0, 20.0, 30.0, 40.0], np.float32)
images = tf.constant(np.ones((4, 8, 8, 3), np.float32) * values[:, None, None, None])
labels = tf.constant([0, 1, 2, 1])
weights = tf.constant([1.0, 1.0, 0.5, 0.0])
for kind, mixer in (("mixup", Mixer(1.0, 0.0, 3)), ("cutmix", Mixer(0.0, 1.0, 3)), ("both", Mixer(1.0, 1.0, 3))):
    runs = []
    for k in range(40):
        mixed, pairs, w, top = mixer.mix(images, labels, weights, tf.constant([7, k], tf.int64))
        targets = mixer.targets(pairs)  # as the data-parallel step takes them
        runs.append({"images": mixed.numpy().tolist(), "targets": targets.numpy().tolist(),
                     "weights": w.numpy().tolist(), "labels": top.numpy().tolist()})
    again = mixer.mix(images, labels, weights, tf.constant([7, 0], tf.int64))[0].numpy()
    out[f"mix_{kind}"] = {"runs": runs, "same_key_same_mix": bool(np.array_equal(again, runs[0]["images"]))}
lams = [float(Mixer(a, 0.0, 2)._beta(a, tf.constant([1, k], tf.int64))) for a in (1.0, 0.2) for k in range(1500)]
out["beta_1"], out["beta_02"] = lams[:1500], lams[1500:]

# Mixup while training: the mixing is a function of (seed, rank, images seen), and the model ends less sure.
# (A constant rate: the progress moves nothing else. Without mixing, the progress changes nothing.)
first, second = (weights_of(train(net_of(data={"mixup": 0.4}, lr_schedule="constant"), xs, ys, 10)) for _ in range(2))
shifted = weights_of(train(net_of(data={"mixup": 0.4}, lr_schedule="constant"), xs, ys, 10, seen=1600))
plain, plain_shifted = (weights_of(train(net_of(lr_schedule="constant"), xs, ys, 10, seen=s)) for s in (0, 1600))
out["mixup_same_progress_same_weights"] = all(np.array_equal(a, b) for a, b in zip(first, second))
out["mixup_other_progress_other_weights"] = not all(np.array_equal(a, b) for a, b in zip(first, shifted))
out["plain_other_progress_same_weights"] = all(np.array_equal(a, b) for a, b in zip(plain, plain_shifted))
for name, data in (("none", {}), ("mixup", {"mixup": 1.0})):
    net = train(net_of(data=data), xs, ys, 150)
    out[f"mixed_max_prob_{name}"] = float(np.mean(np.max(net.model(xs, training=False).numpy(), axis=1)))
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
    # AdamW with its default weight decay (Keras's), recorded and shown as if given.
    options = ["--optimizer", "adamw", "--label-smoothing", "0.1", "--class-weights", "auto"]
    options += ["--augment", "randaugment", "--augment-magnitude", "5"]
    first = cli(["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *TINY, *options])
    assert first.returncode == 0, output_of(first)
    recorded = yaml.safe_load((out / "run_config.yaml").read_text())
    chosen = [recorded["optim"][k] for k in ("optimizer", "weight_decay", "label_smoothing", "class_weights")]
    assert chosen == ["adamw", 0.004, 0.1, "auto"]
    assert (recorded["data"]["augment"], recorded["data"]["augment_magnitude"]) == ("randaugment", 5.0)
    more = [*TINY[:-1], "2"]
    second = cli(["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *more, *options])
    assert second.returncode == 0, output_of(second)
    assert "resuming from" in second.stderr, output_of(second)
    recipe = (
        "--optimizer adamw, --weight-decay 0.004, --label-smoothing 0.1, --class-weights auto, --augment randaugment"
    )
    assert f"recipe: {recipe}, magnitude 5" in second.stderr, output_of(second)
    # Its checkpoints hold no moving averages: a resume with --ema is refused, saying why.
    third = cli(["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *TINY, *options, "--ema", "0.9"])
    assert third.returncode == 2 and "holds no moving average of the weights" in third.stderr, output_of(third)


def _arrays(checkpoint, shape):
    """The arrays of ``shape`` in a checkpoint: ``{name: array}`` (the model's and the optimizer's)."""
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(checkpoint / "ckpt"))
    return {n: reader.get_tensor(n) for n, s in tf.train.list_variables(str(checkpoint / "ckpt")) if s == list(shape)}


@pytest.mark.both_kerases
def test_early_stop_with_ema_saves_the_best_epochs_averaged_weights_and_resumes(tmp_path, demo_small):
    import tensorflow as tf

    out = tmp_path / "run"
    # Five classes: top-5 is always 1.0, so it never improves after epoch 1 and patience 1 ends the run
    # after epoch 2; epoch 1's checkpoint is kept beyond --keep-checkpoints 1, and its model is saved.
    # Under mixed precision: the averages, the mixing and the saved float32 copy together.
    options = ["--ema", "0.9", "--mixup", "0.2", "--cutmix", "1.0", "--keep-checkpoints", "1"]
    options += ["--precision", "mixed_bfloat16"]
    stop = ["--early-stop", "1", "--early-stop-metric", "val_top5"]
    command = ["train", "--data", demo_small, "--output", out, "--val-split", "0.2", *TINY[:-1], "3", *options]
    first = cli([*command, *stop])
    assert first.returncode == 0, output_of(first)
    assert "training ends after epoch 2 of 3 (best: epoch 1" in first.stderr, output_of(first)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["early_stop"] == {
        "metric": "val_top5",
        "patience": 1,
        "best_epoch": 1,
        "best_score": 1.0,
        "epochs_trained": 2,
        "saved_epoch": 1,
    }
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch-0001", "epoch-0002"]
    recorded = yaml.safe_load((out / "run_config.yaml").read_text())
    assert (recorded["optim"]["ema"], recorded["data"]["mixup"], recorded["data"]["cutmix"]) == (0.9, 0.2, 1.0)
    assert (recorded["run"]["early_stop"], recorded["run"]["early_stop_metric"]) == (1, "val_top5")
    # The saved head is epoch 1's moving average: an array the optimizer kept, not the model's own weights.
    saved = next(
        w for w in tf.keras.models.load_model(out / "model.keras", compile=False).get_weights() if w.shape == (32, 5)
    )
    best, last = _arrays(checkpoints / "epoch-0001", (32, 5)), _arrays(checkpoints / "epoch-0002", (32, 5))
    matches = [name for name, array in best.items() if np.array_equal(array, saved)]
    assert len(matches) == 1 and matches[0].startswith("optimizer/"), sorted(best)
    assert not any(np.array_equal(array, saved) for array in last.values())
    # The model's own kernel: tf-keras keeps it under the model, Keras 3 under the optimizer's variables.
    own = next(n for n in best if n.startswith(("model/", "optimizer/_trainable_variables/")))
    assert own not in matches and not np.array_equal(best[own], saved)
    # The held-out scores are of the saved weights, scored again: epoch 1's row of metrics.csv.
    rows = (out / "metrics.csv").read_text().splitlines()
    header, epoch_1 = rows[0].split(","), rows[1].split(",")
    assert summary["val_accuracy"] == pytest.approx(float(epoch_1[header.index("val_accuracy")]))
    # Killed in epoch 2 (its checkpoint and the outputs not written yet): the rerun resumes after epoch 1,
    # ends after epoch 2 as before, and saves epoch 1's averaged weights again.
    shutil.rmtree(checkpoints / "epoch-0002")
    for name in ("model.keras", "summary.json"):
        (out / name).unlink()
    resumed = cli([*command, *stop])
    assert resumed.returncode == 0 and "resuming from" in resumed.stderr, output_of(resumed)
    assert "training ends after epoch 2 of 3 (best: epoch 1" in resumed.stderr, output_of(resumed)
    assert json.loads((out / "summary.json").read_text())["early_stop"]["saved_epoch"] == 1
    again_saved = tf.keras.models.load_model(out / "model.keras", compile=False).get_weights()
    assert any(w.shape == (32, 5) and np.array_equal(w, saved) for w in again_saved)
    # The same command again: the run stopped already. Without --early-stop it trains on from epoch 2.
    again = cli([*command, *stop])
    assert again.returncode == 0 and "stopped early after epoch 2 already" in again.stderr, output_of(again)
    more = cli(command)
    assert more.returncode == 0 and "resuming from" in more.stderr, output_of(more)
    summary = json.loads((out / "summary.json").read_text())
    assert "early_stop" not in summary and len((out / "metrics.csv").read_text().splitlines()) == 4


def test_adamw_decays_by_keras_default_unless_told_and_an_explicit_zero_is_refused(recipe):
    from hvd_train import config
    from hvd_train.cli import build_parser
    from hvd_train.config.choices import ADAMW_WEIGHT_DECAY
    from hvd_train.errors import UserError

    def weight_decay(*options):
        args = build_parser().parse_args(["train", "--data", "d", "--output", "o", *options])
        return config.from_sources(args).optim.weight_decay

    assert weight_decay("--optimizer", "adamw") == ADAMW_WEIGHT_DECAY == 0.004  # keras.optimizers.AdamW()'s
    assert weight_decay("--optimizer", "adamw", "--weight-decay", "0.05") == 0.05
    assert weight_decay("--optimizer", "adam") == weight_decay() == 0.0
    assert recipe["adamw_alone"] == ["AdamW", ADAMW_WEIGHT_DECAY]
    # AdamW told to decay by nothing is Adam under another name: refused in one line.
    with pytest.raises(UserError, match="--optimizer adamw decays weights: give --weight-decay > 0, or leave it out"):
        weight_decay("--optimizer", "adamw", "--weight-decay", "0")


@pytest.mark.both_kerases
@pytest.mark.parametrize("case", ["fp32", "mixed", "accum"])
def test_ema_averages_the_weights_after_each_update_and_the_statistics_after_each_step(recipe, case):
    ema = recipe[f"ema_{case}"]
    assert (ema["trainable"], ema["statistics"]) == (6, 2), ema  # the BatchNorm's mean and variance
    assert ema["off_formula"] < 1e-6 and ema["moved"] > 1e-3, ema
    # Half an update (one of two accumulated passes) leaves the weights' averages; a step moves the statistics.
    assert (ema["moved_by_half"]["weights"] == 0.0) == (case == "accum"), ema
    assert ema["moved_by_half"]["statistics"] > 0 and ema["statistics_off_formula"] < 1e-6, ema
    assert ema["apart_from_weights"] > 1e-2, ema
    assert ema["decay"] < 0.75  # still warming up after about 20 updates


@pytest.mark.parametrize("case", ["fp32", "mixed", "accum"])
def test_averaged_holds_the_averages_inside_and_the_weights_after(recipe, case):
    assert recipe[f"ema_{case}"]["swap"] == [True, True]


def _mix_checks(run):
    """Checks one mixed batch of the constant images 10, 20, 30, 40 (the last a stand-in); returns its lam."""
    images = np.array(run["images"])
    targets = np.array(run["targets"])
    labels = [0, 1, 2, 1]
    assert np.allclose(targets.sum(axis=1), 1.0)
    # Image 0's partner is the stand-in: it stays whole, with its own label.
    assert np.all(images[0] == 10.0) and targets[0].tolist() == [1.0, 0.0, 0.0]
    assert run["weights"][3] == 0.0  # a stand-in weighs nothing, mixed or not
    lams = []
    for i, (mine, other) in enumerate(((20.0, 30.0), (30.0, 20.0))):
        lam = targets[i + 1, labels[i + 1]]
        pixels = images[i + 1]
        if np.all(np.isin(pixels, (mine, other))):  # CutMix: lam is the share of the image's own pixels
            assert np.mean(pixels == mine) == pytest.approx(lam, abs=1e-6)
        else:  # mixup: every pixel is lam x own + (1 - lam) x the other
            assert np.allclose(pixels, lam * mine + (1 - lam) * other, atol=1e-3)
        assert run["labels"][i + 1] == (labels[i + 1] if lam >= 0.5 else labels[2 - i])
        lams.append(lam)
    assert lams[0] == pytest.approx(lams[1], abs=1e-6)  # one draw for the batch: lam of each one's own
    w = run["weights"]
    assert w[1] == pytest.approx(lams[0] * 1.0 + (1 - lams[0]) * 0.5, abs=1e-6), w
    assert w[2] == pytest.approx(lams[0] * 0.5 + (1 - lams[0]) * 1.0, abs=1e-6), w
    return lams[0]


@pytest.mark.parametrize("kind", ["mixup", "cutmix", "both"])
def test_mixing_blends_pixels_targets_and_weights_alike(recipe, kind):
    mixed = recipe[f"mix_{kind}"]
    assert mixed["same_key_same_mix"]
    lams = [_mix_checks(run) for run in mixed["runs"]]
    assert len(set(np.round(lams, 6))) > 12  # each key its own draw (CutMix's in whole pixels of 8 x 8)
    kinds = {bool(np.all(np.isin(np.array(run["images"])[1], (20.0, 30.0)))) for run in mixed["runs"]}
    assert kinds == {"mixup": {False}, "cutmix": {True}, "both": {False, True}}[kind]


def test_mixing_draws_lam_from_a_symmetric_beta(recipe):
    for alpha, name in ((1.0, "beta_1"), (0.2, "beta_02")):
        lams = np.array(recipe[name])
        assert np.all((lams >= 0) & (lams <= 1))
        assert np.mean(lams) == pytest.approx(0.5, abs=0.03)
        assert np.var(lams) == pytest.approx(1 / (4 * (2 * alpha + 1)), rel=0.12)  # Beta(a, a)'s variance


def test_mixup_is_a_function_of_the_progress_and_makes_the_model_less_sure(recipe):
    assert recipe["mixup_same_progress_same_weights"]
    assert recipe["mixup_other_progress_other_weights"]
    assert recipe["plain_other_progress_same_weights"]
    assert recipe["mixed_max_prob_none"] > 0.99
    assert recipe["mixed_max_prob_mixup"] < recipe["mixed_max_prob_none"] - 0.01


def test_early_stop_wants_a_lower_loss_a_higher_accuracy_and_counts_epochs_since_the_best():
    from hvd_train.config.choices import RunConfig
    from hvd_train.training.early_stop import better, exhausted, note
    from hvd_train.training.state import TrainState

    assert better("val_loss", 0.5, 0.6) and not better("val_loss", 0.6, 0.5) and not better("val_loss", 0.5, 0.5)
    assert better("val_accuracy", 0.6, 0.5) and not better("val_accuracy", 0.5, 0.6)
    assert better("val_loss", 0.9, None) and not better("val_loss", float("nan"), None)
    run = RunConfig(output="o", early_stop=2, early_stop_metric="val_loss")
    state = TrainState(seed=0, world_size=1, batch_size=1, global_batch=1, total=1)
    stops = []
    for epoch, loss in enumerate([0.9, 0.7, 0.8, 0.6, 0.65, 0.61, 0.5]):
        note(run, state, epoch, {"val_loss": loss}, is_root=False)
        state.next_epoch()
        stops.append(exhausted(run, state))
    # Two epochs after epoch 4's 0.6 without a better loss: patience 2 is used up. A run that goes on
    # anyway (a rerun with more patience) finds a better one and is not exhausted any more.
    assert stops == [False, False, False, False, False, True, False]
    assert (state.best_epoch, state.best_score) == (6, 0.5)
