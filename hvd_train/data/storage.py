"""Where data lives: a local folder or an S3 prefix, behind one small interface.

``open_store(url)`` gives a ``Store`` rooted at ``url`` (``/data/x`` or
``s3://bucket/prefix``) that lists files below it, reads whole files or byte
ranges, and writes files atomically (a reader never sees half a file).

S3 goes through boto3: one client per process, shared by a bounded pool of
threads (connections are reused up to ``concurrency``), retries in boto3's
``standard`` or ``adaptive`` mode, credentials from the standard AWS chain
(environment, profile, instance role), and ``--s3-endpoint`` or
``AWS_ENDPOINT_URL`` for S3-compatible stores. When boto3 gives up, the
error names the bucket and key; no credential is ever put in a message.
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
import unicodedata
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from hvd_train import files
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger

log = get_logger("data")

T = TypeVar("T")
R = TypeVar("R")


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def os_bytes(path: str) -> bytes:
    """``path`` as the bytes the file system names it by, for TensorFlow's string tensors.

    Python keeps a name that is not valid UTF-8 (``caf\\xe9.png``, as an old
    Latin-1 tool writes it) with surrogate escapes; TensorFlow takes only
    bytes or valid UTF-8. S3 keys are always UTF-8.
    """
    return path.encode("utf-8", "surrogateescape")


def join(url: str, rel: str) -> str:
    """``url`` + ``/`` + ``rel`` for a folder or an S3 prefix."""
    return f"{url.rstrip('/')}/{rel}" if rel else url


def nfc(text: str) -> str:
    """``text`` in Unicode normal form C: the form names take on Linux and in S3 uploads from
    most systems, while macOS file systems hand out the decomposed form (NFD)."""
    return unicodedata.normalize("NFC", text)


def canonical_key(rel: str) -> tuple[str, ...]:
    """The sort key of a file path relative to a data root: its NFC segments, compared one by one.

    One order for every source: a local walk and an S3 listing of the same
    tree give the same list. Comparing segments rather than whole strings
    keeps a folder's files together (``a/x`` before ``a-b/x``, although
    ``-`` sorts before ``/``), and NFC makes a name typed on macOS sort like
    the same name typed elsewhere.
    """
    return tuple(nfc(rel).split("/"))


@dataclass(frozen=True)
class S3Options:
    """How to talk to S3.

    Attributes:
        endpoint: URL of an S3-compatible store; empty: ``AWS_ENDPOINT_URL`` or AWS.
        concurrency: requests in flight per process (and pooled connections).
        retry_mode: boto3 retry mode, ``standard`` or ``adaptive``.
        max_attempts: attempts per request, the first included.
        connect_timeout: seconds to connect before a retry.
        read_timeout: seconds without data before a retry.
    """

    endpoint: str = ""
    concurrency: int = 32
    retry_mode: str = "standard"
    max_attempts: int = 5
    connect_timeout: float = 10.0
    read_timeout: float = 60.0


def redact_url(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))


class Store:
    """Files below one root; paths given to the methods are relative to it."""

    url: str

    def list(self, flag: str) -> list[tuple[str, int]]:
        """Every file below the root as ``(relative path, size)``, in ``canonical_key`` order."""
        raise NotImplementedError

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """The file's bytes, or bytes ``[start, end)`` of it."""
        raise NotImplementedError

    def write(self, rel: str, data: bytes) -> None:
        """Writes the file so that it appears whole or not at all."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        """Removes the file if it exists."""
        raise NotImplementedError

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def full(self, rel: str) -> str:
        """The file's path or URL, for messages."""
        return join(self.url, rel)


class LocalStore(Store):
    def __init__(self, root: str):
        self.url = root
        self.root = root

    def list(self, flag: str) -> list[tuple[str, int]]:
        if not os.path.isdir(self.root):
            raise UserError(f"folder {self.root} does not exist; check {flag}.")
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if not name.startswith("."):
                    path = os.path.join(dirpath, name)
                    found.append((os.path.relpath(path, self.root).replace(os.sep, "/"), os.path.getsize(path)))
        return sorted(found, key=lambda item: canonical_key(item[0]))

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        path = os.path.join(self.root, rel)
        try:
            with open(path, "rb") as f:
                if start is None:
                    return f.read()
                f.seek(start)
                return f.read((end if end is not None else os.path.getsize(path)) - start)
        except OSError as e:
            raise UserError(f"cannot read {path} ({e.strerror}); was it deleted or changed during the run?") from None

    def write(self, rel: str, data: bytes) -> None:
        path = os.path.join(self.root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with files.replacing(path, "wb", sync=True) as f:
            f.write(data)

    def delete(self, rel: str) -> None:
        try:
            os.unlink(os.path.join(self.root, rel))
        except FileNotFoundError:
            pass

    def exists(self, rel: str) -> bool:
        return os.path.exists(os.path.join(self.root, rel))


class S3Store(Store):
    """An S3 prefix. Thread-safe: one boto3 client shared by all threads."""

    def __init__(self, url: str, options: S3Options):
        parts = urllib.parse.urlsplit(url)
        self.bucket = parts.netloc
        if not self.bucket:
            raise UserError(f"{url} names no bucket; write s3://BUCKET/PREFIX/.")
        self.prefix = parts.path.lstrip("/")
        if self.prefix and not self.prefix.endswith("/"):
            self.prefix += "/"
        self.url = f"s3://{self.bucket}/{self.prefix}"
        self.options = options
        self.client = client_for(options)
        self.endpoint = redact_url(self.client.meta.endpoint_url)

    def key(self, rel: str) -> str:
        return self.prefix + rel

    def _pages(self, prefix: str, flag: str, **kwargs):
        """Paginated ListObjectsV2 below ``prefix``, however many pages; a failure names ``flag``."""
        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix, **kwargs
            )
        except Exception as e:
            raise self.error(e, "list", prefix, flag) from None

    def _objects(self, page) -> list[tuple[str, int]]:
        """``(key relative to the prefix, size)`` of each object of one listing page."""
        return [(o["Key"][len(self.prefix) :], int(o["Size"])) for o in page.get("Contents", [])]

    @staticmethod
    def _files_in_order(found: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """``found`` without folder markers, in canonical order."""
        found = [(rel, size) for rel, size in found if rel and not rel.endswith("/")]
        return sorted(found, key=lambda item: canonical_key(item[0]))

    def list(self, flag: str) -> list[tuple[str, int]]:
        """Every key below the prefix, however many, with its size."""
        return self._files_in_order([obj for page in self._pages(self.prefix, flag) for obj in self._objects(page)])

    def children(self, rel: str, flag: str) -> tuple[list[str], list[str]]:
        """The names of the sub-folders and of the files directly in folder ``rel`` (relative to the prefix; ""
        for the prefix itself): a listing of one level, with ``/`` as delimiter."""
        below = self.prefix + (rel + "/" if rel else "")
        folders, files = [], []
        for page in self._pages(below, flag, Delimiter="/"):
            folders += [p["Prefix"][len(below) :].rstrip("/") for p in page.get("CommonPrefixes", [])]
            files += [o["Key"][len(below) :] for o in page.get("Contents", []) if o["Key"] != below]
        return folders, files

    def list_with_etags(self, flag: str) -> dict[str, tuple[int, str]]:
        """Every key below the prefix: ``{key relative to it: (size, ETag)}`` (an ETag is the MD5 of
        the object's body when it was uploaded whole)."""
        pages = self._pages(self.prefix, flag)
        return {
            o["Key"][len(self.prefix) :]: (int(o["Size"]), o.get("ETag", "").strip('"'))
            for page in pages
            for o in page.get("Contents", [])
        }

    def files_here(self, flag: str) -> list[tuple[str, int, str]]:
        """The objects directly below the prefix (a listing of one level): ``(name, size, "size:ETag")``."""
        return [
            (o["Key"][len(self.prefix) :], int(o["Size"]), f"{o['Size']}:{o.get('ETag', '').strip(chr(34))}")
            for page in self._pages(self.prefix, flag, Delimiter="/")
            for o in page.get("Contents", [])
            if o["Key"] != self.prefix
        ]

    def list_by_folder(self, flag: str, ticker=None) -> list[tuple[str, int]]:
        """Like ``list``, with one listing stream per top-level folder, in parallel.

        One ListObjectsV2 stream gives 1,000 keys a round trip: 1,300 round
        trips in a row for ImageNet. The top level is listed first (its
        folders as common prefixes), then every folder on a pool of
        ``concurrency`` threads. ``ticker.count`` follows the keys listed.
        """
        found, folders = [], []
        for page in self._pages(self.prefix, flag, Delimiter="/"):
            folders += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            found += self._objects(page)

        def one(folder: str) -> list[tuple[str, int]]:
            keys = []
            for page in self._pages(folder, flag):
                objects = self._objects(page)
                keys += objects
                if ticker is not None:
                    ticker.count += len(objects)
            return keys

        if folders:
            with ThreadPoolExecutor(min(len(folders), max(1, self.options.concurrency))) as pool:
                for keys in pool.map(one, folders):
                    found += keys
        return self._files_in_order(found)

    def read(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        return read_url(f"s3://{self.bucket}/{self.key(rel)}", self.options, start, end)

    def write(self, rel: str, data: bytes) -> None:
        # One PUT (or a multipart upload, completed last) is atomic in S3.
        key = self.key(rel)
        try:
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, key)
        except Exception as e:
            raise self.error(e, "write", key) from None

    def delete(self, rel: str) -> None:
        key = self.key(rel)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as e:
            raise self.error(e, "delete", key) from None

    def exists(self, rel: str) -> bool:
        key = self.key(rel)
        try:
            self.client.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self.error(e, "read", key) from None

    def error(self, e: Exception, action: str, key: str, flag: str = "") -> UserError:
        return UserError(s3_message(e, action, self.bucket, key, self.endpoint, flag))


def error_code(e: Exception) -> str:
    response = getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def s3_message(e: Exception, action: str, bucket: str, key: str, endpoint: str, flag: str = "") -> str:
    """A one-line explanation of a boto3 failure, naming bucket, key and the fix."""
    from botocore import exceptions as bx

    where = f"s3://{bucket}/{key}"
    via = f" (endpoint {endpoint})"
    code = error_code(e)
    if isinstance(e, bx.NoCredentialsError):
        return (
            f"no AWS credentials found to {action} {where}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            f"AWS_PROFILE, or run on a machine with an instance role (and forward AWS_* to every worker)."
        )
    if isinstance(e, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ReadTimeoutError):
        return (
            f"cannot reach S3 to {action} {where}{via} after retries: {type(e).__name__}; "
            f"check --s3-endpoint / AWS_ENDPOINT_URL and the network."
        )
    if isinstance(e, bx.ConnectionClosedError | bx.HTTPClientError):
        return f"lost the connection to S3 while trying to {action} {where}{via} after retries; check the store."
    if code in ("NoSuchBucket",):
        return f"bucket {bucket!r} does not exist{via}; check the bucket name{' in ' + flag if flag else ''}."
    if code in ("NoSuchKey", "404", "NotFound"):
        return f"{where} does not exist{via}; was it deleted during the run?"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "AuthFailure"):
        return (
            f"S3 rejected the credentials ({code}) to {action} {where}{via}; "
            f"check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE."
        )
    if code in ("AccessDenied", "403", "AllAccessDisabled"):
        return f"access denied to {action} {where}{via}; the credentials lack permission for this bucket."
    if code:
        return f"S3 error {code} when trying to {action} {where}{via}: {first_line(e)}"
    return f"cannot {action} {where}{via}: {type(e).__name__}: {first_line(e)}"


_clients: dict[tuple, object] = {}
_clients_lock = threading.Lock()


def client_for(options: S3Options):
    """One boto3 client per process and options: clients are thread-safe and pool connections."""
    # The AWS_* environment is part of the key: it holds the credential chain's first link.
    key = (options, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    with _clients_lock:
        if key not in _clients:
            import boto3
            from botocore.config import Config

            config = Config(
                retries={"mode": options.retry_mode, "max_attempts": options.max_attempts},
                max_pool_connections=max(10, options.concurrency),
                connect_timeout=options.connect_timeout,
                read_timeout=options.read_timeout,
            )
            # boto3 takes AWS_ENDPOINT_URL itself when no endpoint is given.
            _clients[key] = boto3.session.Session().client("s3", endpoint_url=options.endpoint or None, config=config)
        return _clients[key]


# Reads whose body broke off and were made again, in this process (``summary.json``).
_retried = 0
_retried_lock = threading.Lock()


def retried_reads() -> int:
    """How many S3 reads this process made again after their connection broke mid-body."""
    with _retried_lock:
        return _retried


def read_url(url: str, options: S3Options, start: int | None = None, end: int | None = None) -> bytes:
    """The bytes of one ``s3://bucket/key`` object (or of ``[start, end)`` of it).

    botocore retries a request until its response begins, not while its body
    streams in (boto/boto3#4111): a connection dropped mid-body, common over
    a week of reading ImageNet, would end the job. Such a read is made again,
    up to ``options.max_attempts`` times in all, with jittered exponential
    backoff, and counted (``retried_reads``).
    """
    global _retried
    from botocore import exceptions as bx

    bucket, _, key = url[len("s3://") :].partition("/")
    client = client_for(options)
    extra = {} if start is None else {"Range": f"bytes={start}-{'' if end is None else end - 1}"}
    attempts, attempt = max(1, options.max_attempts), 0
    while True:
        attempt += 1
        try:
            body = client.get_object(Bucket=bucket, Key=key, **extra)["Body"]
        except Exception as e:
            endpoint = redact_url(client.meta.endpoint_url)
            raise UserError(s3_message(e, "read", bucket, key, endpoint)) from None
        try:
            return body.read()
        except (bx.ResponseStreamingError, bx.IncompleteReadError, bx.ReadTimeoutError) as e:
            if attempt == attempts:
                endpoint = redact_url(client.meta.endpoint_url)
                raise UserError(
                    f"the connection to S3 broke while reading s3://{bucket}/{key} (endpoint {endpoint}) in "
                    f"each of {attempts} attempt(s) ({type(e).__name__}); check the network and the store, or "
                    f"raise --s3-max-attempts."
                ) from None
            with _retried_lock:
                _retried += 1
            log.warning(
                "S3: the connection broke while reading s3://%s/%s (%s); reading it again (attempt %d of %d)",
                bucket,
                key,
                type(e).__name__,
                attempt + 1,
                attempts,
            )
            body.close()  # the broken connection goes back to no pool while this thread waits
            time.sleep(random.uniform(0, min(_BACKOFF_CAP, _BACKOFF_BASE * 2**attempt)))
        except Exception as e:
            endpoint = redact_url(client.meta.endpoint_url)
            raise UserError(s3_message(e, "read", bucket, key, endpoint)) from None
        finally:
            body.close()


# Seconds: the n-th retry waits up to min(cap, base * 2**n), drawn uniformly (full jitter).
_BACKOFF_BASE, _BACKOFF_CAP = 0.1, 20.0


def open_store(url: str, s3: S3Options | None = None) -> Store:
    if is_s3(url):
        return S3Store(url, s3 or S3Options())
    return LocalStore(url)
