"""This process's place in the job (``Context``) and the collectives every layer uses.

Everything outside ``hvd_train.distributed`` receives a ``Context`` (rank,
size, and a few collective helpers) and so runs, and is tested, as a single
process too. Collectives over a subset of the ranks (Horovod's process sets,
for a model split across workers) belong here, beside the job-wide ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hvd_train.compat import tf  # (the run's Keras chosen before Horovod loads)
from hvd_train.distributed import cpus
from hvd_train.errors import UserError

T = TypeVar("T")


@dataclass
class Context:
    """This process's place in the job.

    Attributes:
        rank: global rank; rank 0 writes every output.
        size: number of processes.
        local_rank: rank on this host; picks the GPU.
        local_size: processes on this host; divides the CPU cores.
        cpu: CPU threads of this process and where the number came from (set by ``start.init``).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    cpu: cpus.Budget | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def refresh(self) -> None:
        """Reads rank and size again (after an elastic reset changed them)."""
        import horovod.tensorflow as hvd

        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    # The helpers below work without Horovod when size == 1, so single-process
    # callers (and unit tests) need no launcher.
    def broadcast_object(self, obj: T, name: str, root: int = 0) -> T:
        """Rank ``root``'s ``obj`` on every rank."""
        if self.size == 1:
            return obj
        import horovod.tensorflow as hvd

        return hvd.broadcast_object(obj, root_rank=root, name=name)

    def allgather_object(self, obj: T, name: str) -> list[T]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import horovod.tensorflow as hvd

        return hvd.allgather_object(obj, name=name)

    def allreduce_sum(self, array: np.ndarray, name: str) -> np.ndarray:
        """Element-wise sum of ``array`` over all ranks (same shape on each)."""
        if self.size == 1:
            return np.asarray(array)
        import horovod.tensorflow as hvd

        return hvd.allreduce(tf.constant(array), op=hvd.Sum, name=name).numpy()

    def on_root(self, fn: Callable[[], T], name: str) -> T:
        """Runs ``fn`` on rank 0 only and gives its result, or its UserError, to all.

        Used for work that must happen once (listing a folder, downloading
        weights): if rank 0 fails, every rank raises the same error instead of
        waiting for a broadcast that never comes.
        """
        outcome: tuple[bool, Any] = (True, None)
        if self.is_root:
            try:
                outcome = (True, fn())
            except UserError as e:
                outcome = (False, str(e))
        ok, value = self.broadcast_object(outcome, name=name)
        if not ok:
            raise UserError(value, agreed=True)
        return value

    def agree(self, fn: Callable[[], T], name: str) -> T:
        """Runs ``fn`` on every rank; a UserError on any rank is raised on all.

        Returns:
            This rank's result of ``fn``.
        """
        try:
            value, error = fn(), None
        except UserError as e:
            value, error = None, str(e)
        errors = [e for e in self.allgather_object(error, name=name) if e]
        if errors:
            raise UserError(errors[0], agreed=True)
        return value


def allreduce_sum_op(tensor, name: str):
    """The sum of ``tensor`` over all ranks, as an op for use inside a ``tf.function``.

    The op is named ``HorovodAllreduce_<name>``: inside a graph, TensorFlow's
    error names the node, not its type, and a failure must still read as a
    failed collective (``is_horovod_failure``) for an elastic job to go on.

    One process sums nothing: as Horovod's own optimizer does with gradients,
    the tensor then passes through without the round trip through Horovod's
    background thread (about a millisecond a call). The number of processes is
    read when the op runs, so an elastic job that grows from one sums again.
    """
    import horovod.tensorflow as hvd

    def total():
        return hvd.allreduce(tensor, op=hvd.Sum, name=f"HorovodAllreduce_{name}")

    return tf.cond(tf.greater(hvd.size_op(), 1), total, lambda: tf.identity(tensor))
