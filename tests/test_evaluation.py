import numpy as np
import tensorflow as tf

from hvd_train import compat  # noqa: F401
from hvd_train.compat import keras
from hvd_train.distributed.context import Context
from hvd_train.results.evaluation import evaluate

from conftest import write_images


def fixed_model(num_classes):
    """A model whose prediction is the input's own probability vector."""
    inputs = keras.Input((num_classes,))
    return keras.Model(inputs, keras.layers.Lambda(lambda x: x)(inputs))


def test_sums_match_a_direct_computation():
    rng = np.random.default_rng(3)
    n, c = 37, 7
    probs = rng.dirichlet(np.ones(c), n).astype("float32")
    labels = rng.integers(0, c, n).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((probs, labels)).batch(8)
    result = evaluate(fixed_model(c), ds, c, Context())
    assert result.count == n
    assert result.top1 == int((probs.argmax(1) == labels).sum())
    top5 = np.argsort(-probs, axis=1)[:, :5]
    assert result.topk == int(sum(labels[i] in top5[i] for i in range(n)))
    expected_loss = -np.log(np.clip(probs[np.arange(n), labels], 1e-7, 1)).sum()
    assert np.isclose(result.loss_sum, expected_loss, rtol=1e-4)
    assert result.confusion.sum() == n
    assert result.confusion.trace() == result.top1
    assert np.array_equal(
        result.confusion.dense(), np.histogram2d(labels, probs.argmax(1), bins=c, range=[[0, c], [0, c]])[0]
    )
    per_class = result.per_class_accuracy()
    for k in range(c):
        mask = labels == k
        if mask.any():
            assert np.isclose(per_class[k], (probs[mask].argmax(1) == k).mean())


def test_fifty_thousand_classes_are_scored_without_a_matrix_of_every_pair():
    """A dense confusion matrix would be 20 GB here (50,000 squared counts): the cells images fill are kept."""
    rng = np.random.default_rng(5)
    n, c = 9, 50_000
    labels = rng.integers(0, c, n).astype("int32")
    predicted = labels.copy()
    predicted[[2, 5]] = (labels[[2, 5]] + 7) % c  # two mistakes
    probs = np.full((n, c), 0.1 / c, "float32")
    probs[np.arange(n), predicted] = 0.9
    ds = tf.data.Dataset.from_tensor_slices((probs, labels)).batch(4)
    result = evaluate(fixed_model(c), ds, c, Context())
    assert result.count == n and result.top1 == n - 2 and result.confusion.trace() == n - 2
    assert sorted(result.confusion.mistakes()) == sorted((int(labels[i]), int(predicted[i]), 1) for i in (2, 5))
    accuracy = result.per_class_accuracy()
    assert len(accuracy) == c and accuracy[labels[2]] in (0.0, 0.5) and accuracy.count(None) == c - len(set(labels))


def test_fewer_than_five_classes_uses_top_k_of_all():
    probs = np.array([[0.2, 0.8], [0.9, 0.1]], "float32")
    ds = tf.data.Dataset.from_tensor_slices((probs, np.array([0, 0], "int32"))).batch(2)
    result = evaluate(fixed_model(2), ds, 2, Context())
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
    model = keras.Sequential(
        [keras.layers.Input((16, 16, 3)), keras.layers.Flatten(), keras.layers.Dense(2, "softmax")]
    )
    first, again = (evaluate(model, mine.dataset, 2, Context()) for _ in range(2))
    assert first.count == again.count == 11 and first.loss_sum == again.loss_sum and first.top1 == again.top1
    # One trace of the step for full and last batches alike, kept for the next evaluation.
    [step] = model.__dict__["_hvd_train_eval_steps"].values()
    assert step.experimental_get_tracing_count() == 1
