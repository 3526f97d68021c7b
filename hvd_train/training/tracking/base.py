"""What every tracker is: the calls a training run makes of it, on rank 0 alone.

A tracker copies a run to somewhere else as it goes (``--track NAME``): it
is started with the run's configuration, told every epoch's numbers, and
ended once, in one of three ways: ``finish`` (the run's end: its final
numbers and files), ``stopped`` (a stop signal ended it on a checkpoint,
and a resume goes on with it) or ``failed`` (an error ended it: a diverged
run too). Once training runs, a call that fails is a warning: the run's own
files hold everything, and training goes on.

Each tracker is one entry of the table in ``training.tracking``; a sweep
asks the entry what it does for sweeps (``sweep_names``,
``prepare_sweep``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import yaml

# The numbers of summary.json a tracker takes as the run's final results.
FINAL = ("val_accuracy", "val_top5", "val_loss", "val_map", "val_f1", "images_per_sec", "images_per_sec_first_epoch")
# The run's files a tracker takes at its end, where they are there.
ARTEFACTS = (
    "curves.png",
    "confusion.png",
    "report.html",
    "summary.json",
    "run_config.yaml",
    "labels.json",
    "model.keras",
)


def flat_config(cfg) -> dict[str, Any]:
    """``section.option`` -> value, as ``run_config.yaml`` has them (credentials left out)."""
    values = yaml.safe_load(cfg.to_yaml()) or {}
    return {f"{section}.{name}": value for section, body in values.items() for name, value in body.items()}


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numbers of ``values`` (an epoch's logs), as floats; anything else left out."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def final(summary: dict[str, Any]) -> dict[str, float]:
    """The final results of ``summary`` (``FINAL``) that it has as numbers."""
    return {k: summary[k] for k in FINAL if isinstance(summary.get(k), int | float)}


class Tracker(ABC):
    """One run's tracker. An entry of the table is a subclass of this one.

    Class attributes:
        name: the entry's name in the table (``--track NAME``).
        sweep_names: a sweep names the project after its study and each run
            after its trial's folder, unless its base names them.
    """

    name: ClassVar[str] = ""
    sweep_names: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def start(cls, cfg, resumed: bool) -> Tracker:
        """The run's tracker, begun with ``cfg`` (its parameters: ``flat_config``), or found again after a
        resume (``resumed``).

        Raises:
            UserError: the tracker cannot be used (not installed, not reached, a place it must not write):
                one line, before training starts.
        """

    @classmethod
    def prepare_sweep(cls, uri: str, project: str) -> None:
        """What a sweep makes ready once before its trials, given the base's ``tracker_uri`` and the
        sweep's project; nothing by default.

        Raises:
            UserError: the sweep's trials could not be tracked (one line).
        """
        return None

    @abstractmethod
    def log_epoch(self, epoch: int, logs: dict[str, Any]) -> None:
        """The numbers of epoch ``epoch`` (1-based), as metrics.csv has them."""

    @abstractmethod
    def finish(self, summary: dict[str, Any]) -> None:
        """The run's end: its final results (``summary.json``'s) and its files."""

    @abstractmethod
    def stopped(self) -> None:
        """A stop signal ended the run on a checkpoint: a resume goes on with it."""

    @abstractmethod
    def failed(self, error: BaseException | None = None) -> None:
        """The run ended on ``error`` (a diverged run too); a rerun that resumes goes on with it."""
