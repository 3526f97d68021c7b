"""Starting a rank: the launch checks, Horovod's ``init``, GPUs and CPU threads, versions."""

from __future__ import annotations

import logging
import os

from hvd_train import compat  # (the chosen Keras must be in place before Horovod)
from hvd_train.distributed import cpus, launchers
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError

# Seconds a rank of an elastic job waits on a silent peer before it counts as lost.
ELASTIC_GLOO_TIMEOUT = 5
# Seconds the ranks of an elastic job wait at a rendezvous for a worker that joins (our Horovod patch): its start,
# TensorFlow's import among it, takes longer than a collective should wait.
ELASTIC_RENDEZVOUS_TIMEOUT = 120

# Set by MPI launchers (Open MPI, MPICH/PMI, PMIx) in every process they start.
_MPI_VARS = launchers.variables("started_by", lambda entry: entry.mpi)
# Set by every launcher in every process it starts (horovodrun's elastic mode too).
_LAUNCHED_VARS = launchers.variables("started_by")

# Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (1 by default) even with nothing to
# send: 2 % of a core. A process started alone sends nothing (every collective here passes through at
# size 1), so it wakes 10 times a second; any collective would wait at most this long.
ONE_PROCESS_CYCLE_MS = "100"


def launched_by_mpi(env=None) -> bool:
    """Started by mpirun (or horovodrun --mpi), not by horovodrun's Gloo launcher."""
    env = os.environ if env is None else env
    return any(v in env for v in _MPI_VARS) and "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in env


def one_process_job(env=None) -> bool:
    """Known before Horovod starts to be a job of one process: started by no launcher.

    A launcher's job of one process (``-np 1``) keeps Horovod's cycle: its
    rank's end is what the launcher waits for, and a sweep's killed trial
    once left its launcher behind with that rank's end a cycle later.
    """
    env = os.environ if env is None else env
    return not any(v in env for v in _LAUNCHED_VARS)


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
    if not launchers.elastic_job():
        raise UserError(
            "--elastic needs an elastic launcher: horovodrun --min-np N --max-np M --host-discovery-script SCRIPT "
            "(see launch/horovodrun.sh --elastic); drop --elastic for a fixed set of workers."
        )


def refuse_mixed_kerases(majors: list[int]) -> None:
    """Refuses (on every rank that calls it with the gathered ``majors``) a job whose ranks run different
    Kerases: they name and order their variables otherwise, so a broadcast or an allreduce would pair the
    wrong ones."""
    if len(set(majors)) > 1:
        ranks = {major: [r for r, m in enumerate(majors) if m == major] for major in sorted(set(majors))}
        shown = "; ".join(f"Keras {major} on rank(s) {', '.join(map(str, r[:8]))}" for major, r in ranks.items())
        raise UserError(
            f"the ranks of this job run different Kerases ({shown}): give every rank the same HVD_TRAIN_KERAS "
            f"(mpirun -x HVD_TRAIN_KERAS; launch/ scripts forward it)",
            agreed=True,
        )


def init(threads_per_rank: int = 0, deterministic: bool = False, process_sets: bool = False) -> Context:
    """Initialises Horovod and TensorFlow for this process.

    * Under plain ``mpirun`` (or ``horovodrun --mpi``) Horovod is initialised
      from mpi4py's ``MPI.COMM_WORLD``, so MPI is set up with the thread
      support Horovod needs and ``MPI_Abort`` is at hand to stop every rank.
    * A job of one process (``one_process_job``) has Horovod's background
      thread wake 10 times a second instead of 1,000.
    * One GPU per local rank, with memory growth, when GPUs exist.
    * CPU threads from the CPUs the process may use (affinity mask, cgroup
      quota: :mod:`hvd_train.distributed.cpus`), divided among the processes of a host
      that share them, so N ranks do not each start a thread per core.

    Args:
        threads_per_rank: TensorFlow threads per process (0: usable cores / local ranks sharing them).
        deterministic: TensorFlow op determinism (``--deterministic``).
        process_sets: let ``groups.register`` add process sets (the sharded head).

    Returns:
        The context of this process.
    """
    from hvd_train.compat import tf

    if deterministic:
        tf.config.experimental.enable_op_determinism()
    if launchers.elastic_job():
        # Horovod: a rank whose peer in a collective stopped taking part (it
        # noticed a lost worker first) waits this long before it notices too;
        # Gloo's default is 30 s. Every collective cycles in milliseconds, so
        # only a worker that is really gone is waited for this long.
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(ELASTIC_GLOO_TIMEOUT))
        os.environ.setdefault("HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS", str(ELASTIC_RENDEZVOUS_TIMEOUT))
    if one_process_job():
        os.environ.setdefault("HOROVOD_CYCLE_TIME", ONE_PROCESS_CYCLE_MS)
    import horovod.tensorflow as hvd

    if launched_by_mpi():
        from mpi4py import MPI

        # Horovod: share mpi4py's MPI_COMM_WORLD instead of initialising MPI twice.
        hvd.init(comm=MPI.COMM_WORLD, process_sets="dynamic" if process_sets else None)
    else:
        hvd.init(process_sets="dynamic" if process_sets else None)
    ctx = Context(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())
    ctx.cpu = cpus.budget(ctx.local_size, threads_per_rank)
    if ctx.size > 1 and not launchers.elastic_job():
        # An elastic worker that joins must start no collective of its own: the elastic sync checks it.
        refuse_mixed_kerases(ctx.allgather_object(compat.KERAS_MAJOR, name="keras_major"))

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
