"""A sweep's Optuna study: where it is stored, how it samples and prunes, whose trials are still alive.

The study is Optuna's own, in Optuna's storage: SQLite in the sweep's folder
by default, or a database URL (PostgreSQL) that sweep processes on many
machines share. ``optuna-dashboard URL`` reads it as it runs.

Trials are asked for and told by the sweep (Optuna's ask-and-tell). Each
running trial records where its sweep process runs (``host``, ``pid``) and
a heartbeat (``alive``). A trial whose sweep process is gone (the same
host, the process no longer there) or silent for ``STALE_BEATS`` heartbeats
(another host) is handed back: marked failed, and enqueued again with the
same options and folder, so the next sweep process to ask takes it up and
its job resumes from its checkpoint. A trial handed back does not count
towards the sweep's trials; its retry does.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from hvd_train.data.storage import first_line, redact_url
from hvd_train.errors import UserError
from hvd_train.experiments.spec import Sweep
from hvd_train.log import get_logger

log = get_logger("sweep")

# A trial on another host is stale after this many missed heartbeats.
STALE_BEATS = 6

HOST = socket.gethostname()


def optuna():
    try:
        import optuna
    except ImportError:
        raise UserError("hvd-train sweep needs Optuna: pip install 'hvd_train[sweep]'.") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def storage_url(sweep: Sweep, folder: str) -> str:
    return sweep.storage or "sqlite:///" + os.path.abspath(os.path.join(folder, "study.db"))


def open_study(sweep: Sweep, folder: str):
    """The sweep's study, created at its first start (with ``first`` enqueued) and loaded after."""
    op = optuna()
    name = sweep.study or os.path.basename(os.path.abspath(folder))
    url = storage_url(sweep, folder)
    try:
        study = op.create_study(
            study_name=name,
            storage=url,
            sampler=_sampler(op, sweep),
            pruner=_pruner(op, sweep),
            direction=sweep.direction,
            load_if_exists=True,
        )
    except Exception as e:  # SQLAlchemy's errors: a server that is not there, a wrong password
        shown = redact_url(url)
        raise UserError(f"cannot open the study {name!r} in {shown} ({first_line(e)}); check `storage`.") from None
    if study.direction.name.lower() != sweep.direction:
        raise UserError(
            f"the study {name!r} in {redact_url(url)} {study.direction.name.lower()}s; this sweep "
            f"{sweep.direction}s: name another `study` or choose another --output."
        )
    known = study.user_attrs.get("objective")
    if known is None:
        study.set_user_attr("objective", sweep.objective)
        for params in sweep.first:
            study.enqueue_trial(dict(params))
    elif known != sweep.objective:
        raise UserError(
            f"the study {name!r} optimizes {known}, not {sweep.objective}: name another `study` or --output."
        )
    return study


def _sampler(op, sweep: Sweep):
    if sweep.sampler == "grid":
        return op.samplers.GridSampler(sweep.grid(), seed=sweep.seed)
    if sweep.sampler == "random":
        return op.samplers.RandomSampler(seed=sweep.seed)
    # Random for the first few trials (a third of them, 2 to 10), then Tree-structured Parzen
    # Estimators; a running trial counts as its worst outcome (``constant_liar``), so that
    # trials run at once do not all sample the same corner.
    startup = max(2, min(10, sweep.trials // 3))
    return op.samplers.TPESampler(seed=sweep.seed, n_startup_trials=startup, constant_liar=True)


def _pruner(op, sweep: Sweep):
    if sweep.pruner == "median":
        return op.pruners.MedianPruner(
            n_startup_trials=sweep.prune_startup_trials, n_warmup_steps=sweep.first_prunable_epoch()
        )
    if sweep.pruner == "halving":
        return op.pruners.SuccessiveHalvingPruner(min_resource=sweep.first_prunable_epoch())
    return op.pruners.NopPruner()


def suggest(trial, sweep: Sweep) -> dict[str, Any]:
    """The trial's value of every searched option (an enqueued trial's are fixed already)."""
    params = {}
    for key, space in sweep.search.items():
        if space.kind == "choices":
            params[key] = trial.suggest_categorical(key, list(space.values))
        elif space.kind == "int":
            params[key] = trial.suggest_int(key, int(space.low), int(space.high), step=space.step)
        else:
            params[key] = trial.suggest_float(key, space.low, space.high, log=space.kind == "log_uniform")
    return params


def kept(study) -> list:
    """The study's trials but those handed back (see the module docstring): the sweep's trials."""
    op = optuna()
    trials = study.get_trials(deepcopy=False)
    handed_back = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return [t for t in trials if not (t.state == op.trial.TrialState.FAIL and t.number in handed_back)]


def counted(study) -> int:
    """Trials that count towards the sweep's number."""
    return len(kept(study))


def waiting(study) -> int:
    op = optuna()
    return len(study.get_trials(deepcopy=False, states=(op.trial.TrialState.WAITING,)))


def claim(trial) -> None:
    """Records that this process runs ``trial``, and its first heartbeat."""
    trial.set_user_attr("host", HOST)
    trial.set_user_attr("pid", os.getpid())
    trial.set_user_attr("pid_start", process_start(os.getpid()))
    beat(trial)


def beat(trial) -> None:
    trial.set_user_attr("alive", time.time())


def process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def is_stale(attrs: dict, heartbeat: float, now: float | None = None) -> bool:
    """Whether a running trial's sweep process is gone (see the module docstring)."""
    if attrs.get("host") == HOST and attrs.get("pid") is not None:
        return process_start(int(attrs["pid"])) != attrs.get("pid_start")
    return (now or time.time()) - float(attrs.get("alive", 0)) > STALE_BEATS * heartbeat


def tell(study, trial, value=None, **state) -> None:
    """``study.tell``, past two complaints of Optuna's grid sampler after the trial is stored.

    The sampler asks the study to stop after the last point of its grid,
    which Optuna refuses outside ``Study.optimize`` (this sweep stops anyway
    once its trials are done); and it looks for the grid point of an
    enqueued trial (a trial handed back, or one of ``first``), which has its
    options fixed instead (its original's point counts as visited).
    """
    try:
        study.tell(trial, value, **state)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise
    except KeyError as e:
        if e.args != ("grid_id",):
            raise


def hand_back(study, frozen, why: str) -> bool:
    """Fails ``frozen`` (a running trial) and enqueues it again with its options and folder.

    Returns False when another process finished or handed it back first.
    """
    op = optuna()
    try:
        tell(study, frozen.number, state=op.trial.TrialState.FAIL)
    except (op.exceptions.UpdateFinishedTrialError, ValueError):  # finished, or handed back, by another process
        return False
    folder = frozen.user_attrs.get("folder", trial_folder_name(frozen.number))
    study.enqueue_trial(dict(frozen.params), user_attrs={"retry_of": frozen.number, "folder": folder})
    log.info("trial %d %s: handed back, to go on from its checkpoint in %s", frozen.number, why, folder)
    return True


def hand_back_stale(study, heartbeat: float) -> None:
    op = optuna()
    for frozen in study.get_trials(deepcopy=False, states=(op.trial.TrialState.RUNNING,)):
        if is_stale(frozen.user_attrs, heartbeat):
            hand_back(study, frozen, "lost its sweep process")


def trial_folder_name(number: int) -> str:
    return f"trial-{number:04d}"
