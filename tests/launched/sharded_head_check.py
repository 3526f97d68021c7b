"""Launched under horovodrun by the tests: the sharded head against the data-parallel head.

Usage: python sharded_head_check.py OUT_DIR G[,G...] SMOOTHING[,SMOOTHING...]
Every layout (G ranks per head) with every label smoothing, and with the
last smoothing a mixed batch too (mixup's and CutMix's targets: a second
label and the first's share a row, drawn at random). A small
backbone (``tanh(x A)``) and a Dense softmax head of 11 classes (uneven
shards). Every rank draws its own batch (a weight-0 row among them); the
weights are drawn alike on every rank. Both ways compute, in a
``tf.function``: the loss, the backbone's gradient and the head's
gradients (the sharded head's shard against the slice of the full one's),
and the predicted classes. Then three SGD steps each way, and the weights
after them. Each rank writes the largest relative differences, by
``G=..,s=..`` (``,mixed``), to OUT_DIR/rank{R}.json.
"""

import json
import os
import sys

import numpy as np

from hvd_train.distributed import start
from hvd_train.distributed.groups import Layout, register, shard_range

out_dir = sys.argv[1]
layouts = [int(g) for g in sys.argv[2].split(",")]
smoothings = [float(s) for s in sys.argv[3].split(",")]
ctx = start.init(threads_per_rank=1, process_sets=True)

import horovod.tensorflow as hvd  # noqa: E402
import tensorflow as tf  # noqa: E402

from hvd_train.model import sharded_files  # noqa: E402
from hvd_train.model.sharded_head import head_scores, head_step, peers_average  # noqa: E402
from hvd_train.results.evaluation import score_logits  # noqa: E402

sharded_files.CHUNK_BYTES = 2 * 6 * 4  # two columns of the 6-feature kernel a round: the gather takes several

CLASSES, FEATURES, INPUTS, BATCH, LR = 11, 6, 5, 4, 0.5
start_weights = np.random.default_rng(0)
A0 = start_weights.normal(size=(INPUTS, FEATURES)).astype("float32")
W0 = start_weights.normal(size=(FEATURES, CLASSES)).astype("float32")
b0 = start_weights.normal(size=(CLASSES,)).astype("float32") * 0.1
# Every rank registers every layout's process sets, in the same order.
registered = {g: register(Layout(ctx.size, g), ctx.rank) for g in layouts}


def batch(step):
    rng = np.random.default_rng(1000 * step + ctx.rank)
    x = rng.normal(size=(BATCH, INPUTS)).astype("float32")
    y = rng.integers(0, CLASSES, size=BATCH).astype("int32")
    w = np.ones(BATCH, "float32")
    w[1] = 0.0  # a stand-in: no weight
    return tf.constant(x), tf.constant(y), tf.constant(w)


def mixing(step):
    """A mixed batch's second labels (one row's the same as its first) and the first's shares (one 0, one 1)."""
    rng = np.random.default_rng(5000 + 1000 * step + ctx.rank)
    second = rng.integers(0, CLASSES, size=BATCH).astype("int32")
    second[0] = batch(step)[1].numpy()[0]
    share = rng.uniform(0.0, 1.0, size=BATCH).astype("float32")
    share[2], share[3] = 0.0, 1.0  # all the second's, all the first's
    return tf.constant(second), tf.constant(share)


def relative(a, b):
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check(groups, smoothing, mixed=False):
    first, count = shard_range(CLASSES, groups.parallel, groups.shard)

    @tf.function
    def sharded(A, kernel, bias, x, y, w, y2, share):
        with tf.GradientTape() as tape:
            features = tf.tanh(tf.matmul(x, A))
        step = head_step(
            features, y, w, kernel, bias, first=first, classes=CLASSES, groups=groups, smoothing=smoothing,
            mixed=(y2, share) if mixed else None,
        )  # fmt: skip
        d_a = hvd.allreduce(tape.gradient(features, A, output_gradients=step.d_features), op=hvd.Average)
        d_k, d_b = peers_average([step.d_kernel, step.d_bias], groups)
        return hvd.allreduce(step.loss, op=hvd.Average), d_a, d_k, d_b, step.predicted

    @tf.function
    def sharded_scores(A, kernel, bias, x, y):
        return head_scores(tf.tanh(tf.matmul(x, A)), y, kernel, bias, first=first, groups=groups, k=5)

    @tf.function
    def data_parallel_scores(A, W, b, x, y):
        return score_logits(tf.matmul(tf.tanh(tf.matmul(x, A)), W) + b, y, 5)  # what evaluate scores with

    @tf.function
    def scores_of_features(features, kernel, bias, y):
        return head_scores(features, y, kernel, bias, first=first, groups=groups, k=5)

    @tf.function
    def data_parallel(A, W, b, x, y, w, y2, share):
        with tf.GradientTape() as tape:
            logits = tf.matmul(tf.tanh(tf.matmul(x, A)), W) + b
            hot = tf.one_hot(y, CLASSES)
            if mixed:  # as Mixer.targets makes them
                hot = share[:, None] * hot + (1.0 - share[:, None]) * tf.one_hot(y2, CLASSES)
            target = hot * (1 - smoothing) + smoothing / CLASSES
            rows = tf.nn.softmax_cross_entropy_with_logits(target, logits)
            loss = tf.reduce_sum(rows * w) / BATCH
        grads = [hvd.allreduce(g, op=hvd.Average) for g in tape.gradient(loss, [A, W, b])]
        return hvd.allreduce(loss, op=hvd.Average), grads, tf.argmax(logits, axis=1, output_type=tf.int32)

    x, y, w = batch(0)
    A, W, b = tf.Variable(A0), tf.Variable(W0), tf.Variable(b0)
    kernel, bias = tf.Variable(W0[:, first : first + count]), tf.Variable(b0[first : first + count])
    # Traced once for batches of any size, as evaluation does: a rank tracing again alone (for a batch of
    # another size) hung its group.
    sharded_scores.get_concrete_function(
        A, kernel, bias, tf.TensorSpec([None, INPUTS], tf.float32), tf.TensorSpec([None], tf.int32)
    )
    loss_s, d_a_s, d_k, d_b, predicted = sharded(A, kernel, bias, x, y, w, *mixing(0))
    loss_d, (d_a_d, d_w, d_bias_d), argmax = data_parallel(A, W, b, x, y, w, *mixing(0))
    result = {
        "shard": [first, count],
        "loss": relative(loss_s, loss_d),
        "backbone": relative(d_a_s, d_a_d),
        "kernel": relative(d_k, d_w[:, first : first + count]),
        "bias": relative(d_b, d_bias_d[first : first + count]),
        "predicted": predicted.numpy().tolist(),
        "argmax": argmax.numpy().tolist(),
        "head_gradient_nonzero": float(np.max(np.abs(d_k))),
    }
    # Held-out scores over all classes: the loss of each row, its best class and its top 5.
    (loss_s, top1_s, top5_s), (loss_d, top1_d, top5_d) = (
        sharded_scores(A, kernel, bias, x, y),
        data_parallel_scores(A, W, b, x, y),
    )
    # Held-out batches of other sizes on each rank, one of them empty (the last batches of a rank's share).
    rows = [4, 0, 3, 1][ctx.rank % 4]
    (loss_u, top1_u, top5_u), (loss_v, top1_v, top5_v) = (
        sharded_scores(A, kernel, bias, x[:rows], y[:rows]),
        data_parallel_scores(A, W, b, x[:rows], y[:rows]),
    )
    loss_s, loss_d = tf.concat([loss_s, loss_u], 0), tf.concat([loss_d, loss_v], 0)
    top1_s, top1_d = tf.concat([top1_s, top1_u], 0), tf.concat([top1_d, top1_v], 0)
    top5_s, top5_d = tf.concat([top5_s, top5_u], 0), tf.concat([top5_d, top5_v], 0)
    result["score_loss"] = relative(loss_s, loss_d)
    result["top1"] = [top1_s.numpy().tolist(), top1_d.numpy().tolist()]
    result["top5"] = [top5_s.numpy().tolist(), top5_d.numpy().tolist()]
    # Rows of a diverged model (a feature inf or nan: no finite logits) and rows whose logits all tie (a head of
    # zeros: of equal logits the lower classes are the top 5), scored alike by both ways.
    odd = np.random.default_rng(7).normal(size=(4, FEATURES)).astype("float32")
    odd[0, 0], odd[1, 2] = np.inf, np.nan
    odd_labels = tf.constant([0, 3, 4, 7], tf.int32)
    for name, (W_odd, b_odd) in {"odd": (W0, b0), "tied": (0 * W0, 0 * b0)}.items():
        (_, top1_s, top5_s), (_, top1_d, top5_d) = (
            scores_of_features(odd, W_odd[:, first : first + count], b_odd[first : first + count], odd_labels),
            score_logits(tf.matmul(odd, W_odd) + b_odd, odd_labels, 5),
        )
        result[f"{name}_top1"] = [top1_s.numpy().tolist(), top1_d.numpy().tolist()]
        result[f"{name}_top5"] = [top5_s.numpy().tolist(), top5_d.numpy().tolist()]

    A_s, A_d = tf.Variable(A0), tf.Variable(A0)
    for step in range(1, 4):
        x, y, w = batch(step)
        _, d_a_s, d_k, d_b, _ = sharded(A_s, kernel, bias, x, y, w, *mixing(step))
        _, (d_a_d, d_w, d_bias_d), _ = data_parallel(A_d, W, b, x, y, w, *mixing(step))
        for var, grad in ((A_s, d_a_s), (kernel, d_k), (bias, d_b), (A_d, d_a_d), (W, d_w), (b, d_bias_d)):
            var.assign_sub(LR * grad)
    result["trained_backbone"] = relative(A_s, A_d)
    result["trained_kernel"] = relative(kernel, W[:, first : first + count])
    result["trained_bias"] = relative(bias, b[first : first + count])
    result["moved"] = relative(W0[:, first : first + count], kernel)

    # The trained head written whole by the first group, then read back by any layout's ranges.
    folder = os.path.join(out_dir, f"head-G{groups.parallel}-s{smoothing:g}{'-mixed' if mixed else ''}")
    os.makedirs(folder, exist_ok=True)
    sharded_files.gather_into(folder, "kernel", kernel.numpy(), groups, CLASSES)
    sharded_files.gather_into(folder, "bias", bias.numpy(), groups, CLASSES)
    hvd.allreduce(tf.constant(0.0), name=f"written.{groups.parallel}.{smoothing:g}.{mixed}")  # files complete
    mine = sharded_files.read_columns(folder, "kernel", first, count, CLASSES)
    result["read_back"] = relative(mine, kernel) + relative(
        sharded_files.read_columns(folder, "bias", first, count, CLASSES), bias
    )
    resplit = [shard_range(CLASSES, 3, j) for j in range(3)]  # another layout's shards
    result["resplit"] = max(
        relative(sharded_files.read_columns(folder, "kernel", f, c, CLASSES), W[:, f : f + c]) for f, c in resplit
    )
    return result


results = {f"G={g},s={s:g}": check(registered[g], s) for g in layouts for s in smoothings}
results.update({f"G={g},s={smoothings[-1]:g},mixed": check(registered[g], smoothings[-1], True) for g in layouts})
with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump(results, f)
