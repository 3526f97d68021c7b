"""Launched under horovodrun by the tests: a peer lost while a compiled step runs its own allreduce.

Usage: python lost_peer_in_a_step.py
Both ranks run the training step's stop-agreement allreduce (named, inside a
``tf.function``, as in ``network.Net``) once; then rank 1 leaves without a
word and rank 0 runs it again. Rank 0 prints what it caught, and whether an
elastic job would take it for a lost worker, as one JSON line.
"""

import json
import os
import time

import tensorflow as tf

from hvd_train.distributed import context, elastic, start

ctx = start.init(threads_per_rank=1)
step = tf.function(lambda x: context.allreduce_sum_op(x, name="boundary_flags"), autograph=False)
assert step(tf.ones(3)).numpy().tolist() == [2.0, 2.0, 2.0]
if ctx.rank == 1:
    os._exit(0)
time.sleep(1)
try:
    for _ in range(100):
        step(tf.ones(3))
        time.sleep(0.1)
    print(json.dumps({"caught": None}))
except Exception as e:  # noqa: BLE001  (what it is, is what the test checks)
    print(json.dumps({"caught": type(e).__name__, "lost": elastic.is_horovod_failure(e), "message": str(e)[:2000]}))
os._exit(0)
