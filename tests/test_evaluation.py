import json

import numpy as np
import pytest
import tensorflow as tf

from hvd_train import compat  # noqa: F401
from hvd_train.compat import keras
from hvd_train.distributed.context import Context
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.results.evaluation import evaluate

from conftest import write_images


def head_model(kernel, bias=None):
    """A model whose logits are its inputs times ``kernel`` plus ``bias``: a softmax head as the catalogue's."""
    kernel = np.asarray(kernel, "float32")
    inputs = keras.Input((kernel.shape[0],))
    head = keras.layers.Dense(kernel.shape[1], activation="softmax", dtype="float32", name=HEAD_LAYER)
    model = keras.Model(inputs, head(inputs))
    head.set_weights([kernel, np.zeros(kernel.shape[1], "float32") if bias is None else np.asarray(bias, "float32")])
    return model


def logits_model(num_classes):
    """A model whose logits are its inputs."""
    return head_model(np.eye(num_classes))


def expected(logits, labels, k):
    """The scores of each row, in NumPy: cross-entropy, the best class, the label in the top ``k``; of equal
    logits the lower class first; a row with a logit that is not finite has no best class and no hit."""
    logits = logits.astype("float64")
    finite = np.isfinite(logits).all(axis=1)
    order = np.argsort(-np.where(finite[:, None], logits, 0), axis=1, kind="stable")
    with np.errstate(invalid="ignore", over="ignore"):
        top = logits.max(axis=1, keepdims=True)
        loss = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))) - logits[np.arange(len(labels)), labels]
    best = np.where(finite, order[:, 0], -1)
    hits = np.array([f and label in row[:k] for f, label, row in zip(finite, labels, order)])
    return loss, best, hits


def test_sums_match_a_direct_computation():
    rng = np.random.default_rng(3)
    n, c = 37, 7
    logits = rng.normal(scale=3.0, size=(n, c)).astype("float32")
    labels = rng.integers(0, c, n).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((logits, labels)).batch(8)
    result = evaluate(logits_model(c), ds, c, Context())
    loss, best, hits = expected(logits, labels, 5)
    assert result.count == n
    assert result.top1 == int((best == labels).sum()) and result.topk == int(hits.sum())
    assert np.isclose(result.loss_sum, loss.sum(), rtol=1e-5)
    assert result.confusion.sum() == n
    assert result.confusion.trace() == result.top1
    assert np.array_equal(result.confusion.dense(), np.histogram2d(labels, best, bins=c, range=[[0, c], [0, c]])[0])
    per_class = result.per_class_accuracy()
    for k in range(c):
        mask = labels == k
        if mask.any():
            assert np.isclose(per_class[k], (best[mask] == k).mean())


def test_a_sure_model_ties_or_non_finite_logits_score_by_the_logits_and_a_diverged_row_is_a_miss():
    """Probabilities are no ranking: a sure model's other classes all round to 0 (every label tied in the top
    5 by its probability), and an overflowed row's are nan. The logits rank them; of equal logits the lower
    class comes first; a row with a logit that is not finite is a miss with no predicted class."""
    c, inf, nan = 12, np.inf, np.nan
    rows = np.zeros((6, c), "float32")
    rows[0] = np.arange(c) * -10.0  # sure of class 0: the others' probabilities are 0.0 in float32
    rows[0, 0] = 200.0
    rows[1] = rows[0]
    rows[2, 3] = inf  # an overflowed logit
    rows[3, 5] = nan
    rows[4] = 1.0  # every class ties: the lower five are the top 5
    rows[5] = 1.0
    labels = np.array([9, 4, 3, 5, 4, 7], "int32")
    probabilities = head_model(np.eye(c))(rows).numpy()
    assert (probabilities[0, 1:] == 0).all() and np.isnan(probabilities[2]).all()  # what the old ranking read
    ds = tf.data.Dataset.from_tensor_slices((rows, labels)).batch(4)
    result = evaluate(logits_model(c), ds, c, Context())
    loss, best, hits = expected(rows, labels, 5)
    assert hits.tolist() == [False, True, False, False, True, False] and best.tolist() == [0, 0, -1, -1, 0, 0]
    assert (result.count, result.top1, result.topk) == (6, 0, 2)
    assert np.isnan(result.loss_sum) and np.isclose(loss[[0, 1, 4, 5]].sum(), 290 + 240 + 2 * np.log(c), rtol=1e-6)
    # The two rows with no answer count among their classes' images, never as right, in no cell of the matrix.
    assert result.confusion.sum() == 6 and result.confusion.unanswered() == 2 and result.confusion.dense().sum() == 4
    assert result.per_class_accuracy()[3] == 0.0 and result.per_class_accuracy()[5] == 0.0
    assert result.confusion.mistakes() == [(4, 0, 2), (7, 0, 1), (9, 0, 1)]
    # What evaluation.json and summary.json keep, read back by the report, keeps them: the rows of a matrix
    # have no column for them, so the cells are written.
    from hvd_train.results import plots
    from hvd_train.results.report_page import per_class_rows

    kept = plots.confusion_from_json(json.loads(json.dumps(plots.confusion_to_json(result.confusion))))
    assert kept == result.confusion and kept.sum() == 6 and kept.unanswered() == 2
    rows = {name: (images, right) for name, images, right, *_ in per_class_rows(kept, [str(c) for c in range(c)])}
    assert rows["3"] == (1, 0) and rows["5"] == (1, 0) and sum(images for images, _ in rows.values()) == 6


def test_fifty_thousand_classes_are_scored_without_a_matrix_of_every_pair():
    """A dense confusion matrix would be 20 GB here (50,000 squared counts): the cells images fill are kept."""
    rng = np.random.default_rng(5)
    n, c = 9, 50_000
    labels = rng.integers(0, c, n).astype("int32")
    predicted = labels.copy()
    predicted[[2, 5]] = (labels[[2, 5]] + 7) % c  # two mistakes
    # A random unit column for each class (64 features): an input along class p's column scores p highest.
    columns = rng.normal(size=(64, c))
    columns /= np.linalg.norm(columns, axis=0)
    model = head_model(columns)
    inputs = (10 * columns[:, predicted].T).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(4)
    result = evaluate(model, ds, c, Context())
    assert result.count == n and result.top1 == n - 2 and result.confusion.trace() == n - 2
    assert sorted(result.confusion.mistakes()) == sorted((int(labels[i]), int(predicted[i]), 1) for i in (2, 5))
    accuracy = result.per_class_accuracy()
    assert len(accuracy) == c and accuracy[labels[2]] in (0.0, 0.5) and accuracy.count(None) == c - len(set(labels))


def test_fewer_than_five_classes_uses_top_k_of_all():
    logits = np.array([[0.2, 0.8], [0.9, 0.1]], "float32")
    ds = tf.data.Dataset.from_tensor_slices((logits, np.array([0, 0], "int32"))).batch(2)
    result = evaluate(logits_model(2), ds, 2, Context())
    assert result.k == 2 and result.top5 == 1.0 and result.accuracy == 0.5
    assert result.per_class_accuracy() == [0.5, None]


def test_the_held_out_input_is_built_once_a_rank_and_the_step_traced_once_for_every_batch(tmp_path):
    from hvd_train.config.choices import TrainConfig
    from hvd_train.data.folder import list_folder
    from hvd_train.model.catalogue import get_spec
    from hvd_train.training.epoch_end import HeldOut
    from hvd_train.training.job import Job

    images = list_folder(str(write_images(tmp_path / "d", {"a": 5, "b": 6}, size=16)))
    job = Job(TrainConfig(), images, images, 16, "float32", get_spec("MobileNet"))
    held_out = HeldOut(job)
    mine = held_out.input(Context(), 4)  # 11 images: batches of 4, 4 and 3
    # Every epoch's end reads the same input (its decoding traced once); another rank or world size
    # (an elastic reset) or batch gets its own.
    assert held_out.input(Context(), 4) is mine
    assert held_out.input(Context(rank=1, size=2), 4) is not mine
    assert held_out.input(Context(), 5) is not held_out.input(Context(rank=1, size=2), 4)
    mine = held_out.input(Context(), 4)
    inputs = keras.Input((16, 16, 3))
    model = keras.Model(inputs, keras.layers.Dense(2, "softmax", name=HEAD_LAYER)(keras.layers.Flatten()(inputs)))
    first, again = (evaluate(model, mine.dataset, 2, Context()) for _ in range(2))
    assert first.count == again.count == 11 and first.loss_sum == again.loss_sum and first.top1 == again.top1
    # One trace of the step for full and last batches alike, kept for the next evaluation.
    [step] = model.__dict__["_hvd_train_eval_steps"].values()
    assert step.experimental_get_tracing_count() == 1


def test_predict_gives_an_image_whose_scores_are_not_finite_no_label():
    from hvd_train.commands.predict import answer

    classes = ["cat", "dog", "owl"]
    assert answer("a.png", np.array([0.1, 0.7, 0.2], "float32"), classes) == ("a.png", "dog", pytest.approx(0.7))
    path, label, probability = answer("b.png", np.array([np.nan] * 3, "float32"), classes)
    assert (path, label) == ("b.png", "") and np.isnan(probability)  # was "cat", the argmax of nan
