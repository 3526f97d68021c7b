"""Other tools' TFRecord files as ``--data``: read in place through an index made once, and every file or record
they refuse (one process, no job; the launched runs at the end)."""

import gzip
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from hvd_train.compat import tf
from hvd_train.data import packed, records
from hvd_train.data.features import RecordOptions
from hvd_train.data.pipeline import eval_dataset
from hvd_train.data.storage import S3Options
from hvd_train.errors import UserError

from conftest import (
    HVD_TRAIN,
    TINY,
    launcher_command,
    output_of,
    read_json,
    run_at_once,
    trained_alike,
    write_images,
)

COUNTS = {"cat": 3, "dog": 4, "owl": 2}
# Model Garden's and the TPU reference ImageNet shards: these keys, labels from 1, the synset beside the label.
GARDEN = {"image": "image/encoded", "label": "image/class/label", "offset": 1, "text": "image/class/synset"}


def feature(value):
    if isinstance(value, int):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))
    return tf.train.Feature(
        bytes_list=tf.train.BytesList(value=[value if isinstance(value, bytes) else value.encode()])
    )


def rewrite(
    shard_set_dir,
    out,
    stem="train",
    image="image/encoded",
    label="image/class/label",
    offset=0,
    text="",
    strings=False,
    keep=lambda name: True,
    change=lambda fields: fields,
):
    """The records of the shard set at ``shard_set_dir`` written again as another tool would: in the same order
    and files (``<stem>-0000i-of-0000n``), the image and label under other keys, the label counted from
    ``offset`` or given as its class name, the class name under ``text``; only the classes ``keep`` keeps, each
    record's features as ``change`` makes them. Returns the file names."""
    shard_set = packed.load(str(shard_set_dir), "--data")
    os.makedirs(out, exist_ok=True)
    names = []
    for i, shard in enumerate(shard_set.shards):
        data = (shard_set_dir / shard.file).read_bytes()
        framed = []
        for record in packed.unframe(data, shard.images, shard.file):
            ours = tf.train.Example.FromString(record).features.feature
            index = ours["image/class/label"].int64_list.value[0]
            name = shard_set.classes[index]
            if not keep(name):
                continue
            fields = {image: feature(ours["image/encoded"].bytes_list.value[0])}
            fields[label] = feature(name if strings else index + offset)
            if text:
                fields[text] = feature(name)
            example = tf.train.Example(features=tf.train.Features(feature=change(fields)))
            framed.append(packed.frame(example.SerializeToString()))
        names.append(f"{stem}-{i:05d}-of-{len(shard_set.shards):05d}")
        (out / names[-1]).write_bytes(b"".join(framed))
    return names


def pairs(data):
    """``(image, label)`` of every held-out record of ``data`` as one process reads them."""
    ds = eval_dataset(data, rank=0, size=1, batch_size=4, image_size=8, crop_fraction=1.0, preprocess=lambda x: x)
    found = [
        (img.tobytes(), int(label))
        for images, labels in ds.dataset
        for img, label in zip(images.numpy(), labels.numpy())
    ]
    return found


@pytest.fixture
def pack_of_tree(tmp_path):
    tree = write_images(tmp_path / "images", COUNTS, size=8)
    packed.pack(str(tree), str(tmp_path / "packed"), shard_size=1200, on_bad_image="skip", seed=3, s3=S3Options())
    return tmp_path / "packed"


def test_model_gardens_records_are_the_set_pack_wrote_and_the_index_is_made_once(pack_of_tree, tmp_path, caplog):
    """1-based labels under the usual keys, the synset beside them: the classes, counts, images and labels of the
    set ``pack`` wrote. The index is made on the first read, kept beside the files, and read the next time; a
    rewritten file alone is read again."""
    caplog.set_level(logging.INFO, logger="hvd_train")
    out = tmp_path / "garden"
    names = rewrite(pack_of_tree, out, offset=1, text=GARDEN["text"])
    rewrite(pack_of_tree, out, stem="validation", offset=1, text=GARDEN["text"])
    ours = packed.load(str(pack_of_tree), "--data")
    url = f"{out}/train-*"
    assert records.is_records(url) and records.is_records(str(out)) and not records.is_records(str(pack_of_tree))
    theirs = records.load(url, "--data", S3Options(), RecordOptions(label_offset=1))
    assert theirs.classes == ours.classes == ["cat", "dog", "owl"] and theirs.counts() == ours.counts()
    assert [s.file for s in theirs.shards] == names and [s.images for s in theirs.shards] == [
        s.images for s in ours.shards
    ]
    assert pairs(theirs) == pairs(ours)
    index = [n for n in os.listdir(out) if n.startswith(".hvd_train-index-")]
    assert len(index) == 1 and f"indexed 9 records in {len(names)} TFRecord files" in caplog.text
    caplog.clear()
    again = records.load(url, "--data", S3Options(), RecordOptions(label_offset=1))
    assert again == theirs and "from the index" in caplog.text and "read " not in caplog.text
    # A file written again (another size) is read again, alone; the index names only the files it has read.
    data = (out / names[0]).read_bytes()
    (out / names[0]).write_bytes(data + data[: theirs.shards[0].offsets[1]])
    caplog.clear()
    grown = records.load(url, "--data", S3Options(), RecordOptions(label_offset=1))
    grown_by_one = ours.shards[0].images + 1
    assert f"read {grown_by_one} records of 1 TFRecord files" in caplog.text and grown.shards[0].images == grown_by_one
    kept = json.loads((out / index[0]).read_text())
    assert [f["file"] for f in kept["files"]] == names
    # The same files elsewhere (other modification times): the same set, to the digest.
    moved = shutil.copytree(out, tmp_path / "moved")
    for path in moved.iterdir():
        os.utime(path, ns=(1, 1))  # as a copy that kept no times
    assert records.load(f"{moved}/train-*", "--data", S3Options(), RecordOptions(label_offset=1)).digest == grown.digest
    # Held-out records of two of the classes: named by their own text all the same.
    rewrite(pack_of_tree, tmp_path / "some", offset=1, text=GARDEN["text"], keep=lambda name: name != "cat")
    some = records.load(str(tmp_path / "some"), "--val-data", S3Options(), RecordOptions(label_offset=1), ours.classes)
    assert pairs(some) == [pair for pair in pairs(ours) if pair[1] != 0]
    # The validation files are a set of their own (another index), held out against the training classes.
    held = records.load(f"{out}/validation-*", "--val-data", S3Options(), RecordOptions(label_offset=1), ours.classes)
    assert held.classes == ours.classes and pairs(held) == pairs(ours)


def test_string_labels_under_keys_of_ones_own_and_names_from_a_file(pack_of_tree, tmp_path):
    out = tmp_path / "own"
    rewrite(pack_of_tree, out, stem="data.tfrecord", image="jpeg", label="name", strings=True)
    options = RecordOptions(image_key="jpeg", label_key="name")
    theirs = records.load(str(out), "--data", S3Options(), options)
    ours = packed.load(str(pack_of_tree), "--data")
    assert theirs.classes == ours.classes and pairs(theirs) == pairs(ours)
    # Integer labels from 0 and no text: the numbers, or the lines of --class-names.
    numbered = tmp_path / "numbered"
    rewrite(pack_of_tree, numbered)
    assert records.load(str(numbered), "--data", S3Options()).classes == ["0", "1", "2"]
    (tmp_path / "names.txt").write_text("\ufeffcat\ndog\n\nowl\n")
    named = records.load(str(numbered), "--data", S3Options(), RecordOptions(class_names=str(tmp_path / "names.txt")))
    assert named.classes == ours.classes and pairs(named) == pairs(ours)


def test_what_is_no_set_of_records_is_refused_in_one_line_naming_it(pack_of_tree, tmp_path, caplog):
    out = tmp_path / "garden"
    names = rewrite(pack_of_tree, out, offset=1)

    def refused(match, url=str(out), **options):
        with pytest.raises(UserError, match=match):
            records.load(url, "--data", S3Options(), RecordOptions(**options))

    refused(
        r"has no feature 'image/jpeg' \(it has: image/class/label, image/encoded\); name the right one with "
        r"--record-image-key",
        image_key="image/jpeg",
    )
    refused(r"has no feature 'label' .*--record-label-key", label_key="label")
    (tmp_path / "two.txt").write_text("a\nb\n")
    refused(
        r"has the label 3, and --class-names .* names 2 classes", label_offset=1, class_names=str(tmp_path / "two.txt")
    )
    refused(r"has no record of label 0 and has one of 1 .* if they count from 1, pass --label-offset 1")
    zero = tmp_path / "zero"
    rewrite(pack_of_tree, zero)
    refused(
        r"has the label 0 \(image/class/label\), below --label-offset 1; pass --label-offset 0",
        str(zero),
        label_offset=1,
    )
    refused(
        r"matches no TFRecord file; give a folder of \*.tfrecord files \(in S3 with a trailing /\)", f"{out}/valid-*"
    )
    # A corrupt byte, a file cut short, a file of something else: each named with its record.
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    refused(rf"{names[1]} is corrupt at record 0 \(its checksum\)", label_offset=1)
    (out / names[1]).write_bytes(data[:-3])
    refused(rf"{names[1]} ends inside record 2: a file cut short", label_offset=1)
    (out / names[1]).write_bytes(b"<html>" * 10)
    refused(rf"{names[1]} is no TFRecord file", label_offset=1)
    (out / names[1]).write_bytes(data)
    (out / "more.tfrecord.gz").write_bytes(b"")
    refused(r"more.tfrecord.gz is a compressed TFRecord file .* write the records uncompressed", f"{out}/*")
    (out / "more.tfrecord.gz").unlink()
    # gzip under a plain name; a glob that takes a text file; a file whose name has a bracket, given whole.
    (out / "zipped.tfrecord").write_bytes(gzip.compress(data))
    refused(r"zipped.tfrecord is compressed \(gzip\) .* write the records uncompressed", str(out / "zipped.tfrecord"))
    (out / "README").write_text("made by a tool")
    refused(r"README is no TFRecord file", f"{out}/*")
    (out / "odd[1].tfrecord").write_bytes(data)
    assert len(records.load(str(out / "odd[1].tfrecord"), "--data", S3Options(), RecordOptions(label_offset=1))) == 3
    # Held out: a class the model was not trained on.
    (tmp_path / "names.txt").write_text("cat\ndog\nowl\n")
    options = RecordOptions(label_offset=1, class_names=str(tmp_path / "names.txt"))
    with pytest.raises(UserError, match=r"class 'owl' of --val-data .* is not a training class"):
        records.load(f"{out}/train-*", "--val-data", S3Options(), options, ["cat", "dog"])
    # Two sets of files in one folder given whole: the training and held-out records, mostly.
    held = rewrite(pack_of_tree, out, stem="validation", offset=1)
    os.unlink(out / held[0])
    caplog.set_level(logging.WARNING, logger="hvd_train")
    records.load(f"{out}/validation-*", "--val-data", S3Options(), RecordOptions(label_offset=1), ["0", "1", "2"])
    assert f"has {len(held) - 1} of the {len(held)} files of validation-*: the others" in caplog.text
    refused(r"holds the files of 2 sets \(train-\*, validation-\*\): .* Give one with a pattern, e.g. '.*/train-\*'")


def test_records_no_image_decodes_from_or_whose_labels_are_no_text_or_of_two_kinds_are_refused(pack_of_tree, tmp_path):
    def refused(match, **change):
        out = tmp_path / f"x{len(list(tmp_path.iterdir()))}"
        count = iter(range(100))

        def changed(fields):
            if next(count) in (1, 4):
                fields.update({k: feature(v) for k, v in change.items()})
            return fields

        rewrite(pack_of_tree, out, change=changed)
        with pytest.raises(UserError, match=match):
            records.load(str(out), "--data", S3Options())

    refused(
        r"2 record\(s\) of --data .* hold no image that decodes \(the first: record 1 of .*train-00000-of-",
        **{"image/encoded": b"<html>not found</html>"},
    )
    refused(r"record 1 of .*: its label b'\\xff\\xfe' is not UTF-8 text", **{"image/class/label": b"\xff\xfe"})
    refused(r"record 1 of .* has a str label and record 0 a int one", **{"image/class/label": "cat"})
    refused(r"2 record\(s\) of --data .* hold no image that decodes", **{"image/encoded": b"GIF89a" + b"\0" * 40})


def test_an_index_entry_that_is_not_whole_is_read_again_and_files_of_two_sets_are_told_apart(pack_of_tree, tmp_path):
    out = tmp_path / "garden"
    names = rewrite(pack_of_tree, out, offset=1)
    first = records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1))
    index = next(out.glob(".hvd_train-index-*"))
    kept = json.loads(index.read_text())
    for broken in ({"bad": [[1]]}, {"texts": {"image/class/synset": {"1": "cat"}}}, {"offsets": [0, 0]}):
        index.write_text(json.dumps({**kept, "files": [{**kept["files"][0], **broken}, *kept["files"][1:]]}))
        assert records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1)) == first
    # Numbered files of two sets with a suffix; files of two sets without numbers.
    for name in names:
        os.rename(out / name, out / f"{name}.tfrecord")
    rewrite(pack_of_tree, out, stem="validation", offset=1)
    with pytest.raises(UserError, match=r"2 sets \(train-\*.tfrecord, validation-\*\).* e.g. '.*/train-\*.tfrecord'"):
        records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1))
    plain = tmp_path / "plain"
    plain.mkdir()
    for name, target in ((names[0], "train.tfrecord"), ("validation-00000-of-00003", "val.tfrecord")):
        shutil.copy(out / (f"{name}.tfrecord" if name in names else name), plain / target)
    with pytest.raises(UserError, match=r"holds the files of 2 sets \(train\*, val\*\)"):
        records.load(str(plain), "--data", S3Options(), RecordOptions(label_offset=1))
    # Held out: a few of many numbered classes.
    few = records.load(
        str(plain / "val.tfrecord"),
        "--val-data",
        S3Options(),
        RecordOptions(label_offset=1),
        [str(i) for i in range(6000)],
    )
    assert len(few) > 0


def test_a_folder_that_cannot_keep_the_index_keeps_it_in_the_cache_folder(pack_of_tree, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="hvd_train")
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "garden"
    rewrite(pack_of_tree, out, offset=1)
    # The index's name taken by a folder: the file cannot be written there (root writes anywhere else).
    found = records.source(str(out), "--data", S3Options(), RecordOptions(label_offset=1))
    (out / records.record_index.name_of(found)).mkdir()
    first = records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1))
    kept = list((tmp_path / "cache" / "record-index").iterdir())
    assert len(kept) == 1 and f"the index is {kept[0]}" in caplog.text
    caplog.clear()
    assert records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1)) == first
    assert f"from the index {kept[0]}" in caplog.text
    # An index beside the files whose every entry is stale (an older copy) does not hide the cache's.
    (out / records.record_index.name_of(found)).rmdir()
    stale = json.loads(kept[0].read_text())
    stale["files"] = [{**entry, "stamp": "0:0"} for entry in stale["files"]]
    (out / records.record_index.name_of(found)).write_text(json.dumps(stale))
    caplog.clear()
    assert records.load(str(out), "--data", S3Options(), RecordOptions(label_offset=1)) == first
    assert "read " not in caplog.text and str(kept[0]) in caplog.text


def test_trains_flags_reach_the_records_and_are_refused_where_no_records_are(pack_of_tree, tmp_path):
    """``train``'s options as typed: the records read with them; on a folder of images, or with --val-split
    (which cannot divide files of records), each refused in one line."""
    import argparse

    from hvd_train import config
    from hvd_train.distributed.context import Context
    from hvd_train.training.stages import training_sets

    out = tmp_path / "own"
    rewrite(pack_of_tree, out, stem="data.tfrecord", image="jpeg", label="id", offset=1)
    (tmp_path / "names.txt").write_text("cat\ndog\nowl\n")

    def sets(*argv):
        parser = argparse.ArgumentParser()
        config.add_arguments(parser)
        cfg = config.from_sources(parser.parse_args(["--output", str(tmp_path / "run"), *map(str, argv)]))
        return training_sets(cfg.data, 0, Context())

    given = ["--record-image-key", "jpeg", "--record-label-key", "id", "--label-offset", "1"]
    train, val = sets("--data", out, "--val-data", out, *given, "--class-names", tmp_path / "names.txt")
    assert train.classes == val.classes == ["cat", "dog", "owl"] and len(train) == len(val) == 9
    with pytest.raises(UserError, match=r"is a set of TFRecord files, which --val-split cannot divide; pass its "):
        sets("--data", out, *given)
    with pytest.raises(UserError, match=r"--class-names tells how other tools' TFRecord files are read, and no data"):
        sets("--data", tmp_path / "images", "--class-names", tmp_path / "names.txt")
    pets = shutil.copytree(TFDS_PETS, tmp_path / "pets")
    train, val = sets("--data", pets, "--val-data", pets, "--data-split", "validation", "--val-data-split", "train")
    assert (len(train), len(val)) == (6, 12) and train.classes == val.classes == ["cat", "dog", "owl"]
    train, val = sets("--data", pets)  # alone: its validation split held out
    assert (len(train), len(val)) == (12, 6) and val.features.kind == "tfds"
    info = json.loads((pets / "dataset_info.json").read_text())
    (pets / "dataset_info.json").write_text(json.dumps({**info, "splits": info["splits"][:1]}))
    with pytest.raises(UserError, match=r"is a split of a TFDS folder, which --val-split cannot divide; pass the "):
        sets("--data", pets)  # a folder of a train split alone
    with pytest.raises(
        UserError, match=r"--val-data-split test tells which split of a TFDS folder or rows of a CSV are read, and its"
    ):
        sets("--data", pets, "--val-data", tmp_path / "images", "--val-data-split", "test")
    with pytest.raises(UserError, match=r"`--label-offset` is invalid. Received: label_offset=-1; use a whole"):
        sets("--data", out, "--label-offset", "-1")


# A folder tensorflow_datasets 4.9.10 prepared (a builder of 18 solid 8x8 PNGs, pixel value 10 i + 12 for the
# 12 of train and 10 i + 6 for the 6 of validation, label i % 3 of cat, dog, owl): its files as TFDS writes them.
TFDS_PETS = Path(__file__).parent / "tfds_pets"


def tfds_folder(shard_sets, out, classes):
    """The records of shard sets (``{split: folder}``) written again as a prepared TFDS folder of the dataset
    ``demo`` would hold them, its JSON made from what TFDS wrote for ``TFDS_PETS``."""
    info = json.loads((TFDS_PETS / "dataset_info.json").read_text())
    info["name"], splits = "demo", []
    for split, folder in shard_sets.items():
        names = rewrite(folder, out, stem=f"demo-{split}.tfrecord", image="image", label="label")
        lengths = [str(packed.load(str(folder), "--data").shards[i].images) for i in range(len(names))]
        splits.append({**info["splits"][0], "name": split, "shardLengths": lengths})
    info["splits"] = splits
    (out / "dataset_info.json").write_text(json.dumps(info))
    shutil.copy(TFDS_PETS / "features.json", out)
    (out / "label.labels.txt").write_text("".join(f"{c}\n" for c in classes))


def pixels(data):
    """``(pixel value, label)`` of every record of ``data``, sorted."""
    ds = eval_dataset(data, rank=0, size=1, batch_size=4, image_size=8, crop_fraction=1.0, preprocess=lambda x: x)
    return sorted((int(i[0, 0, 0]), int(label)) for images, labels in ds.dataset for i, label in zip(images, labels))


def test_a_folder_tfds_prepared_is_read_by_its_own_description(tmp_path):
    """The splits, the image and label features, the class names, the files and their record counts: all from
    TFDS's JSON, without tensorflow_datasets."""
    folder = shutil.copytree(TFDS_PETS, tmp_path / "pets" / "1.0.0")
    assert records.is_records(str(folder))
    train = records.load(str(folder), "--data", S3Options())
    assert train.classes == ["cat", "dog", "owl"] and train.features.kind == "tfds" and len(train) == 12
    assert pixels(train) == sorted((10 * i + 12, i % 3) for i in range(12))
    trained = ["owl", "yak", "cat", "dog"]  # a model's classes, in another order: labels are mapped onto them
    held = records.load(str(folder), "--val-data", S3Options(), classes=trained)
    assert pixels(held) == sorted((10 * i + 6, trained.index(train.classes[i % 3])) for i in range(6))
    named = records.load(str(folder), "--data", S3Options(), RecordOptions(split="validation"))
    assert pixels(named) == sorted((10 * i + 6, i % 3) for i in range(6))

    def refused(match, flag="--data", **options):
        with pytest.raises(UserError, match=match):
            records.load(str(folder), flag, S3Options(), RecordOptions(**options))

    refused(
        r"has no split 'test'; its splits are: train, validation. Name one with --val-data-split",
        "--val-data",
        split="test",
    )
    assert records.load(str(folder), "--data", S3Options(), RecordOptions(label_offset=1)) == train  # not applied
    info = json.loads((folder / "dataset_info.json").read_text())
    info["splits"][0]["shardLengths"] = ["13"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    refused(r"pets-train.tfrecord-00000-of-00001 holds 12 records where dataset_info.json says 13")
    info["splits"][0]["shardLengths"] = ["6", "7"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    refused(r"2 of the 2 files of split 'train' are not in --data .* \(the first: pets-train.tfrecord-00000-of-00002")
    (folder / "dataset_info.json").write_text(json.dumps({**info, "fileFormat": "array_record"}))
    refused(r"is a TFDS folder of array_record files; only TFRecord files are read")
    info["splits"][0]["shardLengths"] = ["twelve"]
    (folder / "dataset_info.json").write_text(json.dumps(info))
    refused(r"its dataset_info.json or features.json is not as TFDS writes it \(ValueError: ")
    shutil.copy(TFDS_PETS / "dataset_info.json", folder)
    (folder / "label.labels.txt").write_text("cat\ncat\nowl\n")
    refused(r"label.labels.txt names 'cat' twice; prepare the dataset again")
    # A split without labels (TFDS writes -1, as for ImageNet's test split).
    shutil.copy(TFDS_PETS / "label.labels.txt", folder)
    unlabelled = tmp_path / "unlabelled"
    unlabelled.mkdir()
    for name in ("dataset_info.json", "features.json", "label.labels.txt"):
        shutil.copy(TFDS_PETS / name, unlabelled)
    framed = []
    for record in tf.data.TFRecordDataset(str(TFDS_PETS / "pets-validation.tfrecord-00000-of-00001")):
        example = tf.train.Example.FromString(record.numpy())
        example.features.feature["label"].int64_list.value[0] = -1
        framed.append(packed.frame(example.SerializeToString()))
    (unlabelled / "pets-validation.tfrecord-00000-of-00001").write_bytes(b"".join(framed))
    shutil.copy(TFDS_PETS / "pets-train.tfrecord-00000-of-00001", unlabelled)
    with pytest.raises(
        UserError,
        match=r"split 'validation' of --val-data .* holds records without a label \(-1\); "
        r"choose a labelled split with --val-data-split",
    ):
        records.load(str(unlabelled), "--val-data", S3Options(), classes=["cat", "dog", "owl"])
    # A description beside no TFRecord files is no TFDS folder (an image tree may hold one).
    for name in os.listdir(unlabelled):
        if "tfrecord" in name:
            os.unlink(unlabelled / name)
    assert not records.is_records(str(unlabelled))


@pytest.mark.multiprocess  # two processes at once, then a job of two ranks
def test_other_tools_records_train_the_packed_sets_model_and_evaluate_alike_under_a_launcher(demo_small, tmp_path):
    """The demo's images packed (train and val), and the same records written again as Model Garden writes them
    (one folder, ``train-*`` and ``validation-*``, labels from 1): the same weights to the bit and the same held-out
    score. Two ranks make the index of a folder never read before, each a share of the files, and ``evaluate``
    scores it as the folder of the images."""

    packs = tmp_path / "packed"
    proc = run_at_once([*HVD_TRAIN, "pack", demo_small, packs, "--val-split", "0.2", "--shard-size", "20KB"])[0]
    assert proc.returncode == 0, output_of(proc)
    garden = tmp_path / "garden"
    rewrite(packs / "train", garden, offset=1)
    rewrite(packs / "val", garden, stem="validation", offset=1)
    names = tmp_path / "names.txt"
    names.write_text("".join(f"{c}\n" for c in packed.load(str(packs / "train"), "--data").classes))
    given = {
        "packed": ["--data", packs / "train", "--val-data", packs / "val"],
        "garden": [
            *("--data", f"{garden}/train-*", "--val-data", f"{garden}/validation-*"),
            *("--label-offset", "1", "--class-names", names),
        ],
    }
    runs = {name: tmp_path / name for name in given}
    ours, theirs = trained_alike(given, tmp_path, [*TINY, "--deterministic", "--epochs", "2"]).values()
    assert theirs["val_images"] == ours["val_images"] > 0
    fresh = tmp_path / "fresh"
    rewrite(packs / "train", fresh, offset=1)
    rewrite(packs / "val", fresh, stem="validation", offset=1)
    evaluate = [*HVD_TRAIN, "evaluate", "--model-dir", runs["garden"], "--data"]
    names.unlink()  # the run's --class-names file is gone: its classes name the labels all the same
    launched, folder = run_at_once(
        [
            *launcher_command("horovodrun-gloo", 2),
            *evaluate,
            f"{fresh}/*",  # both sets of files; their labels and names are read as the run read its own
            "--report",
            tmp_path / "fresh.json",
        ],
        [*evaluate, demo_small, "--report", tmp_path / "folder.json"],
    )
    for proc in (launched, folder):
        assert proc.returncode == 0, output_of(proc)
    # Rank 0 read every other file; the index it wrote has all of them.
    files = sorted(n for n in os.listdir(fresh) if not n.startswith("."))
    assert re.search(rf"read \d+ records of {len(files[0::2])} TFRecord files", launched.stderr), output_of(launched)
    assert f"indexed 115 records in {len(files)} TFRecord files" in launched.stderr
    by_records, by_folder = (read_json(tmp_path / f"{name}.json") for name in ("fresh", "folder"))
    assert by_records["images"] == by_folder["images"] == 115
    assert (by_records["accuracy"], by_records["loss"]) == (by_folder["accuracy"], by_folder["loss"])
    # A TFDS folder of the same records: its validation split (evaluate's default) scores as the packed val set.
    prepared = tmp_path / "tfds"
    tfds_folder(
        {"train": packs / "train", "validation": packs / "val"}, prepared, read_json(runs["garden"] / "labels.json")
    )
    scored = run_at_once(
        [*evaluate, prepared, "--report", tmp_path / "tfds.json"],
        [*evaluate, packs / "val", "--report", tmp_path / "val.json"],
        [*evaluate, prepared, "--data-split", "train", "--report", tmp_path / "tfds-train.json"],
    )
    for proc in scored:
        assert proc.returncode == 0, output_of(proc)
    by_tfds, by_val, by_train = (read_json(tmp_path / f"{name}.json") for name in ("tfds", "val", "tfds-train"))
    assert (
        by_tfds["images"] == by_val["images"] == theirs["val_images"] and by_train["images"] == 115 - by_val["images"]
    )
    assert (by_tfds["accuracy"], by_tfds["loss"]) == (by_val["accuracy"], by_val["loss"])
