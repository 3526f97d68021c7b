"""Trackers (``--track NAME``): rank 0 copies the run somewhere as it goes.

``TRACKERS`` is the table: each name ``--track`` takes (``none`` aside) and
its entry, a ``base.Tracker``; ``start`` begins the run's. TensorBoard's
HParams, written by every run with TensorBoard logs, are ``hparams``.
"""

from __future__ import annotations

from hvd_train.training.tracking.base import Tracker
from hvd_train.training.tracking.jsonl import JsonlTracker
from hvd_train.training.tracking.mlflow import MlflowTracker

TRACKERS: dict[str, type[Tracker]] = {entry.name: entry for entry in (MlflowTracker, JsonlTracker)}


def entry(name: str) -> type[Tracker] | None:
    """The table's entry of ``name`` (``--track``); None for ``none``."""
    return TRACKERS.get(name)


def start(cfg, resumed: bool) -> Tracker | None:
    """The run's tracker, begun (``Tracker.start``); None without ``--track``.

    Raises:
        UserError: the tracker cannot be used (one line).
    """
    found = entry(cfg.run.track)
    return None if found is None else found.start(cfg, resumed)
