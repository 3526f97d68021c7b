"""The tf.data input pipeline: shard, read, decode, augment, preprocess, batch.

Sharding is by index, per epoch:

1. every rank draws the same permutation of the N training images from
   ``(seed, epoch)``;
2. the permutation is extended by wrapping around to ``steps * batch * size``
   indices, with ``steps >= N / (batch * size)``, so every image is seen at
   least once an epoch;
3. rank ``r`` takes every ``size``-th index starting at ``r``.

Every rank therefore runs exactly ``steps`` full batches per epoch: Horovod
allreduces once per step, and a rank with fewer steps would leave the others
waiting forever. Augmentation draws from stateless random ops seeded by
``(seed, epoch, image index)``, so a resumed run sees the same images the
same way as an uninterrupted one.

Evaluation shards without padding (rank ``r`` takes images ``r, r+size, …``)
and keeps the last partial batch: each held-out image is scored exactly once.

Packed shard sets (``shards.py``) are divided into contiguous record ranges
instead, read with ranged reads (see ``train_shards``); images in S3 are
fetched by a bounded thread pool and streamed in (``StreamReader``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from hvd_train.data import shards, storage
from hvd_train.data.folder import ImageSet
from hvd_train.data.images import decode
from hvd_train.data.shards import ShardSet

Preprocess = Callable[[tf.Tensor], tf.Tensor]


@dataclass(frozen=True)
class TrainShard:
    """The training input of one rank.

    Attributes:
        dataset: batches of ``(images, labels)`` for epochs ``initial_epoch`` ... ``epochs - 1``.
        steps_per_epoch: batches per epoch, the same on every rank.
        reader: the fetcher of S3 objects or shard blocks (None for local image files).
    """

    dataset: tf.data.Dataset
    steps_per_epoch: int
    reader: StreamReader | None = None


def train_dataset(
    paths: list[str],
    labels: list[int],
    *,
    rank: int,
    size: int,
    batch_size: int,
    image_size: int,
    augment: str,
    preprocess: Preprocess,
    seed: int,
    initial_epoch: int,
    epochs: int,
    steps: int,
    threads: int = 0,
    s3: storage.S3Options | None = None,
) -> TrainShard:
    """Builds rank ``rank``'s training batches (see the module docstring).

    ``s3://`` images are fetched by a bounded pool of threads, in the order
    the index stream asks for them, and fed to tf.data without touching disk.

    Args:
        steps: batches per epoch; ``steps * batch_size * size`` must be at
            least ``len(paths)`` (``config.make_plan`` computes it).
        s3: how to reach S3, for ``s3://`` paths.
    """
    n = len(paths)
    padded = steps * batch_size * size
    paths_t = tf.constant(paths)
    labels_t = tf.constant(labels, dtype=tf.int32)
    augmenter = _augmenter(augment, image_size, seed)

    def epoch_order(epoch):
        perm = tf.random.experimental.stateless_shuffle(
            tf.range(n, dtype=tf.int64), seed=tf.stack([tf.constant(seed, tf.int64), epoch])
        )
        # Horovod: pad by wrapping around so every rank gets `steps` full batches.
        perm = tf.tile(perm, [math.ceil(padded / n)])[:padded]
        return perm[rank::size]

    def load(index, epoch, contents):
        return preprocess(augmenter(decode(contents), epoch * n + index)), labels_t[index]

    reader = None
    if paths and storage.is_s3(paths[0]):
        reader = StreamReader(s3 or storage.S3Options())

        def fetch(item):
            return storage.read_url(paths[item[0]], reader.s3)

        def objects():
            for epoch in range(initial_epoch, epochs):
                for index in epoch_order(tf.constant(epoch, tf.int64)).numpy().tolist():
                    yield index, epoch

        def stream():
            for (index, epoch), contents in reader.fetcher.stream(objects(), fetch):
                yield index, epoch, contents

        ds = reader.dataset(
            stream, (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string))
        )
    else:

        def epoch_indices(epoch):
            mine = epoch_order(epoch)
            return tf.data.Dataset.from_tensor_slices(mine).map(lambda i: (i, epoch))

        ds = tf.data.Dataset.range(initial_epoch, epochs).flat_map(epoch_indices)
        ds = ds.map(lambda i, e: (i, e, tf.io.read_file(paths_t[i])), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return TrainShard(_with_threads(ds, threads), steps, reader)


def train_shards(
    shard_set: ShardSet,
    *,
    rank: int,
    size: int,
    batch_size: int,
    image_size: int,
    augment: str,
    preprocess: Preprocess,
    seed: int,
    initial_epoch: int,
    epochs: int,
    steps: int,
    threads: int = 0,
    s3: storage.S3Options | None = None,
    shuffle_buffer: int = 1024,
) -> TrainShard:
    """Builds rank ``rank``'s training batches from a packed shard set.

    Every epoch the shard order is shuffled with ``(seed, epoch)`` and the
    records, taken in that order and wrapped around to ``steps * batch_size *
    size``, are cut into ``size`` equal contiguous ranges: rank ``r`` reads
    range ``r`` with ranged reads, so every rank runs exactly ``steps`` steps
    and every image is read at least once an epoch. A range is split into
    blocks of records; blocks are fetched in parallel, read interleaved
    ``CYCLE`` at a time, and records pass a shuffle buffer.
    """
    n = len(shard_set)
    per_rank = steps * batch_size
    reader = StreamReader(s3 or storage.S3Options(), local=not storage.is_s3(shard_set.url))
    label_map = tf.constant(shard_set.label_map, dtype=tf.int32)
    augmenter = _augmenter(augment, image_size, seed)
    starts = shard_set.starts

    def blocks(epoch: int) -> list[Block]:
        order = np.random.default_rng([seed, epoch, 1]).permutation(len(shard_set.shards))
        first = rank * per_rank
        mine = _ranges(shard_set, order, first % n, per_rank)
        out = [b for shard, lo, hi in mine for b in _split(shard_set, shard, lo, hi)]
        return [out[i] for i in np.random.default_rng([seed, epoch, 2, rank]).permutation(len(out))]

    def stream():
        def items():
            for epoch in range(initial_epoch, epochs):
                for block in blocks(epoch):
                    yield epoch, block

        fetched = reader.fetcher.stream(items(), lambda item: reader.read_block(shard_set, item[1]))
        yield from _interleave(fetched, starts)

    spec = (tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))
    ds = reader.dataset(stream, spec).unbatch()
    if shuffle_buffer > 1:
        ds = ds.shuffle(shuffle_buffer, seed=seed + rank)

    def load(record, index, epoch):
        contents, label = shards.parse(record)
        return preprocess(augmenter(decode(contents), epoch * n + index)), tf.gather(label_map, label)

    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    ds = ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return TrainShard(_with_threads(ds, threads), steps, reader)


def _augmenter(augment: str, image_size: int, seed: int):
    """``f(image, key index)``: the training augmentation, drawn from ``(seed, key index)``."""
    flips = "flip" in augment
    crops = "crop" in augment

    def apply(image, key_index):
        key = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), key_index)
        crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        if crops:
            image = _random_crop(image, image_size, crop_key)
        else:
            image = _center_crop(image, image_size, 1.0)
        if flips:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        return image

    return apply


@dataclass(frozen=True)
class Block:
    """Records ``first`` ... ``last - 1`` of shard ``shard``: one ranged read."""

    shard: int
    first: int
    last: int


BLOCK_BYTES = 4 << 20  # a ranged read: large enough for S3 throughput, small enough to mix
CYCLE = 4  # blocks read interleaved


def _ranges(shard_set: ShardSet, order, begin: int, count: int) -> list[tuple[int, int, int]]:
    """``(shard, first, last)`` runs covering ``count`` records from position
    ``begin`` of the records concatenated in shard ``order``, wrapping around."""
    out = []
    lengths = [shard_set.shards[s].images for s in order]
    # Find the shard where position `begin` falls.
    pos, k = 0, 0
    while pos + lengths[k] <= begin:
        pos += lengths[k]
        k += 1
    offset = begin - pos
    while count > 0:
        s = int(order[k % len(order)])
        take = min(shard_set.shards[s].images - offset, count)
        out.append((s, offset, offset + take))
        count -= take
        offset = 0
        k += 1
    return out


def _split(shard_set: ShardSet, shard: int, first: int, last: int) -> list[Block]:
    """Records ``first`` ... ``last - 1`` of a shard as blocks of about ``BLOCK_BYTES``."""
    offsets = shard_set.shards[shard].offsets
    out = []
    while first < last:
        end = first + 1
        while end < last and offsets[end] - offsets[first] < BLOCK_BYTES:
            end += 1
        out.append(Block(shard, first, end))
        first = end
    return out


def _interleave(fetched, starts, cycle: int = CYCLE):
    """Round-robin over ``cycle`` fetched blocks at a time, in chunks.

    Args:
        fetched: ``((epoch, block), records)`` in fetch order.
        starts: global index of each shard's first record.

    Yields:
        ``(records, global indices, epochs)`` arrays.
    """
    active: collections.deque = collections.deque()

    def chunk_of(item, records):
        (epoch, block) = item
        first = int(starts[block.shard]) + block.first
        return records, np.arange(first, first + len(records), dtype=np.int64), np.full(len(records), epoch, np.int64)

    for item, records in fetched:
        active.append(chunk_of(item, records))
        if len(active) < cycle:
            continue
        yield from _round_robin(active)
    while active:
        yield from _round_robin(active)


def _round_robin(active: collections.deque, piece: int = 16):
    """Takes ``piece`` records from each active block in turn until one runs out."""
    while active:
        for _ in range(len(active)):
            records, index, epoch = active.popleft()
            yield np.asarray(records[:piece], dtype=object), index[:piece], epoch[:piece]
            if len(records) > piece:
                active.append((records[piece:], index[piece:], epoch[piece:]))
            else:
                return


class StreamReader:
    """Feeds records fetched by a pool of threads into tf.data.

    Remembers the first failure of the fetch so the trainer can report it
    (tf.data would only say that a Python generator raised), and counts
    how long the pipeline waited on storage. ``failures`` collects the first
    failure of every reader of the process, evaluation readers included.
    """

    failures: list[BaseException] = []

    def __init__(self, s3: storage.S3Options, local: bool = False):
        self.s3 = s3
        self.fetcher = storage.Fetcher(8 if local else s3.concurrency)
        self.error: BaseException | None = None
        self._stores: dict[str, storage.Store] = {}

    def read_block(self, shard_set: ShardSet, block: Block) -> list[bytes]:
        shard = shard_set.shards[block.shard]
        if shard_set.url not in self._stores:
            self._stores[shard_set.url] = storage.open_store(shard_set.url, self.s3)
        store = self._stores[shard_set.url]
        start, end = shard.span(block.first, block.last)
        data = store.read(shard.file, start, end)
        return shards.unframe(data, block.last - block.first, store.full(shard.file) + f" (bytes {start}-{end})")

    def dataset(self, stream, signature) -> tf.data.Dataset:
        def guarded():
            try:
                yield from stream()
            except BaseException as e:
                if self.error is None:
                    self.error = e
                    StreamReader.failures.append(e)
                raise

        return tf.data.Dataset.from_generator(guarded, output_signature=signature)

    def stats(self) -> dict:
        return self.fetcher.stats()


def input_failure() -> BaseException | None:
    """The first failure of any S3 or shard reader of this process, if any."""
    return StreamReader.failures[0] if StreamReader.failures else None


def eval_dataset(
    data: ImageSet | ShardSet,
    *,
    rank: int,
    size: int,
    batch_size: int,
    image_size: int,
    crop_fraction: float,
    preprocess: Preprocess,
    threads: int = 0,
    s3: storage.S3Options | None = None,
) -> tf.data.Dataset:
    """Builds rank ``rank``'s share of held-out images: no padding, no drops.

    Folder images are dealt round-robin (rank ``r`` takes ``r, r+size, ...``);
    a shard set is cut into ``size`` contiguous ranges of records. Batches are
    ``(images, labels)``; the last batch may be smaller.
    """
    s3 = s3 or storage.S3Options()

    def center(contents):
        return preprocess(_center_crop(decode(contents), image_size, crop_fraction))

    if isinstance(data, ShardSet):
        reader = StreamReader(s3, local=not storage.is_s3(data.url))
        bounds = np.linspace(0, len(data), size + 1).astype(np.int64)
        order = np.arange(len(data.shards))
        mine = _ranges(data, order, int(bounds[rank]), int(bounds[rank + 1] - bounds[rank]))
        blocks = [b for shard, lo, hi in mine if hi > lo for b in _split(data, shard, lo, hi)]
        label_map = tf.constant(data.label_map, dtype=tf.int32)

        def stream():
            for _, records in reader.fetcher.stream(blocks, lambda b: reader.read_block(data, b)):
                yield np.asarray(records, dtype=object)

        ds = reader.dataset(stream, tf.TensorSpec([None], tf.string)).unbatch()

        def load_record(record):
            contents, label = shards.parse(record)
            return center(contents), tf.gather(label_map, label)

        ds = ds.map(load_record, num_parallel_calls=tf.data.AUTOTUNE)
    else:
        mine_paths = data.paths[rank::size]
        mine_labels = data.labels[rank::size]
        labels_t = tf.constant(mine_labels, dtype=tf.int32)
        if mine_paths and storage.is_s3(mine_paths[0]):
            reader = StreamReader(s3)

            def objects():
                fetched = reader.fetcher.stream(range(len(mine_paths)), lambda i: storage.read_url(mine_paths[i], s3))
                yield from fetched

            ds = reader.dataset(objects, (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string)))
        else:
            ds = tf.data.Dataset.from_tensor_slices(
                (tf.range(len(mine_paths), dtype=tf.int64), tf.constant(mine_paths, dtype=tf.string))
            )
            ds = ds.map(lambda i, p: (i, tf.io.read_file(p)), num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.map(lambda i, contents: (center(contents), labels_t[i]), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
    return _with_threads(ds, threads)


def predict_dataset(
    paths: list[str], *, batch_size: int, image_size: int, crop_fraction: float, preprocess: Preprocess
) -> tf.data.Dataset:
    """Batches of preprocessed images in ``paths`` order, for prediction."""
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(paths, dtype=tf.string))
    ds = ds.map(
        lambda p: preprocess(_center_crop(decode(tf.io.read_file(p)), image_size, crop_fraction)),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def _random_crop(image: tf.Tensor, image_size: int, key: tf.Tensor) -> tf.Tensor:
    """Random crop of 25-100% of the area, aspect 3/4-4/3, resized to the input size."""
    begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
        tf.shape(image),
        bounding_boxes=tf.zeros([1, 0, 4]),
        seed=key,
        min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(0.25, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    image = tf.slice(image, begin, crop_size)
    return _resize(image, image_size)


def _center_crop(image: tf.Tensor, image_size: int, fraction: float) -> tf.Tensor:
    """The central square of side ``fraction * min(h, w)``, resized to the input size."""
    shape = tf.shape(image)
    h, w = shape[0], shape[1]
    side = tf.maximum(1, tf.cast(fraction * tf.cast(tf.minimum(h, w), tf.float32), tf.int32))
    top = (h - side) // 2
    left = (w - side) // 2
    image = tf.slice(image, tf.stack([top, left, 0]), tf.stack([side, side, 3]))
    return _resize(image, image_size)


def _resize(image: tf.Tensor, image_size: int) -> tf.Tensor:
    image = tf.image.resize(image, [image_size, image_size])  # bilinear, as Keras preprocessing
    image.set_shape([image_size, image_size, 3])
    return image  # float32 in [0, 255], what keras.applications preprocess_input expects


def _with_threads(ds: tf.data.Dataset, threads: int) -> tf.data.Dataset:
    options = tf.data.Options()
    if threads:
        options.threading.private_threadpool_size = threads
    return ds.with_options(options)
