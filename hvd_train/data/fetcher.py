"""Bounded-concurrency fetches in order: how local and S3 reads overlap without flooding a store."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Fetcher:
    """Runs a blocking fetch over many items with bounded concurrency, in order.

    ``stream`` keeps up to ``window`` fetches queued on a pool of
    ``concurrency`` threads (so at most ``concurrency`` requests are in
    flight) and yields results in input order. The time the consumer spent
    waiting for a result that was not ready yet is added to ``wait_seconds``:
    the input pipeline stalled on storage for at most that long.
    """

    def __init__(self, concurrency: int):
        self.concurrency = max(1, concurrency)
        self.wait_seconds = 0.0
        self.fetched = 0
        self.bytes = 0
        self._lock = threading.Lock()

    def stream(self, items: Iterable[T], fetch: Callable[[T], R], window: int = 0) -> Iterator[tuple[T, R]]:
        window = window or 4 * self.concurrency
        # A pool per stream, shut down when the stream ends or is abandoned:
        # evaluation builds a new stream every epoch.
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="hvd-train-fetch")
        pending: collections.deque[tuple[T, Future]] = collections.deque()
        it = iter(items)
        try:
            for item in it:
                pending.append((item, pool.submit(fetch, item)))
                if len(pending) >= window:
                    break
            while pending:
                item, future = pending.popleft()
                if not future.done():
                    t0 = time.perf_counter()
                    result = future.result()
                    waited = time.perf_counter() - t0
                else:
                    result, waited = future.result(), 0.0
                with self._lock:
                    self.wait_seconds += waited
                    self.fetched += 1
                    self.bytes += _size(result)
                nxt = next(it, _END)
                if nxt is not _END:
                    pending.append((nxt, pool.submit(fetch, nxt)))
                yield item, result
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict:
        with self._lock:
            return {"wait_seconds": self.wait_seconds, "objects": self.fetched, "bytes": self.bytes}


_END = object()


def _size(result) -> int:
    """Bytes in a fetch result: one object's bytes, or a list of records."""
    if isinstance(result, bytes | bytearray):
        return len(result)
    if isinstance(result, list):
        return sum(len(r) for r in result)
    return 0
