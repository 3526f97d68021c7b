"""Two hosts on one machine: network namespaces joined by a veth pair (root only).

Each namespace has an interface ``hvd0`` with its own address and its own
loopback, and its own /etc/hosts in which this machine's name resolves to
that address, as on a cluster. Used by the multi-host tests and by
benchmarks/planner.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import uuid
from pathlib import Path


class Unavailable(Exception):
    """Namespaces cannot be made here; the message says why."""


def ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@contextlib.contextmanager
def two_hosts():
    """Yields ``(namespaces, addresses)``: ``{"a": name, "b": name}`` and their addresses on ``hvd0``.

    Raises:
        Unavailable: not root, no iproute2, or the kernel refuses namespaces.
    """
    if os.geteuid() != 0:
        raise Unavailable("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None:
        raise Unavailable("iproute2 (`ip`) is not installed")
    tag = uuid.uuid4().hex[:6]
    ns = {"a": f"hvd-a-{tag}", "b": f"hvd-b-{tag}"}
    made = ip("netns", "add", ns["a"])
    if made.returncode != 0:
        raise Unavailable(f"cannot create a network namespace here: {made.stderr.strip()}")
    net = 10 + int(tag[:2], 16) % 200
    addr = {"a": f"10.77.{net}.1", "b": f"10.77.{net}.2"}
    etc = {side: Path("/etc/netns") / name for side, name in ns.items()}
    try:
        # As on a cluster, each host's name resolves to its own address (ip netns
        # exec mounts /etc/netns/NS/hosts over /etc/hosts). Horovod 0.28.1's Gloo
        # process-set context ignores --network-interface and binds to that address.
        for side in "ab":
            etc[side].mkdir(parents=True, exist_ok=True)
            (etc[side] / "hosts").write_text(f"127.0.0.1 localhost\n{addr[side]} {socket.gethostname()}\n")
        steps = [
            ("netns", "add", ns["b"]),
            ("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"),
            ("link", "set", f"va{tag}", "netns", ns["a"]),
            ("link", "set", f"vb{tag}", "netns", ns["b"]),
            ("-n", ns["a"], "link", "set", f"va{tag}", "name", "hvd0"),
            ("-n", ns["b"], "link", "set", f"vb{tag}", "name", "hvd0"),
        ]
        for side in "ab":
            steps += [
                ("-n", ns[side], "addr", "add", f"{addr[side]}/24", "dev", "hvd0"),
                ("-n", ns[side], "link", "set", "hvd0", "up"),
                ("-n", ns[side], "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = ip(*step)
            if done.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {done.stderr}")
        yield ns, addr
    finally:
        for name in ns.values():
            ip("netns", "del", name)
        for folder in etc.values():
            shutil.rmtree(folder, ignore_errors=True)


def shape(ns: dict[str, str], rate: str) -> None:
    """Limits ``hvd0`` of both namespaces to ``rate`` (e.g. ``100mbit``) with a token bucket."""
    for name in ns.values():
        done = subprocess.run(
            ["ip", "netns", "exec", name, "tc", "qdisc", "replace", "dev", "hvd0", "root", "tbf", "rate", rate,
             "burst", "256kbit", "latency", "50ms"],
            capture_output=True,
            text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"tc in {name}: {done.stderr.strip()}")
