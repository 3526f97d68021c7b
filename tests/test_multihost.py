"""Two hosts on one machine: network namespaces joined by a veth pair, one rank in each.

Each namespace has its own interface ``hvd0`` with its own address and its
own loopback, so ranks can only meet over ``hvd0``. A remote-shell agent
(``launched/netns-agent``) plays ssh: ``mpirun`` uses it as its rsh agent,
``horovodrun`` (Gloo) finds it as ``ssh`` on PATH. Both launches go through
``launch/mpirun.sh`` / ``launch/horovodrun.sh`` with the interface named
explicitly.
"""

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY, output_of, read_json, run

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
AGENT = Path(__file__).parent / "launched" / "netns-agent"
DUMP = Path(__file__).parent / "launched" / "train_and_dump.py"


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def hosts():
    """Namespaces ``a`` and ``b``, addresses 10.77.N.1 and 10.77.N.2 on ``hvd0``."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = uuid.uuid4().hex[:6]
    ns = {"a": f"hvd-a-{tag}", "b": f"hvd-b-{tag}"}
    made = _ip("netns", "add", ns["a"])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here: {made.stderr.strip()}")
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
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield ns, addr
    finally:
        for name in ns.values():
            _ip("netns", "del", name)
        for folder in etc.values():
            shutil.rmtree(folder, ignore_errors=True)


def env_for(ns, addr, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ssh").unlink(missing_ok=True)
    (bin_dir / "ssh").symlink_to(AGENT)  # horovodrun calls `ssh HOST CMD`
    return {
        "HVD_TRAIN_NETNS_MAP": f"{addr['a']}={ns['a']} {addr['b']}={ns['b']}",
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HVD_TRAIN": sys.executable,
        "EXPECTED_SIZE": "2",
    }


def check_two_hosts(out, dump, proc, addr):
    with np.load(dump / "weights-rank0.npz") as f0, np.load(dump / "weights-rank1.npz") as f1:
        assert len(f0.files) == len(f1.files) > 100
        assert all(np.array_equal(f0[k], f1[k]) for k in f0.files), "ranks ended with different weights"
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["weights_identical_across_ranks"] is True
    assert summary["val_images"] == 25


def program(demo_small, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    out = tmp_path / "run"
    args = [DUMP, dump, "--data", demo_small, "--output", out, *TINY, "--val-split", "0.2", "--epochs", "2"]
    return out, dump, args


def test_mpirun_across_two_hosts(hosts, demo_small, tmp_path):
    ns, addr = hosts
    out, dump, args = program(demo_small, tmp_path)
    cmd = [
        "ip", "netns", "exec", ns["a"],
        "bash", REPO / "launch" / "mpirun.sh",
        "--np", "2",
        "-H", f"{addr['a']}:1,{addr['b']}:1",
        "--network-interface", "hvd0",
        "--mpirun-arg", "--mca", "--mpirun-arg", "plm_rsh_agent", "--mpirun-arg", AGENT,
        "--", *args,
    ]  # fmt: skip
    proc = run(cmd, timeout=600, **env_for(ns, addr, tmp_path))
    assert proc.returncode == 0, output_of(proc)
    assert "btl_tcp_if_include hvd0" in proc.stderr  # the printed command names the interface
    check_two_hosts(out, dump, proc, addr)


def test_horovodrun_across_two_hosts(hosts, demo_small, tmp_path):
    # Gloo controller: horovodrun starts the remote rank with `ssh` (our agent).
    ns, addr = hosts
    out, dump, args = program(demo_small, tmp_path)
    cmd = [
        "ip", "netns", "exec", ns["a"],
        "bash", REPO / "launch" / "horovodrun.sh",
        "--np", "2",
        "-H", f"{addr['a']}:1,{addr['b']}:1",
        "--network-interface", "hvd0",
        "--", *args,
    ]  # fmt: skip
    proc = run(cmd, timeout=600, **env_for(ns, addr, tmp_path))
    assert proc.returncode == 0, output_of(proc)
    check_two_hosts(out, dump, proc, addr)
