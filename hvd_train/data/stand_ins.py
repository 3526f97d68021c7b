"""Stand-ins for images that cannot be decoded: no rank drops or fails on one (``decoded_or_stand_in``)."""

from __future__ import annotations

from hvd_train.compat import tf
from hvd_train.data.images import plain

# Images decoded together under one guard against decode errors (``decoded_or_stand_in``): enough to
# spread the guard's cost (a few small datasets per group), few enough to keep few images in flight.
GUARDED_GROUP = 32


def group_size(batch: int) -> int:
    """The images a training batch is decoded in groups of: a divisor of ``batch``.

    The largest divisor up to ``GUARDED_GROUP``; where that is below 8 (a
    batch of 37 or 74), the smallest one above it, so that a batch of
    whole groups never costs a guard per image.
    """
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    group = max(d for d in divisors if d <= GUARDED_GROUP)
    return group if group >= 8 else next((d for d in divisors if d >= 8), batch)


def decoded_or_stand_in(ds: tf.data.Dataset, load, stand_ins, group: int = GUARDED_GROUP) -> tf.data.Dataset:
    """``ds.batch(group).map(load)`` (``load`` per element), where an element whose image cannot be
    decoded becomes a stand-in.

    ``stand_ins`` takes elements batched (a tensor per component) and gives their stand-ins.

    An image that passed the start-up check can still fail to decode (a
    corrupt middle that ``--check-images quick`` does not read, or any
    image under ``none``). Under Horovod a rank may neither drop it (it
    would run a step fewer, and the others would wait for it forever) nor
    fail on it (every rank would stop). So it is replaced, in its place in
    the order, by a stand-in that says what it is: a black image whose id
    (training) or label (evaluation) is ``-1 - index``. Training gives it
    no weight and evaluation does not count it; both list it. Reading
    errors (a file gone, S3 down) are not caught here: they stop the run
    as before.

    Elements go in groups of ``group`` (the last may be short), and the
    groups come out batched. A group is decoded by a small dataset that
    drops the elements that fail, each kept with its place in the group;
    the group's stand-ins then take in the ones that decoded, in their
    places. Groups are decoded in parallel and in order, like ``map``. A
    dataset per element, which this replaced, halved the pipeline's speed;
    groups of 8 unbatched and batched again cost 0.05 ms of CPU an image
    more than a batch of whole groups of 32.
    """

    def decode_group(*elements):
        places = tf.range(tf.shape(elements[0])[0])
        decoded = (
            tf.data.Dataset.from_tensor_slices((places, elements))
            .map(plain(lambda place, element: (place, load(*element))))
            .ignore_errors()
            .batch(group)
        )
        none = tf.nest.map_structure(lambda s: tf.zeros([0, *s.shape[1:]], s.dtype), decoded.element_spec)
        kept, images = decoded.concatenate(tf.data.Dataset.from_tensors(none)).take(1).get_single_element()
        return tuple(tf.tensor_scatter_nd_update(s, kept[:, None], d) for s, d in zip(stand_ins(*elements), images))

    return ds.batch(group).map(plain(decode_group), num_parallel_calls=tf.data.AUTOTUNE)


def black(ids: tf.Tensor, image_size: int) -> tf.Tensor:
    """Black images, one per id in ``ids``."""
    return tf.zeros([tf.shape(ids)[0], image_size, image_size, 3], tf.float32)
