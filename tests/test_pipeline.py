import collections

import numpy as np
import pytest
from PIL import Image

from hvd_train import compat  # noqa: F401
from hvd_train.data.folder import ImageSet
from hvd_train.data.pipeline import eval_dataset, train_input
from hvd_train.data.sharding import Segment

N = 23  # not a multiple of any batch used here


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipe")
    paths = []
    for i in range(N):
        # Left half dark, right half bright: a flip is visible in the pixels.
        pixels = np.zeros((12, 16, 3), np.uint8)
        pixels[:, 8:] = 200 + i
        path = root / f"{i:02d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(str(path))
    return paths


def labels_of(ds):
    return [int(x) for _, labels, *_ in ds.as_numpy_iterator() for x in labels]


def shard(files, rank, size, epochs=2, batch=4, augment="none", seed=1, first_epoch=0, first_step=0):
    segments = [
        (Segment.whole(e, N, size, batch, seed=seed), first_step if e == first_epoch else 0)
        for e in range(first_epoch, epochs)
    ]
    return train_input(
        ImageSet(files, list(range(N)), [str(i) for i in range(N)]),
        segments,
        rank=rank,
        image_size=8,
        augment=augment,
        preprocess=lambda x: x,
        seed=seed,
    )


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_rank_same_steps_and_every_image_each_epoch(files, size):
    batch, epochs = 4, 2
    steps = -(-N // (batch * size))
    per_rank = [labels_of(shard(files, r, size, epochs, batch).dataset) for r in range(size)]
    for seen in per_rank:
        assert len(seen) == epochs * steps * batch  # identical step counts: no Horovod hang
    for epoch in range(epochs):
        window = slice(epoch * steps * batch, (epoch + 1) * steps * batch)
        union = collections.Counter(i for seen in per_rank for i in seen[window])
        assert set(union) == set(range(N))  # every image at least once per epoch
        padded = steps * batch * size
        assert sum(union.values()) == padded and max(union.values()) <= -(-padded // N)


def test_ids_name_the_images_of_each_batch(files):
    for images, labels, ids in shard(files, 1, 2, epochs=1).dataset.as_numpy_iterator():
        assert labels.tolist() == ids.tolist()  # label i is image i here
        assert [int(round(img[:, -1].mean())) - 200 for img in images] == ids.tolist()  # the pixels say which image


@pytest.mark.parametrize("batch", [4, 23, 40, 64])
def test_batches_of_several_guarded_groups_follow_the_plan(files, batch):
    """A batch is decoded in whole groups (4: one of 4, 40: two of 20, 64: two of 32), merged in order."""
    from hvd_train.data.pipeline import STRIDED
    from hvd_train.data.sharding import epoch_order
    from hvd_train.data.stand_ins import group_size

    segment = Segment.whole(0, N, 2, batch, seed=1)
    batches = list(shard(files, 1, 2, epochs=1, batch=batch).dataset.as_numpy_iterator())
    assert [len(ids) for _, _, ids in batches] == [batch] * segment.steps
    ids = np.concatenate([ids for _, _, ids in batches])
    assert ids.tolist() == epoch_order(N, 1, 0)[segment.stream(STRIDED, 1, 0)].tolist()
    images = np.concatenate([images for images, _, _ in batches])
    assert [int(round(img[:, -1].mean())) - 200 for img in images] == ids.tolist()  # each image with its id
    assert batch // group_size(batch) == {4: 1, 23: 1, 40: 2, 64: 2}[batch]


def test_group_sizes_divide_the_batch_and_stay_between_8_and_32_where_they_can():
    from hvd_train.data.stand_ins import group_size

    sizes = {b: group_size(b) for b in (1, 4, 8, 32, 37, 48, 64, 74, 256, 1024)}
    assert sizes == {1: 1, 4: 4, 8: 8, 32: 32, 37: 37, 48: 24, 64: 32, 74: 37, 256: 32, 1024: 32}


def test_order_changes_per_epoch_and_is_reproducible(files):
    first = labels_of(shard(files, 0, 1, epochs=2, batch=N).dataset)
    assert sorted(first[:N]) == sorted(first[N:]) and first[:N] != first[N:]
    assert labels_of(shard(files, 0, 1, epochs=2, batch=N).dataset) == first
    # A run resumed at epoch 1 sees epoch 1 exactly as an uninterrupted one.
    resumed = labels_of(shard(files, 0, 1, epochs=2, batch=N, first_epoch=1).dataset)
    assert resumed == first[N:]


def test_a_run_resumed_mid_epoch_continues_at_the_same_image_and_augmentation(files):
    whole = list(shard(files, 1, 2, epochs=2, augment="crop,flip").dataset.as_numpy_iterator())
    resumed = list(shard(files, 1, 2, epochs=2, augment="crop,flip", first_step=2).dataset.as_numpy_iterator())
    assert len(resumed) == len(whole) - 2
    for (xa, ya, ia), (xb, yb, ib) in zip(whole[2:], resumed):
        assert ia.tolist() == ib.tolist() and ya.tolist() == yb.tolist()
        np.testing.assert_array_equal(xa, xb)


def test_flip_augmentation_flips_some_images_and_none_flips_none(files):
    def bright_side(augment):
        counts = collections.Counter()
        for images, *_ in shard(files, 0, 1, epochs=1, batch=N, augment=augment).dataset:
            for image in images.numpy():
                counts["right" if image[:, -1].mean() > image[:, 0].mean() else "left"] += 1
        return counts

    assert bright_side("none") == {"right": N}
    flipped = bright_side("flip")
    assert flipped["left"] > 0 and flipped["right"] > 0


def test_the_pipeline_augments_alike_after_a_resume_and_otherwise_than_crop_flip(files):
    whole = list(shard(files, 1, 2, epochs=2, augment="randaugment").dataset.as_numpy_iterator())
    resumed = list(shard(files, 1, 2, epochs=2, augment="randaugment", first_step=2).dataset.as_numpy_iterator())
    assert len(resumed) == len(whole) - 2
    for (a, la, ia), (b, lb, ib) in zip(whole[2:], resumed):
        assert np.array_equal(a, b) and np.array_equal(la, lb) and np.array_equal(ia, ib)
    plain = list(shard(files, 1, 2, epochs=2, augment="crop,flip").dataset.as_numpy_iterator())
    differ = sum(not np.allclose(a, p, atol=1e-3) for (a, *_), (p, *_) in zip(whole, plain))
    assert differ >= len(whole) // 2


def test_evaluation_counts_each_image_once(files):
    for size in (1, 2, 3, 5):
        seen = []
        for rank in range(size):
            ds = eval_dataset(
                ImageSet(files, list(range(N)), [str(i) for i in range(N)]),
                rank=rank,
                size=size,
                batch_size=4,
                image_size=8,
                crop_fraction=0.875,
                preprocess=lambda x: x,
            ).dataset
            seen += labels_of(ds)
        assert sorted(seen) == list(range(N)), size


def test_undecodable_images_become_stand_ins_in_their_places_across_groups():
    """One bad image inside a group, a whole group bad, one bad in the last, partial group."""
    import io

    import tensorflow as tf

    from hvd_train.data import stand_ins as guard

    group = guard.GUARDED_GROUP
    n = 2 * group + 5
    bad = {3, *range(group, 2 * group), 2 * group + 3}

    def png(value):
        buf = io.BytesIO()
        Image.fromarray(np.full((2, 2), value, np.uint8)).save(buf, "PNG")
        return buf.getvalue()

    contents = [b"not an image at all" if i in bad else png(i) for i in range(n)]
    ds = tf.data.Dataset.from_tensor_slices((tf.range(n, dtype=tf.int64), contents))

    def load(i, encoded):
        return tf.cast(tf.reshape(tf.io.decode_png(encoded, channels=1), [4]), tf.int64), i

    def stand_ins(i, encoded):
        return tf.fill([tf.shape(i)[0], 4], tf.constant(-7, tf.int64)), -1 - i

    out = list(guard.decoded_or_stand_in(ds, load, stand_ins).unbatch().as_numpy_iterator())
    assert [int(i) for _, i in out] == [-1 - i if i in bad else i for i in range(n)]
    assert [pixels.tolist() for pixels, _ in out] == [[-7] * 4 if i in bad else [i] * 4 for i in range(n)]


def test_a_multi_label_sets_batches_carry_each_images_classes_as_a_multi_hot_row(files):
    """Each training image's label is the row of its set of classes (none: all 0), found again by its id."""
    from hvd_train.data.label_sets import LabelSets

    sets = [[i % 3, (i * 2) % 5] if i % 4 else [] for i in range(N)]
    data = ImageSet(files, [0] * N, [f"c{i}" for i in range(5)], label_sets=LabelSets.of(sets))
    segments = [(Segment.whole(0, N, 1, 4, seed=1), 0)]
    ds = train_input(data, segments, rank=0, image_size=8, augment="none", preprocess=lambda x: x, seed=1).dataset
    seen = set()
    for _, labels, ids in ds.as_numpy_iterator():
        assert labels.shape == (4, 5) and labels.dtype == np.float32
        for row, i in zip(labels, ids):
            assert sorted(np.flatnonzero(row).tolist()) == sorted(set(sets[i])) and set(row.tolist()) <= {0.0, 1.0}
            seen.add(int(i))
    assert seen == set(range(N))  # every image, its steps padded as every rank's are
