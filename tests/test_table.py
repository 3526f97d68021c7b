"""A CSV of labels as ``--data``: what it names, where, and every row it refuses (one process, no job)."""

import os
import re

import numpy as np
import pytest

from hvd_train.data.folder import is_image_name, list_folder
from hvd_train.data.storage import nfc as storage_nfc
from hvd_train.data.table import TableOptions, is_table, read_table
from hvd_train.errors import UserError

from conftest import HVD_TRAIN, TINY, output_of, read_json, run_at_once, trained_alike, write_images

COUNTS = {"cat": 3, "dog": 4, "owl": 2}


@pytest.fixture
def tree(tmp_path):
    """``tmp_path/images/<class>/img-N.png``."""
    return write_images(tmp_path / "images", COUNTS, size=8)


def table(path, lines, encoding="utf-8"):
    path.write_bytes("\n".join(lines).encode(encoding) + b"\n")
    return str(path)


def rows_of(tree, prefix=""):
    """``prefix<class>/<file>,<class>`` for every image of ``tree``, in an order of their own (reversed)."""
    found = sorted(p.relative_to(tree).as_posix() for p in tree.rglob("*") if p.is_file() and is_image_name(p.name))
    return [f"{prefix}{rel},{rel.split('/')[0]}" for rel in reversed(found)]


def test_a_table_of_a_folders_images_is_the_folders_list_to_the_digest(tree):
    """The same images, labels, classes and order as the folder tree gives: the same hold-out and training."""
    csv = table(tree / "labels.csv", ["path,label", *rows_of(tree)])
    assert is_table(csv) and is_table("s3://b/x/LABELS.CSV") and not is_table(str(tree))
    listed, read = list_folder(str(tree)), read_table(csv, "--data")
    assert read.classes == ["cat", "dog", "owl"] and read.counts() == [3, 4, 2]
    assert list(read.paths) == list(listed.paths) and np.array_equal(read.labels, listed.labels)
    assert read.digest == listed.digest and read.prefix == listed.prefix


def test_columns_are_found_by_their_usual_names_or_named_and_ids_without_extension_are_found(tmp_path):
    flat = tmp_path / "train"
    flat.mkdir()
    for i, label in enumerate(["a", "b", "a", "b"]):
        write_images(tmp_path / "made", {label: 1})
        os.replace(tmp_path / "made" / label / "img-000.png", flat / f"{i:04d}.png")
    # Kaggle's layout: a flat folder, an id column without extension, labels in "Category", semicolons.
    csv = table(tmp_path / "train.csv", ["\ufeffId;Category", *(f"train/{i:04d};{'ab'[i % 2]}" for i in range(4))])
    read = read_table(csv, "--data")
    assert read.classes == ["a", "b"] and read.relative(0) == "train/0000.png" and read.labels.tolist() == [0, 0, 1, 1]
    named = table(tmp_path / "named.csv", ["file,kind,x", *(f"train/{i:04d}.png,{'ab'[i % 2]},1" for i in range(4))])
    assert read_table(named, "--data", options=TableOptions(label_column="Kind")) == read
    with pytest.raises(UserError, match=r"named.csv has no column of labels \(label/class/category/class_name, "):
        read_table(named, "--data")
    with pytest.raises(UserError, match=r"has no column 'tag' \(--label-column\); its columns are: file, kind, x"):
        read_table(named, "--data", options=TableOptions(label_column="tag"))


def test_a_path_below_the_image_root_is_taken_and_any_other_is_refused_by_line(tree, tmp_path):
    inside = table(tmp_path / "in.csv", ["path,label", *rows_of(tree, f"{tree}/")])
    assert read_table(inside, "--data", options=TableOptions(image_root=str(tree))) == list_folder(str(tree))
    rows = rows_of(tree, "./")
    beside = f"{tree}-2/cat/img-000.png,cat"  # a folder whose name starts with the root's
    outside = ("../images/cat/img-000.png,cat", "/etc/passwd,cat", "s3://bucket/cat/x.png,cat", beside)
    for bad in (*outside, "a\\b.png,cat"):
        csv = table(tmp_path / "labels.csv", ["path,label", *rows, bad])
        with pytest.raises(UserError) as refused:
            read_table(csv, "--data", options=TableOptions(image_root=str(tree)))
        message = str(refused.value)
        assert "\n" not in message and f"line {len(rows) + 2}: " in message, message
        assert message.startswith(f"--data {csv}: 1 row(s) cannot be used"), message


def test_names_written_on_macos_are_found_by_the_same_names_typed_elsewhere(tree):
    """A class folder, a folder in it and a file named in decomposed accents (NFD, as macOS writes them), the CSV's
    rows in composed ones (NFC): the folder's list to the digest."""
    nfd, nfc = "cafe\u0301", "caf\u00e9"
    os.replace(tree / "cat", tree / nfd)
    (tree / "dog" / nfd).mkdir()
    os.replace(tree / "dog" / "img-000.png", tree / "dog" / nfd / f"{nfd}.png")
    listed = list_folder(str(tree))
    rows = [f"{listed.relative(i)},{listed.classes[label]}" for i, label in enumerate(listed.labels.tolist())]
    assert any(f"dog/{nfc}/{nfc}.png" in row for row in rows) and f"{nfc}/img-000.png,{nfc}" in rows
    read = read_table(table(tree / "labels.csv", ["path,label", *rows]), "--data")
    assert list(read.paths) == list(listed.paths) and read.digest == listed.digest and read.classes == listed.classes
    assert (tree / "dog" / nfd / f"{nfd}.png").as_posix() in list(read.paths)


def test_the_file_systems_root_as_image_root_and_files_that_are_no_one_image(tree, tmp_path, caplog):
    rows = rows_of(tree, f"{tree}/")
    csv = table(tmp_path / "abs.csv", ["path,label", *rows])
    read = read_table(csv, "--data", options=TableOptions(image_root="/"))
    assert read.prefix == "/" and list(read.paths) == list(list_folder(str(tree)).paths)
    from hvd_train.data import packed
    from hvd_train.data.storage import S3Options

    packed.pack(csv, str(tmp_path / "packed"), shard_size=10**6, on_bad_image="fail", seed=1, s3=S3Options(),
                table=TableOptions(image_root="/"))  # fmt: skip
    assert packed.load(str(tmp_path / "packed"), "--data").class_counts == (3, 4, 2)
    (tree / "cat" / "loop").symlink_to("loop")
    (tree / "cat" / "two.png").write_bytes(b"")
    (tree / "cat" / "two.JPG").write_bytes(b"")
    (tree / "cat" / "d.png").mkdir()
    os.replace(tree / "dog" / "img-000.png", tree / "dog" / "mixed.Jpeg")
    odd = ["cat/loop/x.png,cat", "cat/two,cat", "cat/d.png,cat", "dog/img-000,dog", "dog/mixed,dog"]
    csv = table(tree / "odd.csv", ["path,label", *rows_of(tree)[:2], *odd[1:3]])
    with pytest.raises(UserError) as refused:
        read_table(csv, "--data")
    assert str(refused.value).endswith(
        "2 row(s) name no one image file: line 4: cat/two (one id, several files: two.JPG, two.png); "
        "line 5: cat/d.png (a folder); name each image's file."
    ), refused.value
    csv = table(tree / "odd.csv", ["path,label", *rows_of(tree)[:2], *odd[:1], *odd[3:]])
    with pytest.raises(
        UserError, match=r": 2 of 5 image\(s\) it names are not in .*: line 4: cat/loop/x.png; line 5: "
    ):
        read_table(csv, "--data")
    # An id whose file's extension is in another case is found, and labels alike in all but case are warned of.
    csv = table(tree / "alike.csv", ["path,label", *rows_of(tree)[:2], "dog/mixed,Owl", "cat/img-001,Owl"])
    with caplog.at_level("WARNING", logger="hvd_train"):
        read = read_table(csv, "--data")
    assert read.classes == ["Owl", "owl"] and "dog/mixed.Jpeg" in list(read.paths.relatives())
    assert any("labels 'Owl'/'owl' differ only in case" in r.getMessage() for r in caplog.records), caplog.records


def test_missing_images_duplicate_rows_and_too_few_images_of_a_label_are_counted_and_the_first_named(tree):
    rows = rows_of(tree)
    csv = table(tree / "gone.csv", ["path,label", *rows, *(f"cat/gone-{i}.png,cat" for i in range(5))])
    with pytest.raises(UserError, match=rf"5 of {len(rows) + 5} image\(s\) it names are not in {tree}: line 11: "):
        read_table(csv, "--data")
    csv = table(tree / "twice.csv", ["path,label", *rows, rows[0]])
    with pytest.raises(UserError, match=r"1 image\(s\) are on more than one row: owl/img-001.png on lines 2 and 11"):
        read_table(csv, "--data")
    assert rows[2] == "dog/img-003.png,dog"
    csv = table(tree / "typo.csv", ["path,label", *rows[:2], "dog/img-003.png,dgo", *rows[3:]])
    with pytest.raises(UserError, match=r"1 label\(s\) are on fewer than 2 images: 'dgo' on 1 \(line 4\).*-label 1"):
        read_table(csv, "--data")
    assert read_table(csv, "--data", options=TableOptions(min_per_label=1)).classes == ["cat", "dgo", "dog", "owl"]


def test_held_out_labels_index_the_training_classes_and_another_label_is_refused(tree):
    csv = table(tree / "val.csv", ["path,label", "dog/img-000.png,dog", "owl/img-000.png,owl"])
    held = read_table(csv, "--val-data", classes=["cat", "dog", "owl"])
    assert held.labels.tolist() == [1, 2] and held.counts() == [0, 1, 1]
    with pytest.raises(UserError, match=r"--val-data .*val.csv: line 3 has label 'owl', which is not a training class"):
        read_table(csv, "--val-data", classes=["cat", "dog"])


def test_a_table_that_is_no_utf8_or_no_table_is_one_line(tree, tmp_path):
    latin = table(tmp_path / "latin.csv", ["path,label", "cat/img-000.png,chat", "dog/img-000.png,café"], "latin-1")
    with pytest.raises(UserError, match=r"latin.csv is not UTF-8 \(byte 0xe9 on line 3\); save it as UTF-8"):
        read_table(latin, "--data", options=TableOptions(image_root=str(tree)))
    for lines, said in (
        ([], "is empty; it needs a header row"),
        (["path,label"], "names no images"),
        (["path,label", "cat/img-000.png,cat,x"], "line 2 has 3 column(s) where its header has 2"),
    ):
        with pytest.raises(UserError, match=re.escape(said)):
            read_table(table(tmp_path / "t.csv", lines), "--data")
    with pytest.raises(UserError, match="does not exist; check the path"):
        read_table(str(tmp_path / "none.csv"), "--data")
    utf16 = table(tmp_path / "excel.csv", ["\ufeffpath,label", "cat/img-000.png,cat"], "utf-16-le")
    with pytest.raises(UserError, match=r"excel.csv is UTF-16 \(Excel's Unicode text\); save it as CSV UTF-8"):
        read_table(utf16, "--data")
    headless = table(tmp_path / "headless.csv", ["cat/img-000.png,cat", "dog/img-000.png,dog"])
    with pytest.raises(UserError, match=r"its columns are: cat/img-000.png, cat. Name it with --label-column, or, "):
        read_table(headless, "--data")
    # Excel's first line naming the delimiter is read as such; a header that no delimiter splits is named.
    excel = table(tmp_path / "excel-sep.csv", ["sep=;", "path;label", "cat/img-000.png;cat", "dog/img-000.png;dog"])
    assert read_table(excel, "--data", options=TableOptions(image_root=str(tree), min_per_label=1)).counts() == [1, 1]
    glued = table(tmp_path / "glued.tsv", ["path,label", "cat/img-000.png,cat"])
    with pytest.raises(UserError, match=r"its header 'path,label' is one column split by no '\\t'; write the table"):
        read_table(glued, "--data")


def test_pack_writes_the_shards_of_the_folder_from_its_csv(tree, tmp_path):
    """The same records, byte for byte: the CSV's rows name the images below its folder, as the folder lists them."""
    from hvd_train.data import packed
    from hvd_train.data.storage import S3Options

    csv = table(tree / "labels.csv", ["path,label", *rows_of(tree)])
    options = dict(shard_size=400, on_bad_image="skip", seed=3, s3=S3Options())
    packed.pack(str(tree), str(tmp_path / "folder"), **options)
    packed.pack(csv, str(tmp_path / "csv"), **options)
    shards = sorted(p.name for p in (tmp_path / "folder").glob("shard-*"))
    assert len(shards) > 1 and shards == sorted(p.name for p in (tmp_path / "csv").glob("shard-*"))
    for name in shards:
        assert (tmp_path / "folder" / name).read_bytes() == (tmp_path / "csv" / name).read_bytes(), name


@pytest.mark.multiprocess  # two processes at once
def test_a_csv_of_a_folders_images_trains_the_folders_model_and_evaluate_scores_it_alike(demo_small, tmp_path):
    """The demo's images given as a folder and as a CSV elsewhere (``--image-root``): the same hold-out, the same
    weights to the bit, the same held-out score; ``evaluate`` of the CSV scores what it scores of the folder."""
    csv = table(tmp_path / "labels.csv", ["image,class", *rows_of(demo_small)])
    given = {"folder": ["--data", demo_small], "csv": ["--data", csv, "--image-root", demo_small]}
    runs = {name: tmp_path / name for name in given}
    summaries = trained_alike(given, tmp_path, [*TINY, "--val-split", "0.2", "--deterministic"])
    assert summaries["csv"]["val_images"] == summaries["folder"]["val_images"] == 25
    # predict takes a CSV of paths alone (no labels), and answers in its rows' order.
    shuffled = [row.split(",")[0] for row in rows_of(demo_small)][::7]
    shuffled = shuffled[1::2] + shuffled[::2]
    paths = table(tmp_path / "paths.csv", ["file", *shuffled])
    evaluate = [*HVD_TRAIN, "evaluate", "--model-dir", runs["csv"]]  # each of `given` begins with --data
    predict = [*HVD_TRAIN, "predict", "--model-dir", runs["csv"], paths, "--image-root", demo_small]
    *scored, predicted = run_at_once(
        *([*evaluate, *data, "--report", tmp_path / f"{name}.json"] for name, data in given.items()),
        [*predict, "--output", tmp_path / "p.csv"],
    )
    for proc in [*scored, predicted]:
        assert proc.returncode == 0, output_of(proc)
    by_folder, by_csv = (read_json(tmp_path / f"{name}.json") for name in given)
    assert by_csv["images"] == by_folder["images"] == 115
    assert (by_csv["accuracy"], by_csv["loss"]) == (by_folder["accuracy"], by_folder["loss"])
    answers = (tmp_path / "p.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in answers[1:]] == [f"{demo_small}/{rel}" for rel in shuffled]


def test_the_other_commands_take_the_csvs_options_and_refuse_them_with_no_csv():
    import argparse

    from hvd_train.commands._common import CSV_LABELS, CSV_PATHS, CSV_TRAINING, add_csv_arguments, csv_options

    for names, argv, least in (
        ((*CSV_PATHS, *CSV_TRAINING), ["--label-column", "kind", "--min-images-per-label", "1"], 1),  # pack
        ((*CSV_PATHS, *CSV_LABELS), ["--label-column", "kind"], 2),  # evaluate, export
        (CSV_PATHS, [], 2),  # predict: no labels
    ):
        parser = argparse.ArgumentParser()
        add_csv_arguments(parser, *names)
        args = parser.parse_args(["--image-root", "s3://b/images", *argv])
        kind = "kind" if argv else ""
        assert csv_options(args, "d/", "s3://b/Labels.csv") == TableOptions("", kind, "s3://b/images", least)
        with pytest.raises(UserError, match=r"^--image-root tells how a CSV of labels is read, and d/ is none; leave"):
            csv_options(args, "d/", "")
    with pytest.raises(SystemExit):
        parser.parse_args(["--label-column", "kind"])  # predict reads no labels
    args = argparse.Namespace(min_images_per_label=3)
    with pytest.raises(UserError, match=r"^--min-images-per-label tells how a CSV of labels is read, and d is none"):
        csv_options(args, "d")
    with pytest.raises(UserError, match=r"^--min-images-per-label tells how .*, and none is given; leave it out"):
        csv_options(args, None, None)  # export with neither --check-data nor --calibration-data


def test_predict_refuses_a_csv_or_images_in_s3_before_reading_anything():
    from hvd_train.data.table import table_images

    for url, options in (("s3://b/x.csv", None), ("/tmp/x.csv", TableOptions(image_root="s3://b/images"))):
        with pytest.raises(UserError, match=r": the CSV and its images must be local; PATH reads no S3"):
            table_images(url, "PATH", options)


def test_two_names_alike_but_in_unicode_form_are_each_their_own_file_and_a_third_form_is_refused(tmp_path):
    """Linux and S3 hold both ``é`` forms side by side: a row names the one it spells, never the other."""
    nfc, nfd, mixed = "\u00e9\u00e9", "e\u0301e\u0301", "\u00e9e\u0301"
    write_images(tmp_path / "t", {"a": 2, "b": 2}, size=4)
    os.replace(tmp_path / "t" / "a" / "img-000.png", tmp_path / "t" / "a" / f"{nfc}.png")
    os.replace(tmp_path / "t" / "a" / "img-001.png", tmp_path / "t" / "a" / f"{nfd}.png")
    csv = table(tmp_path / "t" / "l.csv", ["path,label", f"a/{nfd}.png,a", f"a/{nfc}.png,a", "b/img-000.png,b"])
    read = read_table(csv, "--data", options=TableOptions(min_per_label=1))
    listed = list_folder(str(tmp_path / "t"))
    assert sorted(read.paths) == sorted(listed.paths)[:3] and len({storage_nfc(p) for p in read.paths}) == 2
    csv = table(tmp_path / "t" / "l.csv", ["path,label", f"a/{mixed}.png,a", "b/img-000.png,b"])
    with pytest.raises(
        UserError, match=r"1 row\(s\) name no one image file: line 2: .* \(names 2 entries, in two Unic"
    ):
        read_table(csv, "--data", options=TableOptions(min_per_label=1))


def test_a_hidden_file_is_refused_and_an_absolute_path_is_read_as_the_root_writes_it(tree, tmp_path):
    rows = rows_of(tree)
    (tree / "cat" / "._img-000.png").write_bytes(b"resource fork")
    csv = table(tmp_path / "h.csv", ["path,label", *rows, "cat/._img-000.png,cat"])
    with pytest.raises(UserError, match=r"line 11: cat/._img-000.png names a hidden file or folder \(._img-000.png\)"):
        read_table(csv, "--data", options=TableOptions(image_root=str(tree)))
    doubled = [f"/{tree}//{row}" for row in rows]
    csv = table(tmp_path / "d.csv", ["path,label", *doubled])
    assert read_table(csv, "--data", options=TableOptions(image_root=str(tree))).digest == list_folder(str(tree)).digest


def test_a_split_column_trains_on_its_train_rows_and_holds_out_its_validation_rows(tmp_path):
    """Rows marked train, validation and test: training takes the train rows, held-out data the validation rows
    (or the split named), ``pack`` writes both; an image in two splits and a split the CSV lacks are refused."""
    import argparse

    from hvd_train import config
    from hvd_train.data import packed
    from hvd_train.data.storage import S3Options
    from hvd_train.data.table import read_table_pair
    from hvd_train.distributed.context import Context
    from hvd_train.training.stages import training_sets

    tree = write_images(tmp_path / "images", {"cat": 9, "dog": 9, "owl": 6}, size=8)
    rows = rows_of(tree)
    marked = [f"{row},{('train', 'validation', 'test')[i % 3]}" for i, row in enumerate(rows)]
    csv = table(tree / "labels.csv", ["path,label,Split", *marked])
    by_split = {
        s: sorted(r.split(",")[0] for r in marked if r.endswith("," + s)) for s in ("train", "validation", "test")
    }

    def names(images):
        return sorted(images.relative(i) for i in range(len(images)))

    train, held = read_table_pair(csv, "--data", None, TableOptions())
    assert names(train) == by_split["train"] and names(held) == by_split["validation"]
    assert held.classes == train.classes == read_table(csv, "--data").classes
    assert names(read_table(csv, "--data")) == by_split["train"]
    assert names(read_table(csv, "--val-data", classes=train.classes)) == by_split["validation"]  # evaluate's default
    test = read_table(csv, "--val-data", options=TableOptions(split="test"), classes=train.classes)
    assert names(test) == by_split["test"]

    def sets(*argv):
        parser = argparse.ArgumentParser()
        config.add_arguments(parser)
        cfg = config.from_sources(parser.parse_args(["--output", str(tmp_path / "run"), *map(str, argv)]))
        return training_sets(cfg.data, 0, Context())

    train, held = sets("--data", csv)  # no --val-data, no --val-split: the CSV's validation rows
    assert names(train) == by_split["train"] and names(held) == by_split["validation"]
    train, held = sets(
        "--data", csv, "--data-split", "test", "--val-data-split", "train", "--min-images-per-label", "1"
    )
    assert names(train) == by_split["test"] and names(held) == by_split["train"]
    with pytest.raises(
        UserError,
        match=r"has no rows of split 'dev'; its splits are: test, train, validation\. "
        r"Name one with --val-data-split",
    ):
        sets("--data", csv, "--val-data-split", "dev")
    with pytest.raises(UserError, match=r"--data-split train picks rows by their split, and --data .* has no column"):
        sets("--data", table(tree / "plain.csv", ["path,label", *rows]), "--data-split", "train")
    with pytest.raises(UserError, match=r"--val-data-split test tells which split of a TFDS folder or rows of a CSV"):
        sets("--data", tree, "--val-data-split", "test")
    # pack: the train rows into DST/train, the validation rows into DST/val.
    written = packed.pack(
        csv, str(tmp_path / "packed"), shard_size=1 << 20, on_bad_image="skip", seed=1, s3=S3Options()
    )
    assert [m["images"] for m in written.values()] == [len(by_split["train"]), len(by_split["validation"])]
    with pytest.raises(UserError, match=r"holds out rows of its own \(its split column\); leave --val-split out"):
        packed.pack(
            csv, str(tmp_path / "p2"), shard_size=1 << 20, on_bad_image="skip", seed=1, s3=S3Options(), val_split=0.2
        )
    # A column named otherwise; an image on rows of two splits.
    fold = table(tree / "fold.csv", ["path,label,fold", *(m.replace(",validation", ",val") for m in marked)])
    train, held = read_table_pair(fold, "--data", None, TableOptions(split_column="fold"))
    assert names(held) == by_split["validation"]
    leak = table(tree / "leak.csv", ["path,label,split", *marked, f"{marked[0].rsplit(',', 1)[0]},test"])
    with pytest.raises(UserError, match=r"is on line 2 in split 'train' and on line .* in split 'test'; an image held"):
        read_table(leak, "--data")


def test_a_multi_label_csv_is_read_as_sets_of_classes_from_one_cell_or_a_column_per_class(tmp_path):
    """Labels split from one cell (by spaces or a separator), or 0/1 columns, give the same sets; held out by each
    image's rarest class; the digest tells them from a single-label list; bad cells are refused by line."""
    from hvd_train.data.folder import split_per_class

    tree = write_images(tmp_path / "images", {"x": 12}, size=8)
    names = sorted(p.name for p in (tree / "x").iterdir())
    tags = [("cat", "dog"), ("dog",), (), ("owl", "cat"), ("cat",), ("dog", "owl"), ("cat", "dog", "owl")] * 2
    tags = tags[: len(names)]
    multi = TableOptions(multi_label=True)
    rows = [f"x/{n},{' '.join(t)}" for n, t in zip(names, tags)]
    spaced = table(tree / "spaced.csv", ["path,labels", *reversed(rows)])  # the set follows its path's order
    piped = table(tree / "piped.csv", ["file,tags", *(f"x/{n},{'|'.join(t)}" for n, t in zip(names, tags))])
    columns = table(
        tree / "columns.csv",
        [
            "image,owl,cat,dog",
            *(f"x/{n},{int('owl' in t)},{int('cat' in t)},{float('dog' in t)}" for n, t in zip(names, tags)),
        ],
    )
    read = read_table(spaced, "--data", options=multi)
    assert read.classes == ["cat", "dog", "owl"]
    assert [sorted(read.classes[i] for i in read.label_sets.row(k)) for k in range(len(read))] == [
        sorted(t) for t in tags
    ]
    assert read.counts() == [sum(c in t for t in tags) for c in read.classes]
    lowest = [min((read.classes.index(c) for c in t), default=-1) for t in tags]
    assert read.labels.tolist() == lowest  # each set's lowest class, -1 for an image with none
    assert read_table(piped, "--data", options=TableOptions(multi_label=True, label_separator="|")) == read
    assert read_table(columns, "--data", options=multi) == read
    single = read_table(
        table(tree / "one.csv", ["path,label", *(f"x/{n},{t[0] if t else 'none'}" for n, t in zip(names, tags))]),
        "--data",
    )
    assert read.digest != single.digest and read.label_sets is not None and single.label_sets is None
    # One more label on an image, its lowest the same: another set, another digest.
    more = table(tree / "more.csv", ["path,labels", *rows[1:], rows[0] + " owl"])
    assert read_table(more, "--data", options=multi).digest != read.digest
    gone = read.without([(read.paths[0], "unreadable")])
    assert gone.label_sets == read.label_sets.take(range(1, len(read))) and gone.counts() != read.counts()
    train, held = split_per_class(read, 0.25, seed=1)
    assert len(train) + len(held) == len(read) and 0 < len(held) < len(read)
    assert set(train.paths).isdisjoint(held.paths)
    assert held.counts() == [sum(c in tags[names.index(p.rsplit("/", 1)[1])] for p in held.paths) for c in held.classes]
    # Held out: labels among the training classes; a bad cell of a class column; a label on too few images.
    assert read_table(spaced, "--val-data", options=multi, classes=["owl", "dog", "cat", "yak"]).counts()[3] == 0
    with pytest.raises(UserError, match=r"line \d+ has label 'cat', which is not a training class \(a multi-label"):
        read_table(spaced, "--val-data", options=multi, classes=["dog", "owl"])
    # Held out by 0/1 columns: they must be the training classes, none missing (its images would all be negatives).
    assert read_table(columns, "--val-data", options=multi, classes=["cat", "dog", "owl"]) == read
    with pytest.raises(UserError, match=r"have none for 1 of the run's 4 classes \('yak'\); give a column per class"):
        read_table(columns, "--val-data", options=multi, classes=["owl", "dog", "cat", "yak"])
    with pytest.raises(UserError, match=r"line \d+ has label 'owl', which is not a training class"):
        read_table(columns, "--val-data", options=multi, classes=["cat", "dog"])
    never = table(tree / "never.csv", ["image,cat,dog,owl", *(f"x/{n},1,0,0" for n in names)])  # owl: never 1
    assert read_table(never, "--val-data", options=multi, classes=["cat", "dog"]).counts() == [len(names), 0]
    bad = table(tree / "bad.csv", ["image,cat,dog", f"x/{names[0]},1,yes"])
    with pytest.raises(UserError, match=r"line 2 has 'yes' in the column 'dog', where a class's column holds 0 or 1"):
        read_table(bad, "--data", options=multi)
    few = table(tree / "few.csv", ["path,labels", f"x/{names[0]},cat rare", f"x/{names[1]},cat"])
    with pytest.raises(UserError, match=r"1 label\(s\) are on fewer than 2 images: 'rare' on 1 \(line 2\)"):
        read_table(few, "--data", options=multi)


def test_a_multi_label_split_keeps_a_training_image_of_every_class_that_is_never_an_images_rarest():
    """y is on 4 images, each keyed by a rarer class (a, b, c, d, of 2 images each): at --val-split 0.5 each group
    holds out one image, which can be all of y's; one of them goes back to training."""
    from hvd_train.data.folder import ImageSet, split_per_class
    from hvd_train.data.label_sets import LabelSets, split_keys

    classes = ["a", "b", "c", "d", "y"]
    sets = [[0, 4], [0], [1, 4], [1], [2, 4], [2], [3, 4], [3]]
    data = ImageSet([f"{i}.png" for i in range(len(sets))], [0] * len(sets), classes, label_sets=LabelSets.of(sets))
    assert split_keys(data.label_sets, len(classes)).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # y: never the rarest
    for seed in range(64):  # 1 in 16 would hold out all four of y's images
        train, held = split_per_class(data, 0.5, seed)
        assert train.counts()[4] >= 1 and min(train.counts()) >= 1, seed
        assert sorted([*train.paths, *held.paths]) == sorted(data.paths) and len(held) >= 3
