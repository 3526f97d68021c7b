"""A sweep's Optuna study: where it is stored, how it samples and prunes, whose trials are still alive.

The study is Optuna's own, in Optuna's storage: SQLite in the sweep's folder
by default, or a database URL (PostgreSQL) that sweep processes on many
machines share. ``optuna-dashboard URL`` reads it as it runs.

Trials are asked for and told by the sweep (Optuna's ask-and-tell). Each
running trial records where its sweep process runs (``claim``: host, pid
and the process's start, in one attribute, so that no other process reads
it half written) and a heartbeat (``alive``: its host's clock at each
beat). A trial whose sweep process is gone (the same host, the process no
longer there) or whose heartbeat has not changed for ``STALE_BEATS``
heartbeats (another host; timed by the clock of the process that watches,
as the two hosts' clocks may be minutes apart: see ``Watch``) is handed
back: marked failed, and enqueued again with the same options and folder,
so the next sweep process to ask takes it up and its job resumes from its
checkpoint. A trial handed back does not count towards the sweep's
trials; its retry does.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import socket
import time
from typing import Any

from hvd_train.data.storage import redact_url
from hvd_train.errors import UserError, first_line
from hvd_train.experiments.spec import Sweep
from hvd_train.log import get_logger

log = get_logger("sweep")

# A trial on another host is stale after its heartbeat has not changed for this many heartbeats.
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
    """The sweep's study, created at its first start (with ``first`` enqueued) and loaded after.

    Sweep processes that start together on one shared study (a job array)
    race to create it: one does and enqueues ``first``, the others load it
    and wait until it is set up. Each process samples with a seed of its
    own after the creator's (``seed``): the same seed in two processes would
    draw the same values for their trials (but for the grid, whose order of
    points the seed sets).
    """
    op = optuna()
    name = study_name(sweep, folder)
    url = storage_url(sweep, folder)
    shown = redact_url(url)
    try:
        storage = _storage(op, url)
        # Looked for before the study is: trials another process of it makes meanwhile are then its own.
        there = _trials_in(name, folder)
        if name not in op.get_all_study_names(storage):
            if name != default_name(folder):
                _check_folder_name(name, folder)
            _check_no_other_trials(name, folder, there)
        try:
            study = op.create_study(
                study_name=name, storage=storage, pruner=_pruner(op, sweep), direction=sweep.direction
            )
            created = True
        except op.exceptions.DuplicatedStudyError:
            study = op.load_study(study_name=name, storage=storage, pruner=_pruner(op, sweep))
            created = False
    except ImportError as e:
        raise UserError(
            f"the study's storage {shown} needs a database driver ({e}): pip install 'hvd_train[sweep]'."
        ) from None
    except UserError:
        raise
    except Exception as e:  # SQLAlchemy's errors: a server that is not there, a wrong password
        raise UserError(f"cannot open the study {name!r} in {shown} ({first_line(e)}); check `storage`.") from None
    if study.direction.name.lower() != sweep.direction:
        raise UserError(
            f"the study {name!r} in {shown} {study.direction.name.lower()}s; this sweep "
            f"{sweep.direction}s: name another `study` or choose another --output."
        )
    if created:
        study.set_user_attr("folder", name)  # a folder of its own, named after it (see study_folder)
        for params in sweep.first:
            study.enqueue_trial(dict(params))
        study.set_user_attr("objective", sweep.objective)  # last: the study is set up
    known = _wait_for_objective(study, name, shown)
    if known != sweep.objective:
        raise UserError(
            f"the study {name!r} optimizes {known}, not {sweep.objective}: name another `study` or --output."
        )
    # The grid sampler numbers the grid's points in an order shuffled by its seed: every process
    # must have the same order. Its choice among the points no trial has taken stays random.
    seed = sweep.seed if created or sweep.sampler == "grid" else _own_seed(sweep.seed)
    study.sampler = _sampler(op, sweep, seed)
    return study


def default_name(folder: str) -> str:
    """The name of a sweep's study unless ``study`` names one: its folder's."""
    return os.path.basename(os.path.abspath(folder))


def study_name(sweep: Sweep, folder: str) -> str:
    return sweep.study or default_name(folder)


def study_folder(study, folder: str) -> str:
    """Where ``study``'s trials and pages are: a folder named after the study, so that no two studies
    sharing ``folder`` (and its study.db) share a trial's folder: ``folder`` itself when it has the
    study's name (the default study), else a folder of that name in it.

    Every sweep process of a study (sharing it in a database server) finds the same folder, whether it
    gives that folder or its parent as ``--output``: ``--output sw/lr`` and ``--output sw --study lr``
    are one. A study made before studies had folders of their own (no ``folder`` attribute) has its
    trials in ``folder``, and goes on there.

    Raises:
        UserError: the study's ``folder`` attribute (in its database, which others may write to) is
            neither its name nor "" (a study of an earlier version named after its folder), or its
            name cannot be a folder's.
    """
    if "folder" not in study.user_attrs:
        return folder
    name, own = study.study_name, study.user_attrs["folder"]
    if own not in ("", name):
        raise UserError(
            f"the study {name!r} names its folder {own!r} in its database, not its own name: something other "
            f"than a sweep wrote it; set the study's user attribute `folder` back to {name!r}."
        )
    if name == default_name(folder):
        return folder
    _check_folder_name(name, folder)
    return os.path.join(folder, name)


def _check_folder_name(name: str, folder: str) -> None:
    """A study of a name other than its folder's has a folder of that name in it, which must be one."""
    where = os.path.join(folder, name)
    if not _is_folder_name(name) or (os.path.exists(where) and not os.path.isdir(where)):
        raise UserError(
            f"the study {name!r} would have its trials in {where}, which cannot be a folder of its own: name "
            "the study with letters, digits, '.', '_' and '-' (not trial-NNNN, nor a file of the sweep's)."
        )


def _is_folder_name(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name) is not None and not is_trial_folder(name)


def _trials_in(name: str, folder: str) -> list[str]:
    """The trials' folders in what would be the folder of a study ``name`` (see ``study_folder``)."""
    where = folder if name == default_name(folder) else os.path.join(folder, name)
    if not (name == default_name(folder) or _is_folder_name(name)) or not os.path.isdir(where):
        return []
    return sorted(entry for entry in os.listdir(where) if is_trial_folder(entry))


def _check_no_other_trials(name: str, folder: str, there: list[str]) -> None:
    """A new study's folder must hold no trials (``there``): they would be another study's (its database
    elsewhere, as a study.db in that folder when it was given as --output), whose checkpoints its trials
    would take."""
    if not there:
        return
    where = folder if name == default_name(folder) else os.path.join(folder, name)
    parent = os.path.dirname(os.path.abspath(folder))
    if where != folder and os.path.isfile(os.path.join(where, "study.db")):
        fix = f"to go on with the study there, give --output {where} (and no --study)"
    elif where == folder and os.path.isfile(os.path.join(parent, "study.db")):
        fix = f"to go on with the study there, give --output {parent} --study {name}"
    else:
        fix = "give the --output (and `storage`) it was run with, or move those folders away"
    raise UserError(
        f"{where} holds trials of another study ({there[0]}, ...), not of {name!r} in this sweep's storage: {fix}."
    )


def is_trial_folder(name: str) -> bool:
    """Whether ``name`` is a trial's folder's (``trial-NNNN``), as a trial's ``folder`` attribute must be."""
    return re.fullmatch(r"trial-\d+", name) is not None


def trial_folder(trial) -> str:
    """The name of ``trial``'s folder in its study's: its ``folder`` attribute (a trial handed back
    keeps its first's), else ``trial-NNNN``.

    Raises:
        UserError: the attribute (in the study's database, which others may write to) is not trial-NNNN.
    """
    name = trial.user_attrs.get("folder") or trial_folder_name(trial.number)
    if not is_trial_folder(name):
        raise UserError(
            f"trial {trial.number}'s folder is {name!r} in the study's database, not trial-NNNN: something other "
            "than a sweep wrote it; the trial is failed, not run there."
        )
    return name


def _storage(op, url: str, attempts: int = 5):
    """Optuna's storage at ``url``. Sweep processes that start together on a new database race to
    create its tables, and all but one may be refused (a unique violation): they try again."""
    for attempt in range(attempts):
        try:
            return op.storages.RDBStorage(url, engine_kwargs=_engine_options(url))
        except ImportError:
            raise
        except Exception as e:  # SQLAlchemy's IntegrityError, ProgrammingError of a concurrent CREATE TABLE
            if attempt == attempts - 1 or not any(word in str(e) for word in ("already exists", "duplicate key")):
                raise
            time.sleep(0.2 + random.random())
    raise AssertionError("unreachable")


def _engine_options(url: str) -> dict:
    """SQLAlchemy's pool checks a server connection before use (a server restarted, a connection dropped)."""
    return {} if url.startswith("sqlite") else {"pool_pre_ping": True}


def _wait_for_objective(study, name: str, shown: str, timeout: float = 60.0) -> str:
    """The study's objective, once the process that created it has set it up."""
    deadline = time.monotonic() + timeout
    while True:
        known = study.user_attrs.get("objective")
        if known is not None:
            return known
        if time.monotonic() > deadline:
            raise UserError(
                f"the study {name!r} in {shown} has no objective after {timeout:.0f} s: the sweep that made it "
                f"did not finish setting it up; delete the study (optuna delete-study) or name another `study`."
            )
        time.sleep(0.5)


def _own_seed(seed: int) -> int:
    """A seed for this process, from the sweep's, this host and this process."""
    digest = hashlib.sha256(f"{seed}:{HOST}:{os.getpid()}:{process_start(os.getpid())}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _sampler(op, sweep: Sweep, seed: int):
    if sweep.sampler == "grid":
        return op.samplers.GridSampler(sweep.grid(), seed=seed)
    if sweep.sampler == "random":
        return op.samplers.RandomSampler(seed=seed)
    # Random for the first few trials (a third of them, 2 to 10), then Tree-structured Parzen
    # Estimators; a running trial counts as its worst outcome (``constant_liar``), so that
    # trials run at once do not all sample the same corner.
    startup = max(2, min(10, sweep.trials // 3))
    return op.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)


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
    """The study's trials but those handed back and the surplus ones (see ``surplus``): the sweep's trials."""
    op = optuna()
    trials = study.get_trials(deepcopy=False)
    handed_back = {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}
    return [
        t
        for t in trials
        if not (t.state == op.trial.TrialState.FAIL and (t.number in handed_back or t.user_attrs.get("surplus")))
    ]


def surplus(study, trial, trials: int) -> bool:
    """Whether ``trial``, just asked for, is one too many: sweep processes sharing the study each
    checked the count and asked at once. A retry of a trial handed back is never one; otherwise the
    ``trials`` kept trials numbered before it are the sweep's. A surplus trial is failed at once,
    marked ``surplus``, and does not count."""
    if "retry_of" in trial.user_attrs:
        return False
    before = [t for t in kept(study) if t.number < trial.number]
    if len(before) < trials:
        return False
    op = optuna()
    trial.set_user_attr("surplus", True)
    tell(study, trial, state=op.trial.TrialState.FAIL)
    return True


def running_elsewhere(study) -> int:
    """Running trials of other sweep processes (another host, or another process here)."""
    op = optuna()
    return sum(
        1
        for t in study.get_trials(deepcopy=False, states=(op.trial.TrialState.RUNNING,))
        if claimed_by(t.user_attrs)[:2] != (HOST, os.getpid())
    )


def counted(study) -> int:
    """Trials that count towards the sweep's number."""
    return len(kept(study))


def waiting(study) -> int:
    op = optuna()
    return len(study.get_trials(deepcopy=False, states=(op.trial.TrialState.WAITING,)))


def claim(trial) -> None:
    """Records that this process runs ``trial``, in one attribute (one commit: never read half
    written, which would take a claim without its process's start for a process gone), then the
    first heartbeat."""
    trial.set_user_attr("claim", {"host": HOST, "pid": os.getpid(), "pid_start": process_start(os.getpid())})
    beat(trial)


def claimed_by(attrs: dict) -> tuple:
    """``(host, pid, pid_start)`` of the sweep process that claimed a trial (Nones before its claim)."""
    found = attrs.get("claim") or {}
    return found.get("host"), found.get("pid"), found.get("pid_start")


def beat(trial) -> None:
    trial.set_user_attr("alive", time.time())


def process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot), to tell it from a later one with its pid."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class Watch:
    """Which running trials' sweep processes are gone, as this sweep process sees them.

    One of this host is gone when its process is (its pid no longer there,
    or another process's). One of another host is gone when its heartbeat
    has not changed for ``STALE_BEATS`` heartbeats of this process's
    monotonic clock: the other host's clock is only read for a change,
    never compared with this one's. A trial not yet claimed (just asked
    for) is watched the same way.
    """

    def __init__(self, heartbeat: float):
        self.heartbeat = heartbeat
        self.seen: dict[int, tuple] = {}  # trial number -> (its heartbeat, when this process first saw it)

    def stale(self, number: int, attrs: dict, now: float | None = None) -> bool:
        host, pid, pid_start = claimed_by(attrs)
        if host == HOST and pid is not None:
            return process_start(int(pid)) != pid_start
        now = time.monotonic() if now is None else now
        last = attrs.get("alive")
        seen = self.seen.get(number)
        if seen is None or seen[0] != last:
            self.seen[number] = (last, now)
            return False
        return now - seen[1] > STALE_BEATS * self.heartbeat

    def forget_all_but(self, numbers: set[int]) -> None:
        self.seen = {n: v for n, v in self.seen.items() if n in numbers}


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


def hand_back_stale(study, watch: Watch) -> None:
    """Hands back every running trial whose sweep process ``watch`` finds gone."""
    op = optuna()
    running = study.get_trials(deepcopy=False, states=(op.trial.TrialState.RUNNING,))
    watch.forget_all_but({t.number for t in running})
    for frozen in running:
        if watch.stale(frozen.number, frozen.user_attrs):
            hand_back(study, frozen, "lost its sweep process")


def trial_folder_name(number: int) -> str:
    return f"trial-{number:04d}"
