"""Real ``horovodrun -np 2`` jobs that train from S3 (folder and shards) on a local S3-compatible server."""

import http.server
import json
import re
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

from hvd_train.training.prefix import RECORD

from conftest import (
    HVD_TRAIN,
    S3_KEY_ID,
    S3_SECRET,
    TINY,
    S3Server,
    job_env,
    kill_group,
    launcher_command,
    output_of,
    read_json,
    run,
    run_at_once,
    start,
)
from s3proxy import CuttingProxy

SPOT_WATCH = Path(__file__).resolve().parents[1] / "launch" / "aws-spot-watch.sh"
EXIT_PREEMPTED = 75

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
    through a proxy that breaks every 7th object read mid-body: they are read again. The run
    of shards from S3 writes its --output to S3 as well (rank 0 of two uploads it); its ``out``
    is its staging folder.
    """
    root = tmp_path_factory.mktemp("runs")
    proxy = CuttingProxy(s3_server.url, every=7)
    flaky = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.url, "HVD_TRAIN_CACHE": str(root / "cache")}
    outputs = {"s3 shards": f"s3://{bucket}/runs/shards"}
    sources = {
        "local folder": (textures / "train", textures / "val", {}, 1),
        "s3 folder": (f"s3://{bucket}/folder/train/", f"s3://{bucket}/folder/val/", flaky, 1),
        "local shards": (textures / "shards" / "train", textures / "shards" / "val", {}, 2),
        "s3 shards": (f"s3://{bucket}/shards/train/", f"s3://{bucket}/shards/val/", flaky, 2),
    }
    jobs = {}
    for kind, (data, val, env, ranks) in sources.items():
        extra = ["--no-tensorboard"] if kind.startswith("local") else []
        out = outputs.get(kind, root / kind.replace(" ", "-"))
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
        if kind in outputs:
            out = root / "cache" / "runs" / bucket / "runs" / "shards"
        done[kind] = Run(out, read_json(out / "summary.json"), procs[kind])
    return done, proxy.cuts


@pytest.mark.multiprocess
def test_the_same_images_train_to_the_same_weights_from_local_disk_and_s3(runs, bucket, s3_server):
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
    # The run of two ranks with its --output in S3: the prefix holds every file of its staging folder, and
    # the run's record of them.
    stored = prefix_files(s3_server, bucket, "runs/shards/")
    record = json.loads(stored.pop(RECORD))
    staged = {p.relative_to(done["s3 shards"].out).as_posix(): p for p in done["s3 shards"].out.rglob("*")}
    staged = {rel: p.read_bytes() for rel, p in staged.items() if p.is_file() and not rel.startswith(".")}
    assert json.loads(stored["summary.json"])["weights_digest"] == summaries["s3 shards"]["weights_digest"]
    assert stored == staged
    assert set(record["files"]) == {rel for rel in stored if not rel.startswith("checkpoints/")}
    assert set(record["checkpoints"]) == {rel.split("/")[1] for rel in stored if rel.startswith("checkpoints/")}


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


class SpotMetadata:
    """The instance metadata service (IMDSv2) of a spot machine on 127.0.0.1: a token, and the
    interruption notice once ``notice`` is set."""

    def __init__(self):
        self.notice = False
        metadata = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                self.reply(200, b"token") if self.path == "/latest/api/token" else self.reply(404)

            def do_GET(self):
                asked = self.path == "/latest/meta-data/spot/instance-action"
                if asked and metadata.notice and self.headers.get("X-aws-ec2-metadata-token") == "token":
                    self.reply(200, b'{"action": "terminate", "time": "2026-11-29T12:00:00Z"}')
                else:
                    self.reply(404)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def prefix_files(s3_server, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3_server.client()
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])]  # fmt: skip
    return {k[len(prefix) :]: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def test_a_run_in_s3_stopped_by_a_spot_notice_resumes_on_another_machine_from_the_prefix_alone(
    runs, bucket, s3_server, textures, tmp_path
):
    # Machine 1 trains with --output in S3 through a proxy. Once a checkpoint is complete in the
    # prefix, the network drops every upload: the next checkpoint does not go up, and the run goes
    # on. The network back, an interruption notice from the metadata service reaches
    # launch/aws-spot-watch.sh, which stops the run: its checkpoint goes up before it ends (75).
    done, _ = runs
    prefix, key = f"s3://{bucket}/runs/spot", "runs/spot/"
    samples = tmp_path / "samples"
    data = ["--data", f"s3://{bucket}/folder/train/", "--val-data", f"s3://{bucket}/folder/val/"]
    command = [*HVD_TRAIN, "train", *data, "--output", prefix, *OPTIONS, "--checkpoint-every", "2"]
    command += ["--s3-max-attempts", "2", "--sample-log", samples, "--log-all-ranks"]
    proxy, metadata = CuttingProxy(s3_server.url), SpotMetadata()
    env = {**s3_server.env, "AWS_ENDPOINT_URL": proxy.url}
    log = tmp_path / "machine-1.log"
    first = subprocess.Popen(
        [str(a) for a in command], stdout=subprocess.DEVNULL, stderr=open(log, "w"), stdin=subprocess.DEVNULL,
        env=job_env(HVD_TRAIN_CACHE=str(tmp_path / "machine-1"), **env), start_new_session=True,
    )  # fmt: skip
    watcher = start(["bash", SPOT_WATCH, first.pid, "0.2"], HVD_TRAIN_IMDS=metadata.url)
    try:
        deadline = time.time() + 300

        def wait_for(what, condition):
            while not condition():
                assert first.poll() is None, f"the run ended before {what}:\n{log.read_text()[-5000:]}"
                assert time.time() < deadline, f"no {what} after 300 s:\n{log.read_text()[-5000:]}"
                time.sleep(0.05)

        wait_for("checkpoint in S3", lambda: "uploaded to" in log.read_text())
        proxy.cut_uploads = -1
        wait_for("failed upload", lambda: "could not be uploaded" in log.read_text())
        # The network back, but slow: the run's remaining checkpoints take seconds each, so the
        # notice (polled every 0.2 s) comes long before its last step, however busy the machine.
        proxy.upload_delay, proxy.cut_uploads = 0.2, 0
        metadata.notice = True
        assert first.wait(timeout=300) == EXIT_PREEMPTED, log.read_text()[-5000:]
        _, watched = watcher.communicate(timeout=30)
    finally:
        for proc in (first, watcher):
            kill_group(proc)
        metadata.stop()
    text = log.read_text()
    assert "interruption notice" in watched, watched
    [stop] = re.findall(r"stopped by SIGUSR1 in epoch .*?checkpoint (\S+);", text) or [None]
    assert stop and proxy.upload_cuts >= 4, text[-5000:]  # 2 attempts of botocore's in each of 2 of ours
    name = Path(stop).name
    assert f"checkpoint {name} uploaded to {prefix}/" in text, text[-5000:]
    shutil.rmtree(tmp_path / "machine-1")  # the machine is gone

    # Planted in the prefix, newer than the stop's, and in the run's record as its own uploads would be: a
    # checkpoint half uploaded (no state.json) and one whose part was cut short. Machine 2 passes over both
    # and resumes from the stop's.
    client, stopped = s3_server.client(), prefix_files(s3_server, bucket, f"{key}checkpoints/{name}/")
    for newer, parts in (("epoch-0009", set(stopped) - {"state.json"}), ("epoch-0008", set(stopped))):
        for part in parts:
            body = stopped[part][: len(stopped[part]) // 2] if part == "local.npz" else stopped[part]
            client.put_object(Bucket=bucket, Key=f"{key}checkpoints/{newer}/{part}", Body=body)
    record = json.loads(client.get_object(Bucket=bucket, Key=f"{key}{RECORD}")["Body"].read())
    record["checkpoints"] += ["epoch-0008", "epoch-0009"]
    client.put_object(Bucket=bucket, Key=f"{key}{RECORD}", Body=json.dumps(record).encode())
    # Machine 2, nothing local; its first 3 uploads are cut (the probe's, twice by botocore, once by us).
    proxy.upload_delay, proxy.cut_uploads = 0.0, 3
    try:
        second = run(command, HVD_TRAIN_CACHE=str(tmp_path / "machine-2"), **env)
    finally:
        proxy.stop()
    assert second.returncode == 0, output_of(second)
    assert "skipping checkpoint" in second.stderr and "epoch-0008: local.npz is damaged" in second.stderr
    assert f"resuming the run in {prefix}/: checkpoint {name} (" in second.stderr, output_of(second)
    assert "resuming from" in second.stderr
    stored = prefix_files(s3_server, bucket, key)
    summary = json.loads(stored["summary.json"])
    assert summary["weights_digest"] == done["s3 folder"].summary["weights_digest"], "not bit-identical"
    uploads = summary["output_uploads"]
    assert uploads["retried"] >= 1 and uploads["failed_checkpoints"] == 0 and uploads["files"] > 0, uploads
    # The prefix holds the run: outputs, and complete checkpoints only (the planted ones pruned).
    for rel in ("model.keras", "labels.json", "run_config.yaml", "metrics.csv", "confusion.png"):
        assert rel in stored, sorted(stored)
    assert len(stored["metrics.csv"].decode().splitlines()) == 3  # the header and 2 epochs
    names = {rel.split("/")[1] for rel in stored if rel.startswith("checkpoints/")}
    assert names and all(f"checkpoints/{n}/state.json" in stored for n in names), sorted(stored)
    assert not names & {"epoch-0008", "epoch-0009"} and len(names) <= 2, names
    assert any(rel.startswith("tensorboard/") for rel in stored) and not any(".write-test" in r for r in stored)
    for rel, body in stored.items():
        assert S3_SECRET.encode() not in body and S3_KEY_ID.encode() not in body, rel
    # The commands that read a run take the prefix, and the store's endpoint (no AWS_ENDPOINT_URL):
    # evaluate scores the held-out images exactly as the run did and puts its report beside it; report
    # and export add theirs; predict answers.
    local = {k: v for k, v in s3_server.env.items() if k != "AWS_ENDPOINT_URL"}
    endpoint = ["--s3-endpoint", s3_server.url]
    evaluate = [*HVD_TRAIN, "evaluate", "--model-dir", prefix, "--data", f"s3://{bucket}/folder/val/", *endpoint]
    evaluation = run(evaluate, **local)
    assert evaluation.returncode == 0, output_of(evaluation)
    page = run([*HVD_TRAIN, "report", prefix, *endpoint], **local)
    exported = run([*HVD_TRAIN, "export", prefix, "--format", "savedmodel", *endpoint], **local)
    one = sorted(p for p in (textures / "val").rglob("*") if p.is_file() and not p.name.startswith("."))[0]
    predicted = run([*HVD_TRAIN, "predict", "--model-dir", prefix, one, *endpoint], **local)
    for proc in (page, exported, predicted):
        assert proc.returncode == 0, output_of(proc)
    stored = prefix_files(s3_server, bucket, key)
    report = json.loads(stored["evaluation.json"])
    assert (report["images"], report["accuracy"]) == (summary["val_images"], summary["val_accuracy"])
    assert "report.html" in stored and "export/manifest.json" in stored, sorted(stored)
    assert str(one) in predicted.stdout and any(c in predicted.stdout for c in report["classes"]), predicted.stdout
