"""Elastic Horovod's retry loop: a lost worker rolls the survivors back, new workers join.

What an elastic training run keeps, rolls back and shares is
``hvd_train.training.elastic``; this module drives it.
"""

from __future__ import annotations

import re
import sys

from hvd_train import compat  # noqa: F401  (the run's Keras chosen before Horovod loads)
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError

# What TensorFlow says when a Horovod collective fails: the op's name in the
# message (eager: "__wrapped__HorovodAllreduce_..."; graphs: "{{node HorovodAllreduce_...}}"),
# or, for a node named by us in a compiled step ("{{node while/head_step.features}}"),
# the op's Python wrapper as the last frame of where the node was defined
# ("File "<string>", line 401, in horovod_allgather").
_COLLECTIVE_OP = re.compile(
    r"Horovod(Grouped)?(Allreduce|Allgather|Broadcast|Alltoall|Reducescatter)"
    r"|\bin horovod_(grouped_)?(allreduce|allgather|broadcast|alltoall|reducescatter)\b"
)

# Collectives that may fail in a row, with no commit between them, before an
# elastic job stops treating the failure as a lost worker.
MAX_FAILURES_WITHOUT_PROGRESS = 5


def is_horovod_failure(e: BaseException) -> bool:
    """Whether ``e`` is a failed Horovod collective (a worker was lost, or Horovod shut down).

    As ``horovod.tensorflow.elastic`` decides it: an ``UnknownError`` raised by
    one of Horovod's collective ops (grouped allreduces included), not any
    error whose message happens to mention Horovod.
    """
    from horovod.common.exceptions import HorovodInternalError

    if isinstance(e, HorovodInternalError):
        return True
    from hvd_train.compat import tf

    return isinstance(e, tf.errors.UnknownError) and bool(_COLLECTIVE_OP.search(e.message or ""))


class ElasticSession:
    """What an elastic job keeps, rolls back and shares; ``run_elastic`` drives it.

    Subclasses implement ``save`` (commit in memory), ``restore`` (roll back
    to the last commit), ``sync`` (make every rank, new ones included, equal
    to the most advanced one), ``reset`` (after the world changed) and
    ``body(commit)`` (train, calling ``commit()`` where the job may be rolled
    back to: it saves, then checks for new or lost hosts).
    """

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def body(self, commit):
        raise NotImplementedError


def run_elastic(session: ElasticSession, ctx: Context, on_lost=None):
    """Runs ``session.body(commit)`` as an elastic Horovod job until it returns.

    A collective that fails because a worker was lost makes every survivor
    roll back to the last commit (``session.restore``); Horovod then forms
    the new world (``hvd.shutdown(); hvd.init()``, which waits for at least
    ``--min-np`` workers), ``ctx`` is refreshed, ``session.reset`` adapts
    to it, ``session.sync`` brings every rank (new ones included) to the
    same state, and the body runs again. New workers announced by the driver
    surface at the next commit and join the same way, without a rollback;
    so do hosts taken away (synced too: a sharded head's groups follow).

    Unlike ``horovod.tensorflow.elastic.run``, grouped allreduces count too,
    failures during ``sync`` included, and any other error ends the job
    rather than being dropped. A collective that fails again and again with
    no commit in between (``MAX_FAILURES_WITHOUT_PROGRESS`` times) is no
    lost worker but a fault of the job: it ends the job with its message.
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import State, run_fn
    from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

    failures = 0

    def guarded(fn):
        def call(*args):
            try:
                return fn(*args)
            except Exception as e:
                if is_horovod_failure(e) and not isinstance(e, HorovodInternalError):
                    raise HorovodInternalError(e) from None
                raise

        return call

    def restore_or_give_up():
        nonlocal failures
        failures += 1
        if failures >= MAX_FAILURES_WITHOUT_PROGRESS:
            cause = sys.exc_info()[1]
            reason = str(getattr(cause, "args", [cause])[0] or cause).strip().splitlines()
            raise UserError(
                f"elastic: {failures} collectives failed in a row with no commit between them, so this is no lost "
                f"worker but a fault of the job; the last failure: {reason[0][:300] if reason else cause!r}"
            )
        session.restore()

    def committed(fn):
        def call(*args):
            nonlocal failures
            fn(*args)
            failures = 0

        return call

    class _State(State):
        def __init__(self):
            super().__init__(bcast_object=lambda obj: hvd.broadcast_object(obj, root_rank=0), get_rank=hvd.rank)

        save = staticmethod(guarded(session.save))
        restore = staticmethod(restore_or_give_up)
        sync = staticmethod(guarded(session.sync))

        def commit(self):
            committed(guarded(super().commit))()

        def check_host_updates(self):
            # Horovod skips the sync when hosts were only removed (every rank's state is the same). A sharded
            # head is split again for the new world in the sync, so every change of hosts syncs.
            try:
                super().check_host_updates()
            except HostsUpdatedInterrupt:
                raise HostsUpdatedInterrupt(False) from None

    def reset():
        if on_lost is not None:
            on_lost()
        hvd.shutdown()
        hvd.init()
        ctx.refresh()
        session.reset()

    state = _State()
    return run_fn(lambda _: guarded(session.body)(state.commit), reset)(state)
