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
    assert images.labels == [0, 0, 0, 1, 1]
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
    assert val.classes == ["a", "b", "c"] and val.labels == [0, 2]
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
    assert sorted(train.paths + val.paths) == sorted(images.paths)
    again_train, again_val = split_per_class(images, 0.2, seed=7)
    assert again_val.paths == val.paths
    _, other_val = split_per_class(images, 0.2, seed=8)
    assert other_val.paths != val.paths
