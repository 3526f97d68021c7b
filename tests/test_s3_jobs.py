"""Real ``horovodrun -np 2`` jobs that train from S3 (folder and shards) on a local S3-compatible server."""

import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from conftest import (
    HVD_TRAIN,
    S3_KEY_ID,
    S3_SECRET,
    TINY,
    S3Server,
    kill_group,
    launcher_command,
    output_of,
    read_json,
    run,
    run_at_once,
    start,
)
from s3proxy import CuttingProxy

# The jobs of two ranks run alone (multiprocess), and so do the module's runs, made in the setup
# of the first test; the resume test runs processes of one rank, one after the other, beside another test.

# Two epochs with --deterministic: the same images in the same order give the same weights, bit for bit.
OPTIONS = [
    *TINY[:2],  # the tests' own backbone
    "--weights",
    "none",
    "--image-size",
    "32",
    "--batch-size",
    "8",
    "--epochs",
    "2",
    "--deterministic",
    "--base-lr",
    "0.01",
    "--warmup-epochs",
    "1",
    "--augment",
    "crop,flip",
    "--crop-fraction",
    "1.0",
    "--threads-per-rank",
    "1",
]


@pytest.fixture(scope="module")
def textures(tmp_path_factory) -> Path:
    """``train/`` (25 per class) and ``val/`` (10 per class) of the demo's 5 texture classes.

    The demo's layout (files at the top of a class and in ``part-N/`` folders) is one where a
    folder walk and a sort of whole S3 keys disagree from the first image on.
    """
    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    root = tmp_path_factory.mktemp("textures")
    make_demo_data(str(root / "train"), per_class=25, size=40, seed=0)
    make_demo_data(str(root / "val"), per_class=10, size=40, seed=1)
    return root


@pytest.fixture(scope="module")
def bucket(s3_server, textures):
    """The textures in S3 as folders (``folder/``), and as shards packed by the CLI from there (``shards/``)."""
    name = f"jobs-{uuid.uuid4().hex[:10]}"
    s3_server.client().create_bucket(Bucket=name)
    packs = []  # all four at once, with the server's credentials (the local ones read no S3)
    for part in ("train", "val"):
        s3_server.upload_folder(textures / part, name, f"folder/{part}/")
        # Packed from the S3 folder into S3 shards, as a user would.
        s3 = [*HVD_TRAIN, "pack", f"s3://{name}/folder/{part}/", f"s3://{name}/shards/{part}/", "--shard-size", "64KB"]
        packs.append(s3)
        # ... and from the local folder into local shards: the same listing, so the same shards.
        packs.append([*HVD_TRAIN, "pack", textures / part, textures / "shards" / part, "--shard-size", "64KB"])
    for proc in run_at_once(*packs, **s3_server.env):
        assert proc.returncode == 0, output_of(proc)
    return name


class Run(NamedTuple):
    out: Path
    summary: dict
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def runs(textures, bucket, s3_server, tmp_path_factory):
    """The textures trained four ways, 2 epochs each: ``{kind: Run}``, and how many reads the proxy broke.

    Folders in one process, shards under two ranks: each pair compares like with like, and
    both the per-image fetches and the ranked shard blocks read from S3. The S3 runs read
    through a proxy that breaks every 7th object read mid-body: they are read again.
    """
    root = tmp_path_factory.mktemp("runs")
    proxy = CuttingProxy(s3_server.url, every=7)
    flaky = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.url}
    sources = {
        "local folder": (textures / "train", textures / "val", {}, 1),
        "s3 folder": (f"s3://{bucket}/folder/train/", f"s3://{bucket}/folder/val/", flaky, 1),
        "local shards": (textures / "shards" / "train", textures / "shards" / "val", {}, 2),
        "s3 shards": (f"s3://{bucket}/shards/train/", f"s3://{bucket}/shards/val/", flaky, 2),
    }
    jobs = {}
    for kind, (data, val, env, ranks) in sources.items():
        extra = ["--no-tensorboard"] if kind.startswith("local") else []
        out = root / kind.replace(" ", "-")
        program = [*HVD_TRAIN, "train", "--data", data, "--val-data", val, "--output", out, *OPTIONS, *extra]
        jobs[kind] = ([*launcher_command("horovodrun-gloo", ranks), *program] if ranks > 1 else program, env)
    try:
        # The two runs of one process at the same time, with the proxy's credentials (the local one
        # reads nothing through it), then the two of two ranks one after the other.
        folders = (jobs["local folder"][0], jobs["s3 folder"][0])
        procs = dict(zip(("local folder", "s3 folder"), run_at_once(*folders, **flaky)))
        for kind in ("local shards", "s3 shards"):
            command, env = jobs[kind]
            procs[kind] = run(command, **env)
    finally:
        proxy.stop()
    done = {}
    for kind in sources:
        assert procs[kind].returncode == 0, f"{kind}: {output_of(procs[kind])}"
        out = root / kind.replace(" ", "-")
        done[kind] = Run(out, read_json(out / "summary.json"), procs[kind])
    return done, proxy.cuts


@pytest.mark.multiprocess
def test_the_same_images_train_to_the_same_weights_from_local_disk_and_s3(runs):
    done, cuts = runs
    summaries = {kind: r.summary for kind, r in done.items()}
    for kind, summary in summaries.items():
        ranks = 2 if kind.endswith("shards") else 1
        assert summary["val_images"] == 50, kind
        assert summary["world_size"] == ranks and summary["weights_identical_across_ranks"] is True, kind
    # Same images, same order, same split: the same weights, bit for bit, broken reads or not.
    assert summaries["s3 folder"]["weights_digest"] == summaries["local folder"]["weights_digest"]
    assert summaries["s3 shards"]["weights_digest"] == summaries["local shards"]["weights_digest"]
    retried = {kind: sum(summaries[kind]["input_retried_reads"]) for kind in ("s3 folder", "s3 shards")}
    assert all(retried.values()) and sum(retried.values()) <= cuts, (retried, cuts)
    assert summaries["local folder"]["input_retried_reads"] == [0]
    assert "the connection broke while reading s3://" in done["s3 shards"].proc.stderr
    # (Another run differs: the digest tells runs apart, so the equalities above say something.)
    assert summaries["local shards"]["weights_digest"] != summaries["local folder"]["weights_digest"]
    for kind in ("s3 folder", "s3 shards"):
        summary = summaries[kind]
        assert len(summary["input_wait_seconds"]) == summary["world_size"], kind
        assert all(b > 0 for b in summary["input_bytes"]), kind
        assert "input waited" in done[kind].proc.stderr
    folder = summaries["s3 folder"]
    assert folder["input_objects"][0] == 2 * folder["steps_per_epoch"] * 8
    # No credential anywhere: logs, printed commands, and every file written (TensorBoard's included).
    for kind in ("s3 folder", "s3 shards"):
        text = done[kind].proc.stdout + done[kind].proc.stderr
        assert S3_SECRET not in text and S3_KEY_ID not in text, kind
        out = done[kind].out
        assert any((out / "tensorboard").rglob("events.out.tfevents.*")), kind
        for path in out.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                assert S3_SECRET.encode() not in data and S3_KEY_ID.encode() not in data, path


def test_a_run_resumes_from_s3_after_starting_on_local_disk_and_refuses_other_images(runs, bucket, s3_server, tmp_path):
    # The local folder run (its 2 epochs trained on local disk), copied: the other test reads it.
    out = tmp_path / "run"
    done, _ = runs
    shutil.copytree(done["local folder"].out, out)
    single = [*HVD_TRAIN, "train", "--output", out, *OPTIONS]
    # The same images, moved to S3: the listings have the same digests, the resume goes on.
    s3_val = f"s3://{bucket}/folder/val/"
    moved = run(
        [*single, "--data", f"s3://{bucket}/folder/train/", "--val-data", s3_val, "--epochs", "3"], **s3_server.env
    )
    assert moved.returncode == 0 and "resuming from" in moved.stderr, output_of(moved)
    # Other images (the held-out folder) under the same output: refused, checkpoints kept.
    other = run([*single, "--data", s3_val, "--val-split", "0.2", "--epochs", "4"], **s3_server.env)
    assert other.returncode == 2, output_of(other)
    [error] = [line for line in other.stderr.splitlines() if "error:" in line]
    assert "the images differ from those checkpoint" in error and "--allow-data-change" in error
    assert "training images: 125 images" in error and "40 images" in error
    assert (out / "checkpoints" / "epoch-0003").is_dir()


@pytest.mark.multiprocess
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
    assert all(
        "cannot reach S3" in e or "lost the connection to S3" in e or "the connection to S3 broke" in e for e in errors
    ), errors
    assert all("s3://doomed/train/" in e for e in errors), errors
    assert not (out / "checkpoints" / "epoch-0050").exists()
