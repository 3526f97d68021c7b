"""The launchers' table: every entry complete, and every place that reads a launcher reads it there.

Each reader is given a made-up environment (a dict) holding one entry's
variables at a time, so an entry the reader skipped, or a list of names of
its own that lacks a launcher, fails here.
"""

from __future__ import annotations

import dataclasses
import re
import signal
import sys
import threading

import pytest

from hvd_train.commands import doctor
from hvd_train.distributed import hostname, launchers
from hvd_train.distributed.launchers import TABLE

NAME = re.compile(r"[A-Z][A-Z0-9_]*\Z")


def with_(field: str) -> list:
    return [entry for entry in TABLE if getattr(entry, field)]


def name_of(entry) -> str:
    return entry.name


def test_every_entry_is_complete():
    assert len({entry.name for entry in TABLE}) == len(TABLE), "one entry per name"
    for entry in TABLE:
        assert dataclasses.is_dataclass(entry) and entry.name and entry.what, entry
        named = [getattr(entry, field) for field in launchers.VARIABLES]
        assert any(named), f"{entry.name} names no variable"
        assert all(v is None or NAME.match(v) for v in named), entry
        if entry.mpi or entry.elastic:
            assert entry.started_by, f"{entry.name}: nothing tells that it started the process"
        if entry.size or entry.local_size:
            assert entry.rank or entry.local_rank, entry
        assert entry.stop_signal is None or entry.stop_signal in signal.Signals, entry
        if entry.trial_command:
            assert entry.stop_signal, f"{entry.name}: a sweep could not stop its trials"
            assert "{workers}" in entry.trial_command, entry
    with pytest.raises(dataclasses.FrozenInstanceError):
        TABLE[0].rank = "RANK"  # type: ignore[misc]


def test_the_order_of_precedence_is_the_one_each_place_had():
    assert launchers.pairs("rank", "size") == (
        ("HOROVOD_RANK", "HOROVOD_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    )
    assert launchers.pairs("local_size", "size") == (
        ("HOROVOD_LOCAL_SIZE", "HOROVOD_SIZE"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),
        ("MPI_LOCALNRANKS", "PMI_SIZE"),
    )
    assert launchers.variables("local_rank") == (
        "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK",
    )  # fmt: skip
    assert launchers.variables("local_size") == ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    assert launchers.variables("started_by") == (
        "HOROVOD_SIZE", "HOROVOD_ELASTIC", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
    )  # fmt: skip
    assert launchers.variables("started_by", lambda e: e.mpi) == ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
    assert launchers.variables("nodes") == ("SLURM_STEP_NUM_NODES",)


@pytest.mark.parametrize("entry", [e for e in TABLE if e.rank and e.size], ids=name_of)
def test_the_log_reads_every_launchers_rank_and_size(entry):
    assert launchers.launcher_rank({entry.rank: "3", entry.size: "5"}) == (3, 5)
    assert launchers.launcher_rank({entry.rank: "3"}) == (0, 1)  # a rank without its size is not read


def test_the_first_launcher_of_the_table_wins_and_none_is_rank_0_of_1():
    env = {}
    for i, entry in enumerate(e for e in TABLE if e.rank and e.size):
        env.setdefault(entry.rank, str(i + 1))  # horovodrun's elastic mode shares its variables
        env.setdefault(entry.size, "9")
    assert launchers.launcher_rank(env) == (1, 9)
    assert launchers.launcher_rank({}) == (0, 1)


@pytest.mark.parametrize("entry", [e for e in TABLE if e.local_size and e.size], ids=name_of)
def test_hostname_reads_every_launchers_local_size_and_size(entry):
    assert hostname.spans_hosts({entry.local_size: "2", entry.size: "4"}) is True
    assert hostname.spans_hosts({entry.local_size: "4", entry.size: "4"}) is False


@pytest.mark.parametrize("entry", with_("nodes"), ids=name_of)
def test_hostname_reads_every_launchers_nodes(entry):
    assert hostname.spans_hosts({entry.nodes: "2"}) is True
    assert hostname.spans_hosts({entry.nodes: "1"}) is False
    assert hostname.spans_hosts({}) is None


@pytest.mark.parametrize("entry", with_("elastic"), ids=name_of)
def test_an_elastic_launchers_gloo_job_may_span_hosts(entry):
    env = {"HOROVOD_CONTROLLER": "gloo", entry.local_size: "2", entry.size: "2"}
    assert hostname._gloo_job(env) == (True, False)
    assert hostname._gloo_job({**env, entry.started_by: "1"}) == (True, True)
    assert launchers.elastic_job({entry.started_by: "1"}) and not launchers.elastic_job({entry.started_by: "0"})


@pytest.mark.parametrize("entry", with_("local_rank"), ids=name_of)
def test_doctor_reads_every_launchers_local_rank(entry):
    assert doctor._local_rank({entry.local_rank: "3"}) == 3
    assert doctor._local_rank({}) == 0


@pytest.mark.parametrize("entry", with_("local_size"), ids=name_of)
def test_doctor_reads_every_launchers_local_size(entry):
    assert doctor._local_size({entry.local_size: "3"}) == 3
    assert doctor._local_size({}) == 1


def test_start_knows_every_launcher_and_which_are_mpi():
    from hvd_train.distributed import start

    assert start.one_process_job({}) and not start.launched_by_mpi({})
    for entry in with_("started_by"):
        env = {entry.started_by: "1"}
        assert not start.one_process_job(env), entry.name
        assert start.launched_by_mpi(env) is entry.mpi, entry.name
        assert not start.launched_by_mpi({**env, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1"}), entry.name


def test_a_sweep_may_use_the_launchers_the_table_says_how_to_start_a_trial_with():
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec

    assert spec.LAUNCHERS == launchers.SWEEP_LAUNCHERS == tuple(map(name_of, with_("trial_command")))
    assert spec.LAUNCHERS == ("horovodrun", "mpirun")
    with pytest.raises(UserError) as refused:
        spec.parse({"search": {"optim.base_lr": [0.1]}, "launcher": "srun"})
    message = str(refused.value)
    assert "`launcher` must be one of horovodrun, mpirun." in message and "\n" not in message, message


@pytest.mark.parametrize("name", launchers.SWEEP_LAUNCHERS)
def test_a_trials_command_and_stop_are_its_launchers(name, tmp_path):
    from hvd_train.experiments import spec
    from hvd_train.experiments.trial import Slot, TrialJob

    sweep = spec.Sweep(train={}, search={}, launcher=name, workers=2)
    job = TrialJob(sweep, str(tmp_path), {}, Slot(0, (0, 1)), threading.Event())
    train = [sys.executable, "-m", "hvd_train", "train", "--config", str(tmp_path / "trial.yaml")]
    expected = {
        "horovodrun": [sys.executable, "-m", "hvd_train", "launch", "-np", "2", "--gloo"],
        "mpirun": ["mpirun", "-np", "2", "--bind-to", "none", "-x", "PATH", "-x", "PYTHONUNBUFFERED"],
    }[name]
    assert job.command() == ["taskset", "-c", "0,1", *expected, *train]
    assert job.stop_signal() == {"horovodrun": signal.SIGTERM, "mpirun": signal.SIGUSR1}[name]
    assert job.stop_signal() == launchers.named(name).stop_signal
