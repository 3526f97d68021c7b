"""The classification head sharded by class over groups of ranks (``--head-parallel``): exactness, bad input."""

import shutil
import sys
from pathlib import Path

import pytest

from hvd_train.distributed.groups import Layout, check, shard_range
from hvd_train.errors import UserError

from conftest import HVD_TRAIN, TINY, cli, launch, output_of, read_json, write_images

LAUNCHED = Path(__file__).parent / "launched"
CLASSES = 11  # as in the launched check: shards of 5 and 6, or 2, 3, 3 and 3


def test_layout_groups_consecutive_ranks_and_peers_hold_the_same_shard():
    layout = Layout(size=8, parallel=4)
    assert layout.groups == 2 and [layout.group_ranks(g) for g in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.peer_ranks(1) == [1, 5] and (layout.group_of(6), layout.shard_of(6)) == (1, 2)


@pytest.mark.parametrize("classes, parallel", [(11, 2), (11, 4), (1_000_000, 3), (7, 7)])
def test_shards_cover_every_class_once_as_evenly_as_they_can(classes, parallel):
    ranges = [shard_range(classes, parallel, j) for j in range(parallel)]
    assert [first for first, _ in ranges] == [sum(c for _, c in ranges[:j]) for j in range(parallel)]
    assert sum(c for _, c in ranges) == classes and max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


@pytest.mark.parametrize(
    "parallel, size, classes, message",
    [
        (3, 4, 10, "--head-parallel 3 does not divide the 4 workers of this job into groups: use one of 1, 2, 4."),
        (8, 4, 10, "--head-parallel 8 is more than the 4 workers of this job: use at most 4, or start more workers."),
        (4, 4, 3, "--head-parallel 4 is more than the 3 classes of the data"),
        (0, 4, 10, "--head-parallel 0: use a whole number >= 1"),
    ],
)
def test_a_head_that_cannot_be_split_so_is_refused_in_one_line(parallel, size, classes, message):
    with pytest.raises(UserError) as refused:
        check(parallel, size, classes)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def exact(results: dict, rank: int) -> None:
    for key, r in results.items():
        for name in (
            "loss",
            "backbone",
            "kernel",
            "bias",
            "trained_backbone",
            "trained_kernel",
            "trained_bias",
        ):
            assert r[name] <= 1e-5, (rank, key, name, r[name])
        assert r["predicted"] == r["argmax"], (rank, key)
        assert r["head_gradient_nonzero"] > 1e-3 and r["moved"] > 1e-3, (rank, key)  # something was compared
        # Held-out scores over all classes: the loss, the best class and the top 5, merged from the shards.
        assert r["score_loss"] <= 1e-5 and r["top1"][0] == r["top1"][1] and r["top5"][0] == r["top5"][1], (rank, key)
        # A diverged model's rows (no finite logits) are misses with no class, and of tied logits the lower
        # classes win, in both layouts.
        expected = {"odd": ([-1, -1], [False, False]), "tied": ([-1, -1, 0, 0], [False, False, True, False])}
        for name, (top1, top5) in expected.items():
            assert r[f"{name}_top1"][0] == r[f"{name}_top1"][1] and r[f"{name}_top5"][0] == r[f"{name}_top5"][1], r
            assert r[f"{name}_top1"][0][: len(top1)] == top1 and r[f"{name}_top5"][0][: len(top5)] == top5, r
        # The head written whole from the shards reads back exactly, and in another layout's shards.
        assert r["read_back"] == 0 and r["resplit"] <= 1e-5, (rank, key)


class OneProcess:
    """A stand-in for ``HeadGroups`` of one rank holding the whole head: each exchange gives back what it got."""

    parallel, shard, peers = 1, 0, None

    def gather(self, tensor, name):
        return tensor

    scatter_sum = group_sum = job_sum = broadcast = gather

    def peers_average(self, tensors, name):
        return list(tensors)


def test_the_sharded_heads_maths_through_a_one_process_stand_in_is_kerass_softmax_head():
    """``head_step`` and ``head_scores`` take their exchanges from the groups object alone: through a stand-in of one
    process they are a plain softmax head's loss (label smoothing and mixed targets included), gradients and
    scores."""
    import numpy as np

    from hvd_train.compat import keras, tf
    from hvd_train.model.sharded_head import head_scores, head_step
    from hvd_train.results.evaluation import score_logits

    rng = np.random.default_rng(3)
    features = tf.constant(rng.normal(size=(6, 4)), tf.float32)
    labels = tf.constant([0, 3, 2, 2, 1, 0])
    weights = tf.constant([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])  # a stand-in image weighs nothing
    kernel = tf.Variable(rng.normal(size=(4, 5)), dtype=tf.float32)
    bias = tf.Variable(rng.normal(size=5), dtype=tf.float32)
    loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.1)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(features)
        logits = tf.matmul(features, kernel) + bias
        loss = loss_fn(tf.one_hot(labels, 5), logits, sample_weight=weights)  # a mean over every row
    step = head_step(features, labels, weights, kernel, bias, first=0, classes=5, groups=OneProcess(), smoothing=0.1)
    np.testing.assert_allclose(step.loss.numpy(), loss.numpy(), rtol=1e-5)
    for got, variable in ((step.d_kernel, kernel), (step.d_bias, bias), (step.d_features, features)):
        np.testing.assert_allclose(got.numpy(), tape.gradient(loss, variable).numpy(), rtol=1e-4, atol=1e-6)
    assert step.predicted.numpy().tolist() == np.argmax(logits.numpy(), axis=1).tolist()
    # Mixed targets (mixup, CutMix): a second label and the first's share a row (one row mixed with itself).
    second, share = tf.constant([4, 3, 0, 1, 1, 2]), tf.constant([0.7, 0.2, 1.0, 0.5, 0.0, 0.9])
    soft = share[:, None] * tf.one_hot(labels, 5) + (1.0 - share[:, None]) * tf.one_hot(second, 5)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(features)
        logits = tf.matmul(features, kernel) + bias
        loss = loss_fn(soft, logits, sample_weight=weights)
    mixed = head_step(
        features, labels, weights, kernel, bias, first=0, classes=5, groups=OneProcess(), smoothing=0.1,
        mixed=(second, share),
    )  # fmt: skip
    np.testing.assert_allclose(mixed.loss.numpy(), loss.numpy(), rtol=1e-5)
    for got, variable in ((mixed.d_kernel, kernel), (mixed.d_bias, bias), (mixed.d_features, features)):
        np.testing.assert_allclose(got.numpy(), tape.gradient(loss, variable).numpy(), rtol=1e-4, atol=1e-6)
    scored = head_scores(features, labels, kernel, bias, first=0, groups=OneProcess(), k=3)
    for got, want in zip(scored, score_logits(logits, labels, 3)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5)


@pytest.mark.multiprocess
def test_the_sharded_head_equals_the_data_parallel_head(tmp_path):
    """Loss, gradients, predictions and three SGD steps, to 1e-5 relative, one and two groups, with and without
    label smoothing, and with mixed targets (mixup's and CutMix's: two labels and a share a row); held-out scores;
    the trained head gathered into one file and split again.

    Four ranks: groups of 2 (two groups, whose peers average the head's gradients), of 4 (one group, the
    whole job, as two ranks in one group of 2 are) and of 1 (each rank the whole head, its exchanges local, the
    peers every rank: what an elastic job falls back to in a world of a prime number of workers)."""
    np_, layouts = 4, "1,2,4"
    program = [sys.executable, LAUNCHED / "sharded_head_check.py", tmp_path, layouts, "0,0.1"]
    proc = launch("horovodrun-gloo", np_, program)
    assert proc.returncode == 0, output_of(proc)
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(np_)]
    for rank, results in enumerate(ranks):
        keys = [f"G={g},s={s}" for g in layouts.split(",") for s in ("0", "0.1")]
        assert sorted(results) == sorted([*keys, *(f"G={g},s=0.1,mixed" for g in layouts.split(","))])
        exact(results, rank)
    for g in map(int, layouts.split(",")):  # each group's shards are the whole head
        for group in range(np_ // g):
            shards = [ranks[r][f"G={g},s=0"]["shard"] for r in Layout(np_, g).group_ranks(group)]
            assert shards == [list(shard_range(CLASSES, g, j)) for j in range(g)]


def test_a_head_file_of_other_classes_or_none_is_refused_in_one_line(tmp_path):
    import numpy as np

    from hvd_train.model import sharded_files

    np.save(sharded_files.path_of(str(tmp_path), "kernel"), np.zeros((4, 10), np.float32))
    assert sharded_files.read_columns(str(tmp_path), "kernel", 3, 4, 10).shape == (4, 4)
    for name, classes, message in (("kernel", 12, "holds a head of 10 classes, this run has 12"), ("bias", 10, "")):
        with pytest.raises(UserError) as refused:
            sharded_files.read_columns(str(tmp_path), name, 0, 5, classes)
        assert message in str(refused.value) and "\n" not in str(refused.value)


def evaluated(out, data, tmp_path, name):
    """The saved model scored by ``evaluate`` as an ordinary model, one process."""
    report = tmp_path / f"{name}.json"
    proc = cli(["evaluate", "--model-dir", out, "--data", data, "--report", report])
    assert proc.returncode == 0, output_of(proc)
    return read_json(report)


@pytest.mark.multiprocess
def test_a_sharded_head_trains_scores_exactly_resumes_in_another_layout_and_saves_one_ordinary_model(
    demo_small, tmp_path
):
    """Two ranks, one group (G = 2: classes 0-1 and 2-4); the checkpoint scored again by four ranks in one group,
    then trained on by four ranks in two groups, then scored by one process holding the whole head, which
    trains on; its checkpoint is split again by two ranks.

    The held-out images are the training images: ``evaluate`` of the saved model, an ordinary Keras model
    in one process, then scores exactly what the sharded head scored in training."""
    import numpy as np

    from hvd_train.compat import keras

    out = tmp_path / "run"
    train = [*HVD_TRAIN, "train", "--data", demo_small, "--val-data", demo_small, "--output", out, *TINY]
    proc = launch("horovodrun-gloo", 2, [*train, "--head-parallel", "2"])
    assert proc.returncode == 0, output_of(proc)
    assert "sharded over groups of 2 workers (1 group(s))" in proc.stderr, output_of(proc)
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["val_images"] == 115
    assert summary["weights_identical_across_ranks"] is True  # the backbone: the head is split
    saved = keras.models.load_model(out / "model.keras", compile=False)
    assert saved.get_layer("predictions").units == 5  # one ordinary model, every class
    checkpoint = out / "checkpoints" / "epoch-0001"
    np.testing.assert_array_equal(
        saved.get_layer("predictions").kernel.numpy(), np.load(checkpoint / "head.kernel.npy")
    )
    assert sorted(p.name for p in checkpoint.glob("head.*.npy"))[:2] == ["head.bias.npy", "head.kernel.npy"]
    report = evaluated(out, demo_small, tmp_path, "first")
    assert report["images"] == 115 and report["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert report["top5"] == pytest.approx(summary["val_top5"], abs=1e-9)

    # Four ranks in one group: the head sharded four ways from the checkpoint, scored again, the same.
    proc = launch("horovodrun-gloo", 4, [*train, "--head-parallel", "-1"])
    assert proc.returncode == 0 and "all 1 epochs are done already" in proc.stderr, output_of(proc)
    again = read_json(out / "summary.json")
    assert again["world_size"] == 4 and again["val_accuracy"] == summary["val_accuracy"]
    assert again["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)

    # Four ranks in two groups of 2 train on.
    proc = launch("horovodrun-gloo", 4, [*train, "--head-parallel", "2", "--epochs", "2"])
    assert proc.returncode == 0, output_of(proc)
    assert "sharded over groups of 2 workers (2 group(s))" in proc.stderr and "resuming from" in proc.stderr
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 4 and summary["resumed_from"].endswith("epoch-0001")
    report = evaluated(out, demo_small, tmp_path, "second")
    assert report["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert report["loss"] == pytest.approx(summary["val_loss"], rel=1e-4)

    # One process, the head whole again: the sharded checkpoint, scored by an ordinary model, the same.
    proc = cli([*train[3:], "--epochs", "2"])
    assert proc.returncode == 0 and "all 2 epochs are done already" in proc.stderr, output_of(proc)
    whole = read_json(out / "summary.json")
    assert whole["world_size"] == 1 and whole["val_accuracy"] == summary["val_accuracy"]
    assert whole["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-4)

    # The other way: one process trains an epoch on (an unsharded checkpoint), two ranks split its head again.
    proc = cli([*train[3:], "--epochs", "3"])
    assert proc.returncode == 0, output_of(proc)
    assert not list((out / "checkpoints" / "epoch-0003").glob("head.*.npy"))
    whole = read_json(out / "summary.json")
    proc = launch("horovodrun-gloo", 2, [*train, "--head-parallel", "2", "--epochs", "3"])
    assert proc.returncode == 0 and "all 3 epochs are done already" in proc.stderr, output_of(proc)
    split = read_json(out / "summary.json")
    assert split["world_size"] == 2 and split["val_accuracy"] == whole["val_accuracy"]
    assert split["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-4)
    assert not list((out / "checkpoints").glob(".head-*")), "the staging folders are gone"


def test_the_starting_head_is_the_same_whatever_the_split():
    import numpy as np

    from hvd_train.model.head_start import HEAD_BLOCK, initial_columns

    classes, features = 2 * HEAD_BLOCK + 37, 6
    whole = initial_columns(features, classes, 0, classes, seed=3)
    for parallel in (2, 3, 7):
        parts = [
            initial_columns(features, classes, *shard_range(classes, parallel, j), seed=3) for j in range(parallel)
        ]
        np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)
    limit = np.sqrt(6 / (features + classes))  # Glorot-uniform over the whole head, as Keras's Dense starts
    assert whole.shape == (features, classes) and np.abs(whole).max() <= limit and np.abs(whole).max() > 0.9 * limit
    assert not np.array_equal(whole, initial_columns(features, classes, 0, classes, seed=4))


@pytest.mark.multiprocess
def test_a_sharded_head_under_mixed_float16_saved_as_files_is_scored_whole_and_split_and_then_saved_whole(tmp_path):
    """The features' gradients are those of the scaled loss; a step the scale skips skips the head too. The model
    saved as files (``--head-save files``: the features' model in float32 and the head's arrays) is scored as
    training scored it by one process holding the head whole and by two ranks holding half each; ``predict``
    takes it; a run that saves it whole after removes the files."""
    import numpy as np

    from hvd_train.compat import keras

    data = write_images(tmp_path / "few", {"a": 10, "b": 10, "c": 10})
    out = tmp_path / "run"
    train = [*HVD_TRAIN, "train", "--data", data, "--val-data", data, "--output", out, *TINY, "--batch-size", "4"]
    split = [*train, "--head-parallel", "2", "--precision", "mixed_float16"]
    proc = launch("horovodrun-gloo", 2, [*split, "--head-save", "files"])
    assert proc.returncode == 0, output_of(proc)
    assert "saved as features.keras and the head's arrays (--head-save files)" in proc.stderr, output_of(proc)
    summary = read_json(out / "summary.json")
    assert summary["precision"] == "mixed_float16" and summary["weights_identical_across_ranks"] is True
    assert summary["saved_model"] == "files" and not (out / "model.keras").exists()
    assert sorted(summary["model_files"]) == sorted(
        ["features.keras", "head.kernel.npy", "head.bias.npy", "labels.json", "run_config.yaml"]
    )
    features = keras.models.load_model(out / "features.keras", compile=False)
    assert {layer.dtype_policy.name for layer in features.layers} == {"float32"}
    assert np.load(out / "head.kernel.npy").shape == (features.output_shape[-1], 3)
    reports = {}
    for name, np_ in (("whole", 1), ("split", 2)):
        report = tmp_path / f"{name}.json"
        proc = launch(
            "horovodrun-gloo", np_, [*HVD_TRAIN, "evaluate", "--model-dir", out, "--data", data, "--report", report]
        )
        assert proc.returncode == 0, output_of(proc)
        reports[name] = report = read_json(report)
        assert report["images"] == 30 and report["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9), name
        # Training scored with float16 features, the saved model computes in float32.
        assert report["loss"] == pytest.approx(summary["val_loss"], rel=1e-3), name
    assert reports["split"]["loss"] == pytest.approx(reports["whole"]["loss"], rel=1e-6)
    assert reports["split"]["per_class_accuracy"] == reports["whole"]["per_class_accuracy"]
    proc = cli(["predict", "--model-dir", out, data / "a", "--output", tmp_path / "predicted.csv"])
    assert proc.returncode == 0 and len((tmp_path / "predicted.csv").read_text().splitlines()) == 11, output_of(proc)

    proc = launch("horovodrun-gloo", 2, [*split, "--head-save", "whole"])
    assert proc.returncode == 0 and "saved whole in model.keras (--head-save whole)" in proc.stderr, output_of(proc)
    assert read_json(out / "summary.json")["saved_model"] == "whole"
    assert sorted(p.name for p in out.glob("*.keras")) == ["model.keras"] and not list(out.glob("head.*.npy"))
    saved = keras.models.load_model(out / "model.keras", compile=False)
    assert {layer.dtype_policy.name for layer in saved.layers} == {"float32"}


def test_a_sharded_head_is_saved_whole_when_rank_0_has_the_room_and_as_files_when_not():
    from hvd_train.distributed.memory import Room
    from hvd_train.training.sharded_stages import choose_save

    gib = 2**30
    assert choose_save("auto", 3 * gib, Room(4 * gib, "host"))[0] == "whole"
    form, why = choose_save("auto", 5 * gib, Room(4 * gib, "cgroup limit"))
    assert form == "files" and "5.00 GiB" in why and "4.0 GiB (its cgroup limit)" in why, why
    assert choose_save("whole", 5 * gib, Room(4 * gib, "host"))[0] == "whole"
    assert choose_save("files", 1, Room(4 * gib, "host"))[0] == "files"


# SGD, whose step scales with the gradients' norm: clipping to a norm that counts the head's shards of every rank
# of the group, or not, trains other weights.
RECIPE = [
    *("--label-smoothing", "0.1", "--grad-accum", "2", "--ema", "0.9", "--deterministic", "--mixup", "0.4"),
    *("--cutmix", "1.0"),
    *("--base-lr", "0.5", "--clip-norm", "0.1", "--clip-value", "0.02", "--head-lr-mult", "3"),
]
# Nothing before the head trains: the backbone frozen, no normalisation of the head's input.
FROZEN = ["--optimizer", "adam", "--freeze-backbone", "--head-norm", "none", "--grad-accum", "2", "--deterministic"]
# The backbone's forward and backward passes compiled by XLA, the head's exchanges between them (--grad-accum is
# refused with --xla jit).
XLA = ["--xla", "jit", "--deterministic", "--label-smoothing", "0.1", "--mixup", "0.4", "--base-lr", "0.5"]


@pytest.mark.multiprocess
@pytest.mark.both_kerases
@pytest.mark.parametrize("options", [RECIPE, FROZEN, XLA], ids=["recipe", "frozen", "xla"])
def test_a_sharded_head_trains_the_weights_a_data_parallel_run_trains(demo_small, tmp_path, options):
    """The same job twice on two ranks, with the head whole on each and split over both: both start from the
    same head (``head_start``) and end with the same model, every weight to 1e-4 relative. With mixup and CutMix
    (each step one of them, its targets through the split loss as two labels and a share a row), label smoothing,
    --grad-accum 2 (the head's passes added up, applied with the backbone's), --ema (the head's average moved with
    the backbone's, and saved), --clip-value and --clip-norm (the global norm of the whole model's averaged
    gradients, the head's shards of the group included), then --head-lr-mult; with nothing trainable before
    the head, under Adam (the backbone's optimizer still counts the passes Adam's correction of the head reads);
    and with --xla jit, each way compiled by XLA (the split step: the backbone's passes, around the exchanges)."""
    import numpy as np

    from hvd_train.compat import keras
    from hvd_train.model.head_start import initial_columns

    models = {}
    for name, split in (("whole", []), ("split", ["--head-parallel", "2"])):
        out = tmp_path / name
        train = [*HVD_TRAIN, "train", "--data", demo_small, "--val-data", demo_small, "--output", out, *TINY]
        # --xla jit: TensorFlow's own lines too, which say when XLA compiled a cluster.
        proc = launch("horovodrun-gloo", 2, [*train, *options, *split], HVD_TRAIN_VERBOSE=str(int(options is XLA)))
        assert proc.returncode == 0, output_of(proc)
        assert ("accumulation 2" in proc.stderr) == ("--grad-accum" in options), output_of(proc)
        assert ("Compiled cluster using XLA" in proc.stderr) == (options is XLA), output_of(proc)
        models[name] = keras.models.load_model(out / "model.keras", compile=False)
    for layer in models["whole"].layers:
        for mine, theirs in zip(layer.get_weights(), models["split"].get_layer(layer.name).get_weights()):
            scale = max(np.abs(mine).max(), 1e-30)
            assert np.abs(mine - theirs).max() / scale <= 1e-4, layer.name
    head = models["whole"].get_layer("predictions").kernel.numpy()
    assert np.abs(head - initial_columns(*head.shape, 0, head.shape[1], seed=42)).max() > 1e-3  # it trained


@pytest.mark.both_kerases
@pytest.mark.multiprocess
def test_a_sharded_run_resumed_from_a_mid_epoch_checkpoint_ends_with_the_same_model(demo_small, tmp_path):
    """Checkpoints every 3 steps (of 8 an epoch) gather the sharded head mid-epoch; with the epoch's last one gone, a
    rerun resumes from step 6 (the head sharded again from its files, its optimizer's values too) and saves the
    model of the uninterrupted run, bit for bit."""
    import numpy as np

    from hvd_train.compat import KERAS_MAJOR, keras

    out = tmp_path / "run"
    train = [*HVD_TRAIN, "train", "--data", demo_small, "--val-data", demo_small, "--output", out, *TINY]
    command = [*train, "--head-parallel", "2", "--checkpoint-every", "3", "--keep-checkpoints", "3"]
    proc = launch("horovodrun-gloo", 2, command)
    assert proc.returncode == 0, output_of(proc)
    straight = keras.models.load_model(out / "model.keras", compile=False).get_weights()
    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == [
        "epoch-0000-step-000003",
        "epoch-0000-step-000006",
        "epoch-0001",
    ]
    # The head's optimizer values are named after the head's variables, by the Keras that wrote them.
    momentum = "slot-m-predictions-bias" if KERAS_MAJOR == 2 else "slot-predictions_bias_momentum"
    assert sorted(p.name for p in (checkpoints / "epoch-0000-step-000006").glob("head.*.npy"))[:3] == [
        "head.bias.npy",
        "head.kernel.npy",
        f"head.{momentum}.npy",
    ]
    shutil.rmtree(checkpoints / "epoch-0001")
    (out / "model.keras").unlink()
    proc = launch("horovodrun-gloo", 2, command)
    assert proc.returncode == 0 and "resuming from" in proc.stderr, output_of(proc)
    assert read_json(out / "summary.json")["resumed_from"].endswith("epoch-0000-step-000006")
    resumed = keras.models.load_model(out / "model.keras", compile=False).get_weights()
    assert len(resumed) == len(straight)
    for mine, theirs in zip(resumed, straight):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.multiprocess
@pytest.mark.parametrize("first, then", [("split", "whole"), ("whole", "split")])
def test_early_stop_saves_the_best_epoch_of_the_other_layout(demo_small, tmp_path, first, then):
    """Epoch 1 trained with the head in one layout, then epochs on in the other under --early-stop: the best epoch's
    checkpoint is of the first layout and is read as a resume reads it, into the model the run saves.

    Five classes: top-5 is always 1.0, so epoch 2 is no better than epoch 1, and patience 1 ends the run after it."""
    import numpy as np

    from hvd_train.compat import keras, tf

    out = tmp_path / "run"
    train = [*HVD_TRAIN, "train", "--data", demo_small, "--val-split", "0.2", "--output", out, *TINY]
    train += ["--early-stop", "1", "--early-stop-metric", "val_top5"]

    def job(layout, *more):
        if layout == "split":
            return launch("horovodrun-gloo", 2, [*train, "--head-parallel", "2", *more])
        return cli([*train[3:], *more])

    proc = job(first)
    assert proc.returncode == 0, output_of(proc)
    best = out / "checkpoints" / "epoch-0001"
    if first == "split":
        kernel = np.load(best / "head.kernel.npy")
    else:
        reader = tf.train.load_checkpoint(str(best / "ckpt"))
        # The model's kernel: tf-keras keeps it under the model, Keras 3 under the optimizer's variables.
        mine = ("model/", "optimizer/_trainable_variables/")
        listed = tf.train.list_variables(str(best / "ckpt"))
        [name] = [n for n, shape in listed if shape == [32, 5] and n.startswith(mine)]
        kernel = reader.get_tensor(name)
    proc = job(then, "--epochs", "3")
    assert proc.returncode == 0, output_of(proc)
    assert "training ends after epoch 2 of 3 (best: epoch 1" in proc.stderr, output_of(proc)
    summary = read_json(out / "summary.json")
    assert summary["early_stop"]["saved_epoch"] == 1 and summary["early_stop"]["epochs_trained"] == 2
    saved = keras.models.load_model(out / "model.keras", compile=False).get_layer("predictions").kernel.numpy()
    np.testing.assert_array_equal(saved, kernel)
    assert not list((out / "checkpoints").glob(".head-*")), "the staging folders are gone"
