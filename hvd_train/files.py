"""Whole files written atomically: a reader, or a rerun after a kill, never sees half a file.

And read back leniently, where a missing or foreign file is not an error."""

from __future__ import annotations

import contextlib
import hashlib
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


def sha256(path: str) -> str:
    """The SHA-256 of the file ``path``, in hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def as_plain_file(fd: int) -> None:
    """Gives the file ``fd`` the mode a plain ``open`` would have: 0666 less the umask.

    ``tempfile.mkstemp`` makes its files 0600, so an output written through
    one and renamed into place would be readable by its owner alone (not by a
    team's group, nor by a container running as another user).
    """
    os.fchmod(fd, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it to read it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
