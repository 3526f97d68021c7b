"""``hvd-train launch``: Horovod's own runner (``horovodrun``), with a stop that ends as one.

Horovod 0.28.1 as released turns any rank's non-zero exit into a
``RuntimeError`` and prints its traceback, so a job whose ranks stopped
cleanly after a signal (each printed where it stopped and that its
checkpoint is written, and exited with 75) looks like a crash. Our patch of
Horovod (``launch/patches``) makes ``horovodrun`` itself end with 75 and
nothing more when every failed rank exited 75, and gives the error every
failed rank's status (``exit_codes``). ``hvd-train launch`` runs the same
code with the same arguments and signal handling
(``horovod.runner.launch``); for another failure it prints Horovod's
message in one line and ends with a failed rank's status other than 75.

It also keeps each rank's own status. Horovod 0.28.1 runs a rank through
``sh -c`` and, to end it, signals the rank, waits until it has exited, then
stops and kills the shell. That wait returns as soon as the rank has
exited, at times before its shell has read the status and ended, and the
killed shell then reports 137 or 143 for a rank that exited with 75 (or
0, when Horovod's own wait for the killed shell takes its status first):
the job's status says "killed" (or "done") where the ranks stopped cleanly.
Here the shell has ``SHELL_GRACE`` seconds to end on its own, with the
rank's status.

    hvd-train launch -np 4 hvd-train train --data DIR --output DIR
"""

from __future__ import annotations

import os
import re
import sys
import time

from hvd_train.training.preemption import EXIT_PREEMPTED  # imports neither TensorFlow nor Horovod

# Horovod 0.28.1's words for a failed job: Gloo ("Exit code: N", the first rank to fail) and
# MPI ("mpirun failed with exit code N").
_EXIT_CODE = re.compile(r"(?:Exit code:|exit code) (\d+)")


# How long a rank's shell has to end on its own once the rank has ended.
SHELL_GRACE = 5.0

# Horovod's function that runs one rank's shell, set aside while ours stands in for it.
_horovods_middleman = None


def main(argv: list[str]) -> int:
    from horovod.runner import launch as runner

    _end_shells_gently()
    sys.argv = ["hvd-train launch", *argv]
    try:
        runner.run_commandline()
    except RuntimeError as e:
        message = " ".join(str(e).split())
        # Every failed rank's status (our patch), else the first one's from the message.
        codes = getattr(e, "exit_codes", None) or [int(m) for m in _EXIT_CODE.findall(message)[:1]] or [1]
        if set(codes) == {EXIT_PREEMPTED}:
            return EXIT_PREEMPTED
        print(f"hvd-train launch: {message}", file=sys.stderr)
        return next(code for code in codes if code != EXIT_PREEMPTED)
    return 0


def _end_shells_gently() -> None:
    """Makes Horovod run each rank's shell through ``_middleman`` (see the module docstring).

    Horovod starts the process that runs a rank's shell with multiprocessing's
    ``spawn``, which finds the target function by its name: ``_middleman`` is
    found in this module there, and sets up the gentle ending before it runs
    Horovod's own.
    """
    global _horovods_middleman
    from horovod.runner.common.util import safe_shell_exec

    if safe_shell_exec._exec_middleman is not _middleman:
        _horovods_middleman = safe_shell_exec._exec_middleman
        safe_shell_exec._exec_middleman = _middleman


def _middleman(*args) -> None:
    """Horovod's process for one rank's shell, which ends the shell with ``end_rank_then_shell``."""
    from horovod.runner.common.util import safe_shell_exec

    run = _horovods_middleman or safe_shell_exec._exec_middleman  # spawned: Horovod's module as it is
    safe_shell_exec.terminate_executor_shell_and_children = end_rank_then_shell
    run(*args)


def end_rank_then_shell(pid: int) -> None:
    """Ends the shell ``pid`` (a child of this process) that runs a rank, keeping the rank's status.

    As Horovod does: SIGTERM to the shell's children (the rank), then SIGKILL
    to those (and theirs) still running after the grace. Then, unlike Horovod,
    the shell has ``SHELL_GRACE`` seconds to end on its own, with its
    command's status, before it and all it started are killed.
    """
    import psutil  # a dependency of Horovod
    from horovod.runner.common.util import safe_shell_exec

    grace = safe_shell_exec.GRACEFUL_TERMINATION_TIME_S  # 5 s
    try:
        shell = psutil.Process(pid)
        ranks = shell.children()
    except psutil.NoSuchProcess:
        return
    for rank in ranks:
        _signal(rank, "terminate")
    _, alive = psutil.wait_procs(ranks, timeout=grace)
    for rank in alive:
        for child in _children(rank):
            _signal(child, "kill")
        _signal(rank, "kill")
    if _ends(pid, SHELL_GRACE):
        return
    # The shell went on with something else: stop it (so that it starts nothing more) and end it
    # with all it started.
    _signal(shell, "suspend")
    for child in _children(shell):
        _signal(child, "kill")
    _signal(shell, "kill")


def _ends(pid: int, timeout: float) -> bool:
    """Whether the child ``pid`` has ended within ``timeout`` s; it is left to its parent's wait."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:  # already waited for
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _children(process) -> list:
    import psutil

    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _signal(process, how: str) -> None:
    import psutil

    try:
        getattr(process, how)()
    except psutil.NoSuchProcess:
        pass
