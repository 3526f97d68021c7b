"""Packed shard sets on local disk: format, pack, equal steps per rank, exact evaluation, damage."""

import collections
import json
import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from hvd_train import compat  # noqa: F401
from hvd_train.data import packed
from hvd_train.data.blocks import BlockLayout
from hvd_train.data.pipeline import eval_dataset, train_input
from hvd_train.data.sharding import Segment, from_intervals
from hvd_train.data.storage import S3Options
from hvd_train.errors import UserError

from conftest import HVD_TRAIN, output_of, run, start

N = 47  # images; not a multiple of any batch or rank count used here


def solid(path, value):
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``N`` solid images whose pixel value is ``2 * index``: the pixels tell which image a record is.

    Two names are Latin-1 bytes, not UTF-8 (as an older tool writes ``café``).
    """
    root = tmp_path_factory.mktemp("src")
    for i in range(N):
        cls = root / f"class{i % 3}" / ("nested" if i % 2 else "")
        cls.mkdir(parents=True, exist_ok=True)
        name = os.fsdecode(b"caf\xe9-%03d.png" % i) if i in (4, 9) else f"img-{i:03d}.png"
        solid(cls / name, 2 * i)
    return root


def pack(src, dst, **kw):
    options = dict(shard_size=600, on_bad_image="skip", seed=3, s3=S3Options())
    options.update(kw)
    return packed.pack(str(src), str(dst), **options)


@pytest.fixture(scope="module")
def packed_dir(folder, tmp_path_factory):
    dst = tmp_path_factory.mktemp("packed_dir")
    pack(folder, dst)
    return dst


def ids_of(ds):
    """Image indices (recovered from the pixels) and labels of a dataset of batches."""
    ids, labels = [], []
    for images, batch_labels, *_ in ds.as_numpy_iterator():
        ids += [int(round(float(img.mean()) / 2)) for img in images]
        labels += batch_labels.tolist()
    return ids, labels


def test_shards_are_standard_tfrecords_with_every_image(folder, packed_dir):
    import tensorflow as tf

    manifest = json.loads((packed_dir / "manifest.json").read_text())
    assert manifest["images"] == N and manifest["classes"] == ["class0", "class1", "class2"]
    # As any other output: readable by the team (0666 less the umask), not by the packer alone.
    umask = os.umask(0o022)
    os.umask(umask)
    assert {p.stat().st_mode & 0o777 for p in packed_dir.iterdir()} == {0o666 & ~umask}
    assert manifest["class_counts"] == [16, 16, 15]
    assert len(manifest["shards"]) > 3, "a small --shard-size gives many shards"
    seen = {}
    for shard in manifest["shards"]:
        data = (packed_dir / shard["file"]).read_bytes()
        assert len(data) == shard["bytes"] and shard["offsets"][0] == 0
        # TensorFlow's own reader checks every record's CRC.
        records = list(tf.data.TFRecordDataset(str(packed_dir / shard["file"])).as_numpy_iterator())
        assert len(records) == shard["images"]
        for record in records:
            ex = tf.train.Example.FromString(record).features.feature
            name = os.fsdecode(ex["image/filename"].bytes_list.value[0])
            assert ex["image/encoded"].bytes_list.value[0] == (folder / name).read_bytes()
            seen[name] = ex["image/class/label"].int64_list.value[0]
    assert len(seen) == N
    assert all(seen[name] == int(name.split("/")[0][-1]) for name in seen)
    assert {os.fsencode(n) for n in seen} >= {b"class1/caf\xe9-004.png", b"class0/nested/caf\xe9-009.png"}


def shard_input(shard_set, rank, size, batch=4, epochs=2, first_step=0, seed=1):
    segments = [
        (Segment.whole(e, len(shard_set), size, batch, seed=seed), first_step if e == 0 else 0) for e in range(epochs)
    ]
    return train_input(shard_set, segments, rank=rank, image_size=8, augment="none", preprocess=lambda x: x, seed=seed)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_rank_runs_the_same_steps_and_sees_every_image(packed_dir, size):
    shard_set = packed.load(str(packed_dir), "--data")
    batch, epochs = 4, 2
    steps = -(-N // (batch * size))
    per_rank = [ids_of(shard_input(shard_set, rank, size, batch, epochs).dataset) for rank in range(size)]
    for ids, labels in per_rank:
        assert len(ids) == epochs * steps * batch  # equal steps: no Horovod hang
        assert all(label == i % 3 for i, label in zip(ids, labels))
    for epoch in range(epochs):
        window = slice(epoch * steps * batch, (epoch + 1) * steps * batch)
        union = collections.Counter(i for ids, _ in per_rank for i in ids[window])
        assert set(union) == set(range(N))
        assert sum(union.values()) == steps * batch * size
    first = [ids[: steps * batch] for ids, _ in per_rank]
    second = [ids[steps * batch :] for ids, _ in per_rank]
    assert first != second, "the order changes from epoch to epoch"


def test_records_of_a_rank_are_read_in_few_ranged_reads_and_mixed(packed_dir):
    shard_set = packed.load(str(packed_dir), "--data")
    seg = Segment.whole(0, N, 2, 4, seed=1)
    layout = BlockLayout(shard_set, seed=1, epoch=0, block_bytes=2000, cycle=3)
    blocks, block_of, within, positions = layout.reads(seg, rank=0)
    assert len(blocks) < len(positions) / 2, "records come in blocks, not one read each"
    assert all(b.last - b.first >= 1 for b in blocks)
    # Consecutive records come from different blocks: the interleave mixes shards.
    assert sum(block_of[1:] != block_of[:-1]) > len(block_of) / 2
    shard, index = layout.record(positions)
    for j, b in enumerate(blocks):
        mine = block_of == j
        assert set(shard[mine]) == {b.shard} and sorted(index[mine]) == list(range(b.first, b.last))


def test_a_resumed_shard_stream_skips_what_was_consumed_without_reading_it(packed_dir):
    shard_set = packed.load(str(packed_dir), "--data")
    whole = ids_of(shard_input(shard_set, 1, 2, epochs=1).dataset)[0]
    later = shard_input(shard_set, 1, 2, epochs=1, first_step=3)
    assert ids_of(later.dataset)[0] == whole[3 * 4 :]
    # Only the blocks the rest needs were read.
    layout = BlockLayout(shard_set, 1, 0)
    needed = len(set(layout.reads(Segment.whole(0, N, 2, 4, seed=1), 1, 3)[1].tolist()))
    assert later.reader.stats()["objects"] == needed


@pytest.mark.parametrize("sizes", [(2, 3), (3, 1, 2)])
def test_redealing_a_shard_epoch_covers_exactly_the_records_left(packed_dir, sizes):
    shard_set = packed.load(str(packed_dir), "--data")
    layout = BlockLayout(shard_set, seed=1, epoch=0)
    seg = Segment.whole(0, N, sizes[0], 4, seed=1)
    consumed = set()
    for new_size in [*sizes[1:], None]:
        steps = max(1, seg.steps // 2) if new_size is not None else seg.steps
        for r in range(seg.size):
            consumed.update(seg.stream(layout, r)[: steps * 4].tolist())
        left = set(from_intervals(seg.remaining(layout, steps)).tolist())
        assert left == set(range(N)) - consumed
        if new_size is None:
            break
        seg = seg.follow_on(layout, steps, new_size, 4)
    assert consumed == set(range(N))


def test_evaluation_counts_each_image_once(packed_dir):
    shard_set = packed.load(str(packed_dir), "--val-data")
    for size in (1, 2, 3, 5):
        ids = []
        for rank in range(size):
            ds = eval_dataset(
                shard_set, rank=rank, size=size, batch_size=4, image_size=8, crop_fraction=1.0, preprocess=lambda x: x
            ).dataset
            ids += ids_of(ds)[0]
        assert sorted(ids) == list(range(N)), size


def test_names_that_are_not_utf8_are_checked_digested_and_evaluated_like_any_other(folder, tmp_path):
    from hvd_train.data.folder import list_folder
    from hvd_train.data.images import find_bad_images

    images = list_folder(str(folder))
    assert sum(b"\xe9" in os.fsencode(p) for p in images.paths) == 2
    assert len(images.digest) == 16  # what the first checkpoint records
    assert find_bad_images(list(images.paths)) == []
    ids = []
    for rank in range(2):
        ds = eval_dataset(images, rank=rank, size=2, batch_size=4, image_size=8, crop_fraction=1.0,
                          preprocess=lambda x: x).dataset  # fmt: skip
        ids += ids_of(ds)[0]
    assert sorted(ids) == list(range(N))
    # A class folder so named cannot name a class: one clear line.
    (tmp_path / "tea").mkdir()
    solid(tmp_path / "tea" / "1.png", 0)
    os.mkdir(os.fsencode(tmp_path) + b"/caf\xe9")
    solid(os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9/1.png"), 0)
    with pytest.raises(UserError, match=r"class folder .*caf\\xe9.* is not valid UTF-8.*rename it"):
        list_folder(str(tmp_path))


def test_held_out_labels_map_onto_training_classes(packed_dir):
    shard_set = packed.load(str(packed_dir), "--val-data", classes=["class2", "class0", "class1", "other"])
    assert shard_set.label_map == (1, 2, 0) and shard_set.counts() == [15, 16, 16, 0]
    ds = eval_dataset(
        shard_set, rank=0, size=1, batch_size=8, image_size=8, crop_fraction=1.0, preprocess=lambda x: x
    ).dataset
    ids, labels = ids_of(ds)
    assert all(label == [1, 2, 0][i % 3] for i, label in zip(ids, labels))
    with pytest.raises(UserError, match="class 'class2' of .* is not a training class"):
        packed.load(str(packed_dir), "--val-data", classes=["class0", "class1"])


@pytest.mark.parametrize("name", ["../outside.tfrecord", "/tmp/outside.tfrecord", "sub/../../outside.tfrecord"])
def test_a_manifest_naming_a_shard_outside_its_set_is_refused(packed_dir, tmp_path, name):
    import shutil

    copy = tmp_path / "set"
    shutil.copytree(packed_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shutil.copy(copy / manifest["shards"][0]["file"], tmp_path / "outside.tfrecord")  # readable, were it read
    manifest["shards"][0]["file"] = name
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"names the shard .*outside\.tfrecord.*, which is no file of the set"):
        packed.load(str(copy), "--data")


def test_bad_images_are_listed_or_fail(folder, tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(folder, src)
    (src / "class1" / "broken.png").write_bytes(b"not an image")
    (src / "class2" / "empty.jpg").write_bytes(b"")
    manifest = pack(src, tmp_path / "out")[str(tmp_path / "out")]
    assert manifest["images"] == N
    assert {s["path"].rsplit("/", 1)[1] for s in manifest["skipped"]} == {"broken.png", "empty.jpg"}
    with pytest.raises(UserError, match=r"cannot decode image .*(broken|empty)"):
        pack(src, tmp_path / "out2", on_bad_image="fail")
    assert not (tmp_path / "out2" / "manifest.json").exists()


def test_val_split_overwrite_and_stale_shards(folder, tmp_path):
    manifests = pack(folder, tmp_path, val_split=0.25)
    train, val = manifests[str(tmp_path / "train")], manifests[str(tmp_path / "val")]
    assert train["images"] + val["images"] == N and val["class_counts"] == [4, 4, 4]
    with pytest.raises(UserError, match="exists already; pass --overwrite"):
        pack(folder, tmp_path / "train")
    before = sorted(p.name for p in (tmp_path / "train").glob("shard-*"))
    pack(folder, tmp_path / "train", shard_size=1 << 20, overwrite=True)
    after = sorted(p.name for p in (tmp_path / "train").glob("shard-*"))
    assert len(before) > 1 and after == ["shard-00000.tfrecord"], "stale shards are removed"
    assert packed.load(str(tmp_path / "train"), "--data").shards[0].images == N


def test_corrupt_shard_is_a_clear_error(packed_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(packed_dir, copy)
    victim = copy / "shard-00001.tfrecord"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    shard = shard_input(packed.load(str(copy), "--data"), 0, 1, epochs=1)
    import tensorflow as tf

    with pytest.raises(tf.errors.OpError):
        ids_of(shard.dataset)
    assert isinstance(shard.reader.error, UserError)
    assert "shard-00001.tfrecord" in str(shard.reader.error) and "corrupt" in str(shard.reader.error)


def test_interrupted_pack_leaves_no_manifest(tmp_path):
    src = tmp_path / "src"
    for i in range(400):
        folder = src / f"c{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (48, 48, 3), np.uint8)).save(folder / f"{i}.png")
    dst = tmp_path / "dst"
    proc = start([*HVD_TRAIN, "pack", src, dst, "--shard-size", "20KB"])
    deadline = time.time() + 120
    while len(list(dst.glob("shard-*.tfrecord"))) < 3:
        assert proc.poll() is None and time.time() < deadline, output_of(proc)
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (dst / "manifest.json").exists()
    proc = run([*HVD_TRAIN, "train", "--data", dst, "--output", tmp_path / "o", "--weights", "none"])
    assert proc.returncode == 2, output_of(proc)
    assert "no manifest.json" in proc.stderr and "hvd-train pack" in proc.stderr, output_of(proc)


def test_size_parsing():
    assert packed.parse_size("128MB") == 128_000_000
    assert packed.parse_size("1GiB") == 1 << 30
    assert packed.parse_size("65536") == 65536
    for bad in ("lots", "12XB", "10"):
        with pytest.raises(UserError, match="--shard-size"):
            packed.parse_size(bad)
