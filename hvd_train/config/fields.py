"""How an option is declared: a dataclass field whose metadata carries its flag, its help and the rest.

``config.sources`` makes the parser's flags and reads the YAML keys from
these: ``aliases`` (more flags of the same option), ``choices``, ``words``
(values other than numbers), ``old_keys`` (the YAML keys it had before,
still read, as a ``run_config.yaml`` of an earlier run has them).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, flag: str, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"flag": flag, "help": help, **extra})


def renamed(key: str) -> dict[str, tuple[str, ...]]:
    """An option's name before (``track_uri``): its flag (``--track-uri``) and YAML key, both still taken."""
    return {"aliases": ("--" + key.replace("_", "-"),), "old_keys": (key,)}
