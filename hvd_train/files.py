"""Whole files written atomically: a reader, or a rerun after a kill, never sees half a file.

And read back leniently, where a missing or foreign file is not an error."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading


@contextlib.contextmanager
def replacing(path: str, mode: str = "w", sync: bool = False):
    """A file open on a temporary name beside ``path``, renamed over ``path`` when the block ends.

    If the block raises, the temporary file is removed and ``path`` is left as
    it was. The file is made by a plain ``open``, so it has the mode every
    other output has (0666 less the umask), not ``mkstemp``'s 0600.

    Args:
        mode: ``"w"`` (UTF-8 text) or ``"wb"``.
        sync: flush the file to disk before the rename.
    """
    folder, name = os.path.split(os.path.abspath(path))
    # The host too: processes of two machines writing one shared folder may have the same pid.
    tmp = os.path.join(folder, f".{name}.tmp-{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}")
    text = {} if "b" in mode else {"encoding": "utf-8", "newline": ""}
    try:
        with open(tmp, mode, **text) as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def plain_name(rel) -> bool:
    """Whether ``rel`` names a file in a folder itself: no separator, not ``.`` or ``..``, not empty.

    For names read from a file that lists a folder's files (a checkpoint's ``state.json``, a shard
    set's ``manifest.json``): one that came from elsewhere may name ``../x`` or ``/x``."""
    return isinstance(rel, str) and rel not in ("", ".", "..") and not any(c in rel for c in ("/", "\\", "\0"))


def cache_base() -> str:
    """hvd_train's cache folder: ``$HVD_TRAIN_CACHE``, else ``hvd_train`` in the user's cache folder."""
    return os.environ.get("HVD_TRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvd_train"
    )


def write_text(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside it and a rename."""
    with replacing(path) as f:
        f.write(text)


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
    return _digest(path, hashlib.sha256())


def md5(path: str) -> str:
    """The MD5 of the file ``path``, in hex (to compare with an S3 ETag, not as a guard)."""
    return _digest(path, hashlib.md5(usedforsecurity=False))


def _digest(path: str, h) -> str:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
