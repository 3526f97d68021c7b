"""A real SLURM cluster on one machine for the tests: munge, one slurmctld, two slurmd (root only).

Debian's ``slurm-wlm`` and ``munge`` (installed with the other test
dependencies by launch/install.sh). Everything lives in one folder: the
configuration, munge's key and socket, the daemons' state, logs and pid
files; nothing under /etc or /run is touched, and every daemon is stopped
when the context ends. Clients reach this cluster through ``SLURM_CONF``
(``cluster.env``).

The two nodes ``n1`` and ``n2`` are two ``slurmd -N`` on this host, each
with its own port and spool folder. Each has as many CPUs as the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
# SLURM starts a requeued job no sooner than this many seconds after (22.05: AuthInfo's
# cred_expire, default 120 s); SLURM's smallest here, so that a requeue test waits less.
CRED_EXPIRE = 5
# MinJobAge=5 (seconds a finished job is kept): `sbatch --wait` polls every 2 s while it is
# at most 5 (then 8 s, then 32 s: a finished job would be seen up to half a minute late).


class Unavailable(Exception):
    """A cluster cannot be made here; the message says why."""


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []

    def run(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Runs a SLURM client command (``scontrol``, ``sinfo``, ...) against this cluster."""
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env}
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}\n{self.logs()}")
        return done

    def logs(self, lines: int = 30) -> str:
        parts = []
        for log in sorted(self.root.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout
        return dict(line.split() for line in out.splitlines() if line.strip())

    def job_state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return ""

    def wait_for(self, what: str, test, timeout: float = 60, interval: float = 0.2):
        deadline = time.time() + timeout
        while True:
            value = test()
            if value:
                return value
            if time.time() > deadline:
                raise RuntimeError(f"the SLURM cluster: no {what} after {timeout} s\n{self.logs()}")
            time.sleep(interval)


def _write_config(root: Path, cpus: int) -> None:
    ctld_port, *node_ports = _free_ports(1 + len(NODES))
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs={cpus} State=UNKNOWN"
        for n, p in zip(NODES, node_ports)
    )
    (root / "slurm.conf").write_text(
        f"""ClusterName=hvdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire={CRED_EXPIRE}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
JobRequeue=1
KillWait=30
MinJobAge=5
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
{nodes}
PartitionName=cpu Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""
    )


@contextlib.contextmanager
def cluster(root: Path):
    """Yields a running :class:`Cluster` whose files are in ``root``; stops every daemon after.

    Raises:
        Unavailable: not root, or SLURM / munge are not installed.
    """
    if os.geteuid() != 0:
        raise Unavailable("the test SLURM cluster runs its daemons as root (CI runs as root)")
    missing = [p for p in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(p) is None]
    if missing:
        raise Unavailable(f"not installed: {', '.join(missing)} (Debian's slurm-wlm and munge; make install adds them)")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    (root / "state").mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    _write_config(root, os.cpu_count() or 1)
    made = Cluster(root)

    def daemon(*args: str) -> None:
        made.daemons.append(
            subprocess.Popen(
                list(args),
                stdout=subprocess.DEVNULL,
                stderr=open(root / f"{Path(args[0]).name}-{len(made.daemons)}.err", "w"),
                env={**os.environ, **made.env},
                start_new_session=True,
            )
        )

    try:
        daemon(
            shutil.which("munged"), "--foreground", "--force", f"--socket={root}/munge.socket",
            f"--key-file={key}", f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        )  # fmt: skip
        made.wait_for("munge socket", lambda: (root / "munge.socket").exists(), timeout=20)
        daemon(shutil.which("slurmctld"), "-D", "-i", "-f", str(made.conf))
        for node in NODES:
            # Each node its own copy of the configuration, beside its own mpi.conf: the PMIx
            # plugin's client folders are named by job and step only, so two nodes on one host
            # need different bases.
            folder = root / node
            (folder / "pmix").mkdir(parents=True, exist_ok=True)
            (root / f"spool-{node}").mkdir(exist_ok=True)
            shutil.copy(made.conf, folder / "slurm.conf")
            (folder / "mpi.conf").write_text(f"PMIxCliTmpDirBase={folder / 'pmix'}\n")
            daemon(shutil.which("slurmd"), "-D", "-N", node, "-f", str(folder / "slurm.conf"))
        made.wait_for(
            "idle nodes",
            lambda: (
                (s := made.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)).returncode == 0
                and sorted(line.split()[1] for line in s.stdout.splitlines() if line.strip()) == ["idle"] * len(NODES)
            ),
            timeout=60,
        )
        yield made
    finally:
        with contextlib.suppress(Exception):
            made.run("scancel", "--full", "--signal=KILL", "-u", "root", check=False, timeout=20)
        for proc in reversed(made.daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in made.daemons:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        _kill_the_rest(root)


def _kill_the_rest(root: Path) -> None:
    """Ends what outlives slurmd (step daemons of a cancelled job, their tasks): every process of this cluster.

    Each of them has ``SLURM_CONF`` set to a file of this cluster's folder: the daemons and the
    jobs submitted to them to the cluster's, a step daemon to its node's copy.
    """
    mine = f"SLURM_CONF={root}/".encode()
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            environ = (folder / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(mine) for v in environ) and int(folder.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(folder.name), signal.SIGKILL)
