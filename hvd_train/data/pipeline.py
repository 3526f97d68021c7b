"""The tf.data input pipeline: read, decode, augment, preprocess, batch.

Which images a rank trains on, and in which order, is decided in
``sharding`` (image folders: every ``size``-th image of the epoch's
permutation) and ``blocks`` (shard sets: contiguous runs of records read in
blocks): plain numpy plans that depend only on the seed, the epoch and the
numbers of images, workers and batch. This module turns a rank's plan into
batches of ``(images, labels, ids)``; ``ids`` name the images (index in the
folder listing, or record index in a shard set) so a run can account for
every image it consumed.

Augmentation draws from stateless random ops seeded by ``(seed, epoch, image
index)``, and every stage keeps its order, so a resumed run sees the same
images in the same order and augmented the same way as an uninterrupted
one.

Evaluation shards without padding (rank ``r`` takes images ``r, r+size, ...``
of a folder, or one contiguous range of a shard set's records) and keeps the
last partial batch: each held-out image is scored exactly once. Images in
S3 are fetched by a bounded thread pool and streamed in (``StreamReader``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hvd_train.compat import tf
from hvd_train.data import storage
from hvd_train.data.blocks import BlockLayout, eval_blocks, stream_records
from hvd_train.data.folder import ImageSet, PathList
from hvd_train.data.images import DEFAULT_ALPHA_BACKGROUND, Window, decode_window, plain
from hvd_train.data.packed import ShardSet
from hvd_train.data.randaugment import rand_augment
from hvd_train.data.sharding import Segment, Strided, epoch_order
from hvd_train.data.stand_ins import black, decoded_or_stand_in, group_size
from hvd_train.data.streams import StreamReader

Preprocess = Callable[[tf.Tensor], tf.Tensor]

STRIDED = Strided()


@dataclass(frozen=True)
class TrainInput:
    """The training input of one rank for the rest of a run.

    Attributes:
        dataset: batches of ``(images, labels, ids)``; epoch after epoch,
            ``steps`` batches of each segment of ``segments``.
        segments: ``(segment, first step)`` in the order the batches come.
        reader: the fetcher of S3 objects or shard blocks (None for local image files).
    """

    dataset: tf.data.Dataset
    segments: tuple[tuple[Segment, int], ...]
    reader: StreamReader | None = None


def train_input(
    data: ImageSet | ShardSet,
    segments: Iterable[tuple[Segment, int]],
    *,
    rank: int,
    image_size: int,
    augment: str,
    preprocess: Preprocess,
    seed: int,
    threads: int = 0,
    s3: storage.S3Options | None = None,
    fused_jpeg: bool = True,
    alpha_background: str = DEFAULT_ALPHA_BACKGROUND,
    magnitude: float = 9.0,
) -> TrainInput:
    """Rank ``rank``'s batches for ``segments`` (each from its first step on).

    Every segment must have the same per-worker batch: it is the batch of
    the dataset.

    Args:
        data: the training images (a folder listing) or a packed shard set.
        segments: ``(segment, start step)`` pairs: the rest of the current
            epoch, then whole epochs.
        s3: how to reach S3, for ``s3://`` images and shard sets.
        fused_jpeg: decode only the crop of a JPEG (False: decode whole, then crop).
        alpha_background: what transparent pixels are composited over (``images.decode``).
        magnitude: RandAugment's magnitude (``augment`` ``randaugment``).
    """
    segments = tuple(segments)
    batches = {seg.batch for seg, _ in segments}
    if len(batches) > 1:
        raise ValueError(f"`segments` must share one batch size. Received: {sorted(batches)}")
    batch = batches.pop() if batches else 1
    augmenter = _augmenter(augment, image_size, seed, fused_jpeg, alpha_background, magnitude)
    n = len(data)
    if isinstance(data, ShardSet):
        reader = StreamReader(s3 or storage.S3Options(), local=not storage.is_s3(data.url))
        label_map = tf.constant(data.label_map, dtype=tf.int32)
        ds = _shard_records(data, segments, rank, seed, reader)
        parse = data.features.parser()

        def load(record, index, epoch):
            contents, label = parse(record)
            return augmenter(contents, epoch * n + index), tf.gather(label_map, label), index

    else:
        reader, ds = _folder_files(data, segments, rank, seed, s3)
        label_of = label_lookup(data)

        def load(index, epoch, contents):
            return augmenter(contents, epoch * n + index), label_of(index), index

        def stand_ins(index, epoch, contents):
            return black(index, image_size), label_of(index), -1 - index

    # Order is kept at every stage (tf.data's default): the same plan gives the same batches.
    if isinstance(data, ShardSet):
        ds = ds.map(plain(load), num_parallel_calls=tf.data.AUTOTUNE)  # records were decoded when packed
        ds = ds.batch(batch, drop_remainder=True)
    else:  # a batch of whole groups, merged by a reshape: nothing is unbatched and batched again
        group = group_size(batch)
        ds = decoded_or_stand_in(ds, load, stand_ins, group).batch(batch // group, drop_remainder=True)

    def prepared(images, labels, ids):
        if not isinstance(data, ShardSet):
            images, labels, ids = (tf.reshape(p, [batch, *p.shape[2:]]) for p in (images, labels, ids))
        # The model's preprocessing, once per batch: vectorized over the batch, cheaper than per image.
        return preprocess(images), labels, ids

    ds = ds.map(plain(prepared), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    return TrainInput(_with_threads(ds, threads), segments, reader)


def label_lookup(data: ImageSet):
    """``f(index)``: the label of image ``index`` of ``data``, its class (int32), or in a multi-label set its
    classes as one multi-hot row (float32 ``[classes]``, all 0 for an image with none)."""
    if data.label_sets is None:
        labels_t = tf.constant(data.labels, dtype=tf.int32)
        return lambda index: tf.gather(labels_t, index)
    sets, classes = data.label_sets, len(data.classes)
    rows = tf.RaggedTensor.from_row_limits(tf.constant(sets.indices, tf.int32), tf.constant(sets.ends))

    def multi_hot(index):  # a scalar index, or a group of them
        index = tf.convert_to_tensor(index)
        mine = tf.gather(rows, tf.reshape(index, [-1]))
        hot = tf.reduce_sum(tf.ragged.map_flat_values(tf.one_hot, mine, classes), axis=1)  # a set: 0 or 1 each
        return tf.reshape(tf.cast(hot, tf.float32), tf.concat([tf.shape(index), [classes]], 0))

    return multi_hot


def release(held: list) -> None:
    """Frees the tf.data iterators in ``held`` (their only reference) without waiting for them.

    Freeing an iterator waits for its autotuning thread. That thread sleeps
    between its rounds for a period that doubles up to 60 s over a run, and
    TensorFlow 2.21's cancellation can miss it (as its code reads, the
    wake-up may come before the flag the thread checks is set): then the
    iterator's owner waits out the rest of the period. At the end of the
    demo that was 29-34 s in about half of the runs, the other rank waiting
    in its next collective. The destructor releases the GIL, so a daemon
    thread can do the waiting while the run goes on; nothing waits for it
    at exit.
    """
    threading.Thread(target=held.clear, name="release-input", daemon=True).start()


def _folder_files(data: ImageSet, segments, rank: int, seed: int, s3):
    """``(index, epoch, encoded image)`` in the order of the plan, and the S3 reader (or None)."""
    n = len(data)
    plan = tuple(segments)

    def order(k: int) -> np.ndarray:
        """This rank's images of segment ``k``, in the order it trains on them."""
        seg, start = plan[k]
        return epoch_order(n, seed, seg.epoch)[seg.stream(STRIDED, rank, start)]

    if data.paths and storage.is_s3(data.paths[0]):
        reader = StreamReader(s3 or storage.S3Options())
        paths = data.paths

        def items():
            for k, (seg, _) in enumerate(plan):
                for index in order(k).tolist():
                    yield index, seg.epoch

        def stream():
            for (index, epoch), contents in reader.fetcher.stream(
                items(), lambda item: storage.read_url(paths[item[0]], reader.s3)
            ):
                yield index, epoch, contents

        signature = (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string))
        return reader, reader.dataset(stream, signature)
    path_of = _path_lookup(data.paths)

    def order_of(k):
        k = int(k)
        ids = order(k).astype(np.int64)
        return ids, np.full(len(ids), plan[k][0].epoch, np.int64)

    def segment(k):
        ids, epochs = tf.numpy_function(order_of, [k], (tf.int64, tf.int64), stateful=False)
        return tf.data.Dataset.from_tensor_slices((tf.ensure_shape(ids, [None]), tf.ensure_shape(epochs, [None])))

    # A segment's order is made when its first image is wanted, one segment at a time: a
    # run's orders of every epoch at once would be ~1 GB for ImageNet's 90. Not
    # ``from_generator``: with it, the same steps ran 7-9 % slower on 2 cores (its element
    # functions cost 0.07 ms of CPU an image more, and the rate lost more than that).
    ds = tf.data.Dataset.range(len(plan)).flat_map(plain(segment))
    ds = ds.map(plain(lambda i, e: (i, e, tf.io.read_file(path_of(i)))), num_parallel_calls=tf.data.AUTOTUNE)
    return None, ds


def _path_lookup(paths: PathList):
    """``f(i)``: path ``i`` as a string tensor, cut from the list's one buffer.

    A tensor of a million separate strings would cost ~100 MB per rank; the
    buffer costs what the relative paths do.
    """
    blob = tf.constant(paths.blob)
    starts_np = paths.starts()
    starts, lengths = tf.constant(starts_np), tf.constant(paths.ends - starts_np)
    prefix = tf.constant(storage.os_bytes(paths.prefix))

    def path_of(i):
        return tf.strings.join([prefix, tf.strings.substr(blob, starts[i], lengths[i])])

    return path_of


def _shard_records(shard_set: ShardSet, segments, rank: int, seed: int, reader: StreamReader) -> tf.data.Dataset:
    """``(record, record index, epoch)`` in the order of the plan (see ``blocks``)."""

    def plans():
        for seg, start in segments:
            layout = BlockLayout(shard_set, seed, seg.epoch)
            blocks, block_of, within, positions = layout.reads(seg, rank, start)
            yield blocks, block_of, within, (layout.global_index(positions), seg.epoch)

    def stream(chunk: int = 64):
        records, index, epochs = [], [], []
        fetched = stream_records(plans(), lambda block: reader.read_block(shard_set, block), reader.fetcher)
        for record, k, (ids, epoch) in fetched:
            records.append(record)
            index.append(ids[k])
            epochs.append(epoch)
            if len(records) == chunk:
                yield np.asarray(records, dtype=object), np.asarray(index, np.int64), np.asarray(epochs, np.int64)
                records, index, epochs = [], [], []
        if records:
            yield np.asarray(records, dtype=object), np.asarray(index, np.int64), np.asarray(epochs, np.int64)

    spec = (tf.TensorSpec([None], tf.string), tf.TensorSpec([None], tf.int64), tf.TensorSpec([None], tf.int64))
    return reader.dataset(stream, spec).unbatch()


def _augmenter(augment: str, image_size: int, seed: int, fused_jpeg=True, background="white", magnitude=9.0):
    """``f(encoded image, key index)``: decode and augment, drawn from ``(seed, key index)``.

    ``randaugment``: the crop and flip, then two RandAugment operations at ``magnitude``."""
    randaugment = augment == "randaugment"
    flips = "flip" in augment or randaugment
    crops = "crop" in augment or randaugment

    def apply(contents, key_index):
        key = tf.random.experimental.stateless_fold_in(tf.constant([seed, 0], tf.int64), key_index)
        crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
        window = random_crop_window(crop_key) if crops else center_window(1.0)
        image = _resize(decode_window(contents, window, fused_jpeg, image_size, background), image_size)
        if flips:
            image = tf.image.stateless_random_flip_left_right(image, flip_key)
        if randaugment:  # a key of its own: the crop's and the flip's stay what they were
            image = rand_augment(image, tf.random.experimental.stateless_fold_in(key, 1), magnitude)
        return image

    return apply


@dataclass(frozen=True)
class EvalInput:
    """One rank's held-out batches, and the reader that fetches them (None for local image files)."""

    dataset: tf.data.Dataset
    reader: StreamReader | None = None


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
    alpha_background: str = DEFAULT_ALPHA_BACKGROUND,
) -> EvalInput:
    """Builds rank ``rank``'s share of held-out images: no padding, no drops.

    Folder images are dealt round-robin (rank ``r`` takes ``r, r+size, ...``);
    a shard set is cut into ``size`` contiguous ranges of records. Batches are
    ``(images, labels)``; the last batch may be smaller.
    """
    s3 = s3 or storage.S3Options()
    reader = None

    def center(contents):
        window = center_window(crop_fraction)
        return _resize(decode_window(contents, window, min_side=image_size, background=alpha_background), image_size)

    if isinstance(data, ShardSet):
        reader = StreamReader(s3, local=not storage.is_s3(data.url))
        blocks = eval_blocks(data, rank, size)
        label_map = tf.constant(data.label_map, dtype=tf.int32)
        parse = data.features.parser()

        def stream():
            for _, records in reader.fetcher.stream(blocks, lambda b: reader.read_block(data, b)):
                yield np.asarray(records, dtype=object)

        ds = reader.dataset(stream, tf.TensorSpec([None], tf.string)).unbatch()

        def load_record(record):
            contents, label = parse(record)
            return center(contents), tf.gather(label_map, label)

        ds = ds.map(plain(load_record), num_parallel_calls=tf.data.AUTOTUNE)
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
                (
                    tf.range(len(mine_paths), dtype=tf.int64),
                    tf.constant([storage.os_bytes(p) for p in mine_paths], dtype=tf.string),
                )
            )
            ds = ds.map(plain(lambda i, p: (i, tf.io.read_file(p))), num_parallel_calls=tf.data.AUTOTUNE)

        if data.label_sets is not None:  # a multi-label set: (images, multi-hot rows, ids), -1 - index a stand-in
            rows_of = label_lookup(data.subset(np.arange(rank, len(data), size)))

            def multi(i, contents):
                return center(contents), rows_of(i), tf.cast(rank + i * size, tf.int32)

            def multi_stand_ins(i, contents):
                return black(i, image_size), rows_of(i), tf.cast(-1 - (rank + i * size), tf.int32)

            ds = decoded_or_stand_in(ds, multi, multi_stand_ins).unbatch().batch(batch_size)
            ds = ds.map(plain(lambda images, rows, ids: (preprocess(images), rows, ids)))
            return EvalInput(_with_threads(ds.prefetch(tf.data.AUTOTUNE), threads), reader)

        def stand_ins(i, contents):  # the label says which image it stands for: -1 - its index in ``data``
            return black(i, image_size), tf.cast(-1 - (rank + i * size), tf.int32)

        ds = decoded_or_stand_in(ds, lambda i, contents: (center(contents), labels_t[i]), stand_ins).unbatch()
    ds = ds.batch(batch_size).map(plain(lambda images, labels: (preprocess(images), labels)))
    return EvalInput(_with_threads(ds.prefetch(tf.data.AUTOTUNE), threads), reader)


def predict_dataset(
    paths: list[str],
    *,
    batch_size: int,
    image_size: int,
    crop_fraction: float,
    preprocess: Preprocess,
    alpha_background: str = DEFAULT_ALPHA_BACKGROUND,
) -> tf.data.Dataset:
    """Batches of preprocessed images in ``paths`` order, for prediction."""
    window = center_window(crop_fraction)

    def load(path):
        contents = tf.io.read_file(path)
        return _resize(decode_window(contents, window, min_side=image_size, background=alpha_background), image_size)

    ds = tf.data.Dataset.from_tensor_slices(tf.constant([storage.os_bytes(p) for p in paths], dtype=tf.string))
    ds = ds.map(plain(load), num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).map(plain(preprocess)).prefetch(tf.data.AUTOTUNE)


def random_crop_window(key: tf.Tensor) -> Window:
    """A random crop of 25-100% of the area, aspect 3/4-4/3, drawn from ``key`` (Inception-style)."""

    def window(height_width: tf.Tensor) -> tf.Tensor:
        shape = tf.concat([tf.cast(height_width, tf.int32), [3]], axis=0)
        begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
            shape,
            bounding_boxes=tf.zeros([1, 0, 4]),
            seed=key,
            min_object_covered=0.0,
            aspect_ratio_range=(3 / 4, 4 / 3),
            area_range=(0.25, 1.0),
            max_attempts=10,
            use_image_if_no_bounding_boxes=True,
        )
        return tf.stack([begin[0], begin[1], size[0], size[1]])

    return window


def center_window(fraction: float) -> Window:
    """The central square of side ``fraction * min(height, width)``."""

    def window(height_width: tf.Tensor) -> tf.Tensor:
        h, w = tf.unstack(tf.cast(height_width, tf.int32))
        side = tf.maximum(1, tf.cast(fraction * tf.cast(tf.minimum(h, w), tf.float32), tf.int32))
        return tf.stack([(h - side) // 2, (w - side) // 2, side, side])

    return window


def _resize(image: tf.Tensor, image_size: int) -> tf.Tensor:
    image = tf.image.resize(image, [image_size, image_size])  # bilinear, as Keras preprocessing
    image.set_shape([image_size, image_size, 3])
    return image  # float32 in [0, 255], what keras.applications preprocess_input expects


def _with_threads(ds: tf.data.Dataset, threads: int) -> tf.data.Dataset:
    options = tf.data.Options()
    if threads:
        options.threading.private_threadpool_size = threads
    return ds.with_options(options)
