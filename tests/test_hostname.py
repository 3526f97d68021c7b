"""A host whose name does not resolve (containers, minimal hosts): no segfault, on any launcher.

The jobs run in a UTS namespace of their own (`unshare --uts`, root) whose
host name resolves nowhere, as in `docker run --network none`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from hvd_train.distributed import hostname

from conftest import BIN, HVD_TRAIN, TINY, launcher_command, output_of, read_json, run, unavailable

REPO = Path(__file__).resolve().parents[1]


def nowhere(*command, name: str = "") -> list:
    """``command`` on a host named ``nowhere-<pid>`` (a name no resolver knows), or ``name``."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        unavailable("root", "a UTS namespace needs root and util-linux's unshare (CI runs as root)")
    name = name or f"nowhere-{os.getpid()}"
    quoted = " ".join(f"'{c}'" for c in map(str, command))
    return ["unshare", "--uts", "bash", "-c", f"hostname {name} && exec {quoted}"]


@pytest.mark.multiprocess
def test_single_host_gloo_job_uses_loopback_and_says_so_once(demo_small, tmp_path):
    assert hostname.shim_path().exists(), "launch/install.sh builds the loopback fix"
    out = tmp_path / "run"
    program = [*HVD_TRAIN, "train", "--data", demo_small, "--output", out, *TINY, "--val-split", "0.2", "--epochs", "1"]
    proc = run(
        nowhere(*launcher_command("horovodrun-gloo", 2), *program), timeout=600, PATH=f"{BIN}:{os.environ['PATH']}"
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, output_of(proc)
    assert "Segmentation fault" not in text
    assert text.count("does not resolve; single-host job, so Horovod uses loopback (localhost)") == 1, text[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["val_images"] == 25


PROBE = Path(__file__).parent / "launched" / "hostname_probe.py"


@pytest.mark.multiprocess
@pytest.mark.parametrize("venv", ["its own path", "a path with a space and a colon"])
def test_the_loopback_fix_is_the_ranks_alone_and_keeps_the_interpreter_and_its_flags(tmp_path, venv):
    python = Path(sys.executable)
    if venv != "its own path":
        # The same environment under a path that LD_PRELOAD cannot carry (it splits at spaces and colons).
        link = tmp_path / "my envs: one"
        link.symlink_to(Path(sys.prefix), target_is_directory=True)
        python = link / "bin" / python.name
    seen = tmp_path / "seen"
    seen.mkdir()
    command = [*launcher_command("horovodrun-gloo", 2), python, "-X", "dev", PROBE, seen]
    proc = run(nowhere(*command), timeout=300, PATH=f"{BIN}:{os.environ['PATH']}")
    assert proc.returncode == 0, output_of(proc)
    name = f"nowhere-{os.getpid()}"
    for rank in (0, 1):
        rank_saw = read_json(seen / f"rank-{rank}.json")
        assert rank_saw["notice"] and "single-host job, so Horovod uses loopback" in rank_saw["notice"], rank_saw
        assert rank_saw["gethostname"] == "localhost", rank_saw  # Gloo binds to loopback
        assert rank_saw["real_name"] == rank_saw["loopback_for"] == name, rank_saw
        assert rank_saw["dev_mode"] is True, "the re-executed rank lost its interpreter's flags"
        assert rank_saw["prefix"] == str(python.parent.parent), rank_saw
        # The rank's children see the real host: no preload, no marker.
        assert rank_saw["env_flag"] is None and "gethostname" not in rank_saw["env_preload"], rank_saw
        assert rank_saw["child_gethostname"] == name and "gethostname" not in rank_saw["child_preload"], rank_saw


@pytest.mark.parametrize(
    "env, spans",
    [
        # horovodrun, 3 slots on host a and 1 on host b: every rank, whatever its slot, says several hosts.
        ({"HOROVOD_LOCAL_SIZE": "3", "HOROVOD_SIZE": "4", "HOROVOD_CROSS_SIZE": "1"}, True),
        ({"HOROVOD_LOCAL_SIZE": "1", "HOROVOD_SIZE": "4", "HOROVOD_CROSS_SIZE": "2"}, True),
        ({"HOROVOD_LOCAL_SIZE": "4", "HOROVOD_SIZE": "4", "HOROVOD_CROSS_SIZE": "1"}, False),
        # Open MPI's mpirun (HOROVOD_CONTROLLER=gloo under mpirun: no HOROVOD_* sizes at all).
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_SIZE": "4"}, True),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"}, False),
        # MPICH / Intel MPI (Hydra), SLURM's srun.
        ({"MPI_LOCALNRANKS": "1", "PMI_SIZE": "2"}, True),
        ({"SLURM_STEP_NUM_NODES": "2", "SLURM_NTASKS": "2"}, True),
        ({"SLURM_STEP_NUM_NODES": "1"}, False),
        ({}, None),  # no launcher says: unknown
    ],
)
def test_several_hosts_are_read_from_what_every_launcher_gives_every_rank(env, spans):
    assert hostname.spans_hosts(env) is spans


def test_an_unknown_gloo_launch_is_not_taken_for_a_single_host():
    # Gloo under a launcher that tells nothing: no preload is guessed (it would bind every host to loopback).
    assert hostname._gloo_job({"HOROVOD_CONTROLLER": "gloo"}) == (True, True)
    assert hostname._gloo_job({"HOROVOD_CONTROLLER": "gloo", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                               "OMPI_COMM_WORLD_SIZE": "2"}) == (True, False)  # fmt: skip


def multi_host_env(**extra) -> dict:
    """What horovodrun gives rank 0 of a job across two hosts (the job never gets further)."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.9.9.9",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "1",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_RANK": "0",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "1",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "2",
        **extra,
    }


def test_multi_host_gloo_job_stops_before_horovod_starts_with_one_line(demo_small, tmp_path):
    program = [*HVD_TRAIN, "train", "--data", demo_small, "--output", tmp_path / "run", *TINY]
    proc = run(nowhere(*program), timeout=120, **multi_host_env())
    assert proc.returncode == 2, output_of(proc)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "does not resolve" in errors[0] and "/etc/hosts" in errors[0], proc.stderr
    assert "--network-interface" in errors[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_multi_host_gloo_job_on_a_loopback_name_stops_too(demo_small, tmp_path):
    assert hostname.resolve("localhost").loopback
    program = [*HVD_TRAIN, "train", "--data", demo_small, "--output", tmp_path / "run", *TINY]
    proc = run(nowhere(*program, name="localhost"), timeout=120, **multi_host_env())
    assert proc.returncode == 2 and "(loopback)" in proc.stderr and "cannot reach" in proc.stderr, output_of(proc)


def test_launch_script_stops_a_multi_host_job_before_launching():
    proc = run(nowhere("bash", REPO / "launch" / "horovodrun.sh", "-H", "a:1,b:1", "--np", "2", "--", "train"))
    assert proc.returncode == 2, output_of(proc)
    assert "does not resolve" in proc.stderr and "/etc/hosts" in proc.stderr and "--network-interface" in proc.stderr
    assert "+ horovodrun" not in proc.stderr  # nothing was launched


def test_doctor_reports_an_unresolvable_name(tmp_path):
    proc = run(nowhere(*HVD_TRAIN, "doctor"), timeout=120)
    assert proc.returncode == 0, output_of(proc)
    assert "(does not resolve)" in proc.stdout and "uses loopback" in proc.stdout and "multi-host" in proc.stdout
