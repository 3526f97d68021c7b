"""Launched under horovodrun by the tests: float16 loss scaling with an inf injected on one rank.

Usage: python loss_scale_check.py OUT_DIR
The real training step (``network.Net``) under mixed_float16: first
steps until the dynamic loss scale has come down far enough for a step to
update the weights (random weights overflow float16 at the start), then a
step where only rank 1's batch holds an inf, then a normal step. Each rank
writes what it saw (loss scale, weight digests) for the test to compare
across ranks.
"""

import hashlib
import json
import os
import sys

import numpy as np
import tensorflow as tf

from hvd_train import config
from hvd_train.distributed import gradients, start
from hvd_train.model import compute
from hvd_train.model.catalogue import build_model
from hvd_train.model.network import Net, use_step_seeded_dropout
from hvd_train.model.schedules import WarmupSchedule

out_dir = sys.argv[1]
ctx = start.init(threads_per_rank=1)
cfg = config.build(
    {
        "data": {"train": "d", "batch_size": 4},
        "model": {"name": "MobileNetV2", "weights": "none"},
        "compute": {"precision": "mixed_float16"},
        "run": {"output": "o"},
    }
)
compute.set_policy("mixed_float16")
use_step_seeded_dropout()
net = Net(build_model(cfg.model, 3, 32, load_weights=False), cfg, seed=1, rank=ctx.rank, precision="mixed_float16")
gradients.broadcast_variables(net.variables, ctx)
assert compute.is_loss_scaled(net.optimizer)


def batch(step):
    rng = np.random.default_rng([ctx.rank, step])
    images = rng.uniform(-1, 1, (4, 32, 32, 3)).astype("float32")  # preprocessed range
    if step == INF_STEP and ctx.rank == 1:
        images[0, 0, 0, 0] = np.inf  # only this rank's gradients are not finite
    return images, np.arange(4, dtype=np.int32) % 3, np.zeros(4, np.int64)


def digest():
    # Trainable weights only: BatchNorm moving statistics are each rank's own until epoch ends.
    h = hashlib.sha256()
    for w in net.model.trainable_weights:
        w = w.numpy()
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


INF_STEP = -1
RATES = WarmupSchedule(0.01, 0.01, 0, 1).parameters()  # SGD's default rate, constant


def run(step):
    iterator = iter(tf.data.Dataset.from_tensors(batch(step)))
    before = digest()
    _, report = net.run_steps(iterator, 1, (False, False, 0.0), (0, 0, 4, 4, 4), RATES)
    return {
        "step": step,
        # Ranks whose loss of the epoch was not finite before this step: none, under a loss scale.
        "diverged": float(report.numpy()[3]),
        "loss_scale": compute.current_loss_scale(net.optimizer),
        "changed": digest() != before,
        "digest": digest(),
        "iterations": int(net.optimizer.iterations.numpy()),
    }


seen = []
for step in range(1, 30):  # every rank sees the same scales, so all leave this loop together
    seen.append(run(step))
    if seen[-1]["changed"]:
        break
INF_STEP = step + 1
seen.append(run(INF_STEP))
seen.append(run(INF_STEP + 1))
with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
    json.dump(seen, f)
print(f"rank {ctx.rank} checked loss scaling", flush=True)
