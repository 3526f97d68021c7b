"""Whole files written atomically: a reader, or a rerun after a kill, never sees half a file.

And read back leniently, where a missing or foreign file is not an error."""

from __future__ import annotations

import contextlib
import json
import os


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside it and a rename."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_json(path: str, default=None):
    """The JSON in ``path``, or ``default`` where the file is missing or not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def write_json(path: str, obj) -> None:
    """``obj`` as indented JSON, atomically."""
    write_text(path, json.dumps(obj, indent=2) + "\n")
