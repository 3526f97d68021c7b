"""How a rank ends: at once after a failure (``abort``), cleanly after an agreed stop, or when its work is done."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading


def abort(code: int) -> None:
    """Ends this process so that the launcher ends the others; never returns.

    A normal exit would run Horovod's shutdown, which waits for the other
    ranks, which may be waiting in a collective for this one: a hang.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # Horovod: MPI_Abort tears down every rank of an mpirun job at once.
        mpi.COMM_WORLD.Abort(code)
    # horovodrun ends the remaining workers when one exits non-zero.
    os._exit(code)


def end_after_stop(code: int, stop_signals) -> None:
    """Ends this process after an agreed stop, skipping the interpreter's teardown; never returns.

    Every rank has stopped after the same step, the checkpoint is on disk and
    the outputs are closed. The teardown would free the input pipeline while
    its threads still feed it from a Python generator, and TensorFlow waits
    for them, at times until the launcher kills the rank (horovodrun does
    after 5 s: exit 137, not 75); it also puts back the default signal
    handlers first, so the same stop arriving again through the launcher
    kills the rank (exit 143).

    Args:
        code: the exit code.
        stop_signals: the signals that ask for a stop (ignored from now on).
    """
    for sig in stop_signals:
        # The same stop again (a launcher ending the other ranks passes it on once more): the
        # process is on its way out already. (No Python handler could run during a hang in
        # native code either; SIGKILL still ends it.)
        signal.signal(sig, signal.SIG_IGN)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    hvd = sys.modules.get("horovod.tensorflow")
    if hvd is not None and hvd.is_initialized():
        # Horovod: every rank takes part in the shutdown (each one is on its way out).
        hvd.shutdown()
    _finalize_mpi()
    os._exit(code)


def end_process(code: int) -> None:
    """Ends this process as Python's exit does, but without its teardown of every object; never returns.

    Threads that are not daemons are waited for, and the exit handlers run
    (Horovod's shutdown, logging's flush, temporary folders' removal), as at
    any exit; then MPI is finalised if mpi4py set it up. Skipped: the
    interpreter freeing the objects of every module one by one, which takes
    about a second once TensorFlow is loaded and leaves nothing behind.
    Every output is closed, or flushed, by then (TensorBoard's events after
    each write).
    """
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter calls at exit
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (a closed pipe), or the stream closed
            pass
    _finalize_mpi()
    os._exit(code)


def _finalize_mpi() -> None:
    """Finalises MPI if mpi4py set it up: mpi4py would at the interpreter's teardown, which ``os._exit`` skips."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # else mpirun reports the rank as "exiting improperly"
