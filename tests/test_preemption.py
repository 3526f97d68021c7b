"""Stops that lose nothing, with real launchers and real signals (CPU, 2 ranks).

* SIGTERM to every process of a horovodrun job (twice on each rank), to the
  process group of launch/mpirun.sh and of plain mpirun, to one worker, and
  twice to a single process: every rank stops after the same step, rank 0
  writes a checkpoint there, every rank exits with 75 and one line. A rerun
  of the same command (horovodrun, a single process) continues at that step;
  with --deterministic the final weights are bit-identical to an
  uninterrupted run, and the images trained on are the same, in the same
  order. (For the other ways a stop arrives, the checkpoint a rerun would
  resume from is checked in-process.) A third stop signal ends a process at
  once.
* SIGKILL of a worker: the job ends within 10 s, no process is left, and the
  newest checkpoint is at most --checkpoint-every steps behind.
* SIGKILL during a checkpoint write (of the single process's rerun): the next
  run uses the previous checkpoint, and still ends bit-identical.
"""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hvd_train.config.choices import STEPS_PER_CALL

from conftest import BIN, HVD_TRAIN, TINY, TINY_APP, kill_group, launcher_command, output_of, read_json, run, start

# Every test that starts a job of two ranks, or two processes at once, runs alone (multiprocess);
# one process of one rank shares the machine with another test.

REPO = Path(__file__).resolve().parent.parent
EXIT_PREEMPTED = 75


def options(data, out, samples, *extra, tiny=TINY):
    return [
        *HVD_TRAIN,
        "train",
        "--data",
        data,
        "--output",
        out,
        *tiny,
        "--epochs",
        "3",
        "--val-split",
        "0.2",
        "--deterministic",
        "--sample-log",
        samples,
        *extra,
    ]


def sample_lines(folder):
    """Every step's record, by the process's launch rank: {rank: [record, ...]} in the order they ran.

    A rank's files (one per process: a rerun is a new pid) are joined in the
    order of their first record's time, not of their names: pids are not in
    order as strings (``9999`` sorts after ``10001``), nor always as numbers.
    """
    runs = {}
    for path in Path(folder).glob("rank-*.jsonl"):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        if lines:
            runs.setdefault(int(path.name.split("-")[1]), []).append(lines)
    return {
        rank: [r for lines in sorted(files, key=lambda f: f[0]["time"]) for r in lines] for rank, files in runs.items()
    }


def pid_of(folder, rank):
    [path] = Path(folder).glob(f"rank-{rank}-*.jsonl")
    return int(path.stem.split("-")[2])


def wait_for_steps(proc, folder, steps, rank=0, timeout=300):
    deadline = time.time() + timeout
    while True:
        lines = sample_lines(folder).get(rank, [])
        if len(lines) >= steps:
            return lines[-1]
        assert proc.poll() is None, f"the job ended before step {steps}\n{finish(proc)}"
        assert time.time() < deadline, f"no step {steps} after {timeout} s"
        time.sleep(0.02)


def check_every_rank_ended_stopped(proc, size=2):
    """Every rank printed where it stopped, and none was killed on its way out (137, 143).

    horovodrun names the non-zero exit codes only, and not always all of them: once
    one rank has ended it ends the others (SIGTERM, then SIGKILL 5 s later), and a
    rank that ends in that same instant may go unreported (two of its launcher's
    threads wait for the same child, and the one that loses reads status 0). Plain
    horovodrun may also name 137 or 143 for a rank that exited with 75 (it kills
    the rank's shell before that has ended); ``hvd-train launch`` names the rank's.
    """
    output = proc.stdout + proc.stderr
    for rank in range(size):
        assert re.search(rf"^\[{rank}\]<stderr>:.* stopped by ", output, re.M), f"rank {rank}\n{output_of(proc)}"
    codes = {int(c) for c in re.findall(r"Process \d exit with status code (\d+)", output)}
    assert codes == {EXIT_PREEMPTED}, output_of(proc)


def finish(proc, timeout=180):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the job did not end within {timeout} s\n{stdout[-3000:]}\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def straight_run(proc, out, samples):
    """The final weights and every rank's images of an uninterrupted run, to compare a resumed one with."""
    assert proc.returncode == 0, output_of(proc)
    return read_json(out / "summary.json")["weights_digest"], sample_lines(samples)


@pytest.fixture(scope="module")
def uninterrupted(demo_small, tmp_path_factory):
    # One step per call, where the runs compared with it take the default: the weights do not depend
    # on how the steps are cut into calls.
    root = tmp_path_factory.mktemp("straight")
    command = [*launcher_command("horovodrun-gloo", 2), *options(demo_small, root / "run", root / "samples")]
    proc = run([*command, "--steps-per-call", "1"])
    return straight_run(proc, root / "run", root / "samples")


def check_stopped(proc, stopped_at, launch_exit=None, ranks=2):
    """The job stopped after one step on every rank, with one line each and a checkpoint.

    The stop comes after the signal (``stopped_at``: the last step seen then), in its epoch or, when
    the signal came as that epoch's last call of the steps ran, in the next one.

    Returns the epoch, the step and the checkpoint.
    """
    both = proc.stdout + proc.stderr
    if launch_exit is not None:
        assert proc.returncode == launch_exit, output_of(proc)
    lines = [line for line in both.splitlines() if "stopped by" in line]
    assert len(lines) == ranks, output_of(proc)  # one line per rank
    match = re.search(r"after step (\d+) .* checkpoint (\S+); rerun the same command to continue", lines[0])
    assert match and all(match.group(0) in line for line in lines), output_of(proc)
    step, checkpoint = int(match.group(1)), match.group(2)
    epoch = int(re.fullmatch(r"epoch-(\d{4})-step-(\d{6})", Path(checkpoint).name).group(1))
    assert Path(checkpoint).name == f"epoch-{epoch:04d}-step-{step:06d}"
    assert (epoch, step) >= (stopped_at["epoch"], stopped_at["step"]) and epoch <= stopped_at["epoch"] + 1
    assert Path(checkpoint).is_dir()
    # No traceback from a rank (horovodrun prints its own RuntimeError for the non-zero exits; mpirun does not).
    assert "<stderr>:Traceback" not in both and "<stdout>:Traceback" not in both, output_of(proc)
    if "horovodrun" not in str(proc.args[0]):
        assert "Traceback" not in both, output_of(proc)
    return epoch, step, checkpoint


def check_a_rerun_resumes_from(out, checkpoint, epoch, step):
    """The checkpoint of the stop is the one a rerun resumes from, read in-process.

    For stops that differ only in how the signal came: the rerun itself is the same as in the tests
    that make it.
    """
    from hvd_train.training import checkpoints

    found = checkpoints.latest(str(out))
    assert found is not None and Path(found.path) == Path(checkpoint)
    assert (found.state.epoch, found.state.epoch_steps) == (epoch, step)


def check_the_rerun_is_bit_identical(again, out, samples, checkpoint, before, uninterrupted):
    """The rerun resumed from the stop's checkpoint and ended bit-identical, on the same images in the same order.

    ``before``: every rank's images up to the stop.
    """
    assert again.returncode == 0, output_of(again)
    assert f"resuming from {checkpoint}" in again.stderr
    assert read_json(out / "summary.json")["weights_digest"] == uninterrupted[0], "not bit-identical"
    # Same images in the same order: what ran before the stop, then what the rerun ran.
    after = sample_lines(samples)
    for rank, records in uninterrupted[1].items():
        assert len(before[rank]) < len(records)
        assert [r["ids"] for r in after[rank]] == [r["ids"] for r in records], f"rank {rank} saw other images"


def wait_for_a_save(proc, out, timeout=120, poll=0.002):
    """Waits until rank 0 is writing a checkpoint (its temporary folder exists)."""
    deadline = time.time() + timeout
    while not list((out / "checkpoints").glob(".epoch-*.tmp-*")):
        assert proc.poll() is None, f"the job ended before saving\n{finish(proc)}"
        assert time.time() < deadline, f"no checkpoint being written after {timeout} s"
        time.sleep(poll)


@pytest.mark.multiprocess
def test_sigterm_to_every_process_of_a_horovodrun_job_is_one_stop(demo_small, tmp_path, uninterrupted):
    # As SLURM's scancel and time limit (and systemd) deliver it: to every process of the job. Each rank
    # gets it directly, and again from horovodrun (whose workers sit in a session of their own), here
    # while rank 0 writes the checkpoint of the stop. (SIGTERM to horovodrun alone reaches the ranks the
    # second way only: the same path on every rank.) Through `hvd-train launch`, horovodrun's runner
    # that reports each rank's own status (see check_every_rank_ended_stopped).
    # Step 8 is in the second of 3 epochs (6 steps each), run 4 per call (the default) where the
    # uninterrupted run ran them one by one: the rerun resumes in or at the end of an epoch after the
    # first, goes on into another, and ends with the same weights.
    out, samples = tmp_path / "run", tmp_path / "samples"
    command = [*launcher_command("hvd-train-launch", 2), *options(demo_small, out, samples)]
    proc = start(command)
    at = wait_for_steps(proc, samples, 8)
    for rank in (0, 1):
        os.kill(pid_of(samples, rank), signal.SIGTERM)
    wait_for_a_save(proc, out)
    os.killpg(proc.pid, signal.SIGTERM)
    proc = finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, output_of(proc)
    assert "SIGTERM too: the stop is under way" in proc.stdout + proc.stderr, output_of(proc)
    check_every_rank_ended_stopped(proc)
    _, _, checkpoint = check_stopped(proc, at)
    before = sample_lines(samples)
    check_the_rerun_is_bit_identical(run(command), out, samples, checkpoint, before, uninterrupted)


# Where the tests that only stop a job (the signal's way to the ranks is what they check) send it:
# step 3 of the first epoch's 6 is past the slow first steps, and leaves the stop (at the end of
# the call after the one running) inside that epoch, before its end's evaluation and checkpoint,
# unless the signal reaches the ranks after its last call started.
EARLY = 3


@pytest.mark.multiprocess
def test_sigterm_to_one_worker_stops_every_rank(demo_small, tmp_path):
    out, samples = tmp_path / "run", tmp_path / "samples"
    command = [*launcher_command("hvd-train-launch", 2), *options(demo_small, out, samples)]
    proc = start(command)
    at = wait_for_steps(proc, samples, EARLY, rank=1)
    subprocess.run(["kill", "-TERM", str(pid_of(samples, 1))], check=True)
    proc = finish(proc)
    assert "stopped by SIGTERM" in proc.stdout + proc.stderr  # rank 1's own line
    assert "stopped by a signal to another rank" in proc.stdout + proc.stderr  # rank 0's
    check_every_rank_ended_stopped(proc)
    epoch, step, checkpoint = check_stopped(proc, at, launch_exit=EXIT_PREEMPTED)
    check_a_rerun_resumes_from(out, checkpoint, epoch, step)


@pytest.mark.multiprocess
def test_sigterm_to_the_process_group_of_launch_mpirun_script(demo_small, tmp_path):
    # Ctrl-C in a terminal, kill -- -PGID: the script's whole group. mpirun runs in a group of its
    # own, so only the script's SIGUSR1 reaches it (it would kill the ranks 2 s after a SIGTERM), and
    # passes it on to every rank at once; the script returns their 75.
    out, samples = tmp_path / "run", tmp_path / "samples"
    program = options(demo_small, out, samples)[3:]
    command = ["bash", REPO / "launch/mpirun.sh", "--np", "2", "--mpirun-arg", "--oversubscribe", "--", *program]
    env = {"HVD_TRAIN": str(BIN / "hvd-train")}
    proc = start(command, **env)
    at = wait_for_steps(proc, samples, EARLY)
    os.killpg(proc.pid, signal.SIGTERM)
    proc = finish(proc)
    assert "stopped by SIGUSR1" in proc.stdout + proc.stderr, output_of(proc)
    epoch, step, checkpoint = check_stopped(proc, at, launch_exit=EXIT_PREEMPTED)
    check_a_rerun_resumes_from(out, checkpoint, epoch, step)


@pytest.mark.parametrize("how", ["process group", "launcher alone"])
@pytest.mark.multiprocess
def test_sigterm_to_launch_horovodrun_script_ends_in_75_without_a_traceback(how, demo_small, tmp_path):
    # Plain horovodrun may report 137/143 for a rank that exited 75 (and then print its traceback);
    # the script runs it as `hvd-train launch`, which ends with their 75 alone. The script execs the launcher, so the
    # group is the launcher's (the ranks sit in a session of their own): both reach the ranks
    # through horovodrun.
    out, samples = tmp_path / "run", tmp_path / "samples"
    program = options(demo_small, out, samples)[3:]
    command = ["bash", REPO / "launch/horovodrun.sh", "--np", "2", "--", *program]
    proc = start(command, HVD_TRAIN=str(BIN / "hvd-train"), PATH=f"{BIN}:{os.environ['PATH']}")
    at = wait_for_steps(proc, samples, EARLY)
    if how == "process group":
        os.killpg(proc.pid, signal.SIGTERM)
    else:
        os.kill(proc.pid, signal.SIGTERM)
    proc = finish(proc)
    assert "+ hvd-train launch -np 2 --gloo" in proc.stderr, output_of(proc)
    epoch, step, checkpoint = check_stopped(proc, at, launch_exit=EXIT_PREEMPTED)
    check_a_rerun_resumes_from(out, checkpoint, epoch, step)


@pytest.mark.both_kerases
@pytest.mark.multiprocess
def test_one_process_stops_once_on_a_repeated_sigterm_a_kill_mid_checkpoint_falls_back_and_it_ends_bit_identical(
    demo_small, tmp_path
):
    # Two epochs of 45 steps (batches of 2), run 2 per call (the uninterrupted run: the default): the
    # signal after step 4 is agreed in a call or two and read after the next, so the stop is inside
    # the first epoch, and the reruns go on into the second. The uninterrupted run to compare with
    # trains meanwhile: one process each, both cores work. MobileNet's steps, not the tests' backbone's,
    # and small batches: the stop must land inside the epoch, and on a fast machine 8 steps of 8 images
    # went by before the stop was read (it came after step 12, the epoch's last).
    two = ("--epochs", "2", "--batch-size", "2")
    straight_out, straight_samples = tmp_path / "straight", tmp_path / "straight-samples"
    straight = start(options(demo_small, straight_out, straight_samples, *two, tiny=TINY_APP))
    try:
        out, samples = tmp_path / "run", tmp_path / "samples"
        command = options(demo_small, out, samples, *two, "--steps-per-call", "2", tiny=TINY_APP)
        proc = start(command)
        at = wait_for_steps(proc, samples, 4)
        os.killpg(proc.pid, signal.SIGTERM)
        wait_for_a_save(proc, out)
        os.killpg(proc.pid, signal.SIGTERM)  # the same stop, delivered again while its checkpoint is written
        proc = finish(proc)
        assert proc.returncode == EXIT_PREEMPTED, output_of(proc)
        assert "SIGTERM too: the stop is under way" in proc.stderr, output_of(proc)
        epoch, step, checkpoint = check_stopped(proc, at, ranks=1)
        assert epoch == 0 and step < 45, "a stop inside the epoch"
        before = sample_lines(samples)

        # The rerun is killed while it writes its next checkpoint (the end of the epoch): the one after
        # it uses the previous one, the stop's, and ends as if nothing had happened.
        folder = out / "checkpoints"
        killed = start(command)
        try:
            wait_for_a_save(killed, out, poll=0.0005)
            killed.send_signal(signal.SIGKILL)
            _, stderr = killed.communicate()
        finally:
            kill_group(killed)
        assert f"resuming from {checkpoint}" in stderr, stderr[-5000:]
        partial = list(folder.glob(".epoch-*.tmp-*"))
        assert partial, "the kill should have left a partial checkpoint"
        complete = sorted(p.name for p in folder.glob("epoch-*"))
        # The steps the killed run made, the next rerun makes again: set apart, to compare.
        killed_log = samples / f"rank-0-{killed.pid}.jsonl"
        redone = [json.loads(line)["ids"] for line in killed_log.read_text().splitlines()]
        killed_log.rename(tmp_path / "killed.jsonl")
        again = run(command)
        assert again.returncode == 0, output_of(again)
        assert f"resuming from {folder / complete[-1]}" in again.stderr, output_of(again)
        assert not any(p.exists() for p in partial), "the partial checkpoint is cleaned up"
        uninterrupted = straight_run(finish(straight), straight_out, straight_samples)
    finally:
        kill_group(straight)
    check_the_rerun_is_bit_identical(again, out, samples, checkpoint, before, uninterrupted)
    rerun_ids = [r["ids"] for r in sample_lines(samples)[0][len(before[0]) :]]
    assert redone and rerun_ids[: len(redone)] == redone, "the killed run's steps are not the rerun's"


def test_a_third_stop_signal_ends_the_process_at_once(demo_small, tmp_path):
    out, samples = tmp_path / "run", tmp_path / "samples"
    proc = start(options(demo_small, out, samples, "--epochs", "30"))
    wait_for_steps(proc, samples, 3)
    # Three kinds: signals of one kind that arrive before Python runs their handler count once.
    sent = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
    for sig in sent:
        os.killpg(proc.pid, sig)
        time.sleep(0.01)
    proc = finish(proc, timeout=60)
    assert -proc.returncode in sent, output_of(proc)  # ended by the signal itself, not after a stop
    assert "stopped by" not in proc.stderr, output_of(proc)


def loading_tensorflow(pid):
    """TensorFlow's library is mapped into the process: it is still starting (no step yet)."""
    try:
        return "tensorflow" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_a_stop_signal_while_a_rank_starts_up_is_the_first_steps_stop(demo_small, tmp_path):
    # SLURM's time-limit signal (SIGUSR1 from the batch script) can reach a rank that is still
    # importing TensorFlow; the default action of SIGUSR1 would end it at once (exit 138).
    out, samples = tmp_path / "run", tmp_path / "samples"
    proc = start(options(demo_small, out, samples))
    deadline = time.time() + 60
    while not loading_tensorflow(proc.pid):
        assert proc.poll() is None and time.time() < deadline, f"TensorFlow never loaded\n{finish(proc)}"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGUSR1)
    proc = finish(proc)
    assert proc.returncode == EXIT_PREEMPTED, output_of(proc)
    assert "stopped by SIGUSR1" in proc.stderr, output_of(proc)
    # The first call of the steps (--steps-per-call of them), then the stop.
    assert len(sample_lines(samples)[0]) == STEPS_PER_CALL, "one call of the steps, then the stop"
    at = {"epoch": 0, "step": STEPS_PER_CALL}
    epoch, step, checkpoint = check_stopped(proc, at, ranks=1)
    assert (epoch, step) == (0, STEPS_PER_CALL)
    check_a_rerun_resumes_from(out, checkpoint, epoch, step)


@pytest.mark.multiprocess
def test_sigterm_to_the_process_group_of_plain_mpirun_stops_every_rank(demo_small, tmp_path):
    # Plain mpirun passes SIGTERM on after odls_base_sigkill_timeout seconds
    # and SIGKILLs as long after. Its default, 1 s, makes the test a timing
    # bound on a loaded test machine (the time a save takes is measured by
    # benchmarks/preemption.py); docs/long-runs.md's fix for plain mpirun is to raise
    # it, as here, so the test checks the stop itself.
    out, samples = tmp_path / "run", tmp_path / "samples"
    # Epochs enough that training is not over before the stop reaches the ranks, 5 s after the
    # signal: 12 epochs of the tests' backbone took 7 s in all once a picture no longer followed each.
    command = [*launcher_command("mpirun", 2), *options(demo_small, out, samples, "--epochs", "40")]
    proc = start(command, OMPI_MCA_odls_base_sigkill_timeout="5")
    wait_for_steps(proc, samples, EARLY)
    os.killpg(proc.pid, signal.SIGTERM)
    proc = finish(proc)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "stopped by SIGTERM" in line]
    assert len(lines) == 2, output_of(proc)
    checkpoint = re.search(r"checkpoint (\S+); rerun", lines[0]).group(1)
    assert Path(checkpoint).is_dir()
    from hvd_train.training import checkpoints

    assert Path(checkpoints.latest(str(out)).path) == Path(checkpoint), "a rerun resumes from it"


def processes_of(out):
    found = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in found]


@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "horovodrun-mpi", "mpirun"])
@pytest.mark.multiprocess
def test_sigkill_of_a_worker_ends_the_job_fast_with_a_recent_checkpoint(launcher, demo_small, tmp_path):
    out, samples = tmp_path / "run", tmp_path / "samples"
    command = [*launcher_command(launcher, 2), *options(demo_small, out, samples, "--checkpoint-every", "4")]
    command.remove("--deterministic")
    proc = start(command)
    # Step 5 of the first epoch: the --checkpoint-every checkpoint of step 4 is complete (rank 1 gets
    # its path from rank 0 before its step 5), and without --checkpoint-every there would be none.
    killed = wait_for_steps(proc, samples, 5, rank=1)
    subprocess.run(["kill", "-KILL", str(pid_of(samples, 1))], check=True)
    t0 = time.time()
    proc = finish(proc, timeout=60)
    seconds = time.time() - t0
    assert proc.returncode != 0
    assert seconds < 10, f"the job took {seconds:.1f} s to end after a worker was killed"
    time.sleep(0.5)
    assert processes_of(out) == [], "processes of the job are left"
    # What a rerun would resume from (a rerun after a kill runs in the single-process test above).
    from hvd_train.training import checkpoints

    found = checkpoints.latest(str(out))
    assert found is not None, output_of(proc)
    # The killed rank had run `killed["step"]` steps of epoch `killed["epoch"]`; 6 steps an epoch.
    killed_at = killed["epoch"] * 6 + killed["step"]
    assert killed_at - found.state.step <= 4, f"lost {killed_at - found.state.step} steps"
