"""The CPUs a rank may use: its affinity mask and its cgroup's CPU quota, not the machine's count.

Real limits on real processes: ``taskset`` for the mask; a cgroup made for
the test (v1 ``cpu.cfs_quota_us`` or v2 ``cpu.max``, whichever this kernel
mounts; root) for the quota. ``hvd-train doctor`` shows the choice, and a
training run records it in ``summary.json``.
"""

import contextlib
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import BIN, TINY, output_of, read_json, run, run_at_once, unavailable


@pytest.fixture
def two_cpus():
    """Linux's affinity masks and 2 CPUs or more, to leave one out (HVD_TRAIN_REQUIRE=cpus makes it a must)."""
    if not hasattr(os, "sched_getaffinity"):
        unavailable("cpus", "CPU affinity masks are Linux's")
    if (os.cpu_count() or 1) < 2:
        unavailable("cpus", "needs 2 CPUs or more, to leave one out or set a quota below them")


HVD_TRAIN = [str(BIN / "hvd-train")]
# TINY without its --threads-per-rank, so that the run picks its own number.
at = TINY.index("--threads-per-rank")
AUTO = TINY[:at] + TINY[at + 2 :]


def doctor_cpus(prefix=(), proc=None):
    """The cpus section of ``hvd-train doctor`` run under ``prefix`` (or of its finished ``proc``)."""
    proc = proc or run([*prefix, *HVD_TRAIN, "doctor"], timeout=120)
    assert proc.returncode == 0, output_of(proc)
    lines = proc.stdout.split("cpus\n", 1)[1].split("\nnetwork", 1)[0]
    return dict(line.split(None, 1) for line in lines.splitlines())


def test_a_taskset_mask_sets_the_threads(two_cpus, demo_small, tmp_path):
    machine = os.cpu_count()
    out = tmp_path / "run"
    # Three processes, each with its own affinity, at once (two of them on one core).
    free, one, proc = run_at_once(
        [*HVD_TRAIN, "doctor"],
        ["taskset", "-c", "0", *HVD_TRAIN, "doctor"],
        ["taskset", "-c", "0", *HVD_TRAIN, "train", "--data", demo_small, "--output", out, *AUTO],
    )
    free, one = doctor_cpus(proc=free), doctor_cpus(proc=one)
    assert free["affinity"] == str(machine) and free["threads"].startswith(f"{machine} per rank, from the affinity")
    assert one["affinity"].startswith("1 (narrower than its parent's") and one["threads"].startswith("1 per rank")
    assert proc.returncode == 0, output_of(proc)
    cpu = read_json(out / "summary.json")["cpu"]
    assert cpu["threads"] == 1 and cpu["affinity_cpus"] == 1 and cpu["affinity_own"] is True, cpu
    assert cpu["machine_cpus"] == machine and cpu["source"] == "affinity mask"


def _read(path):
    return path.read_text() if path.exists() else ""


@contextlib.contextmanager
def cgroup(controller: str, v1_limits: dict, v2_limits: dict):
    """A cgroup with these limits (v1 or v2, as mounted here); yields a command prefix that runs a program in it."""
    if os.geteuid() != 0:
        unavailable("root", "making a cgroup needs root")
    name = f"hvd-{controller}-{uuid.uuid4().hex[:6]}"
    v1, v2 = Path("/sys/fs/cgroup") / controller, Path("/sys/fs/cgroup")
    if (v1 / next(iter(v1_limits))).exists():
        folder, limits = v1 / name, v1_limits
    elif controller in _read(v2 / "cgroup.controllers").split():
        folder, limits = v2 / name, v2_limits
    else:
        unavailable("root", f"no cgroup {controller} controller is mounted here")
    folder.mkdir()
    for file, value in limits.items():
        (folder / file).write_text(value)
    try:
        yield ["sh", "-c", f'echo $$ > {folder}/cgroup.procs && exec "$@"', "in-cgroup"]
    finally:
        # What is left of the runs (none, normally), then the cgroup once the kernel has let them go:
        # rmdir right after the last process ended failed once with EBUSY.
        deadline = time.time() + 30
        while pids := (folder / "cgroup.procs").read_text().split():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            assert time.time() < deadline, f"processes {pids} stay in {folder}"
            time.sleep(0.1)
        while True:
            try:
                folder.rmdir()
                break
            except OSError:
                assert time.time() < deadline, f"{folder} stays busy"
                time.sleep(0.1)


@pytest.fixture
def one_cpu_cgroup():
    """A cgroup limited to 1 CPU of quota."""
    with cgroup(
        "cpu", {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}, {"cpu.max": "100000 100000"}
    ) as c:
        yield c


def test_a_cgroup_cpu_quota_sets_the_threads(two_cpus, one_cpu_cgroup, demo_small, tmp_path):
    found = doctor_cpus(one_cpu_cgroup)
    assert found["cgroup"] == "quota of 1 CPUs", found
    assert found["threads"].startswith("1 per rank, from the cgroup quota"), found
    out = tmp_path / "run"
    proc = run([*one_cpu_cgroup, *HVD_TRAIN, "train", "--data", demo_small, "--output", out, *AUTO])
    assert proc.returncode == 0, output_of(proc)
    cpu = read_json(out / "summary.json")["cpu"]
    assert cpu["threads"] == 1 and cpu["cgroup_quota"] == 1.0 and cpu["source"] == "cgroup quota", cpu


def test_the_room_for_memory_is_the_hosts_or_less_under_a_cgroup_limit():
    """What ``--head-save auto`` weighs a whole model against: MemAvailable, or a cgroup limit less its use."""
    program = [
        sys.executable,
        "-c",
        "from hvd_train.distributed.memory import room; r = room(); print(r.bytes, r.source, sep=',')",
    ]
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    free, source = run(program).stdout.strip().split(",")
    assert source == "host" and 0 < int(free) <= int(meminfo["MemTotal"].split()[0]) * 1024
    limit = 2**30
    with cgroup("memory", {"memory.limit_in_bytes": str(limit)}, {"memory.max": str(limit)}) as in_cgroup:
        proc = run([*in_cgroup, *program])
    assert proc.returncode == 0, output_of(proc)
    free, source = proc.stdout.strip().split(",")
    # The limit less what the cgroup holds already: this Python and what it imported.
    assert source == "cgroup limit" and limit - 2**28 < int(free) < limit, proc.stdout
