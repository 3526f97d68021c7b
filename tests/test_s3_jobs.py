"""Real ``horovodrun -np 2`` jobs that train from S3 (folder and shards) on a local S3-compatible server."""

import time
import uuid
from pathlib import Path

import pytest

from conftest import (
    HVD_TRAIN,
    S3_KEY_ID,
    S3_SECRET,
    S3Server,
    kill_group,
    launch,
    launcher_command,
    output_of,
    read_json,
    run,
    start,
)

pytestmark = pytest.mark.multiprocess

# From scratch on the demo's textures: about a minute for 2 CPU workers.
OPTIONS = [
    "--weights",
    "none",
    "--image-size",
    "48",
    "--batch-size",
    "16",
    "--epochs",
    "12",
    "--base-lr",
    "0.01",
    "--warmup-epochs",
    "1",
    "--augment",
    "flip",
    "--crop-fraction",
    "1.0",
    "--no-tensorboard",
    "--threads-per-rank",
    "1",
]


@pytest.fixture(scope="module")
def textures(tmp_path_factory) -> Path:
    """``train/`` (80 per class) and ``val/`` (20 per class) of the demo's 5 texture classes."""
    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    root = tmp_path_factory.mktemp("textures")
    make_demo_data(str(root / "train"), per_class=80, size=48, seed=0)
    make_demo_data(str(root / "val"), per_class=20, size=48, seed=1)
    return root


@pytest.fixture(scope="module")
def bucket(s3_server, textures):
    """The textures in S3 as folders (``folder/``) and as shards packed by the CLI (``shards/``)."""
    name = f"jobs-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=name)
    for part in ("train", "val"):
        s3_server.upload_folder(textures / part, name, f"folder/{part}/")
        # Packed from the S3 folder into S3 shards, as a user would.
        proc = run(
            [*HVD_TRAIN, "pack", f"s3://{name}/folder/{part}/", f"s3://{name}/shards/{part}/", "--shard-size", "64KB"],
            **s3_server.env,
        )
        assert proc.returncode == 0, output_of(proc)
    return name


def train(data, val, out, env, launcher="horovodrun-gloo"):
    program = [*HVD_TRAIN, "train", "--data", data, "--val-data", val, "--output", out, *OPTIONS]
    proc = launch(launcher, 2, program, timeout=600, **env)
    assert proc.returncode == 0, output_of(proc)
    return proc


@pytest.fixture(scope="module")
def local_run(textures, tmp_path_factory, s3_server):
    out = tmp_path_factory.mktemp("local") / "run"
    return out, train(textures / "train", textures / "val", out, {})


def test_s3_folder_and_s3_shards_reach_the_local_accuracy(local_run, bucket, s3_server, tmp_path):
    local_out, _ = local_run
    runs = {
        "folder": (f"s3://{bucket}/folder/train/", f"s3://{bucket}/folder/val/"),
        "shards": (f"s3://{bucket}/shards/train/", f"s3://{bucket}/shards/val/"),
    }
    local = read_json(local_out / "summary.json")
    assert local["val_images"] == 100 and local["val_accuracy"] >= 0.8
    procs = {}
    for kind, (data, val) in runs.items():
        procs[kind] = train(data, val, tmp_path / kind, s3_server.env)
        summary = read_json(tmp_path / kind / "summary.json")
        assert summary["val_images"] == 100, kind
        assert summary["weights_identical_across_ranks"] is True
        # Same within the noise of 100 held-out images and of training itself
        # (thread scheduling; the shards also see the images in another order).
        assert abs(summary["val_accuracy"] - local["val_accuracy"]) <= 0.15, (kind, summary, local)
        assert len(summary["input_wait_seconds"]) == 2 and all(b > 0 for b in summary["input_bytes"])
        assert "input waited" in procs[kind].stderr
        print(f"{kind}: val_accuracy {summary['val_accuracy']:.4f} (local {local['val_accuracy']:.4f})")
    # Same images, same order: the S3 folder trains like the local one.
    folder = read_json(tmp_path / "folder" / "summary.json")
    assert folder["input_objects"][0] == 12 * folder["steps_per_epoch"] * 16
    # No credential anywhere: logs, printed commands, and every file written.
    for kind, proc in procs.items():
        text = proc.stdout + proc.stderr
        assert S3_SECRET not in text and S3_KEY_ID not in text, kind
        for path in (tmp_path / kind).rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert S3_SECRET.encode() not in data and S3_KEY_ID.encode() not in data, path


def test_server_killed_mid_training_ends_every_rank_with_a_clear_error(textures, tmp_path):
    server = S3Server(tmp_path)
    try:
        server.client().create_bucket(Bucket="doomed")
        server.upload_folder(textures / "train", "doomed", "train/")
        out = tmp_path / "run"
        program = [
            *HVD_TRAIN,
            "train",
            "--data",
            "s3://doomed/train/",
            "--val-split",
            "0",
            "--output",
            out,
            *OPTIONS,
            "--epochs",
            "50",
            "--s3-max-attempts",
            "2",
        ]
        proc = start([*launcher_command("horovodrun-gloo", 2), *program], **server.env)
        try:
            deadline = time.time() + 300
            while not (out / "checkpoints" / "epoch-0001").exists():
                assert proc.poll() is None, "".join(proc.communicate())[-5000:]
                assert time.time() < deadline, "no checkpoint after 300 s"
                time.sleep(0.2)
            server.stop()
            stdout, stderr = proc.communicate(timeout=180)
        except BaseException:
            kill_group(proc)
            raise
    finally:
        server.stop()
    text = stdout + stderr
    assert proc.returncode != 0
    errors = [line for line in text.splitlines() if "ERROR error: rank" in line]
    assert errors, text[-5000:]
    assert all("cannot reach S3" in e or "lost the connection to S3" in e for e in errors), errors
    assert all("s3://doomed/train/" in e for e in errors), errors
    assert not (out / "checkpoints" / "epoch-0050").exists()
