"""The memory this process may still take (Linux): the host's, and its cgroups' limits.

The host's is ``MemAvailable`` (free memory and what the kernel can
reclaim). A cgroup's limit (``docker --memory``, a Kubernetes memory limit,
SLURM's ``--mem`` with cgroup enforcement) holds besides: what is left under
it is its limit less what the cgroup uses already. The smaller bound wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hvd_train.distributed.cpus import _cgroup_paths, _folders, _mounts, _read


@dataclass(frozen=True)
class Room:
    """Bytes this process may still allocate, and which bound gave the number."""

    bytes: int
    source: str  # "host" or "cgroup limit"

    def __str__(self) -> str:
        return f"{self.bytes / 2**30:.1f} GiB ({'the host' if self.source == 'host' else 'its cgroup limit'})"


def _host() -> int | None:
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_rooms() -> list[int]:
    """What each of this process's cgroups with a memory limit leaves, v1 or v2."""
    paths = _cgroup_paths()
    rooms = []
    for root, point, fstype, options in _mounts():
        if fstype == "cgroup2" and "v2" in paths:
            names, folders = ("memory.max", "memory.current"), _folders(root, point, paths["v2"])
        elif fstype == "cgroup" and "memory" in options and "memory" in paths:
            names, folders = ("memory.limit_in_bytes", "memory.usage_in_bytes"), _folders(root, point, paths["memory"])
        else:
            continue
        for folder in folders:
            limit, used = _read(folder / names[0]), _read(folder / names[1])
            # v2 says "max" for no limit; v1 a number near 2**63.
            if limit and used and limit != "max" and int(limit) < 2**60:
                rooms.append(max(0, int(limit) - int(used)))
    return rooms


def room() -> Room:
    """Bytes this process may still allocate: the host's available memory, or less under a cgroup limit."""
    host = _host()
    rooms = _cgroup_rooms()
    if rooms and (host is None or min(rooms) < host):
        return Room(min(rooms), "cgroup limit")
    return Room(host if host is not None else 2**62, "host")
