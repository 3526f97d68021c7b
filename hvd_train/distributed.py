"""The Horovod glue: the only module of hvd_train that imports Horovod.

Everything else receives a ``Context`` (rank, size, and a few collective
helpers) and so runs, and is tested, as a single process too.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from hvd_train import (
    compat,  # noqa: F401  (Keras 2 must be in place before Horovod)
    cpus,
)
from hvd_train.errors import UserError

T = TypeVar("T")

# Seconds a rank of an elastic job waits on a silent peer before it counts as lost.
ELASTIC_GLOO_TIMEOUT = 5

# Set by MPI launchers (Open MPI, MPICH/PMI, PMIx) in every process they start.
_MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


@dataclass
class Context:
    """This process's place in the job.

    Attributes:
        rank: global rank; rank 0 writes every output.
        size: number of processes.
        local_rank: rank on this host; picks the GPU.
        local_size: processes on this host; divides the CPU cores.
        cpu: CPU threads of this process and where the number came from (set by :func:`init`).
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

        from hvd_train.compat import tf

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


def abort(code: int) -> None:
    """Ends this process so that the launcher ends the others; never returns.

    A normal exit would run Horovod's shutdown, which waits for the other
    ranks, which may be waiting in a collective for this one: a hang.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # Horovod: MPI_Abort tears down every rank of an mpirun job at once.
        mpi.COMM_WORLD.Abort(code)
    # horovodrun ends the remaining workers when one exits non-zero.
    os._exit(code)


def end_after_stop(code: int, stop_signals) -> None:
    """Ends this process after an agreed stop, skipping the interpreter's teardown; never returns.

    Every rank has stopped after the same step, the checkpoint is on disk and
    the outputs are closed. The teardown would free the input pipeline while
    its threads still feed it from a Python generator, and TensorFlow waits
    for them, at times until the launcher kills the rank (horovodrun does
    after 5 s: exit 137, not 75); it also puts back the default signal
    handlers first, so the same stop arriving again through the launcher
    kills the rank (exit 143).

    Args:
        code: the exit code.
        stop_signals: the signals that ask for a stop (ignored from now on).
    """
    for sig in stop_signals:
        # The same stop again (a launcher ending the other ranks passes it on once more): the
        # process is on its way out already. (No Python handler could run during a hang in
        # native code either; SIGKILL still ends it.)
        signal.signal(sig, signal.SIG_IGN)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        # Horovod: every rank takes part in the shutdown (each one is on its way out).
        hvd.shutdown()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # else mpirun reports the rank as "exiting improperly"
    os._exit(code)


def launched_by_mpi() -> bool:
    """Started by mpirun (or horovodrun --mpi), not by horovodrun's Gloo launcher."""
    return any(v in os.environ for v in _MPI_VARS) and "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ


def check_launch(elastic: bool) -> None:
    """Refuses ``--elastic`` where no elastic launcher runs this process.

    Raises:
        UserError: ``--elastic`` under plain mpirun, or without an elastic horovodrun.
    """
    if not elastic:
        return
    if launched_by_mpi():
        raise UserError(
            "--elastic: plain mpirun (and horovodrun --mpi) has no elastic mode; launch with "
            "horovodrun --min-np N --max-np M --host-discovery-script SCRIPT (Gloo), or drop --elastic."
        )
    if os.environ.get("HOROVOD_ELASTIC") != "1":
        raise UserError(
            "--elastic needs an elastic launcher: horovodrun --min-np N --max-np M --host-discovery-script SCRIPT "
            "(see launch/horovodrun.sh --elastic); drop --elastic for a fixed set of workers."
        )


def init(threads_per_rank: int = 0, deterministic: bool = False) -> Context:
    """Initialises Horovod and TensorFlow for this process.

    * Under plain ``mpirun`` (or ``horovodrun --mpi``) Horovod is initialised
      from mpi4py's ``MPI.COMM_WORLD``, so MPI is set up with the thread
      support Horovod needs and ``MPI_Abort`` is at hand to stop every rank.
    * One GPU per local rank, with memory growth, when GPUs exist.
    * CPU threads from the CPUs the process may use (affinity mask, cgroup
      quota: :mod:`hvd_train.cpus`), divided among the processes of a host
      that share them, so N ranks do not each start a thread per core.

    Args:
        threads_per_rank: TensorFlow threads per process (0: usable cores / local ranks sharing them).
        deterministic: TensorFlow op determinism (``--deterministic``).

    Returns:
        The context of this process.
    """
    from hvd_train.compat import tf

    if deterministic:
        tf.config.experimental.enable_op_determinism()
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        # Horovod: a rank whose peer in a collective stopped taking part (it
        # noticed a lost worker first) waits this long before it notices too;
        # Gloo's default is 30 s. Every collective cycles in milliseconds, so
        # only a worker that is really gone is waited for this long.
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(ELASTIC_GLOO_TIMEOUT))
    import horovod.tensorflow as hvd

    if launched_by_mpi():
        from mpi4py import MPI

        # Horovod: share mpi4py's MPI_COMM_WORLD instead of initialising MPI twice.
        hvd.init(comm=MPI.COMM_WORLD)
    else:
        hvd.init()
    ctx = Context(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    ctx.cpu = cpus.budget(ctx.local_size, threads_per_rank)

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        # Horovod: pin one GPU per process, chosen by local rank.
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpus[ctx.local_rank % len(gpus)], "GPU")
    else:
        # Horovod: N processes on one host share its cores.
        threads = cpu_threads(ctx, threads_per_rank)
        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(max(2, threads))
        except RuntimeError:  # TensorFlow already started in this process (tests)
            pass
    return ctx


def warn_ineffective(horovod_cfg, ctx: Context) -> None:
    """Says when a Horovod option cannot act in this job (rank 0)."""
    import horovod.tensorflow as hvd

    if horovod_cfg.hierarchical_allreduce and ctx.is_root:
        if not (hvd.nccl_built() and hvd.mpi_enabled()) or ctx.size == ctx.local_size:
            logging.getLogger("hvd_train").warning(
                "--hierarchical-allreduce has no effect here: it needs Horovod built with NCCL and MPI, "
                "an MPI controller, and workers on more than one host"
            )


def cpu_threads(ctx: Context, threads_per_rank: int = 0) -> int:
    """CPU threads this process may use (TensorFlow's pools and the input pipeline)."""
    if threads_per_rank:
        return threads_per_rank
    return (ctx.cpu or cpus.budget(ctx.local_size)).threads


def distributed_optimizer(optimizer, *, fp16_allreduce: bool, grad_accum: int):
    """Wraps a Keras optimizer so that gradients are averaged over all ranks."""
    import horovod.tensorflow.keras as hvd_keras

    from hvd_train.compat import tf

    wrapped = hvd_keras.DistributedOptimizer(
        optimizer,
        # Horovod: halve the bytes on the wire; gradients are summed in float32 again.
        compression=hvd_keras.Compression.fp16 if fp16_allreduce else hvd_keras.Compression.none,
        # Horovod: accumulate N local batches before one allreduce and update.
        backward_passes_per_step=grad_accum,
        average_aggregated_gradients=True,
    )
    # Horovod makes its gradient allreduce a tf.function with AutoGraph, made
    # when the optimizer is (eagerly). Its Python has no control flow on
    # tensors (each gradient's tf.cond is explicit), but converting it and the
    # allreduce it calls, once per gradient, took seconds of every rank's first
    # step (see classifier.Net). The same function, traced as written:
    reduce = getattr(wrapped, "_allreduce_grads", None)
    if hasattr(reduce, "python_function"):
        plain = tf.function(reduce.python_function, autograph=False)
        wrapped._allreduce_grads = plain
        helper = getattr(wrapped, "_agg_helper", None)
        if helper is not None and getattr(helper, "_allreduce_grads", None) is reduce:
            helper._allreduce_grads = plain
    return wrapped


def broadcast_variables(variables, ctx: Context, root: int = 0) -> None:
    """Gives every rank rank ``root``'s values of ``variables`` (weights, optimizer state)."""
    if ctx.size == 1:
        return
    import horovod.tensorflow as hvd

    hvd.broadcast_variables(variables, root_rank=root)


def allreduce_gradients(grads, fp16: bool = False) -> list:
    """Averages gradients over all ranks, like ``DistributedOptimizer`` does (for use in a ``tf.function``)."""
    import horovod.tensorflow as hvd

    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    present = [(i, g) for i, g in enumerate(grads) if g is not None]
    averaged = hvd.grouped_allreduce([g for _, g in present], op=hvd.Average, compression=compression)
    out = list(grads)
    for (i, _), value in zip(present, averaged):
        out[i] = value
    return out


def allreduce_sum_op(tensor, name: str):
    """The sum of ``tensor`` over all ranks, as an op for use inside a ``tf.function``.

    The op is named ``HorovodAllreduce_<name>``: inside a graph, TensorFlow's
    error names the node, not its type, and a failure must still read as a
    failed collective (``is_horovod_failure``) for an elastic job to go on.
    """
    import horovod.tensorflow as hvd

    return hvd.allreduce(tensor, op=hvd.Sum, name=f"HorovodAllreduce_{name}")


def average_variables(variables, ctx: Context, name: str) -> None:
    """Sets each variable to its mean over all ranks (in place)."""
    if ctx.size == 1 or not variables:
        return
    import horovod.tensorflow as hvd

    averaged = hvd.grouped_allreduce([v.read_value() for v in variables], op=hvd.Average, name=name)
    for variable, value in zip(variables, averaged):
        variable.assign(value)


# What TensorFlow says when a Horovod collective fails: the op's name in the
# message (eager: "__wrapped__HorovodAllreduce_..."; graphs: "{{node HorovodAllreduce_...}}").
_COLLECTIVE_OP = re.compile(r"Horovod(Grouped)?(Allreduce|Allgather|Broadcast|Alltoall|Reducescatter)")

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
    surface at the next commit and join the same way, without a rollback.

    Unlike ``horovod.tensorflow.elastic.run``, grouped allreduces count too,
    failures during ``sync`` included, and any other error ends the job
    rather than being dropped. A collective that fails again and again with
    no commit in between (``MAX_FAILURES_WITHOUT_PROGRESS`` times) is no
    lost worker but a fault of the job: it ends the job with its message.
    """
    import horovod.tensorflow as hvd
    from horovod.common.elastic import State, run_fn
    from horovod.common.exceptions import HorovodInternalError

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

    def reset():
        if on_lost is not None:
            on_lost()
        hvd.shutdown()
        hvd.init()
        ctx.refresh()
        session.reset()

    state = _State()
    return run_fn(lambda _: guarded(session.body)(state.commit), reset)(state)


def versions() -> dict[str, str]:
    import horovod

    from hvd_train import __version__
    from hvd_train.compat import keras, tf

    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "horovod": horovod.__version__,
        "hvd_train": __version__,
    }
