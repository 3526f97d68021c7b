"""launch/slurm.sbatch on a real SLURM cluster (tests/slurm.py: munge, slurmctld, two slurmd).

The script is submitted as it is, with ``sbatch --wait`` on 2 nodes, one rank
each: it trains to identical weights on both nodes with exact held-out counts,
and each way SLURM stops a job (``scancel --signal=TERM``, the time limit's
early ``--signal=B:USR1@N``, ``scontrol requeue``) ends in a checkpoint and
exit 75; a requeued job resumes from it, and with --deterministic ends with
the weights of the uninterrupted job. An elastic job goes on without a node
drained under it.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import slurm
from conftest import BIN, TINY, output_of, read_json, start, unavailable

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "launch" / "slurm.sbatch"
DUMP = Path(__file__).parent / "launched" / "train_and_dump.py"
EXIT_PREEMPTED = 75
# The uninterrupted job and the one stopped twice, which must end with its weights: 6 epochs of 6
# steps of the tests' backbone. The first stop is asked for after step 4, the second 3 steps into
# the requeued job. SLURM takes a second or more to deliver a stop, and these steps are quick: in
# one run the stops came after steps 10 and 18, which leaves steps to train after both.
COMPARED_EPOCHS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        with slurm.cluster(tmp_path_factory.mktemp("slurm")) as made:
            yield made
    except slurm.Unavailable as e:
        unavailable("slurm", str(e))


# First, and sharing the machine: it starts no job (the cluster starts meanwhile); the others run jobs, alone.
def test_discover_slurm_leaves_out_a_drained_node(cluster):
    env = {**os.environ, **cluster.env, "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "1"}

    def discover():
        done = subprocess.run(["bash", REPO / "launch" / "discover-slurm.sh"], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert discover() == ["n1:1", "n2:1"]
    cluster.run("scontrol", "update", "nodename=n2", "state=drain", "reason=test")
    try:
        assert discover() == ["n1:1"]
    finally:
        cluster.run("scontrol", "update", "nodename=n2", "state=resume")
    cluster.wait_for("n2 back", lambda: cluster.node_states().get("n2") == "idle")
    without = {k: v for k, v in env.items() if k != "SLURM_JOB_NODELIST"}
    done = subprocess.run(["bash", REPO / "launch" / "discover-slurm.sh"], capture_output=True, text=True, env=without)
    assert done.returncode != 0 and "inside a SLURM allocation" in done.stderr


def train_args(data, out, samples, epochs=3, tiny=TINY):
    return [
        "--data", data, "--output", out, *tiny, "--epochs", str(epochs), "--val-split", "0.2",
        "--deterministic", "--sample-log", samples,
    ]  # fmt: skip


def submit(cluster, folder, program, *sbatch_options, script=SCRIPT, **env):
    """``sbatch --wait [options] launch/slurm.sbatch -- PROGRAM`` from ``folder``; the job's log is job.log."""
    command = ["sbatch", "--wait", "--parsable", "-D", folder, "-o", folder / "job.log", *sbatch_options, script]
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", **cluster.env, **env}
    return start([*command, "--", *program], **env)


def finish(proc, cluster, folder, timeout=300):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.run("scancel", "-u", "root", check=False)
        stdout, stderr = proc.communicate()
        pytest.fail(f"sbatch --wait did not return within {timeout} s\n{log_of(folder)}\n{cluster.logs()}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def log_of(folder):
    path = folder / "job.log"
    return path.read_text(errors="replace") if path.exists() else "(no job log)"


def steps_done(samples, rank=0):
    return sum(len(p.read_text().splitlines()) for p in Path(samples).glob(f"rank-{rank}-*.jsonl"))


def wait_for_steps(proc, samples, steps, folder, timeout=240, rank=0):
    deadline = time.time() + timeout
    while steps_done(samples, rank) < steps:
        assert proc.poll() is None, f"the job ended before rank {rank}'s step {steps}\n{log_of(folder)}"
        assert time.time() < deadline, f"no step {steps} of rank {rank} after {timeout} s\n{log_of(folder)}"
        time.sleep(0.05)


def stop_lines(log, *hows):
    """The checkpoint of each stop in the job log, in order; stop i was by signal ``hows[i]`` (a regex).

    SLURM signals every rank, but not at once: a rank whose own signal comes after the ranks agreed
    to stop names the other rank's signal instead ("a signal to another rank"). One rank at least
    names the signal itself.
    """
    lines = [line for line in log.splitlines() if "stopped by" in line]
    assert len(lines) == 2 * len(hows), log  # one per rank and stop
    checkpoints = []
    for i, how in enumerate(hows):
        pair = lines[2 * i : 2 * i + 2]
        assert any(re.search(f"stopped by {how}", line) for line in pair), log
        assert all(re.search(f"stopped by ({how}|a signal to another rank)", line) for line in pair), log
        match = re.search(r"checkpoint (\S+); rerun the same command to continue", pair[0])
        assert match and all(match.group(0) in line for line in pair), log
        checkpoints.append(Path(match.group(1)))
    assert "Traceback" not in log, log
    return checkpoints


@pytest.fixture(scope="module")
def uninterrupted(cluster, demo_small, tmp_path_factory):
    """The script as it is on 2 nodes; returns the run's weights digest.

    Submitted from a checkout whose path holds a space: SLURM runs a copy of the script from its
    spool folder, which finds launch/_common.sh in the checkout from the job's ``Command=``.
    """
    folder = tmp_path_factory.mktemp("straight")
    checkout = folder / "a checkout"
    shutil.copytree(SCRIPT.parent, checkout / "launch")
    dump = folder / "dump"
    dump.mkdir()
    out = folder / "run"
    program = [DUMP, dump, *train_args(demo_small, out, folder / "samples", COMPARED_EPOCHS)]
    script = checkout / "launch" / SCRIPT.name
    proc = submit(cluster, folder, program, script=script, HVD_TRAIN=sys.executable, EXPECTED_SIZE="2")
    proc = finish(proc, cluster, folder)
    log = log_of(folder)
    assert proc.returncode == 0, f"{output_of(proc)}\n{log}"
    # The ranks ran where SLURM put them, one on each node of the allocation.
    assert sorted(re.findall(r"rank (\d)/2 dumped \d+ arrays on node (n\d)", log)) == [("0", "n1"), ("1", "n2")], log
    assert "slurm.sbatch: job " in log and ": 2 rank(s) on n1,n2" in log, log
    with np.load(dump / "weights-rank0.npz") as f0, np.load(dump / "weights-rank1.npz") as f1:
        assert len(f0.files) == len(f1.files) > 10  # the tests' backbone has 17
        assert all(np.array_equal(f0[k], f1[k]) for k in f0.files), "ranks ended with different weights"
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == 2 and summary["weights_identical_across_ranks"] is True
    assert summary["val_images"] == 25 and sum(map(sum, summary["val_confusion_matrix"])) == 25
    return summary["weights_digest"]


@pytest.mark.multiprocess
def test_the_script_as_it_is_trains_on_two_cpu_nodes(uninterrupted):
    assert re.fullmatch(r"[0-9a-f]{16}", uninterrupted)


@pytest.mark.multiprocess
def test_stops_from_slurm_checkpoint_and_the_requeued_job_ends_bit_identical(
    cluster, demo_small, tmp_path, uninterrupted
):
    # One job, stopped twice. scancel --signal=TERM signals the ranks and leaves the job running:
    # the script requeues it (HVD_TRAIN_REQUEUE=1). Once it trains again, scontrol requeue (an
    # admin, a preemption in REQUEUE mode) signals the job and requeues it itself.
    out, samples = tmp_path / "run", tmp_path / "samples"
    program = ["train", *train_args(demo_small, out, samples, COMPARED_EPOCHS)]
    proc = submit(cluster, tmp_path, program, HVD_TRAIN_REQUEUE="1")
    wait_for_steps(proc, samples, 4, tmp_path)
    job = proc_job_id(cluster)
    cluster.run("scancel", "--signal=TERM", job)
    cluster.wait_for("the requeued job", lambda: "(restart 1)" in log_of(tmp_path), timeout=120)
    stopped = steps_done(samples)
    wait_for_steps(proc, samples, stopped + 3, tmp_path)
    cluster.run("scontrol", "requeue", job)
    proc = finish(proc, cluster, tmp_path)
    log = log_of(tmp_path)
    assert proc.returncode == 0, f"{output_of(proc)}\n{log}"  # the twice requeued job's end
    # The second: SLURM's SIGTERM to the ranks, or the script's SIGUSR1 where the batch shell got it first.
    first, second = stop_lines(log, "SIGTERM", "SIG(TERM|USR1)")
    assert first != second, log
    assert re.search(r"srun: error: n1: task 0: Exited with exit code 75", log), log
    for restart, checkpoint in ((1, first), (2, second)):
        assert f"slurm.sbatch: job {job} (restart {restart}): 2 rank(s) on n1,n2" in log, log
        assert f"resuming from {checkpoint}" in log, log
    assert read_json(out / "summary.json")["weights_digest"] == uninterrupted, "not bit-identical"


@pytest.mark.multiprocess
def test_a_plain_scancel_checkpoints_and_the_job_stays_cancelled(cluster, demo_small, tmp_path):
    # SIGTERM to every process of the job, SIGKILL after KillWait: a user's cancel, which
    # HVD_TRAIN_REQUEUE=1 must not undo.
    out, samples = tmp_path / "run", tmp_path / "samples"
    # 60 steps: the cancel, after step 8, lands well before the end (it is never trained to it).
    args = train_args(demo_small, out, samples, epochs=10)
    proc = submit(cluster, tmp_path, ["train", *args], HVD_TRAIN_REQUEUE="1")
    wait_for_steps(proc, samples, 8, tmp_path)
    job = proc_job_id(cluster)
    cluster.run("scancel", job)
    proc = finish(proc, cluster, tmp_path)
    log = log_of(tmp_path)
    # The script either says so, or SLURM ended it first. So may srun, which carries the ranks'
    # output: SLURM signals the batch step too, and srun answers SIGTERM by ending the step, so
    # the ranks' last lines may be lost; their checkpoint is not. (sbatch --wait's status for a
    # cancelled job is the killed script's, 0 or not: the job's state is what says "cancelled".)
    assert "requeueing" not in log and "(restart 1)" not in log, f"{output_of(proc)}\n{log}"
    state = cluster.wait_for("its end", lambda: (s := cluster.job_state(job)) != "COMPLETING" and s, interval=0.1)
    assert state == "CANCELLED", log
    from hvd_train.training import checkpoints

    found = checkpoints.latest(str(out))
    # Written at the stop, mid-epoch (the checkpoint says so whether or not the ranks' lines got out).
    assert found is not None and found.state.epoch_steps > 0, log
    assert re.fullmatch(r"stopped by (SIGTERM|SIGUSR1|a signal to another rank)", found.info["reason"]), found.info
    # Each rank's line that got out (none, one or both) names that checkpoint.
    lines = [line for line in log.splitlines() if "stopped by" in line]
    assert len(lines) <= 2, log
    for line in lines:
        match = re.search(r"stopped by (SIGTERM|SIGUSR1|a signal to another rank) .*checkpoint (\S+); rerun", line)
        assert match and Path(match.group(2)) == Path(found.path), log
    assert "Traceback" not in log, log


@pytest.mark.multiprocess
def test_a_rank_killed_without_mpi_abort_ends_the_job(cluster, demo_small, tmp_path):
    # SIGKILL to one rank, as the OOM killer or a segfault ends it: no MPI_Abort. The other rank
    # must not wait in a collective until the time limit: srun ends the step HVD_TRAIN_SRUN_WAIT
    # seconds after the first task ended (--wait), and says which one it was.
    out, samples = tmp_path / "run", tmp_path / "samples"
    program = ["train", *train_args(demo_small, out, samples, epochs=100)]
    proc = submit(cluster, tmp_path, program, HVD_TRAIN_SRUN_WAIT="3")
    wait_for_steps(proc, samples, 5, tmp_path, rank=1)
    [victim] = Path(samples).glob("rank-1-*.jsonl")
    os.kill(int(victim.stem.split("-")[2]), 9)
    proc = finish(proc, cluster, tmp_path, timeout=240)  # a job that hung would fail here
    log = log_of(tmp_path)
    assert proc.returncode != 0, f"{output_of(proc)}\n{log}"
    assert re.search(r"srun: error: n2: task 1: Killed", log), log
    assert "--wait=3" in log, log


def proc_job_id(cluster):
    jobs = cluster.run("squeue", "-h", "-o", "%i").stdout.split()
    assert len(jobs) == 1, jobs
    return jobs[0]


@pytest.mark.multiprocess
def test_the_time_limit_signal_checkpoints_and_ends_the_job_with_75(cluster, demo_small, tmp_path):
    # --time=2 with the signal 110 s before its end: SIGUSR1 to the script 10 to 40 s in (SLURM
    # looks at time limits every half minute or so), which passes it on to every rank, whether
    # they train or still start up (tests/test_preemption.py has a stop during start-up).
    out, samples = tmp_path / "run", tmp_path / "samples"
    proc = submit(
        cluster, tmp_path, ["train", *train_args(demo_small, out, samples, epochs=100)], "--time=2",
        "--signal=B:USR1@110",
    )  # fmt: skip
    proc = finish(proc, cluster, tmp_path)
    log = log_of(tmp_path)
    assert proc.returncode == EXIT_PREEMPTED, f"{output_of(proc)}\n{log}"
    [checkpoint] = stop_lines(log, "SIGUSR1")
    assert "requeueing" not in log, log
    from hvd_train.training import checkpoints

    found = checkpoints.latest(str(out))
    assert found is not None and Path(found.path) == checkpoint, "a resubmitted job resumes from it"


@pytest.mark.multiprocess
def test_an_elastic_job_in_the_allocation_goes_on_without_a_drained_node(cluster, demo_small, tmp_path):
    # The script runs Horovod's elastic driver in the batch step; it starts a worker on each usable
    # node of the allocation (launch/discover-slurm.sh) as a step of the job (launch/srun-ssh).
    # Both nodes are this machine here, so the workers meet over loopback.
    out, samples = tmp_path / "run", tmp_path / "samples"
    # Three epochs: the drain is seen within seconds, in the first; the rest runs on one worker.
    program = ["train", "--elastic", "--commit-every", "2", *train_args(demo_small, out, samples, epochs=3)]
    proc = submit(cluster, tmp_path, program, HVD_TRAIN_LAUNCH_ARGS="--network-interface lo --elastic-timeout 60")
    wait_for_steps(proc, samples, 3, tmp_path, rank=1)  # both workers train (the one started second too)
    workers = cluster.run("squeue", "-h", "-s", "-o", "%i %N").stdout.split("\n")
    cluster.run("scontrol", "update", "nodename=n2", "state=drain", "reason=test")
    try:
        proc = finish(proc, cluster, tmp_path)
    finally:
        cluster.run("scontrol", "update", "nodename=n2", "state=resume")
    cluster.wait_for("n2 back", lambda: cluster.node_states().get("n2") == "idle")
    log = log_of(tmp_path)
    assert proc.returncode == 0, f"{output_of(proc)}\n{log}"
    # The workers were steps of the job, one on each node.
    steps = sorted(line.split()[1] for line in workers if re.match(r"\d+\.\d+ ", line))
    assert steps == ["n1", "n2"], (workers, log)
    summary = read_json(out / "summary.json")
    assert summary["world_sizes"] == [2, 1] and summary["world_size"] == 1, log
    assert summary["val_images"] == 25 and sum(map(sum, summary["val_confusion_matrix"])) == 25
    assert "elastic: training again on 1 worker(s)" in log, log
    assert "Traceback" not in log, log


@pytest.mark.multiprocess
def test_a_sweep_as_a_job_array_shares_one_postgresql_study(cluster, demo_small, tmp_path, postgres_url):
    """Two array tasks run trials of one study in PostgreSQL, together 3 and no more.

    Three trials for two tasks: the task that finishes first finds them all taken while the other
    runs its second, and waits for it (it could be lost, and its trial handed back).
    """
    import optuna
    import yaml

    from postgres_server import PASSWORD

    study = "array"
    out = tmp_path / "out"
    spec = {
        "train": {
            "data": {"train": str(demo_small), "val_split": 0.2, "batch_size": 8, "image_size": 32},
            "model": {"name": TINY[1], "weights": "none"},
            "run": {"epochs": 1, "tensorboard": False},
            "horovod": {"threads_per_rank": 1},
        },
        "search": {"optim.base_lr": {"log_uniform": [0.001, 0.1]}},
        "first": [{"optim.base_lr": 0.01}],
        "trials": 3,
        "sampler": "random",
        "pruner": "none",
        "storage": postgres_url,  # in the file: a password on a command line shows in `ps` and Command=
        "study": study,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    command = [
        "sbatch", "--wait", "--parsable", "-D", tmp_path, "-o", tmp_path / "job-%a.log",
        "--array=0-1", "--nodes", "1", "--ntasks", "1", SCRIPT, "--", "sweep", path, "--output", out,
    ]  # fmt: skip
    env = {"PATH": f"{BIN}:{os.environ['PATH']}", **cluster.env, "HVD_TRAIN": str(BIN / "hvd-train")}
    proc = finish(start(command, **env), cluster, tmp_path, timeout=400)
    logs = "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("job-*.log")))
    assert proc.returncode == 0, f"{output_of(proc)}\n{logs}"
    # Each task ends when the study has its 3 trials (sbatch --wait does not say how each task ended).
    assert logs.count("sweep done: 3 complete") == 2 and "Traceback" not in logs, logs
    assert "waiting while other sweep processes run theirs" in logs, logs
    storage = optuna.storages.RDBStorage(postgres_url)
    try:
        trials = optuna.load_study(study_name=study, storage=storage).get_trials()
    finally:  # its pooled connections closed now, not warned of when a later test collects them
        storage.remove_session()
        storage.engine.dispose()
    kept = [t for t in trials if not t.user_attrs.get("surplus")]
    assert [t.state.name for t in kept] == ["COMPLETE"] * 3, [(t.number, t.state.name, t.user_attrs) for t in trials]
    # The first values once (one task set the study up), and each task drew values of its own.
    rates = [t.params["optim.base_lr"] for t in kept]
    assert rates.count(0.01) == 1 and len(set(rates)) == 3, rates
    assert len({t.user_attrs["claim"]["pid"] for t in kept}) == 2, "both tasks ran trials"
    # A study named otherwise than its folder has its trials in a folder of its name.
    assert {p.name for p in (out / study).glob("trial-*")} == {f"trial-{t.number:04d}" for t in kept}
    # No password in any log or file the sweep wrote.
    written = [p for p in [*tmp_path.glob("job-*.log"), *out.rglob("*")] if p.is_file() and p.suffix != ".keras"]
    leaked = [str(p) for p in written if PASSWORD.encode() in p.read_bytes()]
    assert not leaked, leaked
