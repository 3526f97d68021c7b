"""The sweep: trials asked of the study, run ``parallel`` at a time, told what they gave.

Each slot (``trial.slots``) is a thread that asks the study for a trial,
runs its job and tells the study how it ended, until the sweep's number of
trials is reached. Asking is done under one lock, after handing back the
trials whose sweep process is gone (``study.hand_back_stale``). Sweep
processes that share one study (on many machines, or a SLURM job array)
may ask in the same instant: a trial numbered after the sweep's count of
kept ones is failed at once as surplus (``study.surplus``), so the count
holds. A process whose trials are all taken waits while others run theirs,
and takes up any that is handed back.

A tracked sweep (``train.run.track``) makes ready what its trials' tracker
shares before any trial (``tracking.prepare``: MLflow's store and
experiment): a store it cannot use stops it before any trial starts. A sweep
whose first ``ALIKE_FAILURES`` trials all fail with the same cause (its
data, its store, its environment: not a trial's options) stops there and
says that cause, rather than start trial after trial that fails alike.

A stop signal (SIGTERM, SIGINT, SIGUSR1) stops every running job as a
scheduler would (each writes its checkpoint), hands its trial back, writes
the pages and ends with 75. The same command then goes on: finished trials
are kept, the trials cut mid-run resume from their checkpoints, and the
number of trials stays the one asked for.
"""

from __future__ import annotations

import os
import signal
import threading

from hvd_train.data.storage import redact_url
from hvd_train.errors import UserError
from hvd_train.experiments import pages, tracking
from hvd_train.experiments import study as studies
from hvd_train.experiments.spec import Sweep
from hvd_train.experiments.trial import Outcome, Slot, TrialJob, slots
from hvd_train.log import get_logger
from hvd_train.results import report_page
from hvd_train.training.preemption import EXIT_PREEMPTED, STOP_SIGNALS

log = get_logger("sweep")

# A sweep whose first trials fail, this many of them with one cause, stops.
ALIKE_FAILURES = 2


class SweepRun:
    """Runs ``sweep`` with its files in ``folder`` (see the module docstring)."""

    def __init__(self, sweep: Sweep, folder: str):
        self.sweep = sweep
        self.folder = folder
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []
        self.watch = studies.Watch(sweep.heartbeat)
        self.failures: list[str] = []  # the causes of this process's first trials, while all fail
        self.ended_well = False  # a trial of this process completed or was pruned
        self.halted = ""  # the cause its first trials all failed of

    def run(self) -> int:
        sweep = self.sweep
        os.makedirs(self.folder, exist_ok=True)
        places = slots(sweep.parallel, sweep.workers)
        self.study = studies.open_study(sweep, self.folder)
        self.storage = redact_url(studies.storage_url(sweep, self.folder))
        self.pages = studies.study_folder(self.study, self.folder)  # its trials' folders and its pages
        os.makedirs(self.pages, exist_ok=True)
        self._prepare_tracking()
        log.info(
            "sweep %s: %d trials of %s, %d at once x %d worker(s) in %s; study in %s",
            self.study.study_name,
            sweep.trials,
            sweep.objective,
            sweep.parallel,
            sweep.workers,
            self.pages,
            self.storage,
        )
        previous = {sig: signal.signal(sig, self._stop) for sig in STOP_SIGNALS}
        try:
            threads = [threading.Thread(target=self._slot, args=(s,), name=f"slot-{s.index}") for s in places]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():  # a timed join: the main thread takes the signals
                    t.join(0.5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        summary = pages.write(sweep, self.study, self.pages, self.storage)
        if self.errors:
            raise self.errors[0]
        if self.halted:
            raise UserError(
                f"the first {len(self.failures)} trials failed alike ({self.halted}); the sweep stops there: fix "
                f"that, then run the same command (failed trials count among its {sweep.trials}; see their "
                f"trial.log in {self.pages})."
            )
        if summary["importances_tie"]:
            log.info("%s", pages.tie_note(sweep))
        counts, best = summary["counts"], summary["best"]
        done = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        if self.stopping.is_set():
            log.warning(
                "sweep stopped (%s of %d trials); run the same command to go on: cut trials resume from "
                "their checkpoints",
                done or "none",
                sweep.trials,
            )
            return EXIT_PREEMPTED
        if best is None:
            log.error("error: no trial finished (%s); see each trial's trial.log in %s", done, self.pages)
            return 1
        log.info(
            "sweep done: %s; best trial %d, %s %.4f; %s, %s, %s",
            done,
            best["number"],
            sweep.objective,
            best["value"],
            *(os.path.join(self.pages, name) for name in (pages.BEST, pages.PAGE, pages.SUMMARY)),
        )
        return 0

    def _prepare_tracking(self) -> None:
        """A tracked sweep's store and experiment (the study's name, as its trials'), made once before any trial."""
        tracking.prepare(self.sweep.train.get("run") or {}, self.study.study_name)

    def _stop(self, signum, frame) -> None:
        if not self.stopping.is_set():
            log.warning("%s: stopping the running trials (each writes its checkpoint)", signal.Signals(signum).name)
        self.stopping.set()

    def _slot(self, slot: Slot) -> None:
        try:
            while not self.stopping.is_set():
                trial = self._next_trial()
                if trial is None:
                    return
                self._run(trial, slot)
        except BaseException as e:  # the sweep ends with it, after the other slots' trials
            self.errors.append(e)
            self.stopping.set()

    def _next_trial(self):
        """The next trial to run, or None when the sweep has all its trials.

        While other sweep processes still run trials of the study, this one
        waits: one of them may stop or be lost, and its trial be handed back
        to whoever asks next.
        """
        study, sweep = self.study, self.sweep
        said = False
        while not self.stopping.is_set():
            with self.lock:
                studies.hand_back_stale(study, self.watch)
                if studies.waiting(study) or studies.counted(study) < sweep.trials:
                    trial = study.ask()
                    studies.claim(trial)
                    if not studies.surplus(study, trial, sweep.trials):
                        return trial
                    continue
                if not studies.running_elsewhere(study):
                    return None
            if not said:
                log.info("the sweep's trials are all taken; waiting while other sweep processes run theirs")
                said = True
            self.stopping.wait(sweep.heartbeat)
        return None

    def _run(self, trial, slot: Slot) -> None:
        sweep = self.sweep
        params = studies.suggest(trial, sweep)
        shown = ", ".join(f"{k}={_short(v)}" for k, v in params.items())
        try:
            name = studies.trial_folder(trial)
        except UserError as e:
            self._tell(trial, Outcome("failed", note=str(e)), shown)
            return
        trial.set_user_attr("folder", name)
        retry = trial.user_attrs.get("retry_of")
        log.info(
            "trial %d: %s%s",
            trial.number,
            shown,
            f" (goes on from trial {retry}'s checkpoint)" if retry is not None else "",
        )
        job = TrialJob(sweep, os.path.join(self.pages, name), params, slot, self.stopping, self.study.study_name)
        try:
            outcome = job.run(trial)
        except UserError as e:
            outcome = Outcome("failed", note=str(e))
        self._tell(trial, outcome, shown)

    def _tell(self, trial, outcome: Outcome, shown: str) -> None:
        op = studies.optuna()
        with self.lock:
            try:
                self._told(trial, outcome, shown)
            except op.exceptions.UpdateFinishedTrialError:
                # Another sweep process took this one for lost (its heartbeats late) and handed it
                # back: its retry goes on from the checkpoint, and has the say.
                log.warning("trial %d was handed back by another sweep meanwhile; its retry counts", trial.number)

    def _told(self, trial, outcome: Outcome, shown: str) -> None:
        """Records how ``trial`` ended (under the lock)."""
        op = studies.optuna()
        sweep = self.sweep
        if outcome.state == "lost":
            log.warning("trial %d was handed back by another sweep meanwhile; its retry counts", trial.number)
            return
        trial.set_user_attr("epochs", outcome.epoch)
        trial.set_user_attr("seconds", round(outcome.seconds, 1))
        if outcome.note:
            trial.set_user_attr("note", outcome.note)
        if outcome.state == "stopped":
            studies.hand_back(self.study, trial, outcome.note or "stopped")
            return
        if outcome.state == "complete":
            studies.tell(self.study, trial, outcome.value)
            report_page.write_or_warn(os.path.join(self.pages, trial.user_attrs["folder"]))
            best = self.study.best_trial
            log.info(
                "trial %d: %s %.4f in %.0f s; best so far: trial %d, %.4f",
                trial.number,
                sweep.objective,
                outcome.value,
                outcome.seconds,
                best.number,
                best.value,
            )
        elif outcome.state == "pruned":
            studies.tell(self.study, trial, state=op.trial.TrialState.PRUNED)
            log.info("trial %d %s (%s)", trial.number, outcome.note, shown)
        else:
            studies.tell(self.study, trial, state=op.trial.TrialState.FAIL)
            log.warning("trial %d failed: %s", trial.number, outcome.note)
            self._halt_if_alike(trial, outcome.note)
        self.ended_well |= outcome.state in ("complete", "pruned")
        pages.write(sweep, self.study, self.pages, self.storage)

    def _halt_if_alike(self, trial, note: str) -> None:
        """Stops the sweep when its first trials have all failed, ``ALIKE_FAILURES`` of them with one cause.

        Causes are compared with each trial's own folder left out of them.
        """
        if self.ended_well or self.halted:
            return
        name = trial.user_attrs["folder"]
        self.failures.append(note.replace(os.path.abspath(os.path.join(self.pages, name)), "").replace(name, ""))
        if len(self.failures) >= ALIKE_FAILURES and len(set(self.failures)) == 1:
            self.halted = note
            self.stopping.set()


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
