"""This host's name, as Horovod's Gloo controller needs it.

Horovod 0.28.1's Gloo controller makes the device of every process set
from this host's name (``gethostname()`` and a lookup of it), whatever
``--network-interface`` says. Where the name does not resolve, that lookup
fails and the process dies with a segmentation fault inside ``hvd.init()``;
where it resolves to loopback, the other hosts cannot reach this one.

* Single-host job, name unresolvable: the rank re-executes itself (the same
  interpreter, flags and arguments) with a tiny preload library (built by
  ``launch/install.sh``) under which ``gethostname()`` answers
  ``localhost``, so Gloo binds to loopback, and rank 0 says so in one line.
  The preload is the rank's alone: once re-executed, the rank takes it and
  its marker out of its environment again, so the programs it starts see
  the real name.
* Single-host job, name resolves to loopback: nothing to change; rank 0
  says that Horovod uses loopback.
* Multi-host Gloo job, name unresolvable or loopback: every affected rank
  stops before ``hvd.init()`` with one line naming the fix.

Whether a job spans several hosts is read from what its launcher tells
every rank: horovodrun (``HOROVOD_LOCAL_SIZE``/``HOROVOD_SIZE``, its
rendezvous address), Open MPI (``OMPI_COMM_WORLD_LOCAL_SIZE``/``_SIZE``),
MPICH and Intel MPI (``MPI_LOCALNRANKS``/``PMI_SIZE``) and SLURM's srun
(``SLURM_STEP_NUM_NODES``, the nodes of the step, not of the allocation).
Each rank of a job reaches the same answer, whatever its slot count. A Gloo
job whose launcher says none of this counts as multi-host: no preload is
guessed.

The MPI controller (plain ``mpirun``, ``horovodrun --mpi``) does not build
Gloo devices, so none of this applies there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from hvd_train.distributed import launchers
from hvd_train.errors import UserError

# Set in the environment of a rank re-executed with the preload library; taken out again once it runs.
SHIM_FLAG = "HVD_TRAIN_LOOPBACK_HOSTNAME"
SHIM_NAME = "gethostname.so"
# LD_PRELOAD separates entries with spaces and colons: a path with either cannot be preloaded.
_UNSAFE = (" ", ":", "\t")

# This process's real host name when it runs under the preload (else None).
_loopback_for: str | None = None


@dataclasses.dataclass(frozen=True)
class Resolution:
    name: str
    address: str | None  # None: the name does not resolve

    @property
    def loopback(self) -> bool:
        return self.address is not None and (self.address.startswith("127.") or self.address == "::1")

    def describe(self) -> str:
        if self.address is None:
            return f"this host's name {self.name!r} does not resolve"
        return f"this host's name {self.name!r} resolves to {self.address}" + (" (loopback)" if self.loopback else "")


def real_name() -> str:
    """This host's name, also under the preload (``uname``, which the preload leaves alone)."""
    return os.uname().nodename


def resolve(name: str | None = None) -> Resolution:
    name = name or real_name()
    try:
        return Resolution(name, socket.gethostbyname(name))
    except OSError:
        return Resolution(name, None)


def shim_path() -> Path:
    """Where launch/install.sh puts the preload library: inside the environment."""
    return Path(sys.prefix) / "lib" / "hvd_train" / SHIM_NAME


def _sizes(env) -> list[tuple[int, int]]:
    """(ranks on this host, ranks in the job) as each launcher present tells them."""
    found = []
    for local, world in launchers.pairs("local_size", "size"):
        try:
            found.append((int(env[local]), int(env[world])))
        except (KeyError, ValueError):
            continue
    return found


def spans_hosts(env=None) -> bool | None:
    """Whether this job's ranks run on more than one host, per its launcher; None if it does not say.

    Not ``HOROVOD_CROSS_SIZE``: that counts the ranks that share this
    rank's local rank, so a rank in a slot that only one host has reads 1.
    """
    env = os.environ if env is None else env
    sizes = _sizes(env)
    if sizes:  # the launcher that started this rank
        return any(local != world for local, world in sizes)
    for var in launchers.variables("nodes"):  # srun: the nodes of this step (not of the allocation)
        nodes = env.get(var, "")
        if nodes.isdigit():
            return int(nodes) > 1
    return None


def _gloo_job(env=None) -> tuple[bool, bool]:
    """(a Gloo-controller job, it spans several machines), from the launcher's environment."""
    env = os.environ if env is None else env
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or env.get("HOROVOD_CONTROLLER") == "gloo"
    if not gloo:
        return False, False
    rendezvous = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "")
    if rendezvous.startswith("127.") or rendezvous in ("localhost", "::1"):
        # Every rank reaches the rendezvous over loopback: all run on this
        # machine, even where horovodrun counts "localhost" and "127.0.0.1" as two hosts.
        return True, False
    if launchers.elastic_job(env):
        return True, True  # hosts may join later
    spans = spans_hosts(env)
    return True, spans is not False


def prepare_rank(argv_given: bool) -> str | None:
    """Called first thing in a rank, before TensorFlow or Horovod load.

    Args:
        argv_given: ``main()`` was called with explicit arguments (in-process
            use, as in tests): never re-execute then.

    Returns:
        The one-line notice rank 0 logs, or None.

    Raises:
        UserError: a multi-host Gloo job on a host whose name does not
            resolve to a reachable address, or no preload library to fix an
            unresolvable name (or one that did not load).
    """
    if SHIM_FLAG in os.environ:
        return _after_reexec()
    gloo, multi = _gloo_job()
    if not gloo:
        return None
    found = resolve()
    if multi:
        if found.address is None or found.loopback:
            raise UserError(
                f"{found.describe()}: Horovod's Gloo controller binds to that name's address, which the "
                f"other hosts cannot reach. Add '<address on the cluster network> {found.name}' to /etc/hosts "
                "and pass that network's interface with --network-interface (or launch with mpirun)"
            )
        return None
    if found.address is not None:
        return f"{found.describe()}; single-host job, Horovod uses loopback" if found.loopback else None
    shim = shim_path()
    if argv_given or not shim.exists():
        raise UserError(
            f"{found.describe()} and Horovod's Gloo controller crashes on that: add '127.0.0.1 {found.name}' "
            "to /etc/hosts, launch with mpirun, or reinstall with launch/install.sh (it builds the loopback fix)"
        )
    preload = str(_preloadable(shim))
    env = dict(os.environ)
    env[SHIM_FLAG] = found.name
    env["LD_PRELOAD"] = ":".join(filter(None, [preload, env.get("LD_PRELOAD", "")]))
    sys.stdout.flush()
    sys.stderr.flush()
    # The same interpreter with the same flags (-X, -W, ...) and arguments.
    os.execve(sys.executable, list(sys.orig_argv), env)
    raise AssertionError("unreachable")


def _after_reexec() -> str:
    """In the re-executed rank: checks the preload took, and keeps it from the rank's children."""
    global _loopback_for
    name = os.environ.pop(SHIM_FLAG)
    # prepare_rank put the library first; what follows is the launcher's own LD_PRELOAD.
    preload = os.environ.pop("LD_PRELOAD", "")
    ours = preload.split(":", 1)[0]
    rest = preload[len(ours) :].lstrip(": ")
    if rest:
        os.environ["LD_PRELOAD"] = rest
    if socket.gethostname() != "localhost":
        raise UserError(
            f"this host's name {name!r} does not resolve and the loopback fix ({shim_path()}) did not load; "
            f"add '127.0.0.1 {name}' to /etc/hosts or launch with mpirun"
        )
    _loopback_for = name
    return f"this host's name {name!r} does not resolve; single-host job, so Horovod uses loopback (localhost)"


def _preloadable(shim: Path) -> Path:
    """``shim``, or a copy of it at a path that LD_PRELOAD can carry (no space, no colon)."""
    if not any(c in str(shim) for c in _UNSAFE):
        return shim
    data = shim.read_bytes()
    for base in (tempfile.gettempdir(), "/tmp", "/dev/shm"):
        folder = Path(base) / f"hvd_train-{os.getuid()}"
        target = folder / f"gethostname-{hashlib.sha256(data).hexdigest()[:12]}.so"
        if any(c in str(target) for c in _UNSAFE):
            continue
        try:
            if not target.exists():
                folder.mkdir(mode=0o700, exist_ok=True)
                tmp = folder / f".{target.name}.{os.getpid()}"
                shutil.copyfile(shim, tmp)
                os.replace(tmp, target)
            return target
        except OSError:
            continue
    raise UserError(
        f"the loopback fix {shim} has a space or colon in its path, which LD_PRELOAD cannot carry, and no "
        f"temporary folder could take a copy; install into a virtual environment whose path has neither"
    )


def loopback_for() -> str | None:
    """This host's real name when this rank runs under the preload, else None."""
    return _loopback_for
