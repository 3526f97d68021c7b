"""Where the rows of a CSV of labels find their files: each folder they name listed once, names matched
exactly, else by their Unicode normal form C (``data.table``)."""

from __future__ import annotations

import concurrent.futures
import os
from collections import defaultdict
from dataclasses import dataclass, field

from hvd_train.data import storage
from hvd_train.data.folder import is_image_name
from hvd_train.errors import UserError


@dataclass
class _Folder:
    """One listed folder: its files' and sub-folders' names, those by their NFC too, and its images by stem."""

    files: set[str] = field(default_factory=set)
    folders: set[str] = field(default_factory=set)
    nfc_files: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    nfc_folders: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    stems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def _pick(name: str, exact: set[str], by_nfc: dict[str, list[str]]) -> tuple[str | None, str]:
    """The entry ``name`` names: itself, else the one entry of its NFC; or None and why not ("": none)."""
    if name in exact:
        return name, ""
    found = by_nfc.get(storage.nfc(name), [])
    if len(found) > 1:
        return None, f" (names {len(found)} entries, in two Unicode forms: rename one of them)"
    return (found[0], "") if found else (None, "")


class Listing:
    """The folders the rows name, each listed once (not a look-up a row).

    A segment of a row's path names the entry of that exact name, else the
    one entry whose name has the same NFC: a name as macOS writes it
    (decomposed accents) is found by the same name typed elsewhere, as a
    folder's listing finds it, and two entries that differ only so are
    refused rather than guessed between. Folders of one depth are listed at
    once on a pool of threads (S3: a delimited ListObjectsV2 stream each).
    """

    def __init__(self, prefix: str, s3, where: str):
        self.prefix, self.where = prefix, where
        self.store = storage.S3Store(prefix, s3) if storage.is_s3(prefix) else None
        self.threads = max(1, s3.concurrency) if self.store else 16
        self.listed: dict[str, _Folder | None] = {}  # real folder (relative) -> its listing; None: not there
        self.real: dict[str, tuple[str | None, str]] = {"": ("", "")}  # a row's folder -> (real folder, why not)

    def find(self, folders: set[str]) -> None:
        """Finds and lists ``folders`` (as the rows write them, relative to the root) and the folders above them."""
        levels: dict[int, list[str]] = defaultdict(list)  # the folders by their depth
        for found in {f for folder in folders for f in _with_parents(folder)}:
            levels[_depth(found)].append(found)
        for depth in range(1, max(levels) + 2):
            todo = sorted(
                {r for r, _ in map(self.real.get, levels[depth - 1]) if r is not None and r not in self.listed}
            )
            with concurrent.futures.ThreadPoolExecutor(min(self.threads, max(1, len(todo)))) as pool:
                for real, listing in zip(todo, pool.map(self._list, todo)):
                    self.listed[real] = listing
            for folder in levels[depth]:
                parent, _, name = folder.rpartition("/")
                real_parent, why = self.real[parent]
                listing = self.listed.get(real_parent) if real_parent is not None else None
                if listing is None:
                    self.real[folder] = (None, why)
                    continue
                real, why = _pick(name, listing.folders, listing.nfc_folders)
                self.real[folder] = (None if real is None else (real_parent + "/" if real_parent else "") + real, why)

    def resolve(self, rel: str) -> tuple[str | None, str]:
        """The real relative path of the file ``rel`` names (an id without extension found with one), or None
        and why not ("" when it is not there)."""
        folder, _, name = rel.rpartition("/")
        real, why = self.real[folder]
        listing = self.listed.get(real) if real is not None else None
        if listing is None:
            return None, why
        found, why = _pick(name, listing.files, listing.nfc_files)
        if why:
            return None, why
        if found is not None:
            if not is_image_name(found):
                return None, f" ({os.path.splitext(found)[1] or 'no extension'}: not an image read here)"
        elif _pick(name, listing.folders, listing.nfc_folders)[0] is not None:
            return None, " (a folder)"
        elif not is_image_name(name):
            matches = listing.stems.get(storage.nfc(name), [])
            if len(matches) > 1:
                return None, f" (one id, several files: {', '.join(sorted(matches))})"
            found = matches[0] if matches else None
        if found is None:
            return None, ""
        return (real + "/" if real else "") + found, ""

    def _list(self, real: str) -> _Folder | None:
        listing = _Folder()

        def add(name: str, is_folder: bool) -> None:
            key = storage.nfc(name)
            if is_folder:
                listing.folders.add(name)
                listing.nfc_folders[key].append(name)
                return
            listing.files.add(name)
            listing.nfc_files[key].append(name)
            if is_image_name(key):
                listing.stems[key.rsplit(".", 1)[0]].append(name)

        if self.store is not None:
            folders, files = self.store.children(real, self.where)
            for name in folders:
                add(name, True)
            for name in files:
                add(name, False)
            return listing if folders or files or not real else None
        path = self.prefix + real
        try:
            with os.scandir(path) as entries:
                for entry in entries:
                    try:
                        kind = entry.is_dir(), entry.is_file()
                    except OSError:  # a link in a loop: neither, as a broken link
                        continue
                    if any(kind):
                        add(entry.name, kind[0])
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise UserError(f"{self.where}: cannot list {path} ({e.strerror}); check its permissions.") from None
        return listing


def _depth(folder: str) -> int:
    """Segments of ``folder`` (0 for the root, "")."""
    return folder.count("/") + 1 if folder else 0


def _with_parents(folder: str) -> list[str]:
    """``a/b/c`` -> ``a``, ``a/b``, ``a/b/c`` (and the root, "")."""
    parts = folder.split("/") if folder else []
    return ["", *("/".join(parts[: i + 1]) for i in range(len(parts)))]
