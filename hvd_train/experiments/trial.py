"""One trial's job: ``hvd-train train`` under a launcher, in the trial's folder, watched epoch by epoch.

The job is a real Horovod job (``hvd-train launch``, which is horovodrun, or
mpirun) of ``workers`` ranks on the cores (and GPUs) of the trial's slot.
After each epoch, rank 0's metrics.csv row gives the objective, which is
reported to the study; when the pruner says so, the job is stopped as a
scheduler would stop it (SIGTERM to horovodrun, SIGUSR1 to mpirun: every
rank stops after the same step, with a checkpoint). The launcher of a
sweep that dies gets the same signal (``PR_SET_PDEATHSIG``), so no trial
runs on unwatched.

The trial's folder is locked (``flock``) by the sweep and by the job's
launcher, which inherits the lock: a trial handed back after its sweep died
is taken up only once its earlier job has ended.
"""

from __future__ import annotations

import csv
import ctypes
import fcntl
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import yaml

from hvd_train import files
from hvd_train.config import sources
from hvd_train.distributed import launchers
from hvd_train.errors import Diverged, UserError
from hvd_train.experiments import study as studies
from hvd_train.experiments.spec import Sweep
from hvd_train.log import get_logger
from hvd_train.training.preemption import EXIT_PREEMPTED

log = get_logger("sweep")

# How often a running trial's metrics.csv is read (seconds).
POLL = 0.5
# How long a stopped job has to write its checkpoint and end before it is killed (seconds).
STOP_GRACE = 120.0
# How long a trial waits for the earlier job of its folder to end (seconds).
LOCK_WAIT = 600.0
LOG = "trial.log"
CONFIG = "trial.yaml"

_PR_SET_PDEATHSIG = 1


@dataclass
class Slot:
    """The cores (and GPUs) one trial at a time runs on."""

    index: int
    cores: tuple[int, ...]
    gpus: tuple[str, ...] = ()


def slots(parallel: int, workers: int) -> list[Slot]:
    """``parallel`` slots: this process's cores split evenly, and the GPUs ``workers`` each.

    Raises:
        UserError: fewer cores than slots, or fewer GPUs than trials x workers.
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < parallel:
        raise UserError(f"{parallel} trials at once need {parallel} cores at least; this process may use {len(cores)}.")
    gpus = _gpus()
    if gpus and len(gpus) < parallel * workers:
        raise UserError(
            f"{parallel} trials x {workers} workers need {parallel * workers} GPUs; {len(gpus)} are visible: "
            "lower `parallel` or `workers`."
        )
    share = len(cores) // parallel
    return [
        Slot(i, tuple(cores[i * share : (i + 1) * share]), tuple(gpus[i * workers : (i + 1) * workers]))
        for i in range(parallel)
    ]


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        return sorted(d[len("nvidia") :] for d in os.listdir("/dev") if d[len("nvidia") :].isdigit())
    except OSError:
        return []


@dataclass
class Outcome:
    """How a trial's job ended: ``state`` complete, pruned, failed, stopped (handed back), or lost
    (handed back by another sweep process, which took this one's for gone)."""

    state: str
    value: float | None = None
    epoch: int = 0  # the last epoch reported
    note: str = ""
    seconds: float = 0.0


@dataclass
class TrialJob:
    """Runs one trial (see the module docstring)."""

    sweep: Sweep
    folder: str
    params: dict
    slot: Slot
    stopping: object  # threading.Event: the sweep is stopping
    experiment: str = ""  # the tracker's project of a tracked sweep: the study's name
    reported: dict = field(default_factory=dict)  # epoch -> value

    def run(self, trial) -> Outcome:
        os.makedirs(self.folder, exist_ok=True)
        self._check_own_folder()  # before its lock: another sweep's job may hold that for hours
        lock = self._lock(trial)
        if lock is None:  # the sweep stopped while the earlier job of this folder ended
            return Outcome("stopped", note="stopped before it started")
        started = time.monotonic()
        try:
            with files.replacing(os.path.join(self.folder, CONFIG), "w") as f:
                config = self.sweep.trial_config(self.params, os.path.abspath(self.folder), self.experiment)
                yaml.safe_dump(config, f, sort_keys=False)
            with open(os.path.join(self.folder, LOG), "ab") as out:
                command = self.command()
                out.write(f"$ {shlex.join(command)}\n".encode())  # the job's command first, as a user would run it
                out.flush()
                proc = subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self._env(),
                    pass_fds=(lock,),
                    start_new_session=True,
                    preexec_fn=_stop_with_parent(self.stop_signal()),
                )
                outcome = self._watch(proc, trial)
        finally:
            os.close(lock)
        outcome.seconds = time.monotonic() - started
        return outcome

    def _check_own_folder(self) -> None:
        """Refuses a folder whose trial.yaml has other values of the searched options: another
        sweep's trial, whose checkpoints this one would resume and report as its own.

        Raises:
            UserError: naming the folder, the option and both values.
        """
        path = os.path.join(self.folder, CONFIG)
        if not os.path.exists(path):
            return
        found = sources.read_yaml(path, "trial file", "move the folder away")
        for key, value in self.params.items():
            section, name = key.split(".", 1)
            there = (found.get(section) or {}).get(name, "(not set)")
            if there != value:
                raise UserError(
                    f"{self.folder} holds a trial of {key}={there!r}, not {value!r}: another sweep's (its "
                    f"trial.yaml); give this sweep another --output, or move that folder away."
                )

    def command(self) -> list[str]:
        train = [sys.executable, "-m", "hvd_train", "train", "--config", os.path.join(self.folder, CONFIG)]
        # The slot's cores: the launcher's and its ranks' (a rank counts the cores it may use).
        cores = ["taskset", "-c", ",".join(map(str, self.slot.cores))]
        return [*cores, *launchers.trial_command(self.sweep.launcher, self.sweep.workers, sys.executable), *train]

    def stop_signal(self) -> int:
        """What stops the job as a scheduler would: the launcher's stop signal (launchers.TABLE)."""
        return int(launchers.named(self.sweep.launcher).stop_signal)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.slot.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.slot.gpus)
        return env

    def _lock(self, trial) -> int | None:
        """The trial folder's lock, once its earlier job (if any) has ended; None if the sweep stops first.

        The trial's heartbeats go on while it waits.
        """
        fd = os.open(os.path.join(self.folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        beat = time.monotonic()
        deadline = beat + LOCK_WAIT
        said = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if self.stopping.is_set():
                    os.close(fd)
                    return None
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise UserError(
                        f"{self.folder} is still used by an earlier job after {LOCK_WAIT:.0f} s; end it and rerun."
                    ) from None
                if not said:
                    log.info("%s: waiting for the earlier job of this trial to end", self.folder)
                    said = True
                time.sleep(1.0)
                if time.monotonic() - beat >= self.sweep.heartbeat:
                    studies.beat(trial)
                    beat = time.monotonic()

    def _watch(self, proc: subprocess.Popen, trial) -> Outcome:
        beat = time.monotonic()
        pruned = None
        stopped = False
        lost = False
        finished = studies.optuna().exceptions.UpdateFinishedTrialError
        while proc.poll() is None:
            time.sleep(POLL)
            try:
                if time.monotonic() - beat >= self.sweep.heartbeat:
                    studies.beat(trial)
                    beat = time.monotonic()
                if pruned is None and not stopped:
                    pruned = self._report(trial)
            except finished:  # another sweep process handed it back: its retry goes on from the checkpoint
                lost = True
            if not stopped and (lost or pruned is not None or self.stopping.is_set()):
                stopped = True
                proc.send_signal(self.stop_signal())
                stop_at = time.monotonic()
            if stopped and proc.poll() is None and time.monotonic() - stop_at > STOP_GRACE:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: its ranks too
        code = proc.returncode
        last = max((epoch for epoch, _ in self._epochs()), default=0)  # the epochs the job ran
        if pruned is None and code in (0, Diverged.exit_code) and not lost:
            try:
                self._report(trial)  # the last epochs, written before the job ended
            except finished:
                lost = True
        if lost:
            return Outcome("lost", None, last, "handed back by another sweep process")
        if pruned is not None:
            value = self.reported[pruned]
            note = f"pruned at epoch {pruned}: {self.sweep.objective} {value:.4f}; stopped after epoch {last}"
            return Outcome("pruned", value, last, note)
        if code == EXIT_PREEMPTED or (stopped and code != 0):
            return Outcome("stopped", None, last, f"stopped after epoch {last}" if last else "stopped")
        if code == Diverged.exit_code:
            # Options that diverge are a region of the search to leave, as a pruned trial is (TPE learns
            # from it; a failed trial it ignores), not a failure of the sweep's set-up.
            trial.set_user_attr("diverged", True)
            value = self.reported.get(last)
            return Outcome("pruned", value, last, _last_error(self.folder).partition("error: ")[2] or "diverged")
        if code != 0:
            return Outcome("failed", None, last, f"exit {code}: {_last_error(self.folder)}")
        return self._summary(last)

    def _report(self, trial) -> int | None:
        """Reports new epochs' objective; the epoch to prune at, if the pruner says so."""
        for epoch, value in self._epochs():
            if epoch in self.reported:
                continue
            self.reported[epoch] = value
            trial.report(value, epoch)
            if trial.should_prune():
                return epoch
        return None

    def _epochs(self) -> list[tuple[int, float]]:
        path = os.path.join(self.folder, "metrics.csv")
        try:
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        except OSError:
            return []
        found = []
        for row in rows:
            text = row.get(self.sweep.objective) or ""
            if (row.get("epoch") or "").isdigit() and text:
                try:
                    found.append((int(row["epoch"]), float(text)))
                except ValueError:
                    continue
        return found

    def _summary(self, last: int) -> Outcome:
        path = os.path.join(self.folder, "summary.json")
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get(self.sweep.objective)
        except (OSError, ValueError) as e:
            return Outcome("failed", None, last, f"no summary.json ({e})")
        if not isinstance(value, int | float) or isinstance(value, bool):
            return Outcome("failed", None, last, f"summary.json has no number {self.sweep.objective}")
        return Outcome("complete", float(value), last)


def _stop_with_parent(stop: int):
    """Runs in the child before it becomes the launcher: ``stop`` when the sweep process dies.

    Only a system call (no allocation, no lock: the sweep has threads).
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, stop, 0, 0, 0)
        if os.getppid() != parent:  # the sweep died before the line above
            os.kill(os.getpid(), stop)

    return setup


def _last_error(folder: str) -> str:
    """The last ``error:`` line of the trial's log from ``error:`` on (no time, level nor rank that
    would tell two trials' same error apart), or its last line."""
    try:
        with open(os.path.join(folder, LOG), encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line in f.readlines()[-200:] if line.strip()]
    except OSError:
        return "no log"
    errors = [line[line.index("error:") :] for line in lines if "error:" in line]
    return (errors or lines or ["no output"])[-1][:500]
