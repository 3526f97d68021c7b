"""What counts as a lost worker in an elastic job, and how often it may count in a row."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_train.distributed import elastic

# What TensorFlow raised in this suite's elastic jobs when a peer was killed (eager, Gloo).
LOST = (
    "{{function_node __wrapped__HorovodAllreduce_grads_0_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
    "Gloo error: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer [127.0.0.1]:4461 "
    "[Op:HorovodAllreduce]"
)
# A node of ours in a compiled step (the sharded head's allgather): its op type is not in the message, the
# wrapper that made the node is.
IN_A_STEP = (
    "Graph execution error:\n\nDetected at node while/head_step.features defined at (most recent call last):\n"
    '  File "/venv/bin/hvd-train", line 8, in <module>\n\n'
    '  File "/src/hvd_train/distributed/groups.py", line 128, in gather\n\n'
    '  File "/venv/lib/python3.11/site-packages/horovod/tensorflow/mpi_ops.py", line 222, in allgather\n\n'
    '  File "<string>", line 401, in horovod_allgather\n\n'
    "Horovod has been shut down. This was caused by an exception on one of the ranks or an attempt to allreduce, "
    "allgather or broadcast a tensor after one of the ranks finished execution.\n"
    "\t [[{{node while/head_step.features}}]] [Op:__inference__run_steps_2363]"
)
SHUT_DOWN = (
    "{{function_node __wrapped__HorovodGroupedAllreduce_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
    "Horovod has been shut down. This was caused by an exception on one of the ranks [Op:HorovodGroupedAllreduce]"
)


@pytest.mark.parametrize(
    "kind, message, lost",
    [
        ("UnknownError", LOST, True),
        ("UnknownError", SHUT_DOWN, True),
        ("UnknownError", IN_A_STEP, True),
        # A wrapper's name in a path or a sentence is no frame of it.
        ("UnknownError", "cannot read /data/horovod_allgather_notes.txt", False),
        # An error that mentions Horovod but no collective op: a fault of its own, never retried.
        ("UnknownError", "py_function failed: cannot write /runs/x (Horovod timeline)", False),
        ("InvalidArgumentError", LOST, False),
        ("ValueError", LOST, False),
    ],
)
def test_only_a_failed_horovod_collective_counts_as_a_lost_worker(kind, message, lost):
    import tensorflow as tf

    error = ValueError(message) if kind == "ValueError" else getattr(tf.errors, kind)(None, None, message)
    assert elastic.is_horovod_failure(error) is lost


_ALWAYS_FAILS = f"""
import json
from hvd_train import compat
import tensorflow as tf
import horovod.tensorflow as hvd
from hvd_train.distributed import context, elastic
from hvd_train.errors import UserError

hvd.init()
attempts = []

class Session(elastic.ElasticSession):
    def save(self): pass
    def restore(self): pass
    def sync(self): pass
    def reset(self): pass
    def body(self, commit):
        attempts.append(1)
        if len(attempts) <= 2:
            commit()  # progress: the count of failures in a row starts again
        raise tf.errors.UnknownError(None, None, {LOST!r})

try:
    elastic.run_elastic(Session(), context.Context())
except UserError as e:
    print(json.dumps({{"attempts": len(attempts), "error": str(e)}}))
"""


def test_a_collective_that_fails_again_and_again_ends_the_job():
    # Gloo, as in elastic jobs: Horovod shuts down and starts again at every reset (MPI cannot).
    env = {**os.environ, "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}
    proc = subprocess.run([sys.executable, "-c", _ALWAYS_FAILS], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    # Two attempts committed before failing; then MAX failures in a row with no commit.
    assert result["attempts"] == 2 + elastic.MAX_FAILURES_WITHOUT_PROGRESS - 1
    assert f"{elastic.MAX_FAILURES_WITHOUT_PROGRESS} collectives failed in a row" in result["error"]
    assert "Connection closed by peer" in result["error"]


@pytest.mark.multiprocess
def test_a_peer_lost_during_the_steps_own_allreduce_counts_as_a_lost_worker():
    # The step's stop agreement is an allreduce with a name of its own: TensorFlow's error names that
    # node, not Horovod's op type, and it must still be taken for a lost worker (else an elastic
    # job ends where it should go on).
    from conftest import launch, output_of

    proc = launch("horovodrun-gloo", 2, [sys.executable, Path(__file__).parent / "launched" / "lost_peer_in_a_step.py"])
    lines = [line.split(">:", 1)[-1] for line in proc.stdout.splitlines() if '"caught"' in line]
    assert len(lines) == 1, output_of(proc)
    caught = json.loads(lines[0])
    assert caught["caught"] == "UnknownError" and "boundary_flags" in caught["message"], caught
    assert caught["lost"] is True, caught
