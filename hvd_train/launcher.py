"""``hvd-train launch``: Horovod's own runner (``horovodrun``), with a stop that ends as one.

horovodrun turns any rank's non-zero exit into a ``RuntimeError`` and prints
its traceback, so a job whose ranks stopped cleanly after a signal (each
printed where it stopped and that its checkpoint is written, and exited
with 75) looks like a crash. ``hvd-train launch`` runs the same code with
the same arguments and signal handling (``horovod.runner.launch``), and
ends with the ranks' status instead: 75 and nothing more after a stop; for
another failure, Horovod's message in one line and the first failed rank's
status.

    hvd-train launch -np 4 hvd-train train --data DIR --output DIR
"""

from __future__ import annotations

import re
import sys

from hvd_train.training.preemption import EXIT_PREEMPTED  # imports neither TensorFlow nor Horovod

# Horovod 0.28.1's words for a failed job: Gloo ("Exit code: N", the first rank to fail) and
# MPI ("mpirun failed with exit code N").
_EXIT_CODE = re.compile(r"(?:Exit code:|exit code) (\d+)")


def main(argv: list[str]) -> int:
    from horovod.runner import launch as runner

    sys.argv = ["hvd-train launch", *argv]
    try:
        runner.run_commandline()
    except RuntimeError as e:
        message = " ".join(str(e).split())
        found = _EXIT_CODE.search(message)
        code = int(found.group(1)) if found else 1
        if code != EXIT_PREEMPTED:
            print(f"hvd-train launch: {message}", file=sys.stderr)
        return code
    return 0
