"""Records streamed into tf.data by a pool of threads, and an input pipeline's failure in one line.

``StreamReader`` feeds the blocks of shard sets and the files of S3 folders
to the pipeline (``data.pipeline``) and remembers why a fetch failed, which
tf.data cannot say; ``input_errors`` turns that (or an image gone since the
start) into one line naming the rank, for training and ``evaluate`` alike.
"""

from __future__ import annotations

from hvd_train.compat import tf
from hvd_train.data import packed, storage
from hvd_train.data.blocks import Block
from hvd_train.data.fetcher import Fetcher
from hvd_train.data.packed import ShardSet
from hvd_train.errors import UserError, first_line


class StreamReader:
    """Feeds records fetched by a pool of threads into tf.data.

    Remembers the first failure of its fetches so the trainer can report it
    (tf.data would only say that a Python generator raised), and counts
    how long the pipeline waited on storage. A stream that its consumer
    abandons (``take(n)``, a dataset dropped at an elastic reset) ends with
    ``GeneratorExit``: that is no failure and is not recorded.
    """

    def __init__(self, s3: storage.S3Options, local: bool = False):
        self.s3 = s3
        self.fetcher = Fetcher(8 if local else s3.concurrency)
        self.error: Exception | None = None
        self._stores: dict[str, storage.Store] = {}

    def read_block(self, shard_set: ShardSet, block: Block) -> list[bytes]:
        shard = shard_set.shards[block.shard]
        if shard_set.url not in self._stores:
            self._stores[shard_set.url] = storage.open_store(shard_set.url, self.s3)
        store = self._stores[shard_set.url]
        start, end = shard.span(block.first, block.last)
        data = store.read(shard.file, start, end)
        return packed.unframe(data, block.last - block.first, store.full(shard.file) + f" (bytes {start}-{end})")

    def dataset(self, stream, signature) -> tf.data.Dataset:
        def guarded():
            try:
                yield from stream()
            except Exception as e:  # not GeneratorExit: an abandoned stream did not fail
                if self.error is None:
                    self.error = e
                raise

        return tf.data.Dataset.from_generator(guarded, output_signature=signature)

    def stats(self) -> dict:
        return self.fetcher.stats()


def input_failure(*readers: StreamReader | None) -> Exception | None:
    """The first failure of ``readers`` (the ones feeding the dataset that failed), if any."""
    return next((r.error for r in readers if r is not None and r.error is not None), None)


class input_errors:
    """Words an input pipeline failure as one line naming its cause, for training and ``evaluate`` alike.

    tf.data says only that a generator raised; the reader knows why (S3 gave
    up after its retries, a shard is corrupt). Otherwise a file that is gone
    or unreadable now was there at the start: the images changed while this
    ran. Only this rank knows, so the error names it. Other errors, a lost
    worker's failed collective among them, pass through.

    Args:
        rank: this rank.
        reader: the ``StreamReader`` feeding the dataset, if any.
        during: ``"training"`` or ``"evaluation"``, for the message.
    """

    def __init__(self, rank: int, reader: StreamReader | None = None, during: str = "training"):
        self.rank, self.reader, self.during = rank, reader, during

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or not isinstance(e, tf.errors.OpError):
            return False
        from hvd_train.distributed.elastic import is_horovod_failure

        if is_horovod_failure(e):
            return False  # a lost worker: the elastic wrapper handles it
        failure = input_failure(self.reader)
        if failure is not None:
            if isinstance(failure, UserError):
                raise UserError(f"rank {self.rank}: {failure}") from None
            raise failure from None
        if not isinstance(
            e, (tf.errors.NotFoundError, tf.errors.InvalidArgumentError, tf.errors.PermissionDeniedError)
        ):
            return False
        # Images were checked at the start; failing now means one changed since.
        reason = first_line(e.message)
        again = "rerun (the run resumes)" if self.during == "training" else "run it again"
        raise UserError(
            f"rank {self.rank} could not read its input during {self.during} ({reason}); "
            f"was an image deleted or changed during {self.during}? Fix the data and {again}."
        ) from None
