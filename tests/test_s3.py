"""S3 as a data source, against real S3-compatible servers on 127.0.0.1: moto, and rclone's serve s3."""

import json
import shutil
import unicodedata

import numpy as np
import pytest
from PIL import Image

from hvd_train import compat  # noqa: F401
from hvd_train.data import packed
from hvd_train.data.folder import list_folder, split_per_class
from hvd_train.data.images import find_bad_images
from hvd_train.data.pipeline import eval_dataset, train_input
from hvd_train.data.sharding import Segment
from hvd_train.data.storage import S3Options
from hvd_train.data.streams import input_failure
from hvd_train.errors import UserError

from conftest import S3_SECRET, S3Server, cli, free_port, output_of, write_images
from s3_runs import fresh_bucket


def with_bucket(server, monkeypatch):
    """``server`` as the process's AWS environment; a fresh bucket: ``(server, bucket)``."""
    return server, fresh_bucket(server, monkeypatch)[0]


@pytest.fixture
def s3(any_s3_server, monkeypatch):
    """Each test server in turn (moto, rclone), a fresh bucket in it."""
    return with_bucket(any_s3_server, monkeypatch)


@pytest.fixture
def moto(s3_server, monkeypatch):
    """The moto server alone, a fresh bucket in it (for a test that runs the CLI, whatever the server)."""
    return with_bucket(s3_server, monkeypatch)


OPTIONS = S3Options(max_attempts=2, connect_timeout=2, read_timeout=5)


def tiny_png(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((4, 4, 3), value % 256, np.uint8)).save(path)


def tree_where_orders_differ(local):
    """A class tree where a folder walk and a sort of whole keys disagree.

    Files at the top of a class (``shape-...``) and in sub-folders (``part-...``), a
    sub-folder whose name is a prefix of another's (``part-1`` and ``part-1-b``: ``-``
    sorts before ``/``), and names typed on macOS (NFD: ``e`` + combining accent).
    """
    for i in range(1100):
        cls = f"c{i % 3}"
        if i % 5 == 0:
            rel = f"{cls}/shape-{i:04d}.png"
        elif i % 5 == 1:
            rel = f"{cls}/part-{i % 4}-b/deep-{i % 2}/{i:04d}.png"
        elif i % 5 == 2:
            rel = f"{cls}/cafe\u0301-{i % 2}/{i:04d}.png"
        else:
            rel = f"{cls}/part-{i % 4}/deep-{i % 2}/{i:04d}.png"
        tiny_png(local / rel, i)
    (local / "README.txt").write_text("not in a class")
    (local / "c0" / "notes.txt").write_text("not an image")


def test_the_same_tree_lists_alike_from_local_disk_and_s3(s3, tmp_path):
    server, bucket = s3
    local = tmp_path / "data"
    tree_where_orders_differ(local)
    # Keys in NFC, as most upload tools write them; the local names stay NFD.
    client = server.client()
    for path in sorted(local.rglob("*")):
        if path.is_file():
            key = "sets/one/" + unicodedata.normalize("NFC", path.relative_to(local).as_posix())
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())
    images = list_folder(f"s3://{bucket}/sets/one", "--data", s3=OPTIONS)  # more than 1000 keys: pages
    expected = list_folder(str(local), "--data")
    assert len(images) == 1100 and images.classes == expected.classes == ["c0", "c1", "c2"]
    # The same images, labels and order as the same folder on local disk.
    remote = [images.relative(i) for i in range(len(images))]
    assert remote == [expected.relative(i) for i in range(len(expected))]
    assert images.labels.tolist() == expected.labels.tolist() and images.digest == expected.digest
    # The order is by path segment: a folder's files stay together, before its prefix sibling's.
    c0 = [r for r in remote if r.startswith("c0/part-1")]
    assert c0 == sorted(c0, key=lambda r: r.split("/")) and c0[0].startswith("c0/part-1/")
    assert sorted(p.rsplit("/", 1)[1] for p in images.ignored) == ["README.txt", "notes.txt"]
    # The hold-out and the rest follow: the same split, the same digests.
    for a, b in zip(split_per_class(images, 0.2, 7), split_per_class(expected, 0.2, 7)):
        assert [a.relative(i) for i in range(len(a))] == [b.relative(i) for i in range(len(b))]
        assert a.digest == b.digest


def test_a_csv_in_s3_or_naming_s3_urls_lists_the_images_the_s3_folder_lists(s3, tmp_path):
    """A CSV beside the images in the bucket, and a local one of ``s3://`` URLs below ``--image-root``: the
    folder's list to the digest; a URL outside the root and an image not in the bucket are refused."""
    from hvd_train.data.table import TableOptions, read_table

    server, bucket = s3
    local = write_images(tmp_path / "data", {"cat": 2, "dog": 3}, size=4)
    client = server.client()
    rows = []
    for path in sorted(local.rglob("*.png"), reverse=True):
        rel = path.relative_to(local).as_posix()
        client.put_object(Bucket=bucket, Key=f"pets/{rel}", Body=path.read_bytes())
        rows.append((rel, rel.split("/")[0]))
    root = f"s3://{bucket}/pets"
    expected = list_folder(root, "--data", s3=OPTIONS)
    client.put_object(
        Bucket=bucket, Key="pets/labels.csv", Body="".join(f"{r},{c}\n" for r, c in [("path", "label"), *rows])
    )
    in_bucket = read_table(f"{root}/labels.csv", "--data", OPTIONS)
    assert in_bucket == expected and in_bucket.digest == expected.digest and len(in_bucket) == 5
    urls = tmp_path / "urls.csv"
    urls.write_text("".join(f"{r},{c}\n" for r, c in [("image", "class"), *((f"{root}/{r}", c) for r, c in rows)]))
    elsewhere = TableOptions(image_root=root)
    assert read_table(str(urls), "--data", OPTIONS, elsewhere) == expected
    # A root written with an empty segment is the prefix its store lists, as the URLs of the rows are.
    doubled = read_table(str(urls), "--data", OPTIONS, TableOptions(image_root=f"s3://{bucket}//pets/"))
    assert list(doubled.paths) == list(expected.paths)
    with open(urls, "a") as f:
        f.write(f"s3://{bucket}/other/x.png,cat\n{root}/cat/gone.png,cat\n")
    with pytest.raises(UserError, match=rf"line 7: s3://{bucket}/other/x.png is not below the image root {root}"):
        read_table(str(urls), "--data", OPTIONS, elsewhere)
    with open(urls, "w") as f:
        f.write("".join(f"{r},{c}\n" for r, c in [("image", "class"), *rows, ("cat/gone.png", "cat")]))
    with pytest.raises(UserError, match=rf"1 of 6 image\(s\) it names are not in {root}: line 7: cat/gone.png"):
        read_table(str(urls), "--data", OPTIONS, elsewhere)


def test_other_tools_records_in_s3_read_as_the_same_local_files_and_keep_their_index_beside_them(s3, tmp_path, caplog):
    """Model Garden's records in a bucket: the set the same local files are, the index kept in the bucket beside
    them (their ETags its stamps) and read the next time."""
    import logging

    from test_records import pairs, rewrite

    from hvd_train.data import records
    from hvd_train.data.features import RecordOptions

    caplog.set_level(logging.INFO, logger="hvd_train")
    server, bucket = s3
    local = write_images(tmp_path / "data", {"cat": 2, "dog": 3}, size=4)
    packed.pack(str(local), str(tmp_path / "packed"), shard_size=400, on_bad_image="skip", seed=3, s3=OPTIONS)
    garden = tmp_path / "garden"
    names = rewrite(tmp_path / "packed", garden, offset=1, text="image/class/synset")
    (garden / "README.txt").write_text("not a record")
    client = server.client()
    for path in garden.iterdir():
        client.put_object(Bucket=bucket, Key=f"garden/{path.name}", Body=path.read_bytes())
    options = RecordOptions(label_offset=1)
    expected = records.load(str(garden), "--data", OPTIONS, options)
    url = f"s3://{bucket}/garden/"
    assert records.is_records(url, OPTIONS) and not records.is_records(f"s3://{bucket}/", OPTIONS)
    remote = records.load(url, "--data", OPTIONS, options)
    assert remote.classes == expected.classes and [s.file for s in remote.shards] == names
    assert [s.offsets for s in remote.shards] == [s.offsets for s in expected.shards]
    assert pairs(remote) == pairs(expected) and len(pairs(remote)) == 5
    kept = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="garden/.hvd_train-index-")["Contents"]]
    assert len(kept) == 1 and f"the index is s3://{bucket}/{kept[0]}" in caplog.text
    caplog.clear()
    assert records.load(url, "--data", OPTIONS, options) == remote and "from the index s3://" in caplog.text
    # A TFDS folder in the bucket: the split its description names, as the same folder on disk.
    from test_records import TFDS_PETS

    for path in TFDS_PETS.iterdir():
        client.put_object(Bucket=bucket, Key=f"pets/1.0.0/{path.name}", Body=path.read_bytes())
    tfds = records.load(f"s3://{bucket}/pets/1.0.0", "--val-data", OPTIONS, classes=["cat", "dog", "owl"])
    shutil.copytree(TFDS_PETS, tmp_path / "pets")
    assert pairs(tfds) == pairs(records.load(str(tmp_path / "pets"), "--val-data", OPTIONS, classes=tfds.classes))
    assert tfds.features.kind == "tfds" and len(tfds) == 6
    one = records.load(f"{url}{names[1]}", "--val-data", OPTIONS, options, remote.classes)  # a file named alone
    first = remote.shards[0].images
    assert [s.file for s in one.shards] == [names[1]] and pairs(one) == pairs(remote)[first : first + len(one)]


def test_missing_bucket_names_the_bucket(s3):
    with pytest.raises(UserError, match=r"bucket 'no-such-bucket-here' does not exist.*--data"):
        list_folder("s3://no-such-bucket-here/x/", "--data", s3=OPTIONS)


def test_empty_prefix_is_a_clear_error(s3):
    _, bucket = s3
    with pytest.raises(UserError, match=rf"no objects below s3://{bucket}/nothing/"):
        list_folder(f"s3://{bucket}/nothing/", "--data", s3=OPTIONS)


def test_endpoint_down_is_a_clear_error(moto):
    options = S3Options(endpoint=f"http://127.0.0.1:{free_port()}", max_attempts=2, connect_timeout=1)
    with pytest.raises(UserError, match=r"cannot reach S3 to list s3://[^ ]+ \(endpoint http://127\.0\.0\.1:\d+\)"):
        list_folder(f"s3://{moto[1]}/x/", "--data", s3=options)


@pytest.mark.parametrize("port", ["server", "closed"])
def test_a_password_in_the_endpoint_is_never_printed_or_written(moto, tmp_path, port):
    server, bucket = moto
    secret = "pa55-in-the-url-9b1e"
    where = server.url.split("//", 1)[1] if port == "server" else f"127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    proc = cli(
        ["train", "--data", f"s3://{bucket}/nothing/", "--output", out, "--s3-endpoint", f"http://me:{secret}@{where}",
         "--s3-max-attempts", "1", "--epochs", "1"],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, output_of(proc)
    [error] = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in proc.stderr and secret not in proc.stdout + proc.stderr, output_of(proc)
    for path in out.rglob("*"):
        assert not path.is_file() or secret.encode() not in path.read_bytes(), path
    # A run that fails before training writes nothing; the run_config.yaml of one that trains keeps
    # the endpoint without its password.
    assert not (out / "run_config.yaml").exists()
    from hvd_train import config

    endpoint = f"http://me:{secret}@{where}"
    written = config.build({"data": {"train": "s3://b/x/", "s3_endpoint": endpoint}, "run": {"output": "o"}}).to_yaml()
    assert f"http://{where}" in written and secret not in written


def test_wrong_credentials_are_a_clear_error(tmp_path, monkeypatch):
    import boto3

    # A server that checks signatures: the first 3 requests (creating a user
    # and its key) are free, every later one must be signed by a known key.
    server = S3Server(tmp_path, INITIAL_NO_AUTH_ACTION_COUNT="3")
    try:
        iam = boto3.client(
            "iam", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="y"
        )
        iam.create_user(UserName="trainer")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        good = server.client(key_id=key["AccessKeyId"], secret=key["SecretAccessKey"])
        good.create_bucket(Bucket="guarded")
        write_images(tmp_path / "d", {"a": 2, "b": 2}, size=8)
        for path in sorted((tmp_path / "d").rglob("*.png")):
            good.put_object(Bucket="guarded", Key=path.relative_to(tmp_path / "d").as_posix(), Body=path.read_bytes())
        for name, value in {**server.env, "AWS_ACCESS_KEY_ID": key["AccessKeyId"]}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
        assert len(list_folder("s3://guarded/", "--data", s3=OPTIONS)) == 4  # the right key works
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-" + key["SecretAccessKey"])
        with pytest.raises(UserError, match=r"S3 rejected the credentials \(SignatureDoesNotMatch\)") as e:
            list_folder("s3://guarded/", "--data", s3=OPTIONS)
        assert key["SecretAccessKey"] not in str(e.value)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOBODYKNOWSTHIS0")
        with pytest.raises(UserError, match=r"S3 rejected the credentials \(InvalidAccessKeyId\)"):
            list_folder("s3://guarded/", "--data", s3=OPTIONS)
    finally:
        server.stop()


def test_corrupt_objects_are_listed_as_bad_images(s3, tmp_path):
    server, bucket = s3
    write_images(tmp_path / "d", {"a": 3, "b": 3}, size=8)
    (tmp_path / "d" / "a" / "broken.png").write_bytes(b"\x89PNG but not really")
    server.upload_folder(tmp_path / "d", bucket)
    images = list_folder(f"s3://{bucket}/", "--data", s3=OPTIONS)
    bad = find_bad_images(images.paths, s3=OPTIONS)
    assert [p for p, _ in bad] == [f"s3://{bucket}/a/broken.png"]


def test_object_deleted_after_listing_names_bucket_and_key(s3, tmp_path):
    server, bucket = s3
    write_images(tmp_path / "d", {"a": 3, "b": 3}, size=8)
    server.upload_folder(tmp_path / "d", bucket)
    images = list_folder(f"s3://{bucket}/", "--data", s3=OPTIONS)
    server.client().delete_object(Bucket=bucket, Key="b/img-001.png")
    with pytest.raises(UserError, match=rf"s3://{bucket}/b/img-001.png does not exist"):
        find_bad_images(images.paths, s3=OPTIONS)


def test_s3_folder_streams_the_same_batches_as_local_disk(s3, tmp_path):
    server, bucket = s3
    local = write_images(tmp_path / "d", {"a": 9, "b": 8, "c": 6}, size=12)
    server.upload_folder(local, bucket, "imgs/")
    remote = list_folder(f"s3://{bucket}/imgs/", "--data", s3=OPTIONS)
    here = list_folder(str(local), "--data")

    def batches(images):
        segments = [(Segment.whole(e, len(images), 2, 4, seed=5), 0) for e in (1, 2)]
        shard = train_input(
            images, segments, rank=1, image_size=8, augment="crop,flip", preprocess=lambda x: x, seed=5, s3=OPTIONS
        )
        return list(shard.dataset.as_numpy_iterator()), shard.reader

    (got, reader), (want, _) = batches(remote), batches(here)
    assert len(got) == len(want) == 6
    # The same images in the same order, augmented the same way.
    for (gx, gy, gi), (wx, wy, wi) in zip(got, want):
        assert gy.tolist() == wy.tolist() and gi.tolist() == wi.tolist()
        np.testing.assert_allclose(gx, wx)
    assert reader.stats()["objects"] == 24 and reader.stats()["bytes"] > 0


def test_pack_s3_folder_to_s3_shards_and_read_back(s3, tmp_path):
    server, bucket = s3
    local = write_images(tmp_path / "d", {"a": 7, "b": 5}, size=10)
    (local / "b" / "bad.png").write_bytes(b"junk")
    server.upload_folder(local, bucket, "raw/")
    options = S3Options(concurrency=8, max_attempts=2)
    packed.pack(
        f"s3://{bucket}/raw/", f"s3://{bucket}/packed/", shard_size=2000, on_bad_image="skip", seed=1, s3=options
    )
    manifest = json.loads(server.client().get_object(Bucket=bucket, Key="packed/manifest.json")["Body"].read())
    assert manifest["images"] == 12 and manifest["skipped"][0]["path"] == f"s3://{bucket}/raw/b/bad.png"
    assert S3_SECRET not in json.dumps(manifest)
    shard_set = packed.load(f"s3://{bucket}/packed/", "--data", options)
    assert len(shard_set.shards) > 2
    ds = eval_dataset(
        shard_set, rank=0, size=1, batch_size=5, image_size=8, crop_fraction=1.0, preprocess=lambda x: x
    ).dataset
    labels = [int(y) for _, ys in ds.as_numpy_iterator() for y in ys]
    assert sorted(labels) == [0] * 7 + [1] * 5


def test_corrupt_s3_shard_names_the_key(s3, tmp_path):
    server, bucket = s3
    write_images(tmp_path / "d", {"a": 6, "b": 6}, size=10)
    options = S3Options(max_attempts=2)
    packed.pack(str(tmp_path / "d"), f"s3://{bucket}/p/", shard_size=1500, on_bad_image="skip", seed=1, s3=options)
    client = server.client()
    body = bytearray(client.get_object(Bucket=bucket, Key="p/shard-00000.tfrecord")["Body"].read())
    body[40] ^= 0xFF
    client.put_object(Bucket=bucket, Key="p/shard-00000.tfrecord", Body=bytes(body))
    shard_set = packed.load(f"s3://{bucket}/p/", "--data", options)
    held_out = eval_dataset(
        shard_set, rank=0, size=1, batch_size=4, image_size=8, crop_fraction=1.0, preprocess=lambda x: x
    )
    with pytest.raises(Exception):  # noqa: B017 - tf.data's wrapper; the reader keeps the real error
        list(held_out.dataset.as_numpy_iterator())
    error = input_failure(held_out.reader)
    assert isinstance(error, UserError)
    assert f"s3://{bucket}/p/shard-00000.tfrecord" in str(error) and "corrupt" in str(error)


def test_an_abandoned_stream_is_no_failure_and_each_reader_keeps_its_own(s3, tmp_path):
    # lr-find's take(steps) and an elastic reset abandon a stream; its GeneratorExit
    # must not stand in for a later, real failure of another reader.
    server, bucket = s3
    local = write_images(tmp_path / "d", {"a": 6, "b": 6}, size=10)
    server.upload_folder(local, bucket, "imgs/")
    images = list_folder(f"s3://{bucket}/imgs/", "--data", s3=OPTIONS)
    segments = [(Segment.whole(0, len(images), 1, 2, seed=1), 0)]
    made = train_input(
        images, segments, rank=0, image_size=8, augment="none", preprocess=lambda x: x, seed=1, s3=OPTIONS
    )
    assert len(list(made.dataset.take(1).as_numpy_iterator())) == 1
    assert input_failure(made.reader) is None, "an abandoned stream is not a failure"
    server.client().delete_object(Bucket=bucket, Key="imgs/b/img-001.png")
    broken = eval_dataset(images, rank=0, size=1, batch_size=4, image_size=8, crop_fraction=1.0, preprocess=lambda x: x)
    with pytest.raises(Exception):  # noqa: B017 - tf.data's wrapper; the reader keeps the real error
        list(broken.dataset.as_numpy_iterator())
    error = input_failure(made.reader, broken.reader)
    assert isinstance(error, UserError) and f"s3://{bucket}/imgs/b/img-001.png does not exist" in str(error)
    assert input_failure(made.reader) is None
