"""A sweep file: the base training configuration, the options searched and how.

.. code-block:: yaml

    train:                       # sections of a `train --config` file; run.output is the sweep's
      data: {train: demo/data, val_split: 0.2}
      model: {name: MobileNetV2, weights: none}
      run: {epochs: 6}
    search:                      # train options (section.name) and their spaces
      optim.base_lr: {log_uniform: [0.001, 0.1]}
      optim.optimizer: {choices: [sgd, adam]}
      data.batch_size: {int: [16, 64], step: 16}
    objective: val_accuracy      # a number of summary.json (OBJECTIVES); maximized unless its name says loss
    trials: 8
    sampler: tpe                 # tpe | random | grid
    pruner: median               # median | halving | none
    parallel: 2                  # trials at once
    workers: 1                   # workers of each trial

Everything is checked before the first trial starts: every option of
``train`` and ``search`` is one ``train`` takes, and every value a space can
give is one it accepts.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass
from typing import Any

from hvd_train.config import sources
from hvd_train.config.choices import RunConfig, TrainConfig
from hvd_train.distributed import launchers
from hvd_train.errors import UserError
from hvd_train.experiments import tracking

SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")
# The launchers a trial may run under: those of the table that say how a trial is started.
LAUNCHERS = launchers.SWEEP_LAUNCHERS
SPACES = ("choices", "uniform", "log_uniform", "int")
# The numbers of summary.json a sweep may optimize (training/finish.py writes them at a trial's end).
OBJECTIVES = (
    "val_accuracy",
    "val_loss",
    "val_top5",
    "val_map",  # a multi-label run's
    "val_f1",
    "images_per_sec",
    "images_per_sec_first_epoch",
)
MULTI_LABEL_OBJECTIVES = ("val_map", "val_f1")  # a multi-label run's, whose accuracy is none
# Up to this many combinations of the spaces' corners, every one is checked (see _corners).
ALL_CORNERS = 64
# Those metrics.csv also has after each epoch, which a trial reports for pruning.
EPOCH_METRICS = ("val_accuracy", "val_loss", "val_top5", "val_map", "val_f1", "images_per_sec")


@dataclass(frozen=True)
class Space:
    """Where one option is searched: ``kind`` one of ``SPACES``."""

    kind: str
    values: tuple = ()  # choices
    low: float = 0.0
    high: float = 0.0
    step: int = 1  # int


@dataclass(frozen=True)
class Sweep:
    """A validated sweep file (see the module docstring)."""

    train: dict[str, dict[str, Any]]
    search: dict[str, Space]
    objective: str = "val_accuracy"
    direction: str = "maximize"  # minimize when the objective's name says loss
    trials: int = 10
    sampler: str = "tpe"
    pruner: str = "median"
    prune_startup_trials: int = 2
    prune_warmup_epochs: int = 0  # 0: a third of the epochs (at least 1)
    parallel: int = 1
    workers: int = 1
    launcher: str = "horovodrun"
    storage: str = ""
    study: str = ""
    seed: int = 0
    first: tuple[dict[str, Any], ...] = ()
    heartbeat: float = 10.0

    def trial_config(self, params: dict[str, Any], output: str, experiment: str = "") -> dict[str, dict[str, Any]]:
        """The ``train --config`` mapping of one trial: the base, ``params``, and ``output``.

        Tracked (``train.run.track``), a sweep is one project of its tracker
        (``experiment``, unless the base names one) with a run per trial,
        named after the trial's folder, where the tracker names them
        (``tracking.name_trial``).
        """
        values = {section: dict(body) for section, body in self.train.items()}
        tracking.name_trial(values.setdefault("run", {}), output, experiment)
        for key, value in {**params, "run.output": output}.items():
            section, name = key.split(".", 1)
            values.setdefault(section, {})[name] = value
        return values

    def first_prunable_epoch(self) -> int:
        """The first epoch a trial may be pruned at: ``prune_warmup_epochs``, else a third of the epochs.

        Networks trained from scratch (BatchNorm's statistics still settling)
        are all at chance for an epoch or two; pruning there would keep
        whichever trial happened to start less badly.
        """
        return self.prune_warmup_epochs or max(1, self.epochs() // 3)

    def epochs(self) -> int:
        """Each trial's epochs: the base's, else ``train``'s default."""
        return int((self.train.get("run") or {}).get("epochs", RunConfig().epochs))

    def grid(self) -> dict[str, list]:
        """Every value of every option, for the grid sampler."""
        return {key: list(_values(space)) for key, space in self.search.items()}


_KEYS = {f.name for f in dataclasses.fields(Sweep)}


def load(path: str, **overrides: Any) -> Sweep:
    """Reads and checks the sweep file ``path``; ``overrides`` (not None) win over its keys.

    Raises:
        UserError: the file cannot be read, or names an option, space or value that cannot be.
    """
    loaded = sources.read_yaml(
        path, "sweep file", "check the path", "a mapping with `train` and `search`; see docs/experiments.md"
    )
    loaded.update({k: v for k, v in overrides.items() if v is not None})
    return parse(loaded, path)


def parse(loaded: dict[str, Any], where: str = "the sweep") -> Sweep:
    """A ``Sweep`` from a sweep file's mapping (see ``load``)."""

    def fail(message: str) -> UserError:
        return UserError(f"{where}: {message}")

    unknown = sorted(set(loaded) - _KEYS)
    if unknown:
        raise fail(f"unknown key {unknown[0]!r}; known keys: {', '.join(sorted(_KEYS))}.")
    train = loaded.get("train") or {}
    if not isinstance(train, dict) or not all(isinstance(b, dict) for b in train.values()):
        raise fail("`train` must map sections (data, model, optim, run, ...) to their options, as `--config`.")
    train = sources.renamed_keys(train, f"{where}: train")  # an option's older key under its name now
    if "output" in (train.get("run") or {}):
        raise fail("`train.run.output` is set by the sweep (each trial a folder of its own); remove it.")
    search = loaded.get("search")
    if not isinstance(search, dict) or not search:
        raise fail("`search` must map train options (e.g. optim.base_lr) to their spaces; see docs/experiments.md.")
    spaces = {_now(str(key), where): _space(_now(str(key), where), body, fail) for key, body in search.items()}
    values = {k: v for k, v in loaded.items() if k not in ("train", "search", "first")}
    if "direction" not in values:  # a loss is minimized, anything else maximized
        values["direction"] = "minimize" if "loss" in str(values.get("objective", "")) else "maximize"
    try:
        sweep = Sweep(train=train, search=spaces, first=tuple(loaded.get("first") or ()), **values)
    except TypeError as e:
        raise fail(str(e)) from None
    _check(sweep, fail)
    return sweep


def _now(key: str, where: str) -> str:
    """A search key under its option's name now (``run.track_experiment``: ``run.tracker_project``)."""
    section, _, name = key.partition(".")
    return f"{section}.{next(iter(sources.renamed_keys({section: {name: None}}, where)[section]))}" if name else key


def _space(key: str, body: Any, fail) -> Space:
    section, _, name = key.partition(".")
    if section not in sources.SECTIONS or not name:
        raise fail(
            f"search option {key!r} is not a train option; name it section.option (sections: "
            f"{', '.join(sources.SECTIONS)}), as in run_config.yaml."
        )
    if isinstance(body, list):
        body = {"choices": body}
    kinds = [k for k in SPACES if isinstance(body, dict) and k in body]
    extra = sorted(set(body) - {*SPACES, "step"}) if isinstance(body, dict) else []
    if len(kinds) != 1 or extra:
        raise fail(f"the space of {key} must be one of {', '.join(SPACES)} (e.g. {{log_uniform: [0.001, 0.1]}}).")
    kind, given = kinds[0], body[kinds[0]]
    if kind == "choices":
        if not isinstance(given, list) or not given:
            raise fail(f"`choices` of {key} must be a non-empty list.")
        return Space(kind, values=tuple(given))
    if not (isinstance(given, list) and len(given) == 2 and all(isinstance(v, int | float) for v in given)):
        raise fail(f"`{kind}` of {key} must be [low, high]. Received: {given!r}")
    low, high = given
    if not low < high or (kind == "log_uniform" and low <= 0):
        raise fail(f"`{kind}` of {key} needs low < high{' and low > 0' if kind == 'log_uniform' else ''}.")
    if kind == "int":
        step = body.get("step", 1)
        if not all(float(v).is_integer() for v in (low, high)) or not isinstance(step, int) or step < 1:
            raise fail(f"`int` of {key} needs whole low and high, and a whole step >= 1.")
        return Space(kind, low=int(low), high=int(high), step=step)
    return Space(kind, low=float(low), high=float(high))


def _values(space: Space):
    if space.kind == "choices":
        return space.values
    if space.kind == "int":
        return range(int(space.low), int(space.high) + 1, space.step)
    return (space.low, space.high)


def _within(space: Space, value: Any) -> bool:
    """Whether ``space`` can give ``value`` (Optuna refuses a fixed value outside the space)."""
    if space.kind == "choices":
        return value in space.values
    if not isinstance(value, int | float) or isinstance(value, bool) or not space.low <= value <= space.high:
        return False
    return space.kind != "int" or (float(value).is_integer() and (int(value) - int(space.low)) % space.step == 0)


def _shown(space: Space) -> str:
    if space.kind == "choices":
        return f"choices {list(space.values)}"
    if space.kind == "int":
        return f"int [{int(space.low)}, {int(space.high)}], step {space.step}"
    return f"{space.kind} [{space.low:g}, {space.high:g}]"


def _check(sweep: Sweep, fail) -> None:
    def _require(ok: bool, message: str) -> None:
        if not ok:
            raise fail(message)

    _require(sweep.sampler in SAMPLERS, f"`sampler` must be one of {', '.join(SAMPLERS)}.")
    _require(sweep.pruner in PRUNERS, f"`pruner` must be one of {', '.join(PRUNERS)}.")
    _require(sweep.launcher in LAUNCHERS, f"`launcher` must be one of {', '.join(LAUNCHERS)}.")
    _require(sweep.direction in ("maximize", "minimize"), "`direction` must be maximize or minimize.")
    _require(
        isinstance(sweep.prune_warmup_epochs, int) and sweep.prune_warmup_epochs >= 0,
        "`prune_warmup_epochs` must be a whole number >= 1 (or 0: a third of the epochs).",
    )
    for key in ("trials", "parallel", "workers", "prune_startup_trials"):
        value = getattr(sweep, key)
        _require(isinstance(value, int) and value >= 1, f"`{key}` must be a whole number >= 1. Received: {value!r}")
    _require(sweep.heartbeat > 0, "`heartbeat` must be > 0 seconds.")
    if sweep.sampler == "grid":
        bad = [k for k, s in sweep.search.items() if s.kind not in ("choices", "int")]
        _require(not bad, f"the grid sampler takes `choices` and `int` spaces only; {bad[:1]} is continuous.")
        size = math.prod(len(v) for v in sweep.grid().values())
        _require(sweep.trials <= size, f"`trials` ({sweep.trials}) is more than the grid's {size} points.")
    _require(
        sweep.objective in OBJECTIVES,
        f"`objective` must be a number of each trial's summary.json: {', '.join(OBJECTIVES)}. "
        f"Received: {sweep.objective!r}",
    )
    if sweep.pruner != "none":
        _require(
            sweep.objective in EPOCH_METRICS,
            f"pruning needs an objective that metrics.csv has after each epoch ({', '.join(EPOCH_METRICS)}); "
            f"{sweep.objective!r} is not: use pruner: none.",
        )
    _require(len(sweep.first) <= sweep.trials, f"`first` has {len(sweep.first)} entries: more than `trials`.")
    for entry in sweep.first:
        _require(
            isinstance(entry, dict) and set(entry) <= set(sweep.search),
            f"each entry of `first` must set searched options only ({', '.join(sweep.search)}).",
        )
        for key, value in entry.items():
            _require(
                _within(sweep.search[key], value),
                f"`first` sets {key}={value!r}, outside its space ({_shown(sweep.search[key])}).",
            )
    _require(bool((sweep.train.get("data") or {}).get("train")), "set the images to train on: train.data.train.")
    # Every trial's configuration must be one `train` accepts.
    for params in [*_corners(sweep), *(dict(entry) for entry in sweep.first)]:
        cfg = _train_config(sweep, params, fail)
        if sweep.objective.startswith("val_"):
            _require(
                bool(cfg.data.val) or cfg.data.val_split > 0,
                f"the objective {sweep.objective} needs held-out images: set train.data.val or train.data.val_split"
                + (f" (a trial with {_params(params)} has none)." if params else "."),
            )
        multi = sweep.objective in MULTI_LABEL_OBJECTIVES
        _require(
            not sweep.objective.startswith("val_") or sweep.objective == "val_loss" or multi == cfg.data.multi_label,
            f"the objective {sweep.objective} is a {'multi' if multi else 'single'}-label run's, and "
            f"{'no' if multi else 'a'} trial trains a multi-label set (train.data.multi_label); optimize "
            + ("val_map or val_f1." if cfg.data.multi_label else "val_accuracy or val_top5.")
            + (f" (the trial with {_params(params)})" if params else ""),
        )


def _corners(sweep: Sweep) -> list[dict[str, Any]]:
    """The trials whose configurations stand for all the sweep's: every combination of the spaces'
    corners (each choice; the low and the high of a range) up to ``ALL_CORNERS`` of them, else every
    corner of each option with every corner of each other (the rest at their first corner).

    Either finds every trial that ``train`` refuses for values of one option or of two that cannot
    go together (adamw and a weight decay of 0): its checks look at one option or two. Its one check
    of three (early stopping with no held-out images: run.early_stop, data.val, data.val_split) could
    be missed only with all three searched.
    """
    keys = list(sweep.search)
    corners = [list(_values(s)) if s.kind == "choices" else [s.low, s.high] for s in sweep.search.values()]
    if math.prod(map(len, corners)) <= ALL_CORNERS:
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*corners)]
    if len(keys) == 1:  # more than ALL_CORNERS choices of one option
        return [{keys[0]: value} for value in corners[0]]
    first = {key: corner[0] for key, corner in zip(keys, corners, strict=True)}
    found = {}
    for i, j in itertools.combinations(range(len(keys)), 2):
        for a, b in itertools.product(corners[i], corners[j]):
            params = {**first, keys[i]: a, keys[j]: b}
            found.setdefault(repr(params), params)
    return list(found.values())


def _train_config(sweep: Sweep, params: dict[str, Any], fail) -> TrainConfig:
    try:
        return sources.from_mapping(sweep.trial_config(params, os.path.join("sweep", "trial")), "`train`")
    except UserError as e:
        raise fail(f"a trial with {_params(params)} would fail: {e}") from None


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in params.items())
