"""How a configuration is read: defaults -> YAML file -> command line, and the flags made from the fields."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

import yaml

from hvd_train.config import own_model
from hvd_train.config.checks import validate
from hvd_train.config.choices import ADAMW_WEIGHT_DECAY, OptimConfig, TrainConfig, default_weight_decay
from hvd_train.errors import UserError, first_line

SECTIONS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _section_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {name: hints[name] for name in SECTIONS}


def _field(section_cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(section_cls) if f.name == name)


def _number_or(words: tuple[str, ...], typ: type):
    """An argparse type: one of ``words``, or a ``typ``."""

    def parse(text: str):
        if text in words:
            return text
        try:
            return typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"use a number or {' or '.join(words)}. Received: {text!r}") from None

    parse.__name__ = typ.__name__
    return parse


def _field_type(section_cls: type, name: str) -> type:
    hint = typing.get_type_hints(section_cls)[name]
    if isinstance(hint, types.UnionType):  # e.g. int | None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds one flag per configuration field; unset flags stay absent.

    Defaults are not given to argparse (``SUPPRESS``) so that a YAML file's
    value is only overridden by flags the user actually typed.
    """
    parser.add_argument("--config", metavar="FILE.yaml", help="read options from a YAML file; flags win")
    for section, cls in _section_types().items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            typ = _field_type(cls, f.name)
            kwargs: dict[str, Any] = {
                "dest": f"{section}.{f.name}",
                "default": argparse.SUPPRESS,
                "help": f"{f.metadata['help']} (default: {f.default})",
            }
            if typ is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = _number_or(f.metadata["words"], typ) if "words" in f.metadata else typ
                kwargs["metavar"] = f.name.upper()
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
            group.add_argument(f.metadata["flag"], *f.metadata.get("aliases", ()), **kwargs)


def from_sources(args: argparse.Namespace | None = None, yaml_path: str | None = None) -> TrainConfig:
    """Builds the configuration: defaults, then the YAML file, then the flags.

    Args:
        args: parsed flags from a parser made with ``add_arguments``.
        yaml_path: YAML file; defaults to ``args.config``.

    Returns:
        The validated configuration.

    Raises:
        UserError: for an unreadable file, an unknown key or an invalid value.
    """
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    yaml_path = yaml_path or (getattr(args, "config", None) if args else None)
    in_file: dict[str, Any] = {}
    if yaml_path:
        in_file = read_yaml(yaml_path)
        _merge(values, in_file, yaml_path)
    flags = {key: value for key, value in vars(args or argparse.Namespace()).items() if "." in key}
    for key, value in flags.items():
        section, name = key.split(".", 1)
        values[section][name] = value
    _weight_decay_of_the_file(values, in_file.get("optim") or {}, flags, yaml_path)
    cfg = validate(build(values))
    # A model file of the user's own is recorded by its absolute path: predict, export and a resume
    # find it from any folder.
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=own_model.absolute(cfg.model.name)))


def from_mapping(loaded: dict[str, Any], where: str) -> TrainConfig:
    """The validated configuration of a ``--config`` file's mapping, read from ``where`` (for messages)."""
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    _merge(values, loaded, where)
    return validate(build(values))


def _weight_decay_of_the_file(values: dict, in_file: dict, flags: dict, path: str | None) -> None:
    """A config file's weight decay, read with the optimizer the command line gives.

    A run_config.yaml records the decay its run resolved: its optimizer's
    default (0, ``ADAMW_WEIGHT_DECAY`` for adamw) when none was chosen. Read
    with another ``--optimizer``, that default was no choice: it is left out
    and the new optimizer's applies. Any other decay in the file was chosen
    and is kept (``lr * weight_decay`` a step with every optimizer).
    ``--weight-decay`` wins over both.

    Raises:
        UserError: the file's own 0 would go to adamw (naming the file, not a flag the user did not type).
    """
    if not isinstance(in_file, dict) or "weight_decay" not in in_file or "optim.weight_decay" in flags:
        return
    was = in_file.get("optimizer", OptimConfig.optimizer)
    now = values["optim"].get("optimizer", OptimConfig.optimizer)
    decay = _number(in_file["weight_decay"])
    if now != was and decay == default_weight_decay(was):
        del values["optim"]["weight_decay"]
    elif now == "adamw" and decay == 0:
        raise UserError(
            f"config file {path} sets optim.weight_decay {in_file['weight_decay']!r} with the optimizer adamw, "
            f"which decays weights: set it > 0 there, or remove it for {ADAMW_WEIGHT_DECAY} (Keras's default), or "
            "use the optimizer adam."
        )


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):  # not a number: validation names it
        return None


def build(values: dict[str, dict[str, Any]]) -> TrainConfig:
    """Makes a TrainConfig from nested section dicts, coercing YAML scalars.

    A default that depends on another choice is filled in here: AdamW's
    weight decay (``ADAMW_WEIGHT_DECAY``) where none is given.
    """
    optim = values.get("optim") or {}
    if optim.get("optimizer") == "adamw" and "weight_decay" not in optim:
        values = {**values, "optim": {**optim, "weight_decay": ADAMW_WEIGHT_DECAY}}
    sections = {}
    for section, cls in _section_types().items():
        kwargs = {}
        for name, value in values.get(section, {}).items():
            typ = _field_type(cls, name)
            words = _field(cls, name).metadata.get("words", ())
            kwargs[name] = value if value in words else _coerce(value, typ, f"{section}.{name}")
        sections[section] = cls(**kwargs)
    return TrainConfig(**sections)


def _coerce(value: Any, typ: type, key: str) -> Any:
    if value is None:
        value = ""
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"`{key}` must be true or false. Received: {value!r}; fix the config file.")
    if typ is str:
        return str(value)
    try:
        coerced = typ(value)
    except (TypeError, ValueError):
        raise UserError(f"`{key}` must be {typ.__name__}. Received: {value!r}; fix the config file.") from None
    if typ is int and isinstance(value, float) and value != coerced:
        raise UserError(f"`{key}` must be a whole number. Received: {value!r}; fix the config file.")
    return coerced


def read_yaml(path: str, kind: str = "config file", check: str = "check --config", holds: str = "") -> dict[str, Any]:
    """The mapping a YAML file holds (an empty file: an empty one).

    Raises:
        UserError: naming the ``kind`` of file and ``path``: it cannot be
            read (then ``check``), is not YAML, or holds no mapping (it must
            hold ``holds``; by default the sections of a ``--config`` file).
    """
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
    except OSError as e:
        raise UserError(f"cannot read {kind} {path}: {e.strerror}; {check}.") from None
    except yaml.YAMLError as e:
        raise UserError(f"{kind} {path} is not valid YAML ({first_line(e)}); fix it.") from None
    if not isinstance(loaded, dict):
        holds = holds or f"a mapping of sections ({', '.join(SECTIONS)})"
        raise UserError(f"{kind} {path} must hold {holds}.")
    return loaded


def renamed_keys(loaded: dict[str, Any], where: str) -> dict[str, Any]:
    """``loaded`` (sections of options, as a ``--config`` file holds them) with the keys an option had
    before (``run.track_uri``: its field's ``old_keys``) under its name now (``run.tracker_uri``).

    Raises:
        UserError: a section gives an option under both names (naming ``where``).
    """
    hints = _section_types()
    renamed = {}
    for section, body in loaded.items():
        if section not in hints or not isinstance(body, dict):
            renamed[section] = body  # what _merge refuses, it names
            continue
        now = {old: f.name for f in dataclasses.fields(hints[section]) for old in f.metadata.get("old_keys", ())}
        renamed[section] = {}
        for name, value in body.items():
            if now.get(name) in body:
                raise UserError(
                    f"{where}: {section}.{name} is the older name of {section}.{now[name]}, which it gives too; "
                    f"keep {section}.{now[name]} alone."
                )
            renamed[section][now.get(name, name)] = value
    return renamed


def _merge(values: dict[str, dict[str, Any]], loaded: dict[str, Any], path: str) -> None:
    hints = _section_types()
    for section, body in renamed_keys(loaded, f"config file {path}").items():
        if section not in SECTIONS:
            raise UserError(f"config file {path}: unknown section {section!r}; use one of {', '.join(SECTIONS)}.")
        if not isinstance(body, dict):
            raise UserError(f"config file {path}: section {section!r} must be a mapping.")
        known = {f.name for f in dataclasses.fields(hints[section])}
        for name, value in body.items():
            if name not in known:
                raise UserError(
                    f"config file {path}: unknown key {section}.{name}; known keys: {', '.join(sorted(known))}."
                )
            values[section][name] = value
