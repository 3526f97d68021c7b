"""Two hosts on one machine: network namespaces joined by a veth pair, one rank in each.

Each namespace has its own interface ``hvd0`` with its own address and its
own loopback, so ranks can only meet over ``hvd0``. A remote-shell agent
(``launched/netns-agent``) plays ssh: ``mpirun`` uses it as its rsh agent,
``horovodrun`` (Gloo) finds it as ``ssh`` on PATH. Both launches go through
``launch/mpirun.sh`` / ``launch/horovodrun.sh`` with the interface named
explicitly.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import netns
from conftest import TINY, output_of, read_json, run, unavailable

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
AGENT = Path(__file__).parent / "launched" / "netns-agent"
DUMP = Path(__file__).parent / "launched" / "train_and_dump.py"


@pytest.fixture(scope="module")
def hosts():
    """Namespaces ``a`` and ``b``, addresses 10.77.N.1 and 10.77.N.2 on ``hvd0``."""
    try:
        with netns.two_hosts() as made:
            yield made
    except netns.Unavailable as e:
        unavailable("netns", str(e))


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
        assert len(f0.files) == len(f1.files) > 10  # TINY has 17: 3 kernels, 4 arrays per BatchNorm, the head's 2
        assert all(np.array_equal(f0[k], f1[k]) for k in f0.files), "ranks ended with different weights"
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["weights_identical_across_ranks"] is True
    assert summary["val_images"] == 25


def program(demo_small, tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    out = tmp_path / "run"
    # TINY's one epoch: 6 steps, each an allreduce over hvd0, then the held-out images gathered.
    args = [DUMP, dump, "--data", demo_small, "--output", out, *TINY, "--val-split", "0.2"]
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
