"""The staging folder of a run in S3 (``training.remote``): what it keeps and gives back, in one process against
each real test S3 server (moto, rclone)."""

import errno
import os

import pytest

from hvd_train.compat import keras
from hvd_train.errors import UserError
from hvd_train.training import checkpoints, remote

from s3_runs import OPTIONS, fresh_prefix, save, stored


@pytest.fixture
def prefix(any_s3_server, monkeypatch):
    """A fresh prefix in each test server in turn (moto, rclone): ``(url, bucket, client)``."""
    return fresh_prefix(any_s3_server, monkeypatch)


@pytest.fixture
def net():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    return model, keras.optimizers.SGD(0.1)


def test_a_read_fault_of_a_moment_costs_no_checkpoint_its_turn(prefix, net, tmp_path, monkeypatch):
    # A file server that fails over answers a read with EIO for a moment. A checkpoint just downloaded, or one
    # an outage kept back in the staging folder, is read again before it counts as damaged: else the resume
    # takes an older one from the prefix, and the pull removes the kept-back one. (No disk of this machine
    # fails on demand: the fault is made at the read of a file's bytes that verify() makes.)
    url, _, _ = prefix
    model, optimizer = net
    one = tmp_path / "one"
    mirror = remote.Mirror(url, str(one), OPTIONS)
    mirror.check()
    for epoch in (1, 2):
        assert mirror.push_checkpoint(save(one, 0, model, optimizer, keep=3, epoch=epoch))
    kept_back = os.path.basename(save(one, 0, model, optimizer, keep=3, epoch=3))  # its upload failed
    real, failed = checkpoints._digest, set()

    def fails_once_per_folder(path):
        if os.path.dirname(path) not in failed:
            failed.add(os.path.dirname(path))
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(path)

    monkeypatch.setattr(checkpoints, "_digest", fails_once_per_folder)
    assert remote.Mirror(url, str(tmp_path / "two"), OPTIONS).pull() == "epoch-0002"
    assert remote.Mirror(url, str(one), OPTIONS).pull() == kept_back
    assert len(failed) == 2


def test_credentials_in_the_url_are_refused_and_never_shown(tmp_path, monkeypatch):
    # s3://KEY:SECRET@bucket/x: a folder named after it would hold the secret, and a message that showed it
    # redacted as s3://bucket/x would look like a valid --output.
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path))
    for url in ("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bkt/x", "s3://AKIAEXAMPLE@bkt/x", "s3://:wJalrXUtnFEMI@bkt/x"):
        for flag in ("--output", "--model-dir"):
            with pytest.raises(UserError, match=f"^{flag} holds user:password@ before its bucket") as e:
                remote.staging_folder(url, flag=flag)
            message = str(e.value)
            assert "AKIAEXAMPLE" not in message and "wJalrXUtnFEMI" not in message and "\n" not in message
            assert "(shown without it: s3://bkt/x)" in message and "AWS_ACCESS_KEY_ID" in message


def test_a_file_whose_name_no_key_may_have_stays_in_the_staging_folder_with_a_warning(prefix, net, tmp_path, caplog):
    # A resume refuses a key with a part longer than 150 bytes (with the room a temporary name takes, no staging
    # folder could hold it), and a record that lists one: uploaded, such a file would cost the run its resume.
    url, bucket, client = prefix
    staging = tmp_path / "one"
    long_name = "p" * 160 + ".png"
    (staging / "pictures").mkdir(parents=True)
    (staging / "pictures" / long_name).write_bytes(b"a picture")
    (staging / "metrics.csv").write_text("epoch\n1\n")
    mirror = remote.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    for epoch in (1, 2):
        assert mirror.push_checkpoint(save(staging, 0, *net, epoch=epoch))
    assert remote.Mirror(url, str(tmp_path / "two"), OPTIONS).pull() == "epoch-0002"
    assert "metrics.csv" in stored(client, bucket) and not [k for k in stored(client, bucket) if "ppp" in k]
    assert caplog.text.count(f"pictures/{long_name} of {staging} is not uploaded to {url}: its name has a part") == 1
