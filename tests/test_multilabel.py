"""Multi-label held-out scores: the same on any number of ranks as on the images all together, and as defined."""

import csv
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from hvd_train.results import multilabel


def reference_ap(scores, truth):
    """Average precision as scikit-learn defines it, from every distinct score (not only the positives'):
    the sum over thresholds, descending, of (recall gained) * precision."""
    scores = np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf)
    truth = np.asarray(truth, bool)
    if not truth.any():
        return float("nan")
    ap, recall_before = 0.0, 0.0
    for t in np.unique(scores)[::-1]:
        chosen = scores >= t
        recall = truth[chosen].sum() / truth.sum()
        ap += (recall - recall_before) * truth[chosen].sum() / chosen.sum()
        recall_before = recall
    return ap


class World:
    """``size`` ranks as threads, with an all-gather and an all-reduce that meet at a barrier."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def collectives(self, rank):
        def gather(obj):
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            found = list(self.slots)
            self.barrier.wait()
            return found

        def reduce_sum(array):
            return np.sum(gather(np.asarray(array)), axis=0)

        return gather, reduce_sum

    def run(self, fn, parts):
        results = [None] * self.size

        def one(rank):
            results[rank] = fn(*parts[rank], *self.collectives(rank))

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


def test_a_documented_case():
    """scikit-learn's own example of average_precision_score: 0.83 (to two places)."""
    ap = multilabel.average_precisions(
        np.array([[0.1], [0.4], [0.35], [0.8]]), np.array([[0], [0], [1], [1]]), *multilabel.one_rank()
    )
    assert round(float(ap[0]), 2) == 0.83 and ap[0] == pytest.approx(reference_ap([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_rank_gets_the_scores_of_all_images_together(size):
    """Scores with ties and a NaN, classes with no positive, a rank with no image: per-class average precision and
    the counts at 0.5 equal those of all images at once, on every rank."""
    rng = np.random.default_rng(size)
    n, classes = 200, 6
    logits = np.round(rng.normal(size=(n, classes)), 1).astype(np.float32)  # one decimal: many ties
    labels = (rng.random((n, classes)) < [0.3, 0.05, 0.5, 0.0, 0.9, 0.2]).astype(np.int8)
    labels[:, 0] |= (logits[:, 0] > 0.8).astype(np.int8)  # a class the scores tell apart
    logits[7, 2] = np.nan
    cuts = [0, 0, 120, n][: size + 1] if size == 3 else np.linspace(0, n, size + 1).astype(int)
    parts = [(logits[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])]
    world = World(size)
    aps = world.run(multilabel.average_precisions, parts)
    expected = [reference_ap(logits[:, c], labels[:, c]) for c in range(classes)]
    for ap in aps:
        np.testing.assert_allclose(ap, expected, rtol=0, atol=1e-12)
        assert np.isnan(ap[3]) and not np.isnan(ap).all()
    probs = [(1 / (1 + np.exp(-x.astype(np.float64))), y) for x, y in parts]
    found = world.run(lambda p, y, gather, reduce_sum: multilabel.counts(p, y, 0.5, reduce_sum), probs)
    predicted = np.nan_to_num(logits, nan=-np.inf) >= 0
    truth = labels > 0
    for got in found:
        np.testing.assert_array_equal(got.tp, (predicted & truth).sum(0))
        np.testing.assert_array_equal(got.fp, (predicted & ~truth).sum(0))
        np.testing.assert_array_equal(got.fn, (~predicted & truth).sum(0))
    assert np.isnan(found[0].recall()[3]) and found[0].micro_f1() == pytest.approx(
        2 * (predicted & truth).sum() / (2 * (predicted & truth).sum() + (predicted ^ truth).sum())
    )


def test_a_decision_is_the_float32_probability_against_the_float32_threshold():
    """As predict and the SavedModel decide: 0.45 as float32 (0.44999998...) reaches 0.45, NaN reaches nothing."""
    probs = np.array([[0.7], [np.nextafter(np.float32(0.7), np.float32(0))], [np.float32(0.45)], [np.nan]], np.float32)
    got = multilabel.counts(probs, np.array([[1], [1], [0], [1]]), 0.7, multilabel.one_rank()[1])
    assert (got.tp.tolist(), got.fp.tolist(), got.fn.tolist()) == ([1], [0], [2])
    assert multilabel.decide(probs, 0.45).ravel().tolist() == [True, True, True, False]


@pytest.mark.multiprocess  # a job of two ranks
def test_a_multi_label_run_is_trained_evaluated_predicted_and_exported_with_the_same_decisions(demo_small, tmp_path):
    """The demo's images, each labelled with its pattern and, for every other image, a tag: a sigmoid head trained
    by two ranks. Its summary's mAP, F1 and per-class counts are exactly those one process computes from the saved
    model over the same held-out images, and those `evaluate` gives on a CSV of them; `predict`'s labels over the
    threshold, counted against the truth, give evaluate's counts; the SavedModel's `over_threshold` is predict's,
    and its check holds its decisions alike; what does not apply is refused in one line."""
    import tensorflow as tf

    from hvd_train.compat import keras
    from hvd_train.data.folder import split_per_class
    from hvd_train.data.pipeline import eval_dataset
    from hvd_train.data.table import TableOptions, read_table
    from hvd_train.distributed.context import Context
    from hvd_train.model.catalogue import get_spec
    from hvd_train.results import report_page

    from conftest import HVD_TRAIN, TINY, TINY_MODEL, launcher_command, output_of, read_json, run, run_at_once

    images = sorted(p.relative_to(demo_small).as_posix() for p in demo_small.rglob("*.png"))
    rows = [f"{rel},{rel.split('/')[0]}{'|tagged' if i % 2 else ''}" for i, rel in enumerate(images)]
    (tmp_path / "multi.csv").write_text("path,labels\n" + "\n".join(rows) + "\n")
    table = str(tmp_path / "multi.csv")
    out = tmp_path / "run"
    options = [
        *(*TINY, "--multi-label", "--label-separator", "|", "--threshold", "0.5", "--image-root", demo_small),
        *("--val-split", "0.2", "--epochs", "2", "--seed", "7", "--early-stop", "3", "--early-stop-metric", "val_map"),
    ]
    proc = run(
        [*launcher_command("horovodrun-gloo", 2), *HVD_TRAIN, "train", "--data", table, "--output", out, *options,
         "--track", "jsonl"]
    )  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    summary = read_json(out / "summary.json")
    assert summary["task"] == "multi_label" and summary["val_accuracy"] is None
    # Tracked: its epochs' mAP and F1 (the best epoch's model saved: --early-stop), and summary.json's as results.
    events = [json.loads(line) for line in (out / "tracking.jsonl").read_text().splitlines()]
    epochs = [e["metrics"] for e in events if e["event"] == "epoch"]
    assert len(epochs) == 2 and all({"val_map", "val_f1", "f1"} <= set(m) for m in epochs), epochs
    assert max(m["val_map"] for m in epochs) == pytest.approx(summary["val_map"])
    assert events[-1]["results"] == {k: summary[k] for k in ("val_loss", "val_map", "val_f1", *events[-1]["results"])}
    # One process, the saved model, the same held-out images (the split is the seed's).
    multi = TableOptions(image_root=str(demo_small), multi_label=True, label_separator="|")
    listed = read_table(table, "--data", options=multi)
    held = split_per_class(listed, 0.2, 7)[1]
    model = keras.models.load_model(out / "model.keras", compile=False)
    preprocess = get_spec(TINY_MODEL).preprocess_input()
    data = eval_dataset(held, rank=0, size=1, batch_size=5, image_size=32, crop_fraction=0.875, preprocess=preprocess)
    mine = multilabel.evaluate_multi(model, data.dataset, Context(), 0.5)
    assert summary["val_images"] == mine.count == len(held)
    assert (summary["val_map"], summary["val_f1"]) == (mine.map, mine.f1)
    for i, name in enumerate(listed.classes):
        found = summary["val_per_class"][name]
        assert (found["tp"], found["fp"], found["fn"]) == (
            int(mine.counts.tp[i]),
            int(mine.counts.fp[i]),
            int(mine.counts.fn[i]),
        )
    # The held-out rows as a CSV of their own: evaluate, predict, and export's check.
    truth = {row.split(",")[0]: set(row.split(",")[1].split("|")) for row in rows}
    held_rows = [str(p.relative_to(demo_small)) for p in map(Path, held.paths)]
    (tmp_path / "held.csv").write_text("path,labels\n" + "".join(f"{r},{'|'.join(truth[r])}\n" for r in held_rows))
    single = [*TINY, "--image-root", demo_small, "--val-split", "0.2", "--epochs", "2", "--seed", "7"]
    root, at = ("--image-root", demo_small), ("--threshold", "0.45")  # another decision than the run's
    lower = multilabel.evaluate_multi(model, data.dataset, Context(), 0.45)
    done = run_at_once(
        [*HVD_TRAIN, "evaluate", "--model-dir", out, "--data", tmp_path / "held.csv", *root, *at, "--batch-size", "5"],
        [*HVD_TRAIN, "predict", "--model-dir", out, tmp_path / "held.csv", *root, *at, "--output", tmp_path / "p.csv"],
        [
            *HVD_TRAIN,
            "export",
            out,
            "--format",
            "savedmodel",
            "--check",
            "--check-data",
            tmp_path / "held.csv",
            *root,
            "--output",
            tmp_path / "e",
        ],
        [*HVD_TRAIN, "train", "--data", table, "--output", tmp_path / "x", *options, "--mixup", "0.2"],
        [*HVD_TRAIN, "predict", "--model-dir", out, tmp_path / "held.csv", *root, "--threshold", "1.5"],
        # --deterministic: the same starting weights every time (from random ones the first loss was 0.64-0.90)
        [*HVD_TRAIN, "lr-find", "--data", table, "--output", tmp_path / "lr", *options, "--steps", "12"]
        + ["--deterministic"],
        [*HVD_TRAIN, "train", "--data", table, "--label-column", "labels", "--output", out, *single],
    )
    for proc in done[:3]:
        assert proc.returncode == 0, output_of(proc)
    scored = read_json(out / "evaluation.json")
    assert (scored["task"], scored["images"], scored["threshold"]) == ("multi_label", len(held), 0.45)
    assert (scored["map"], scored["f1"]) == (lower.map, lower.f1) and lower.map == mine.map
    assert {n: [c["tp"], c["fp"], c["fn"]] for n, c in scored["per_class"].items()} == {
        name: [int(lower.counts.tp[i]), int(lower.counts.fp[i]), int(lower.counts.fn[i])]
        for i, name in enumerate(listed.classes)
    }
    assert f"mAP        {mine.map:.4f}" in done[0].stdout
    # The report shows the run's scores and evaluate's, a table per class each.
    page = open(report_page.write(str(out))).read()
    assert page.count("Per class, by average precision") == 2 and f"{lower.map:.4f}; {lower.f1:.4f}" in page
    assert "No held-out images were scored" not in page and "confusion matrix" not in page
    # predict: every label over the threshold, the likeliest first, its probability beside it.
    with open(tmp_path / "p.csv", newline="") as f:
        predicted = list(csv.DictReader(f))
    assert [r["path"] for r in predicted] == [str(demo_small / r) for r in held_rows]
    counted = {name: [0, 0, 0] for name in listed.classes}
    decisions = []
    for row, rel in zip(predicted, held_rows):
        labels = [x for x in row["labels"].split("|") if x]
        probs = [float(x) for x in row["scores"].split("|") if x]
        assert probs == sorted(probs, reverse=True) and all(p >= 0.45 for p in probs) and len(probs) == len(labels)
        given = dict(zip(labels, probs))  # the SavedModel decides at the run's threshold, 0.5
        decisions.append([given.get(name, 0.0) >= 0.5 for name in listed.classes])
        for name in listed.classes:
            said, true = name in labels, name in truth[rel]
            counted[name][0] += said and true
            counted[name][1] += said and not true
            counted[name][2] += true and not said
    assert {n: [c["tp"], c["fp"], c["fn"]] for n, c in scored["per_class"].items()} == counted
    # export: the SavedModel's decisions are predict's, and its check held them alike.
    manifest = read_json(tmp_path / "e" / "manifest.json")
    parity = manifest["formats"][0]["parity"]
    assert (manifest["input"]["task"], parity["passed"], parity["decision_agreement"]) == ("multi_label", True, 1.0)
    served = tf.saved_model.load(str(tmp_path / "e" / "saved_model" / "1")).signatures["serving_default"]
    contents = tf.constant([(demo_small / r).read_bytes() for r in held_rows])
    assert served(image_bytes=contents)["over_threshold"].numpy().tolist() == decisions
    assert "with --multi-label mixup blends one label a row" in done[3].stderr, output_of(done[3])
    assert "--threshold 1.5 is not a probability in (0, 1)" in done[4].stderr, output_of(done[4])
    # The same folder trained as a single-label set (each set a class): its checkpoints are refused in one line.
    assert "is of a multi-label run (a sigmoid head), and this run is a single-label run" in done[6].stderr, output_of(
        done[6]
    )
    # lr-find sweeps the run's loss: at the start every sigmoid says about 1/2, a binary cross-entropy of about ln 2
    # (a softmax's would be about ln of the classes, and a sparse loss would refuse multi-hot rows).
    assert done[5].returncode in (0, 2), output_of(done[5])
    with open(tmp_path / "lr" / "lr_find.csv", newline="") as f:
        first = float(next(csv.DictReader(f))["loss"])
    assert abs(first - np.log(2)) < abs(first - np.log(len(listed.classes))) and abs(first - np.log(2)) < 0.2


def test_predict_joins_labels_so_that_its_file_reads_back_as_the_runs_csv():
    """By the run's separator, else a space, or '|' when a class's name holds a space (a 0/1 column's header)."""
    from hvd_train.commands.predict import answers, joiner
    from hvd_train.data.table_labels import cell_labels
    from hvd_train.results.inference import Trained

    for classes, given, read_with in (
        (["cat", "dog"], "", ""),
        (["cat", "dog"], ";", ";"),
        (["Pleural Effusion", "Edema"], "", "|"),
        (["Pleural Effusion", "Edema|Oedema"], "", ";"),
    ):
        trained = Trained(None, classes, 32, 0.875, None, data={"multi_label": True, "label_separator": given})
        _, labels, scores = answers("x.png", np.array([0.9, 0.7], np.float32), classes, 0.5, joiner(trained))
        assert cell_labels(labels, read_with) == tuple(sorted(classes)) and len(scores.split(joiner(trained))) == 2


def test_evaluate_decides_on_the_probabilities_predict_gets_to_the_last_bit():
    """Thresholds set to predict's own probabilities: each one is reached in predict, so it must be in evaluate
    (a separately summed sigmoid differs from the Keras layer's by an ulp in about a third of them)."""
    from hvd_train.compat import keras, tf
    from hvd_train.distributed.context import Context
    from hvd_train.model.catalogue import HEAD_LAYER

    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 3)(inputs))
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(7, activation="sigmoid", dtype="float32", name=HEAD_LAYER)(x))
    images = np.random.default_rng(3).normal(size=(96, 8, 8, 3)).astype(np.float32)
    probs = model.predict(images, batch_size=32, verbose=0)
    rows = np.zeros((96, 7), np.float32)
    data = tf.data.Dataset.from_tensor_slices((images, rows, np.arange(96, dtype=np.int32))).batch(32)
    for t in probs[::7, 3]:  # a probability predict gave: decided True there, and so must evaluate
        found = multilabel.evaluate_multi(model, data, Context(), float(t))
        assert (found.counts.fp == multilabel.decide(probs, float(t)).sum(0)).all(), t


def test_an_exports_decisions_are_held_to_predicts_over_the_labels_either_gives():
    """80 classes, 3 labels an image: a file that drops one of each image's 3 labels fails its goal, though 98.75%
    of all pairs (over int8's 98%) still agree; pairs within the format's band of the threshold are counted apart,
    not held."""
    from hvd_train.results.export.parity import parity

    reference = np.full((100, 80), 0.05, np.float32)
    reference[:, :3] = 0.9
    dropped = reference.copy()
    dropped[:, 2] = 0.1
    failed = parity(reference, dropped, None, "int8", 0.5)
    assert not failed["passed"] and failed["decision_agreement"] == pytest.approx(2 / 3), failed
    near = reference.copy()
    near[:, 3], reference[:, 3] = 0.505, 0.495  # within int8's band: may fall either side
    held = parity(reference, near, None, "int8", 0.5)
    assert held["passed"] and held["decision_agreement"] == 1.0 and held["decisions_at_the_threshold"] == 100, held


def test_a_threshold_is_refused_for_a_single_label_run_and_taken_from_the_run_when_not_given():
    from hvd_train.errors import UserError
    from hvd_train.results.inference import Trained

    multi = Trained(None, ["a", "b"], 32, 0.875, None, data={"multi_label": True, "threshold": 0.3})
    assert (multi.decision(None), multi.decision(0.7)) == (0.3, 0.7)
    with pytest.raises(UserError, match="--threshold 0.4 applies to multi-label runs, and this one is not"):
        Trained(None, ["a", "b"], 32, 0.875, None, data={"threshold": 0.5}).decision(0.4)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--data", "d", "--multi-label"], r"`--data` is invalid.* a multi-label set is read from a CSV of labels"),
        (["--data", "t.csv", "--multi-label", "--head-parallel", "2"], r"with --multi-label the sharded head"),
        (["--data", "t.csv", "--multi-label", "--class-weights", "auto"], r"with --multi-label its weights"),
        (["--data", "t.csv", "--multi-label", "--cutmix", "1"], r"with --multi-label CutMix blends one label"),
        (["--data", "t.csv", "--multi-label", "--early-stop", "2"], r"scored by val_map, val_f1 or val_loss"),
        (["--data", "t.csv", "--multi-label", "--threshold", "1"], r"use a probability in \(0, 1\)"),
        (["--data", "t.csv", "--threshold", "0.3"], r"it applies to multi-label sets; add --multi-label"),
        (["--data", "t.csv", "--label-separator", ";"], r"it applies to multi-label sets; add --multi-label"),
        (["--data", "d", "--early-stop", "2", "--early-stop-metric", "val_f1"], r"a multi-label set's score"),
    ],
)
def test_what_does_not_apply_to_a_multi_label_set_is_refused_in_one_line(argv, match):
    import argparse

    from hvd_train import config
    from hvd_train.errors import UserError

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    with pytest.raises(UserError, match=match):
        config.from_sources(parser.parse_args(["--output", "o", *argv]))
