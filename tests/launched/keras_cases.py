"""Launched under horovodrun by the tests: the cases of Horovod's own Keras tests, against hvd_train's step.

Usage: python keras_cases.py OUT_DIR
Run under either Keras (``HVD_TRAIN_KERAS``). Each rank writes ``rank{R}.json`` with what it saw:

* aggregation: ``Net``'s real step with ``--grad-accum 4`` and SGD, 10 passes, each rank its own
  batches. After every pass: the iteration count, whether the weights moved, and how far they are from
  ``w - lr x (the mean of the 8 batch gradients of the cycle)``, computed here without Horovod.
* sparse: a gradient that is ``tf.IndexedSlices`` (a gather) averaged as a dense one.
* broadcast: rank 0 builds a model more before the run's own (as lr-find does), so its variables are
  numbered further; the broadcast still meets and gives every rank rank 0's values.
"""

import hashlib
import json
import os
import sys

import numpy as np

from hvd_train import config
from hvd_train.compat import KERAS_MAJOR, keras, tf
from hvd_train.distributed import gradients, start
from hvd_train.model.catalogue import build_model
from hvd_train.model.network import Net, use_step_seeded_dropout
from hvd_train.model.schedules import WarmupSchedule

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tiny_net.py") + ":backbone"
PASSES, STEPS, BATCH, CLASSES, SIZE, LR = 4, 10, 4, 3, 16, 0.05

out_dir = sys.argv[1]
ctx = start.init(threads_per_rank=1)
seen = {"keras": KERAS_MAJOR}

# --- broadcast: a rank whose Keras counted further meets the others -----------------------------------
cfg = config.build(
    {
        "data": {"train": "d", "batch_size": BATCH},
        "model": {"name": TINY, "weights": "none", "dropout": 0.0},
        "optim": {"optimizer": "sgd", "momentum": 0.0, "base_lr": LR, "warmup_epochs": 0},
        "horovod": {"grad_accum": PASSES},
        "run": {"output": "o", "seed": 1},
    }
)
use_step_seeded_dropout()
if ctx.rank == 0:
    build_model(cfg.model, CLASSES, SIZE, load_weights=False)  # numbers rank 0's layers and variables further
tf.random.set_seed(100 + ctx.rank)  # other initial weights on every rank
net = Net(build_model(cfg.model, CLASSES, SIZE, load_weights=False), cfg, seed=1, rank=ctx.rank)
gradients.broadcast_variables(net.variables, ctx)


def digest(variables):
    h = hashlib.sha256()
    for v in variables:
        h.update(np.ascontiguousarray(np.asarray(v)).tobytes())
    return h.hexdigest()[:16]


seen["broadcast"] = digest(net.model.variables)

# --- aggregation: --grad-accum averages 2 ranks x 4 passes, then one update -----------------------------


def batch(rank, step):
    rng = np.random.default_rng([rank, step])
    return rng.uniform(-1, 1, (BATCH, SIZE, SIZE, 3)).astype("float32"), rng.integers(0, CLASSES, BATCH)


loss_fn = keras.losses.SparseCategoricalCrossentropy()


def expected_after(cycle_start):
    """The trainable weights after the update of the cycle that begins at pass ``cycle_start``."""
    weights = [v.numpy() for v in net.model.trainable_variables]
    total = [np.zeros_like(w) for w in weights]
    for rank in range(ctx.size):
        for step in range(cycle_start, cycle_start + PASSES):
            images, labels = batch(rank, step)
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, net.model(images, training=True))
            for t, g in zip(total, tape.gradient(loss, net.model.trainable_variables)):
                t += np.asarray(g)
    return [w - LR * t / (ctx.size * PASSES) for w, t in zip(weights, total)]


rates = WarmupSchedule(LR, LR, 0, 1).parameters()
statistics = [v.numpy() for v in net.batchnorm_statistics()]
passes = []
expected = None
for step in range(STEPS):
    if step % PASSES == 0:
        expected = expected_after(step)
        # the reference's forward passes moved the moving statistics: put them back
        for v, value in zip(net.batchnorm_statistics(), statistics):
            v.assign(value)
    before = digest(net.model.trainable_variables)
    images, labels = batch(ctx.rank, step)
    iterator = iter(tf.data.Dataset.from_tensors((images, labels.astype("int32"), np.arange(BATCH, dtype=np.int64))))
    net.run_steps(iterator, 1, (False, False, 0.0), (0, 0, BATCH * ctx.size, 1e9, 1e9), rates)
    statistics = [v.numpy() for v in net.batchnorm_statistics()]
    after = [v.numpy() for v in net.model.trainable_variables]
    passes.append(
        {
            "iterations": int(net.optimizer.iterations.numpy()),
            "moved": digest(after) != before,
            "off": max(float(np.max(np.abs(a - e))) for a, e in zip(after, expected)),
            "digest": digest(after),
        }
    )
seen["aggregation"] = passes

# --- sparse: an IndexedSlices gradient averaged as dense --------------------------------------------------
table = tf.Variable([1.0, 2.0, 3.0])
with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.gather(table, [0, 2])) * float(ctx.rank + 1)
grad = tape.gradient(loss, table)
assert isinstance(grad, tf.IndexedSlices), type(grad)
seen["sparse"] = np.asarray(tf.function(gradients.allreduce_gradients, autograph=False)([grad])[0]).tolist()

with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump(seen, f)
print(f"rank {ctx.rank} ran the Keras cases under Keras {KERAS_MAJOR}", flush=True)
