"""Runs in S3 for the one-process tests of ``training.s3_mirror``: a fresh prefix in a test server, checkpoints of a
tiny model, a finished run, and what the prefix holds."""

import json
import os
import uuid

import numpy as np

from hvd_train.data.storage import S3Options
from hvd_train.training import checkpoints, s3_mirror
from hvd_train.training.run_record import RECORD
from hvd_train.training.state import TrainState

OPTIONS = S3Options(max_attempts=2, connect_timeout=2, read_timeout=5)


def fresh_bucket(server, monkeypatch) -> tuple[str, object]:
    """``server`` as the process's AWS environment; a fresh bucket in it: ``(bucket, client)``."""
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client = server.client()
    client.create_bucket(Bucket=bucket)
    return bucket, client


def fresh_prefix(server, monkeypatch) -> tuple[str, str, object]:
    """``fresh_bucket`` and the run prefix ``runs/a/`` in it: ``(url, bucket, client)``."""
    bucket, client = fresh_bucket(server, monkeypatch)
    return f"s3://{bucket}/runs/a/", bucket, client


def stored(client, bucket, prefix="runs/a/") -> dict[str, str]:
    """``{path below the prefix: ETag}``."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix) :]: o["ETag"].strip('"') for page in pages for o in page.get("Contents", [])}


def save(staging, step, model, optimizer, keep=2, epoch=0, best_epoch=-1) -> str:
    """A checkpoint ``step`` steps into epoch ``epoch`` (0: at the end of epoch ``epoch``)."""
    state = TrainState(seed=1, world_size=1, batch_size=2, global_batch=2, total=8, step=step, epoch_steps=step)
    state.epoch, state.best_epoch, state.best_score = epoch, best_epoch, 0.5 if best_epoch >= 0 else None
    rows = {"rows": np.zeros((1, 3), np.float32)}
    return checkpoints.save(str(staging), checkpoints.name_for(state), model, optimizer, state, rows, {}, keep)


def new_run(url, staging) -> s3_mirror.Mirror:
    """The mirror of a run that starts in ``url`` with nothing to resume, as a run prepares its output."""
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    assert mirror.pull() is None
    return mirror


def finished_run(staging, url, model, optimizer) -> dict[str, bytes]:
    """A run trained to its end in ``url``, as a run's outputs stand beside its last checkpoint: its files."""
    mirror = new_run(url, staging)
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


def two_up_and_one_kept_back(mirror, staging, model, optimizer) -> str:
    """A run in ``staging`` with its checkpoints of epochs 1 and 2 uploaded through ``mirror`` and epoch 3's
    saved but not uploaded, as an outage keeps one back: the name of that last one."""
    (staging / "run_config.yaml").write_text("model:\n  name: a-model\n")
    for epoch in (1, 2):
        assert mirror.push_checkpoint(save(staging, 0, model, optimizer, keep=3, epoch=epoch))
    return os.path.basename(save(staging, 0, model, optimizer, keep=3, epoch=3))


def prefix_checkpoints(client, bucket) -> set[str]:
    return {k.split("/")[1] for k in stored(client, bucket) if k.startswith("checkpoints/")}


def record_as_the_runs(client, bucket, *names: str) -> None:
    """Checkpoints ``names`` added to the record of the run in ``runs/a/``, as the run adds one it uploads."""
    key = f"runs/a/{RECORD}"
    body = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body["checkpoints"] = sorted({*body["checkpoints"], *names})
    client.put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode())
