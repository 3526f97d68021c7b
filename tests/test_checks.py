"""The check before the first step (quick, full with its cache, none) and the stand-ins for images met broken later."""

import os

import numpy as np
import pytest
from PIL import Image

from hvd_train.data.checks import CheckCache, looks_whole
from hvd_train.data.folder import ImageSet, list_folder
from hvd_train.data.pipeline import eval_dataset, train_input
from hvd_train.data.sharding import Segment
from hvd_train.data.sources import checked
from hvd_train.distributed.context import Context
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.results.evaluation import evaluate

from conftest import png_with_a_corrupt_middle, write_images

CTX = Context(rank=0, size=1, local_rank=0, local_size=1)


@pytest.fixture
def folder(tmp_path):
    data = write_images(tmp_path / "d", {"a": 5, "b": 5}, size=24)
    Image.new("RGB", (24, 24), (1, 2, 3)).save(data / "a" / "photo.jpg", quality=90)
    # A JPEG with bytes after its end marker (as some cameras write) is whole.
    (data / "b" / "trailer.jpg").write_bytes((data / "a" / "photo.jpg").read_bytes() + b"extra bytes")
    return data


def test_quick_check_reads_the_ends_and_decodes_only_suspects(folder, tmp_path):
    (folder / "a" / "empty.png").write_bytes(b"")
    whole = (folder / "a" / "img-000.png").read_bytes()
    (folder / "a" / "cut.png").write_bytes(whole[: len(whole) // 2])
    (folder / "b" / "page.jpg").write_text("<html>not found</html>")
    middle = png_with_a_corrupt_middle(folder / "b" / "middle.png")
    assert looks_whole(str(folder / "a" / "img-000.png")) and looks_whole(str(folder / "a" / "photo.jpg"))
    assert not looks_whole(str(folder / "b" / "trailer.jpg"))  # a suspect, decoded, and fine
    assert looks_whole(str(middle))  # what quick cannot see: training meets it

    images = list_folder(str(folder))
    kept = checked(images, "--data", "skip", CTX, check="quick")
    reasons = dict(kept.skipped)
    assert set(reasons) == {str(folder / "a" / n) for n in ("empty.png", "cut.png")} | {str(folder / "b" / "page.jpg")}
    assert reasons[str(folder / "a" / "empty.png")] == "empty file (0 bytes)"
    assert str(folder / "b" / "trailer.jpg") in kept.paths and str(middle) in kept.paths
    assert len(kept) == len(images) - 3
    # full decodes everything, so it finds the corrupt middle too; none reads nothing.
    full = checked(images, "--data", "skip", CTX, check="full")
    assert {p for p, _ in full.skipped} == set(reasons) | {str(middle)}
    assert checked(images, "--data", "skip", CTX, check="none") is images


def test_full_check_cache_is_used_and_invalidated_by_a_changed_file(folder, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    images = list_folder(str(folder))
    first = checked(images, "--data", "skip", CTX, check="full")
    assert first.skipped == ()
    cache = CheckCache(str(folder))
    entries = cache.load()
    assert len(entries) == len(images) and all(reason is None for _, _, reason in entries.values())

    caplog.set_level("INFO", logger="hvd_train")
    again = checked(images, "--data", "skip", CTX, check="full")
    assert again.skipped == ()
    assert f"{len(images)} of {len(images)} images known from" in caplog.text

    # The same name, other contents: its size and mtime differ, so it is decoded again.
    victim = folder / "a" / "img-001.png"
    png_with_a_corrupt_middle(victim, seed=1)
    os.utime(victim, ns=(1, 1))
    caplog.clear()
    third = checked(images, "--data", "skip", CTX, check="full")
    assert [p for p, _ in third.skipped] == [str(victim)]
    assert f"{len(images) - 1} of {len(images)} images known from" in caplog.text
    # The verdict is cached: the next check knows it without decoding.
    assert cache.load()["a/img-001.png"][2] == third.skipped[0][1]
    caplog.clear()
    fourth = checked(images, "--data", "skip", CTX, check="full")
    assert fourth.skipped == third.skipped
    assert f"{len(images)} of {len(images)} images known from" in caplog.text

    # The training and held-out parts of one root share its cache: checking one keeps the other's verdicts.
    train, val = images.subset(range(0, len(images), 2)), images.subset(range(1, len(images), 2))
    png_with_a_corrupt_middle(victim, seed=2)
    os.utime(victim, ns=(2, 2))
    checked(val, "--val-data", "skip", CTX, check="full")
    caplog.clear()
    checked(train, "--data", "skip", CTX, check="full")
    assert f"{len(train)} of {len(train)} images known from" in caplog.text


def test_an_image_broken_inside_becomes_a_stand_in_with_its_place_kept(folder):
    middle = png_with_a_corrupt_middle(folder / "b" / "middle.png")
    images = checked(list_folder(str(folder)), "--data", "skip", CTX, check="quick")
    bad = list(images.paths).index(str(middle))
    n = len(images)
    segment = Segment.whole(0, n, 1, 4)
    made = train_input(images, [(segment, 0)], rank=0, image_size=16, augment="none", preprocess=lambda x: x, seed=3)
    batches = list(made.dataset.as_numpy_iterator())
    assert len(batches) == segment.steps  # no element dropped, no error
    ids = np.concatenate([b[2] for b in batches])
    assert (ids < 0).sum() >= 1 and set((-1 - ids[ids < 0]).tolist()) == {bad}
    stand_in = np.concatenate([b[0] for b in batches])[np.flatnonzero(ids < 0)[0]]
    assert not stand_in.any()

    held_out = eval_dataset(
        images, rank=0, size=1, batch_size=4, image_size=16, crop_fraction=1.0, preprocess=lambda x: x
    ).dataset
    from hvd_train.compat import keras

    head = keras.layers.Dense(2, "softmax", name=HEAD_LAYER)  # evaluate scores the head's logits
    model = keras.Sequential([keras.layers.Input((16, 16, 3)), keras.layers.Flatten(), head])
    result = evaluate(model, held_out, 2, CTX)
    assert result.count == n - 1 and result.skipped == (bad,)
    assert result.confusion.sum() == n - 1


def test_a_list_of_paths_is_held_compactly_and_acts_as_a_list(tmp_path):
    paths = [f"/r/c{i % 3}/é-{i}.jpg" for i in range(10)]
    images = ImageSet(paths, [i % 3 for i in range(10)], ["c0", "c1", "c2"], prefix="/r/")
    assert list(images.paths) == paths and images.paths[-1] == paths[-1] and images.paths[2:5] == paths[2:5]
    assert images.paths == paths and [images.relative(i) for i in range(10)] == [p[len("/r/") :] for p in paths]
    sub = images.subset([7, 1])
    assert list(sub.paths) == [paths[7], paths[1]] and sub.labels.tolist() == [1, 1]
    left = images.without([(paths[3], "why")])
    assert len(left) == 9 and paths[3] not in list(left.paths) and left.skipped == ((paths[3], "why"),)
    import pickle

    assert pickle.loads(pickle.dumps(images)) == images
