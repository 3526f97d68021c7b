import pytest

from hvd_train.data.folder import list_folder, split_per_class
from hvd_train.errors import UserError


def touch(path, data=b"x"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_classes_nested_folders_and_extension_case(tmp_path):
    touch(tmp_path / "dog" / "a.JPG")
    touch(tmp_path / "dog" / "deep" / "er" / "b.png")
    touch(tmp_path / "cat" / "c.Jpeg")
    touch(tmp_path / "cat" / "d.GIF")
    touch(tmp_path / "cat" / "e.bmp")
    touch(tmp_path / "cat" / "notes.txt")
    touch(tmp_path / "cat" / ".hidden.jpg")
    touch(tmp_path / "README.md")
    images = list_folder(str(tmp_path))
    assert images.classes == ["cat", "dog"]
    names = [p.split(str(tmp_path) + "/")[1] for p in images.paths]
    assert names == ["cat/c.Jpeg", "cat/d.GIF", "cat/e.bmp", "dog/a.JPG", "dog/deep/er/b.png"]
    assert images.labels.tolist() == [0, 0, 0, 1, 1]
    assert sorted(p.rsplit("/", 1)[1] for p in images.ignored) == ["README.md", "notes.txt"]


@pytest.mark.parametrize(
    "layout, message",
    [
        ({}, "has no class folders"),
        ({"only/a.png": b"x"}, "a classifier needs at least 2"),
        ({"a/x.png": b"x", "b/notes.txt": b"x"}, "class 'b' .* has no images"),
        ({"a/x.png": b"x", "b/sub/": None}, "class 'b' .* has no images"),
    ],
)
def test_bad_folders(tmp_path, layout, message):
    for rel, data in layout.items():
        if data is None:
            (tmp_path / rel).mkdir(parents=True)
        else:
            touch(tmp_path / rel, data)
    with pytest.raises(UserError, match=message):
        list_folder(str(tmp_path))


def test_missing_folder_and_file_instead_of_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist; check --data"):
        list_folder(str(tmp_path / "nope"))
    touch(tmp_path / "file.png")
    with pytest.raises(UserError, match="is not a folder"):
        list_folder(str(tmp_path / "file.png"))


def test_held_out_folder_uses_training_labels(tmp_path):
    for c in ("a", "b", "c"):
        touch(tmp_path / "train" / c / "1.png")
    touch(tmp_path / "val" / "c" / "1.png")
    touch(tmp_path / "val" / "a" / "1.png")
    val = list_folder(str(tmp_path / "val"), "--val-data", classes=["a", "b", "c"])
    assert val.classes == ["a", "b", "c"] and val.labels.tolist() == [0, 2]
    touch(tmp_path / "val" / "zebra" / "1.png")
    with pytest.raises(UserError, match="zebra .*--val-data.* is not a training class"):
        list_folder(str(tmp_path / "val"), "--val-data", classes=["a", "b", "c"])


def test_split_per_class_is_stratified_and_deterministic(tmp_path):
    for c, n in (("a", 50), ("b", 10), ("c", 3), ("d", 1)):
        for i in range(n):
            touch(tmp_path / c / f"{i:02d}.png")
    images = list_folder(str(tmp_path))
    train, val = split_per_class(images, 0.2, seed=7)
    assert val.counts() == [10, 2, 1, 0]  # a one-image class stays in training
    assert train.counts() == [40, 8, 2, 1]
    assert set(train.paths).isdisjoint(val.paths)
    assert sorted([*train.paths, *val.paths]) == sorted(images.paths)
    again_train, again_val = split_per_class(images, 0.2, seed=7)
    assert again_val.paths == val.paths
    _, other_val = split_per_class(images, 0.2, seed=8)
    assert other_val.paths != val.paths


def test_order_is_by_relative_path_segments_in_nfc(tmp_path):
    # A class's own files sort among its sub-folders by name; a folder's files stay
    # together before a sibling whose name extends it; NFD names sort as their NFC form.
    for rel in ("a/z.png", "a/part-1/x.png", "a/part-1-b/x.png", "a/shape.png", "a/e\u0301t\u00e9/x.png", "b/y.png"):
        touch(tmp_path / rel)
    images = list_folder(str(tmp_path))
    rel = [images.relative(i) for i in range(len(images))]
    assert rel == ["a/part-1/x.png", "a/part-1-b/x.png", "a/shape.png", "a/z.png", "a/\u00e9t\u00e9/x.png", "b/y.png"]
    assert images.paths[4] == str(tmp_path / "a" / "e\u0301t\u00e9" / "x.png")  # the file's own name is read


def test_class_names_are_nfc_and_two_forms_of_one_name_are_refused(tmp_path):
    touch(tmp_path / "cafe\u0301" / "1.png")  # as macOS names it
    touch(tmp_path / "tea" / "1.png")
    assert list_folder(str(tmp_path)).classes == ["caf\u00e9", "tea"]
    val = tmp_path / "val"
    touch(val / "caf\u00e9" / "1.png")  # the same class, typed on Linux
    assert list_folder(str(val), "--val-data", classes=["caf\u00e9", "tea"]).labels.tolist() == [0]
    touch(tmp_path / "caf\u00e9" / "2.png")
    with pytest.raises(UserError, match="same name in two Unicode forms"):
        list_folder(str(tmp_path))


def test_digest_follows_the_list_and_the_split(tmp_path):
    for c in ("a", "b"):
        for i in range(6):
            touch(tmp_path / c / f"{i}.png")
    images = list_folder(str(tmp_path))
    assert images.digest == list_folder(str(tmp_path) + "/").digest  # however the root is written
    train, val = split_per_class(images, 0.3, seed=1)
    assert len({images.digest, train.digest, val.digest}) == 3
    assert split_per_class(images, 0.3, seed=2)[1].digest != val.digest
    (tmp_path / "b" / "5.png").rename(tmp_path / "b" / "5b.png")
    assert list_folder(str(tmp_path)).digest != images.digest
