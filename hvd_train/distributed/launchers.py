"""The launchers hvd_train knows, one entry each: what they tell a rank, and how a job of theirs stops.

Every place that reads a launcher's environment reads it from ``TABLE``, in
the table's order, which is their order of precedence: the rank and size
for the log (``launcher_rank``), MPI or not and a job of one process
(``start``), whether a job spans hosts (``hostname``), the local rank and
size ``doctor`` shows, and the launchers a sweep may run its trials with
(``experiments.spec``, ``experiments.trial``). A new launcher is one more
entry here.

Only the standard library is imported: the command line reads this before
TensorFlow loads, and modules below ``distributed`` never import it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

# The fields that name an environment variable, and so may be read from an environment.
VARIABLES = ("started_by", "rank", "size", "local_rank", "local_size", "nodes")


@dataclass(frozen=True)
class Launcher:
    """One launcher: the environment variables it gives every process it starts, and its job's stop.

    A variable field is None where this launcher sets no such variable, or
    where hvd_train does not read the one it sets.
    """

    name: str  # how a sweep file names it (`launcher:`), where a sweep may use it
    what: str  # the launcher in words
    # Set in every process it starts: present, this launcher started the process (``start``: MPI or
    # not, a job of one process). None: hvd_train reads none of its variables as a sign of it.
    started_by: str | None
    rank: str | None
    size: str | None
    local_rank: str | None
    local_size: str | None
    nodes: str | None = None  # hosts (nodes) of the job
    mpi: bool = False  # its ranks share MPI's COMM_WORLD (Horovod is initialised from mpi4py)
    elastic: bool = False  # workers may come and go: ``started_by`` is "1" in an elastic job
    stop_signal: int | None = None  # what asks its job to stop with a checkpoint (None: nothing known)
    # A sweep trial's launcher, the words before its `python -m hvd_train train ...` ({python}: this
    # interpreter, {workers}: the trial's workers); empty: a sweep cannot use this launcher.
    trial_command: tuple[str, ...] = ()


HOROVODRUN = Launcher(
    name="horovodrun",
    what="horovodrun (Gloo), also hvd-train launch",
    started_by="HOROVOD_SIZE",
    rank="HOROVOD_RANK",
    size="HOROVOD_SIZE",
    local_rank="HOROVOD_LOCAL_RANK",
    local_size="HOROVOD_LOCAL_SIZE",
    # It passes SIGTERM (and SIGINT) on to its workers as SIGTERM, and kills them 5 s later.
    stop_signal=signal.SIGTERM,
    # Gloo: horovodrun's ranks are its own children, and a SIGTERM to it reaches them. (With
    # MPI it would replace itself with a shell running mpirun, which the signal may outlive.)
    trial_command=("{python}", "-m", "hvd_train", "launch", "-np", "{workers}", "--gloo"),
)

TABLE: tuple[Launcher, ...] = (
    HOROVODRUN,
    # The same variables as horovodrun's, and HOROVOD_ELASTIC=1.
    dataclasses.replace(
        HOROVODRUN,
        name="horovodrun-elastic",
        what="horovodrun --min-np N --max-np M --host-discovery-script SCRIPT (Gloo)",
        started_by="HOROVOD_ELASTIC",
        elastic=True,
        trial_command=(),
    ),
    Launcher(
        name="mpirun",
        what="Open MPI's mpirun (also under horovodrun --mpi)",
        started_by="OMPI_COMM_WORLD_SIZE",
        rank="OMPI_COMM_WORLD_RANK",
        size="OMPI_COMM_WORLD_SIZE",
        local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
        local_size="OMPI_COMM_WORLD_LOCAL_SIZE",
        mpi=True,
        # It passes SIGUSR1 on at once; SIGTERM only after odls_base_sigkill_timeout (1 s), and kills as long after.
        stop_signal=signal.SIGUSR1,
        trial_command=(
            "mpirun",
            "-np",
            "{workers}",
            "--bind-to",
            "none",
            "-x",
            "PATH",
            "-x",
            "PYTHONUNBUFFERED",
        ),
    ),
    Launcher(
        name="hydra",
        what="MPICH's and Intel MPI's mpiexec (Hydra, PMI)",
        started_by="PMI_SIZE",
        rank="PMI_RANK",
        size="PMI_SIZE",
        local_rank=None,
        local_size="MPI_LOCALNRANKS",
        mpi=True,
    ),
    Launcher(
        name="pmix",
        what="a PMIx launcher (srun --mpi=pmix): no size of its own in the environment",
        started_by="PMIX_RANK",
        rank="PMIX_RANK",
        size=None,
        local_rank=None,
        local_size=None,
        mpi=True,
    ),
    Launcher(
        name="srun",
        what="SLURM's srun (its MPI, if any, is another entry's: --mpi=pmix sets PMIx's variables)",
        started_by=None,
        rank="SLURM_PROCID",
        size="SLURM_STEP_NUM_TASKS",
        local_rank="SLURM_LOCALID",
        local_size=None,
        nodes="SLURM_STEP_NUM_NODES",  # the nodes of the step, not of the allocation
        # It passes SIGUSR1 on to every task (launch/slurm.sbatch forwards SLURM's stops as that).
        stop_signal=signal.SIGUSR1,
    ),
    Launcher(
        name="local-rank",
        what="a launcher that sets LOCAL_RANK alone (torchrun's name for it)",
        started_by=None,
        rank=None,
        size=None,
        local_rank="LOCAL_RANK",
        local_size=None,
    ),
)

# The launchers a sweep may run its trials with (the sweep file's `launcher`).
SWEEP_LAUNCHERS = tuple(entry.name for entry in TABLE if entry.trial_command)


def named(name: str) -> Launcher:
    """The entry called ``name``.

    Raises:
        KeyError: no launcher has that name.
    """
    for entry in TABLE:
        if entry.name == name:
            return entry
    raise KeyError(name)


def variables(field: str, where=None) -> tuple[str, ...]:
    """The variables the entries name in ``field`` (one of ``VARIABLES``), first come first, once each.

    ``where``: only the entries for which it is true.
    """
    found = (getattr(entry, field) for entry in TABLE if where is None or where(entry))
    return tuple(dict.fromkeys(v for v in found if v))


def pairs(first: str, second: str) -> tuple[tuple[str, str], ...]:
    """(``first``, ``second``) variables of the entries that name both, in order, once each."""
    found = ((getattr(entry, first), getattr(entry, second)) for entry in TABLE)
    return tuple(dict.fromkeys((a, b) for a, b in found if a and b))


def launcher_rank(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """Rank and size from the launcher's environment, before Horovod starts; (0, 1) under none.

    In an elastic job this is the rank the process started with; Horovod may
    give it another one later.
    """
    env = os.environ if env is None else env
    for rank_var, size_var in pairs("rank", "size"):
        if rank_var in env and size_var in env:
            return int(env[rank_var]), int(env[size_var])
    return 0, 1


def elastic_job(env: Mapping[str, str] | None = None) -> bool:
    """Started by an elastic launcher (horovodrun's elastic mode)."""
    env = os.environ if env is None else env
    return any(env.get(var) == "1" for var in variables("started_by", lambda entry: entry.elastic))


def trial_command(name: str, workers: int, python: str) -> list[str]:
    """The launcher ``name``'s words that start a sweep trial's job of ``workers`` ranks.

    Raises:
        KeyError: no launcher of that name, or one a sweep cannot use.
    """
    words = named(name).trial_command
    if not words:
        raise KeyError(name)
    return [word.format(python=python, workers=workers) for word in words]
