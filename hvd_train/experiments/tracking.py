"""A tracked sweep (``train.run.track``): what the sweep alone does about its trials' tracker.

Each trial is a run tracked as any (``training.tracking``). Where the
tracker's entry says so (``sweep_names``), the sweep is one project (the
study's name, unless the base names one) with a run per trial, named after
the trial's folder; and the sweep makes ready, once before its first trial,
what its trials share (``prepare_sweep``: MLflow's store and experiment).
"""

from __future__ import annotations

import os
from typing import Any

from hvd_train.training import tracking


def name_trial(run: dict[str, Any], output: str, project: str) -> None:
    """Sets, in a trial's ``run`` section, its run's name (``output``'s folder) and the sweep's ``project``
    (the study's name), where the tracker names them and the base does not."""
    found = tracking.entry(str(run.get("track", "none")))
    if found is None or not found.sweep_names:
        return
    run.setdefault("tracker_run", os.path.basename(output))
    if project:
        run.setdefault("tracker_project", project)


def prepare(run: dict[str, Any], study: str) -> None:
    """A tracked sweep's shared tracking (MLflow's store and experiment, the study's name as its trials'),
    made once before any trial.

    Raises:
        UserError: the trials could not be tracked (one line).
    """
    found = tracking.entry(str(run.get("track", "none")))
    if found is not None:
        found.prepare_sweep(str(run.get("tracker_uri") or ""), str(run.get("tracker_project") or study))
