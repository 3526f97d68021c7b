"""The compiled training steps (``Net.run_steps``) on a small model, in one process of their own.

Horovod's optimizer, the weights derived from the ids, the learning rate the
steps compute from the schedule, and several steps per call: how the steps
are cut into calls changes nothing in the weights.
"""

import json
import sys

import numpy as np
import pytest

from conftest import output_of, run

# The steps differ between the Kerases (Horovod's DistributedOptimizer under tf-keras, our own under Keras 3).
pytestmark = pytest.mark.both_kerases

# Prints each case's result as one JSON line.
_STEPS = """
import json
import numpy as np
from hvd_train import config
from hvd_train.distributed import start
from hvd_train.model.network import Net, use_step_seeded_dropout
from hvd_train.compat import keras, tf
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.schedules import WarmupSchedule, graph_rate

ctx = start.init(1)
use_step_seeded_dropout()
CONSTANT = WarmupSchedule(0.1, 0.1, 0, 1).parameters()


def cfg(accum=1, per_call=4):
    return config.build({
        "data": {"train": "unused"}, "run": {"output": "unused"}, "optim": {"base_lr": 0.1},
        "horovod": {"grad_accum": accum}, "compute": {"steps_per_call": per_call},
    })


def net_of(accum=1, dropout=0.0, per_call=4):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dropout(dropout)(keras.layers.Dense(5)(inputs))
    outputs = keras.layers.Dense(3, activation="softmax", name=HEAD_LAYER)(hidden)
    return Net(keras.Model(inputs, outputs), cfg(accum, per_call), 0, 0)


x = np.random.default_rng(1).normal(size=(4, 6)).astype("float32")
y = np.array([0, 1, 2, 0], np.int32)


def update(x, y, ids):
    net = net_of()
    before = [w.numpy().copy() for w in net.model.trainable_weights]
    batch = tf.data.Dataset.from_tensors((x, y, np.asarray(ids, np.int64))).repeat()
    net.run_steps(iter(batch), 1, (False, False, 0.0), (0, 0, 4, 4, 4), CONSTANT)
    return [(w.numpy() - b).ravel().tolist() for w, b in zip(net.model.trainable_weights, before)]


other_x, other_y = x.copy(), y.copy()
other_x[2], other_y[2] = 100.0, 1  # another stand-in in the same place
print(json.dumps({
    "stand_in": update(x, y, [0, 1, -3, 3]),
    "other_stand_in": update(other_x, other_y, [0, 1, -3, 3]),
    "plain": update(x, y, [0, 1, 2, 3]),
    "three_alone": update(x[[0, 1, 3]], y[[0, 1, 3]], [0, 1, 3]),
}))

# Eight steps of 4 images (one epoch of 32), at a rate that warms up, then decays, cut into calls.
xs = np.random.default_rng(2).normal(size=(32, 6)).astype("float32")
ys = np.arange(32, dtype=np.int32) % 3
ids = np.arange(32, dtype=np.int64)
ids[[5, 17]] = [-6, -18]  # two stand-ins
COSINE = WarmupSchedule(0.05, 0.2, 0.25, 1.0, "cosine").parameters()


def trained(calls, accum=1, rates=COSINE):
    # Calls of one step each run the step alone (--steps-per-call 1); the others, a loop.
    net = net_of(accum, dropout=0.5, per_call=max(calls))
    net.timestamps = True
    iterator = iter(tf.data.Dataset.from_tensor_slices((xs, ys, ids)).batch(4).repeat())
    done, met = 0, []
    for steps in calls:
        _, report = net.run_steps(iterator, steps, (False, False, 0.5), (4 * done, done, 4, 32, 32), rates)
        done += steps
        met += net.take_stand_ins()
    return {"weights": [w.numpy().tolist() for w in net.model.weights], "met": sorted(met),
            "iterations": int(net.optimizer.iterations.numpy()), "report": report.numpy().tolist()}


print(json.dumps({
    "one_by_one": trained([1] * 8),
    "three_three_two": trained([3, 3, 2]),
    "all_at_once": trained([8]),
    "constant_rate": trained([8], rates=CONSTANT),
    "accum_one_by_one": trained([1] * 8, accum=2),
    "accum_four_four": trained([4, 4], accum=2),
}))

# The compiled schedule against the Python one, through warmup, the decays and beyond the end.
rate = tf.function(graph_rate, autograph=False)
epochs = np.linspace(0.0, 12.0, 601)
out = {}
for decay in ("cosine", "step", "constant"):
    schedule = WarmupSchedule(0.01, 0.08, 2.5, 10, decay, 0.5, 3)
    out[decay] = [[schedule(e) for e in epochs],
                  [float(rate(decay, schedule.parameters(), tf.constant(e, tf.float64))) for e in epochs]]
no_warmup = WarmupSchedule(0.01, 0.08, 0, 10, "cosine")
out["no_warmup"] = [[no_warmup(e) for e in epochs],
                    [float(rate("cosine", no_warmup.parameters(), tf.constant(e, tf.float64))) for e in epochs]]
print(json.dumps(out))

# A batch with an inf pixel in float32 (no loss scale: its update writes nan into the weights), between two
# good ones: the call after it reports the loss; the weights are not finite.
bad = x.copy()
bad[0, 0] = np.inf
net = net_of(per_call=1)
batches = iter(tf.data.Dataset.from_tensor_slices(([x, bad, x], [y] * 3, [np.arange(4, dtype=np.int64)] * 3)))
reports = [net.run_steps(batches, 1, (False, False, 0.0), (0, 0, 4, 4, 4), CONSTANT)[1].numpy()[3] for _ in range(3)]
print(json.dumps({"reports": [float(r) for r in reports], "broken": net.non_finite(), "fresh": net_of().non_finite()}))

# One collective that Horovod runs here, so the timeline shows it records them.
import horovod.tensorflow as hvd
tf.function(lambda: hvd.allreduce(tf.constant(1.0), name="timeline_control"))()  # eager ops go unnamed
# Horovod's timeline is written by a thread of its own, which stops at shutdown with whatever it has not
# written yet (once, on a loaded machine, the whole timeline): time to write the queue first.
import time
time.sleep(1.0)
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The script's four results, then Horovod's timeline of the process."""
    timeline = tmp_path_factory.mktemp("timeline") / "timeline.json"
    proc = run([sys.executable, "-c", _STEPS], timeout=300, HOROVOD_TIMELINE=str(timeline))
    assert proc.returncode == 0, output_of(proc)
    lines = proc.stdout.splitlines()[-4:]
    return [json.loads(line) for line in lines] + [timeline.read_text()]


def test_stand_ins_weigh_nothing_in_a_step(cases):
    """A stand-in (a negative id) changes nothing in the update, whatever its pixels and label; the others
    count as in any other step."""
    out = {k: [np.asarray(d) for d in v] for k, v in cases[0].items()}
    assert all(np.allclose(a, b) for a, b in zip(out["stand_in"], out["other_stand_in"]))
    assert not all(np.allclose(a, b) for a, b in zip(out["stand_in"], out["plain"]))
    # The mean is over the whole batch: the three images weigh what they weigh in a full batch.
    assert all(np.allclose(a * 3 / 4, b, atol=1e-7) for a, b in zip(out["three_alone"], out["stand_in"]))


def test_how_the_steps_are_cut_into_calls_changes_nothing(cases):
    """Eight steps one per call (the step alone, --steps-per-call 1), 3+3+2, or all in one call (a loop in
    the call): the same weights, bit for bit (the rate of each step, its dropout mask, its update); with
    gradient accumulation too."""
    runs = cases[1]
    same = runs["one_by_one"]
    assert same["iterations"] == 8
    for name in ("three_three_two", "all_at_once"):
        assert runs[name]["weights"] == same["weights"], name
    assert runs["accum_four_four"]["weights"] == runs["accum_one_by_one"]["weights"]
    # The rate matters (the comparison can fail): a constant one trains other weights.
    assert runs["constant_rate"]["weights"] != same["weights"]
    assert runs["accum_one_by_one"]["weights"] != same["weights"]


def test_stand_ins_are_kept_on_the_device_until_taken(cases):
    for name, run_ in cases[1].items():
        assert run_["met"] == [5, 17], name
    # The report: the flags summed over the ranks (one here), the ranks whose loss is not finite (none), then
    # the call's start and end.
    stop, timed, seconds, diverged, started, ended = cases[1]["all_at_once"]["report"]
    assert (stop, timed, seconds, diverged) == (0, 0, 0.5, 0) and ended > started > 0


def test_one_process_agrees_with_itself_without_a_collective_per_call(cases):
    """The flags summed over one rank are the flags (the report above): no round trip through Horovod's
    background thread for each call, which was each step's at --steps-per-call 1."""
    timeline = cases[4]
    assert "timeline_control" in timeline  # the timeline records what Horovod runs
    assert "boundary_flags" not in timeline


def test_the_compiled_schedule_is_the_python_schedule(cases):
    for decay, (python, compiled) in cases[2].items():
        np.testing.assert_allclose(compiled, python, rtol=1e-12, atol=1e-15, err_msg=decay)
        assert len(set(np.round(python, 9))) > 3, decay  # it moves


def test_a_loss_that_is_not_finite_is_reported_by_the_call_after_it(cases):
    """The call's report sums the ranks whose loss of the epoch is not finite before its steps: the step with
    an inf pixel makes the loss nan in the second call, the third reports it (``divergence``). The weights
    its update wrote are not finite, nor the optimizer's values and the loss sums, which the checkpoints'
    check reads; a fresh net's are."""
    found = cases[3]
    assert found["reports"] == [0.0, 0.0, 1.0] and found["fresh"] == []
    assert found["broken"] == ["weights", "optimizer values", "epoch's loss sums"], found["broken"]
