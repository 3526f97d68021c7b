"""This host's name, as Horovod's Gloo controller needs it.

Horovod 0.28.1's Gloo controller makes the device of every process set
from this host's name (``gethostname()`` and a lookup of it), whatever
``--network-interface`` says. Where the name does not resolve, that lookup
fails and the process dies with a segmentation fault inside ``hvd.init()``;
where it resolves to loopback, the other hosts cannot reach this one.

* Single-host job, name unresolvable: the rank re-executes itself with a
  tiny preload library (built by ``launch/install.sh``) under which
  ``gethostname()`` answers ``localhost``, so Gloo binds to loopback, and
  rank 0 says so in one line.
* Single-host job, name resolves to loopback: nothing to change; rank 0
  says that Horovod uses loopback.
* Multi-host Gloo job, name unresolvable or loopback: every affected rank
  stops before ``hvd.init()`` with one line naming the fix.

The MPI controller (plain ``mpirun``, ``horovodrun --mpi``) does not build
Gloo devices, so none of this applies there.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
from pathlib import Path

from hvd_train.errors import UserError

# Set in the environment of a rank re-executed with the preload library.
SHIM_FLAG = "HVD_TRAIN_LOOPBACK_HOSTNAME"
SHIM_NAME = "gethostname.so"


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


def resolve(name: str | None = None) -> Resolution:
    name = name or socket.gethostname()
    try:
        return Resolution(name, socket.gethostbyname(name))
    except OSError:
        return Resolution(name, None)


def shim_path() -> Path:
    """Where launch/install.sh puts the preload library: inside the environment."""
    return Path(sys.prefix) / "lib" / "hvd_train" / SHIM_NAME


def _gloo_job() -> tuple[bool, bool]:
    """(a Gloo-controller job, it spans several machines), from the launcher's environment."""
    env = os.environ
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env or env.get("HOROVOD_CONTROLLER") == "gloo"
    if not gloo:
        return False, False
    rendezvous = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "")
    if rendezvous.startswith("127.") or rendezvous in ("localhost", "::1"):
        # Every rank reaches the rendezvous over loopback: all run on this
        # machine, even where horovodrun counts "localhost" and "127.0.0.1" as two hosts.
        return True, False
    if env.get("HOROVOD_ELASTIC") == "1":
        return True, True  # hosts may join later
    if "HOROVOD_CROSS_SIZE" in env:
        return True, int(env["HOROVOD_CROSS_SIZE"]) > 1
    return True, int(env.get("HOROVOD_LOCAL_SIZE", "1")) != int(env.get("HOROVOD_SIZE", "1"))


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
            unresolvable name.
    """
    gloo, multi = _gloo_job()
    if not gloo:
        return None
    if os.environ.get(SHIM_FLAG):
        return (
            f"this host's name {os.environ[SHIM_FLAG]!r} does not resolve; single-host job, "
            "so Horovod uses loopback (localhost)"
        )
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
    env = dict(os.environ)
    env[SHIM_FLAG] = found.name
    env["LD_PRELOAD"] = ":".join(filter(None, [str(shim), env.get("LD_PRELOAD", "")]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "hvd_train", *sys.argv[1:]], env)
    raise AssertionError("unreachable")
