"""Stopping on a signal without losing work: SIGTERM, SIGINT, SIGUSR1.

Schedulers end jobs with a signal and a grace period: Kubernetes and SLURM
send SIGTERM (SLURM can send SIGUSR1 earlier, ``--signal``), AWS gives a
spot instance two minutes' notice, a user presses Ctrl-C. ``horovodrun``
passes SIGTERM/SIGINT on to its workers (as SIGTERM) and kills them 5 s
later; ``mpirun`` passes SIGTERM/SIGINT on after ``odls_base_sigkill_timeout``
seconds (default 1) and kills after as long again, and passes SIGUSR1/SIGUSR2
on at once.

A handler only notes the signal. At every step boundary the ranks agree,
with one small allreduce, whether any of them was signalled (a signal may
reach one rank, or the launcher, or all of them); if so, all stop after the
same step, rank 0 writes a checkpoint, and every rank ends with
``EXIT_PREEMPTED`` and one line saying where it stopped and how to go on.

One stop may arrive twice: a scheduler that signals every process of a job
(SLURM's ``scancel`` and time limit, systemd) reaches a rank directly and
again through its launcher, which passes the signal on. So the second stop
signal, of any kind, is part of the stop under way; only a third is a
deliberate repeat, and ends the process at once, as that signal would have.
"""

from __future__ import annotations

import signal

from hvd_train.log import get_logger

# EX_TEMPFAIL (sysexits.h): a temporary failure; rerunning the same command continues the run.
EXIT_PREEMPTED = 75

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

# The stop signal that ends a process at once: the third (see the module docstring).
KILL_ON = 3

log = get_logger("train")

# Stop requests noted since a training rank started (``note_from_start``), until training takes them.
_from_start: StopRequests | None = None


class Preempted(Exception):
    """Every rank stopped on a signal after writing a checkpoint; the message says where."""

    exit_code = EXIT_PREEMPTED


class StopRequests:
    """Notes stop signals; the training loop asks ``requested`` at every step boundary."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.received = 0
        self._previous: dict[int, object] = {}

    def install(self) -> StopRequests:
        """Replaces the handlers of ``STOP_SIGNALS`` (main thread only)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        self.received += 1
        if self.received >= KILL_ON:
            # A deliberate repeat: stop now, the way the signal would have.
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        if self.signal is None:
            self.signal = signum
        else:
            log.info(
                "%s too: the stop is under way (a signal may reach a rank directly and again through its "
                "launcher); a third stop signal ends the process at once",
                signal.Signals(signum).name,
            )

    @property
    def requested(self) -> bool:
        return self.signal is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else ""


def note_from_start() -> None:
    """Notes stop signals from a training rank's start-up on, before TensorFlow and Horovod load.

    A scheduler's stop can come while a rank still starts (SLURM's time-limit
    signal, a drained node): with the default handlers it would kill the rank
    (exit 138 for SIGUSR1) and its launcher would report a crash. Noted here,
    it is the first step boundary's stop, like any other.
    """
    global _from_start
    if _from_start is None:
        _from_start = StopRequests().install()


def stop_requests() -> StopRequests:
    """This rank's stop requests: those noted since start-up (``note_from_start``), else new ones."""
    global _from_start
    stop, _from_start = _from_start, None
    return stop if stop is not None else StopRequests().install()
