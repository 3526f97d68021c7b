"""The CPUs this process may use, as the scheduler gave them (Linux).

``os.cpu_count()`` is the machine's, not the process's. A rank may be held
to fewer by its **affinity mask** (``taskset``, ``mpirun --bind-to core``,
SLURM's ``--cpus-per-task`` with task binding, ``docker --cpuset-cpus``)
and by a **CPU quota** of its cgroup (``docker --cpus``, a Kubernetes CPU
limit): the smaller of the two counts.

Which of them the ranks of a host share: a mask narrower than the parent
process's was set for this rank alone (a launcher binding each rank), so it
is not divided; a mask the parent has too (``taskset -c 0-7 horovodrun``, a
container's cpuset), and a quota, hold for all ranks of the host and are.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Budget:
    """Threads for one rank, and where the number came from (``summary.json``'s ``cpu``)."""

    threads: int
    source: str  # "affinity mask", "cgroup quota" or "--threads-per-rank"
    machine_cpus: int
    affinity_cpus: int
    affinity_own: bool
    cgroup_quota: float | None
    local_ranks: int

    def to_json(self) -> dict:
        return asdict(self)


def _affinity(pid: int) -> set[int] | None:
    try:
        return set(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """cgroup mounts: (root within the hierarchy, mount point, fs type, super options)."""
    found = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        fstype, options = fields[sep + 1], set(fields[sep + 3].split(",")) if len(fields) > sep + 3 else set()
        if fstype in ("cgroup", "cgroup2"):
            found.append((fields[3], fields[4], fstype, options))
    return found


def _folders(mount_root: str, mount_point: str, path: str) -> list[Path]:
    """The cgroup folders from this process's up to the mount point (the limits of all hold)."""
    relative = os.path.relpath(path, mount_root) if path.startswith(mount_root) else None
    if relative is None or relative.startswith(".."):
        return [Path(mount_point)]  # a cgroup namespace: the mount's root is this process's
    folder, top, chain = Path(mount_point) / relative, Path(mount_point), []
    while True:
        chain.append(folder)
        if folder == top or top not in folder.parents:
            return chain
        folder = folder.parent


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_paths() -> dict[str, str]:
    """This process's cgroup path by hierarchy: ``"v2"``, or each v1 controller's name (none if unreadable)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    paths = {}
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            paths["v2"] = path
        for c in controllers.split(","):
            paths[c] = path
    return paths


def cgroup_quota() -> float | None:
    """The smallest CPU quota (in CPUs) over this process's cgroups, v1 or v2; None when unlimited."""
    paths = _cgroup_paths()
    quotas = []
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup2" and "v2" in paths:
            for folder in _folders(root, point, paths["v2"]):
                value = _read(folder / "cpu.max")
                if value and not value.startswith("max"):
                    quota, period = value.split()
                    quotas.append(int(quota) / int(period))
        elif fstype == "cgroup" and "cpu" in options and "cpu" in paths:
            for folder in _folders(root, point, paths["cpu"]):
                quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                if quota and period and int(quota) > 0:
                    quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def budget(local_ranks: int = 1, threads_per_rank: int = 0) -> Budget:
    """Threads for this rank: its CPUs (mask or quota, the smaller) shared by the ranks that share them."""
    machine = os.cpu_count() or 1
    mask = _affinity(0)
    parent = _affinity(os.getppid())
    own = mask is not None and parent is not None and mask < parent
    count = len(mask) if mask else machine
    local_ranks = max(1, local_ranks)
    by_mask = count if own else count // local_ranks
    quota = cgroup_quota()
    by_quota = math.ceil(quota) // local_ranks if quota is not None else None
    if threads_per_rank:
        threads, source = threads_per_rank, "--threads-per-rank"
    elif by_quota is not None and by_quota < by_mask:
        threads, source = by_quota, "cgroup quota"
    else:
        threads, source = by_mask, "affinity mask"
    return Budget(max(1, threads), source, machine, count, own, quota, local_ranks)
