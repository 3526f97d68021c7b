"""Checking images before the first step, without paying a full pass at every start.

``--check-images`` picks how much is checked before training:

* ``quick`` (the default): each local file's first and last bytes. A file
  that starts and ends as a JPEG, PNG or GIF does passes; any other (empty,
  cut short, an HTML page saved as ``.jpg``, a BMP) is a *suspect* and is
  decoded, so only real failures are skipped, with the decoder's reason.
  Two small reads per file: 300,000 files take seconds, not the minute a
  decode of each takes. Objects in S3 are not read at start (that would be
  a request per object).
* ``full``: every image decoded once, as before. The verdicts are kept in
  a cache keyed by path, size and modification time, so a resume, a
  requeue or the next run decodes only what changed.
* ``none``: nothing is read.

An image that passes and still cannot be decoded in training (a corrupt
middle) is replaced by a stand-in with no weight (``pipeline``) and
listed: it never stops or stalls a rank.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os

import numpy as np

from hvd_train import files
from hvd_train.data.folder import PathList
from hvd_train.log import Ticker, get_logger

log = get_logger("data")

# How each format starts, and how a whole file of it ends (trailing padding aside).
FORMATS = (
    (b"\xff\xd8\xff", b"\xff\xd9"),  # JPEG: SOI ... EOI
    (b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"),  # PNG: signature ... IEND chunk
    (b"GIF8", b";"),  # GIF: header ... trailer
)


def looks_whole(path: str) -> bool:
    """Whether the file at ``path`` starts and ends like a JPEG, PNG or GIF.

    False means only "decode it to know": a JPEG with bytes after its end
    marker is a valid image.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size < 16:
            return False
        head = os.pread(fd, 16, 0)
        tail = os.pread(fd, 16, size - 16).rstrip(b"\0\r\n ")
    except OSError:
        return False
    finally:
        os.close(fd)
    for start, end in FORMATS:
        if head.startswith(start):
            return tail.endswith(end)
    return False  # BMPs too: rare, and some bit depths do not decode


def suspects(paths: list[str], what: str, workers: int = 8) -> list[str]:
    """The ``paths`` that do not look whole (``looks_whole``), in order; read on a pool of threads."""
    if not paths:
        return []
    chunks = [paths[i::workers] for i in range(workers)]
    with Ticker(log, f"checking {what} (quick)", len(paths), "images") as ticker:

        def check(chunk):
            out = []
            for k, path in enumerate(chunk):
                if not looks_whole(path):
                    out.append(path)
                if k % 1024 == 1023:
                    ticker.count += 1024
            return out

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            found = {p for part in pool.map(check, chunks) for p in part}
    return [p for p in paths if p in found]


def cache_folder() -> str:
    """Where full-check verdicts are kept: ``$HVD_TRAIN_CACHE``, else the user's cache folder."""
    return os.path.join(files.cache_base(), "image-checks")


class CheckCache:
    """Full-check verdicts for the images below one local root, keyed by path, size and mtime.

    One ``.npz`` file per root (named by a digest of its real path), written
    atomically: the relative paths (as a ``PathList``), sizes, modification
    times, and the reason of each image that failed. An entry counts only
    while the file's size and mtime are unchanged.
    """

    def __init__(self, root: str, folder: str | None = None):
        self.root = os.path.realpath(root)
        name = hashlib.sha256(self.root.encode("utf-8", "surrogateescape")).hexdigest()[:16]
        self.path = os.path.join(folder or cache_folder(), f"{name}.npz")

    def load(self) -> dict[str, tuple[int, int, str | None]]:
        """``{relative path: (size, mtime_ns, reason or None)}``; empty when there is no usable cache."""
        try:
            with np.load(self.path, allow_pickle=False) as z:
                paths = PathList("", z["blob"].tobytes(), z["ends"])
                sizes, mtimes = z["sizes"].tolist(), z["mtimes"].tolist()
                reasons = json.loads(str(z["reasons"]))
                if str(z["root"]) != self.root:
                    return {}
        except (OSError, KeyError, ValueError) as e:
            if os.path.exists(self.path):
                log.warning("ignoring the image-check cache %s (%s); images are checked again", self.path, e)
            return {}
        return {p: (s, m, reasons.get(str(i))) for i, (p, s, m) in enumerate(zip(paths, sizes, mtimes))}

    def save(self, entries: dict[str, tuple[int, int, str | None]]) -> None:
        """Replaces the cache with ``entries`` (atomically); a cache that cannot be written is only a warning."""
        rels = list(entries)
        values = [entries[r] for r in rels]
        paths = PathList.of("", rels)
        reasons = {str(i): v[2] for i, v in enumerate(values) if v[2] is not None}
        tmp = f"{self.path}.tmp-{os.getpid()}.npz"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            np.savez(
                tmp,
                root=np.array(self.root),
                blob=np.frombuffer(paths.blob, np.uint8),
                ends=paths.ends,
                sizes=np.array([v[0] for v in values], np.int64),
                mtimes=np.array([v[1] for v in values], np.int64),
                reasons=np.array(json.dumps(reasons)),
            )
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("could not write the image-check cache %s (%s); the next start checks again", self.path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def stamps(paths: list[str], what: str, workers: int = 8) -> list[tuple[int, int] | None]:
    """``(size, mtime_ns)`` of each path (None where it cannot be read), on a pool of threads."""

    def stamp(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    with Ticker(log, f"checking {what} (full): looking up the cache", len(paths), "images") as ticker:
        out = []
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for k, s in enumerate(pool.map(stamp, paths, chunksize=256)):
                out.append(s)
                if k % 1024 == 1023:
                    ticker.count = k + 1
    return out
