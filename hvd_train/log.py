"""A rank-aware logger.

Rank 0 speaks at INFO by default; other ranks only report warnings and
errors, prefixed with ``[rank i/n]`` so a user can tell who said what. With
``all_ranks=True`` every rank logs at INFO (useful when debugging sharding).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

LOGGER_NAME = "hvd_train"


def get_logger(name: str | None = None) -> logging.Logger:
    """Returns the package logger or one of its children."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


def setup(rank: int = 0, size: int = 1, all_ranks: bool = False, level: int = logging.INFO) -> None:
    """Configures the package logger for this process.

    Args:
        rank: this process's Horovod rank.
        size: number of processes in the job.
        all_ranks: whether ranks other than 0 log at ``level`` too.
        level: level of rank 0 (and of every rank with ``all_ranks``).
    """
    logger = get_logger()
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}/{size}] " if size > 1 and (rank != 0 or all_ranks) else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False


class Ticker:
    """Says how far a long phase got, every ``every`` seconds, from a thread of its own.

    ``count`` is advanced by the phase (``ticker.count += n`` from any
    thread); the first line comes after ``every`` seconds, so a phase that
    ends sooner says nothing but its own last line.

    Args:
        logger: where the lines go (rank 0's logger speaks at INFO; other ranks' are quiet).
        what: the phase, e.g. ``"listing --data"``.
        total: the count at which the phase is done, if known.
        unit: what is counted, e.g. ``"images"``.
    """

    EVERY = float(os.environ.get("HVD_TRAIN_TICK_SECONDS", "5"))

    def __init__(self, logger: logging.Logger, what: str, total: int | None = None, unit: str = "", every: float = 0):
        self.logger, self.what, self.total, self.unit = logger, what, total, unit
        self.every = every or self.EVERY
        self.count = 0
        self.started = time.perf_counter()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._tick, name=f"ticker:{what}", daemon=True)

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        if self.total is None and not self.count:
            return f"{self.what}: still at it after {self.seconds:.0f} s"
        of = f"/{self.total:,}" if self.total is not None else ""
        return f"{self.what}: {self.count:,}{of} {self.unit} after {self.seconds:.0f} s".replace("  ", " ")

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            self.logger.info("%s", self.line())
