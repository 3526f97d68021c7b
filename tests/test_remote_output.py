"""A run's --output in S3 (``training.remote``), in one process against each real test S3 server (moto, rclone).

The whole story (a spot notice, a network cut, a resume on another machine) is a real job in
test_s3_jobs.py; here, the parts: multipart uploads, manifests, pruning, a failed upload, a pull.
"""

import dataclasses
import hashlib
import os
import uuid

import numpy as np
import pytest

from hvd_train.compat import keras
from hvd_train.data.storage import S3Options
from hvd_train.errors import UserError
from hvd_train.training import checkpoints, remote
from hvd_train.training.state import TrainState

from conftest import HVD_TRAIN, output_of, run
from s3proxy import CuttingProxy

OPTIONS = S3Options(max_attempts=2, connect_timeout=2, read_timeout=5)


@pytest.fixture
def prefix(any_s3_server, monkeypatch):
    """A fresh bucket and the test server (each in turn) as the process's AWS environment: ``(url, bucket,
    client)``."""
    for key, value in any_s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = f"run-{uuid.uuid4().hex[:12]}"
    client = any_s3_server.client()
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs/a/", bucket, client


def stored(client, bucket, prefix="runs/a/") -> dict[str, str]:
    """``{path below the prefix: ETag}``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) :]: o["ETag"].strip('"') for page in pages for o in page.get("Contents", [])}


def save(staging, step, model, optimizer, keep=2, epoch=0) -> str:
    """A checkpoint ``step`` steps into epoch ``epoch`` (0: at the end of epoch ``epoch``)."""
    state = TrainState(seed=1, world_size=1, batch_size=2, global_batch=2, total=8, step=step, epoch_steps=step)
    state.epoch = epoch
    rows = {"rows": np.zeros((1, 3), np.float32)}
    return checkpoints.save(str(staging), checkpoints.name_for(state), model, optimizer, state, rows, {}, keep)


def finished_run(staging, url, model, optimizer) -> dict[str, bytes]:
    """A run trained to its end in ``url``, as a run's outputs stand beside its last checkpoint: its files."""
    mirror = remote.Mirror(url, str(staging), OPTIONS)
    mirror.check()  # as a run prepares its output
    assert mirror.pull() is None
    outputs = {
        "labels.json": b'["a", "b", "c"]\n',
        "run_config.yaml": b"model:\n  name: a-model\n",
        "model.keras": os.urandom(3000),
        "metrics.csv": b"epoch,loss\n1,0.5\n",
        "tensorboard/events": os.urandom(100),
    }
    for rel, body in outputs.items():
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging / rel).write_bytes(body)
    assert mirror.push_checkpoint(save(staging, 0, model, optimizer, epoch=1))
    mirror.finish({"val_accuracy": 0.5})
    return {rel: (staging / rel).read_bytes() for rel in [*outputs, "summary.json"]}


@pytest.fixture
def net():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
    return model, optimizer


def test_the_staging_folder_is_named_after_the_prefix_and_odd_prefixes_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path))
    assert remote.staging_folder("s3://b/runs/x/") == str(tmp_path / "runs" / "b" / "runs" / "x")
    for url in ("s3://b", "s3://b/", "s3://b/runs//x", "s3://b/runs/../x", "s3:///runs/x"):
        with pytest.raises(UserError, match="must name a bucket and a prefix"):
            remote.staging_folder(url)


def test_checkpoints_go_up_manifest_last_are_pruned_and_a_failed_upload_keeps_the_last_complete_one(
    prefix, net, tmp_path, any_s3_server
):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    mirror = remote.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    model, optimizer = net
    (staging / "tensorboard").mkdir(parents=True)
    (staging / "tensorboard" / "events").write_bytes(os.urandom(100))
    # A file above PART_BYTES goes up in parts. Its ETag is, on moto as on AWS, not an MD5 but "<md5 of the
    # parts' md5s>-<parts>"; rclone's serve s3 joins the parts into one file and answers the MD5 of that.
    (staging / "model.keras").write_bytes(os.urandom(remote.PART_BYTES + 1000))
    names = []
    for step in (1, 2, 3):
        names.append(os.path.basename(save(staging, step, model, optimizer)))
        assert mirror.push_checkpoint(str(staging / "checkpoints" / names[-1]))
    keys = stored(client, bucket)
    whole = hashlib.md5((staging / "model.keras").read_bytes()).hexdigest()
    if any_s3_server.kind == "rclone":
        assert keys["model.keras"] == whole
    else:
        assert keys["model.keras"].endswith("-2") and not keys["model.keras"].startswith(whole)
    assert "tensorboard/events" in keys
    in_prefix = {k.split("/")[1] for k in keys if k.startswith("checkpoints/")}
    assert in_prefix == set(names[1:])  # --keep-checkpoints 2, as on disk
    assert mirror.uploads.bytes > remote.PART_BYTES and mirror.uploads.retried == 0
    # The network goes down after two files of the 4th checkpoint: it is not complete in the prefix
    # (no manifest), and the run is told so.
    proxy = CuttingProxy(any_s3_server.url)
    proxy.cut_uploads, proxy.let_through = -1, 2
    cut = remote.Mirror(url, str(staging), dataclasses.replace(OPTIONS, endpoint=proxy.url))
    cut._sent = dict(mirror._sent)  # the same run's mirror, its outputs up already
    try:
        fourth = os.path.basename(save(staging, 4, model, optimizer))
        assert not cut.push_checkpoint(str(staging / "checkpoints" / fourth))
    finally:
        proxy.stop()
    assert cut.uploads.retried == 1 and cut.uploads.failed_checkpoints == 1 and proxy.upload_cuts >= 4
    keys = stored(client, bucket)
    assert len([k for k in keys if k.startswith(f"checkpoints/{fourth}/")]) == 2, sorted(keys)
    assert f"checkpoints/{fourth}/{checkpoints.STATE_FILE}" not in keys
    # Another machine: the prefix's newest complete checkpoint (the 3rd), verified, and the files
    # beside it, the large one whole.
    other = tmp_path / "two"
    pulled = remote.Mirror(url, str(other), OPTIONS)
    assert pulled.pull() == names[2]
    assert checkpoints.latest(str(other)).path == str(other / "checkpoints" / names[2])
    assert (other / "model.keras").read_bytes() == (staging / "model.keras").read_bytes()
    # The machine that could not upload resumes from the prefix too: its 4th checkpoint is dropped.
    assert remote.Mirror(url, str(staging), OPTIONS).pull() == names[2]
    assert [os.path.basename(p) for p in checkpoints.candidates(str(staging))] == [names[2]]


def test_a_checkpoint_without_its_manifest_or_with_a_part_cut_short_is_never_resumed_from(prefix, net, tmp_path):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    mirror = remote.Mirror(url, str(staging), OPTIONS)
    model, optimizer = net
    good = os.path.basename(save(staging, 1, model, optimizer))
    assert mirror.push_checkpoint(str(staging / "checkpoints" / good))
    parts = {k: client.get_object(Bucket=bucket, Key=f"runs/a/{k}")["Body"].read() for k in stored(client, bucket)}
    for newer, cut_short in (("epoch-0003", None), ("epoch-0002", "local.npz")):
        for key, body in parts.items():
            part = key.split("/")[-1]
            if newer == "epoch-0003" and part == checkpoints.STATE_FILE:
                continue  # an upload that stopped before its manifest
            body = body[: len(body) // 2] if part == cut_short else body
            client.put_object(Bucket=bucket, Key=f"runs/a/checkpoints/{newer}/{part}", Body=body)
    other = remote.Mirror(url, str(tmp_path / "two"), OPTIONS)
    assert other.pull() == good
    # Nothing complete in the prefix: a fresh start, with an empty staging folder.
    for key in stored(client, bucket):
        if key.endswith(checkpoints.STATE_FILE):
            client.delete_object(Bucket=bucket, Key=f"runs/a/{key}")
    assert other.pull() is None and os.listdir(tmp_path / "two") == []


def test_a_missing_bucket_is_one_clear_error_before_anything_is_written(prefix, tmp_path):
    url, bucket, _ = prefix
    mirror = remote.Mirror(url.replace(bucket, bucket + "-gone"), str(tmp_path / "staging"), OPTIONS)
    with pytest.raises(UserError, match=f"bucket '{bucket}-gone' does not exist.*--output"):
        mirror.check()


def test_credentials_that_cannot_delete_keep_older_checkpoints_and_still_upload_every_new_one(
    prefix, net, tmp_path, any_s3_server, caplog
):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    proxy = CuttingProxy(any_s3_server.url)
    proxy.deny_deletes = True
    mirror = remote.Mirror(url, str(staging), dataclasses.replace(OPTIONS, endpoint=proxy.url))
    model, optimizer = net
    try:
        names, summary = [], {}
        for step in (1, 2):  # --keep-checkpoints 1: the first is pruned on disk, and cannot be in S3
            names.append(os.path.basename(save(staging, step, model, optimizer, keep=1)))
            assert mirror.push_checkpoint(str(staging / "checkpoints" / names[-1])) and mirror.uploaded == names[-1]
        (staging / "metrics.csv").write_text("epoch\n")
        client.put_object(Bucket=bucket, Key="runs/a/features.keras", Body=b"an earlier run's model form")
        mirror.finish(summary)
    finally:
        proxy.stop()
    assert mirror.uploads.failed_checkpoints == 0 and summary["output_uploads"]["files"] == mirror.uploads.files
    keys = stored(client, bucket)
    assert all(f"checkpoints/{n}/{checkpoints.STATE_FILE}" in keys for n in names) and "summary.json" in keys
    assert "older checkpoints stay in" in caplog.text and "access denied" in caplog.text
    assert "files of an earlier form of the model stay in" in caplog.text and "features.keras" in keys


def test_report_reads_a_run_in_s3_through_the_endpoint_it_is_given(prefix, net, tmp_path, monkeypatch, any_s3_server):
    # As predict, evaluate and export do (test_s3_jobs.py): a store other than AWS, with no AWS_ENDPOINT_URL.
    url, bucket, client = prefix
    finished_run(tmp_path / "one", url, *net)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    proc = run([*HVD_TRAIN, "report", url, "--s3-endpoint", any_s3_server.url], HVD_TRAIN_CACHE=str(tmp_path / "c"))
    assert proc.returncode == 0, output_of(proc)
    assert "report.html" in stored(client, bucket)
