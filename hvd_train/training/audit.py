"""``--sample-log``: every process writes which images each of its steps trained on.

One JSON line per step (epoch, step within the epoch, rank, world size and
the ids of the batch), written inside the step before its allreduce, so a
step that a stop or a lost worker cut short is in the log too. An elastic
job adds ``commit`` and ``rollback`` lines: an audit counts a step as trained
only if a commit follows it before any rollback.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from hvd_train.distributed.launchers import launcher_rank
from hvd_train.training.state import TrainState


def sample_log_path(folder: str) -> str:
    """This process's ``--sample-log`` file, named by the launch rank (it stays with the process) and the pid."""
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"rank-{launcher_rank()[0]}-{os.getpid()}.jsonl")


class SampleLog:
    """Appends the images of each step of this rank to its ``--sample-log`` file.

    Args:
        folder: the ``--sample-log`` folder.
        state: where the run stands (read at each step).
        ctx: this rank's place in the job (read at each step: an elastic reset changes it).
    """

    def __init__(self, folder: str, state: TrainState, ctx):
        self.folder, self.state, self.ctx = folder, state, ctx
        self._file = None

    def __call__(self, ids) -> None:
        """Writes the step about to run (called inside the step, before its allreduce)."""
        if self._file is None:
            self._file = open(sample_log_path(self.folder), "a", encoding="utf-8")
        record = {
            "time": round(time.time(), 3),
            "epoch": self.state.epoch,
            "step": self.state.epoch_steps + 1,
            "rank": self.ctx.rank,
            "size": self.ctx.size,
            "ids": np.asarray(ids).tolist(),
        }
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def log_sample_event(folder: str, event: str, state: TrainState) -> None:
    """Appends an elastic ``commit`` or ``rollback`` line to this process's ``--sample-log``.

    An audit counts a step as trained only if a commit follows it before any
    rollback: the steps after the last commit of a lost worker, and of the
    survivors before they rolled back, were undone.
    """
    if not folder:
        return
    with open(sample_log_path(folder), "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": round(time.time(), 3), "event": event, "epoch": state.epoch, "step": state.step}))
        f.write("\n")
