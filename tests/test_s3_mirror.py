"""A run's --output in S3 (``training.s3_mirror``), in one process against each real test S3 server (moto, rclone).

The whole story (a spot notice, a network cut, a resume on another machine) is a real job in
test_s3_jobs.py; here, the parts: multipart uploads, manifests, pruning, a failed upload, a pull.
"""

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from hvd_train import config
from hvd_train.data.folder import ImageSet
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.model.catalogue import get_spec
from hvd_train.training import checkpoints, s3_mirror, stages
from hvd_train.training.finish import describe
from hvd_train.training.job import Job
from hvd_train.training.run_record import RECORD

from conftest import HVD_TRAIN, output_of, run
from s3_runs import (
    OPTIONS,
    finished_run,
    new_run,
    prefix_checkpoints,
    record_as_the_runs,
    save,
    stored,
    two_up_and_one_kept_back,
)
from s3proxy import CuttingProxy


def test_the_staging_folder_is_named_after_the_prefix_and_odd_prefixes_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path))
    assert s3_mirror.staging_folder("s3://b/runs/x/") == str(tmp_path / "runs" / "b" / "runs" / "x")
    # Two stores may each hold a bucket of one name: --s3-endpoint's host and port come first, with a ':' that
    # no bucket's name holds. The commands that read a run keep their copy apart from a training's.
    assert s3_mirror.staging_folder("s3://b/x", "http://127.0.0.1:9000") == str(tmp_path / "runs/127.0.0.1:9000/b/x")
    assert s3_mirror.staging_folder("s3://b/x", "https://minio.example") == str(tmp_path / "runs/minio.example:443/b/x")
    assert s3_mirror.staging_folder("s3://b/x", kind="read") == str(tmp_path / "read" / "b" / "x")
    # The bucket is a folder's name too: "s3://../x" would stage in $HVD_TRAIN_CACHE/x, outside runs/.
    odd = ("s3://b", "s3://b/", "s3://b/runs//x", "s3://b/runs/../x", "s3:///runs/x", "s3://../x", "s3://./x")
    for url in (*odd, "s3://b:9000/x", "s3://b c/x"):
        with pytest.raises(UserError, match=f"^--output {re.escape(url)} must name a bucket and a prefix"):
            s3_mirror.staging_folder(url)
    # urlsplit would take "#frag/x" for a fragment and "?x" for a query, and cut the prefix short.
    for url in ("s3://b/r#frag/x", "s3://b/r?v=1/x", "s3://b#/r"):
        with pytest.raises(UserError, match=f"^--model-dir {re.escape(url)} holds a '\\?' or '#'") as e:
            s3_mirror.staging_folder(url, flag="--model-dir")
        assert "\n" not in str(e.value)


def test_checkpoints_go_up_manifest_last_are_pruned_and_a_rerun_uploads_what_an_outage_kept_back(
    prefix, net, tmp_path, any_s3_server
):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    model, optimizer = net
    (staging / "tensorboard").mkdir(parents=True)
    (staging / "tensorboard" / "events").write_bytes(os.urandom(100))
    # A file above PART_BYTES goes up in parts. Its ETag is, on moto as on AWS, not an MD5 but "<md5 of the
    # parts' md5s>-<parts>"; rclone's serve s3 joins the parts into one file and answers the MD5 of that.
    (staging / "model.keras").write_bytes(os.urandom(s3_mirror.PART_BYTES + 1000))
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
    assert mirror.uploads.bytes > s3_mirror.PART_BYTES and mirror.uploads.retried == 0
    # The network goes down after the record of the 4th checkpoint and two of its files: it is not
    # complete in the prefix (no manifest), and the run is told so.
    proxy = CuttingProxy(any_s3_server.url)
    proxy.cut_uploads, proxy.let_through = -1, 3
    cut = s3_mirror.Mirror(url, str(staging), dataclasses.replace(OPTIONS, endpoint=proxy.url))
    cut._sent = dict(mirror._sent)  # the same run's mirror, its outputs up already
    uploaded_model = (staging / "model.keras").read_bytes()
    try:
        fourth = os.path.basename(save(staging, 4, model, optimizer))
        assert not cut.push_checkpoint(str(staging / "checkpoints" / fourth))
        assert cut.uploads.retried == 1 and cut.uploads.failed_checkpoints == 1 and proxy.upload_cuts >= 4
        # The run ends, its outputs written to the staging folder; they cannot go up either.
        (staging / "model.keras").write_bytes(os.urandom(s3_mirror.PART_BYTES + 1000))
        (staging / "summary.json").write_text('{"val_accuracy": 0.5}\n')
        with pytest.raises(UserError, match=f"are in {re.escape(str(staging))}; rerun the same command to upload"):
            cut.finish({"val_accuracy": 0.5})
    finally:
        proxy.stop()
    keys = stored(client, bucket)
    assert len([k for k in keys if k.startswith(f"checkpoints/{fourth}/")]) == 2, sorted(keys)
    assert f"checkpoints/{fourth}/{checkpoints.STATE_FILE}" not in keys and "summary.json" not in keys
    # Another machine: the prefix's newest complete checkpoint (the 3rd), verified, and the files
    # beside it, the large one whole.
    other = tmp_path / "two"
    pulled = s3_mirror.Mirror(url, str(other), OPTIONS)
    assert pulled.pull() == names[2]
    assert checkpoints.latest(str(other)).path == str(other / "checkpoints" / names[2])
    assert (other / "model.keras").read_bytes() == uploaded_model
    # The same command again on the machine that could not upload: its 4th checkpoint, verified and newer
    # than the prefix's, goes up with the outputs that wait beside it, and the run resumes from it.
    again = s3_mirror.Mirror(url, str(staging), OPTIONS)
    again.check()
    assert again.pull() == fourth
    assert checkpoints.latest(str(staging)).path == str(staging / "checkpoints" / fourth)
    keys = stored(client, bucket)
    assert f"checkpoints/{fourth}/{checkpoints.STATE_FILE}" in keys
    up = {rel: client.get_object(Bucket=bucket, Key=f"runs/a/{rel}")["Body"].read() for rel in keys}
    assert up["summary.json"] == (staging / "summary.json").read_bytes()
    assert up["model.keras"] == (staging / "model.keras").read_bytes() != uploaded_model
    assert s3_mirror.Mirror(url, str(other), OPTIONS).pull() == fourth  # and so does any other machine


def test_a_checkpoint_without_its_manifest_or_with_a_part_cut_short_is_never_resumed_from(prefix, net, tmp_path):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    model, optimizer = net
    good = os.path.basename(save(staging, 1, model, optimizer))
    assert mirror.push_checkpoint(str(staging / "checkpoints" / good))
    parts = {k: client.get_object(Bucket=bucket, Key=f"runs/a/{k}")["Body"].read() for k in stored(client, bucket)}
    parts = {key.split("/")[-1]: body for key, body in parts.items() if key.startswith("checkpoints/")}
    for newer, cut_short in (("epoch-0003", None), ("epoch-0002", "local.npz"), ("epoch-0009", None)):
        for part, body in parts.items():
            if newer == "epoch-0003" and part == checkpoints.STATE_FILE:
                continue  # an upload that stopped before its manifest
            body = body[: len(body) // 2] if part == cut_short else body
            client.put_object(Bucket=bucket, Key=f"runs/a/checkpoints/{newer}/{part}", Body=body)
    # The first two as the run's own uploads left them (the run records a checkpoint before it uploads
    # it); the third, whole, is not the run's: someone put it there.
    record_as_the_runs(client, bucket, "epoch-0003", "epoch-0002")
    other = s3_mirror.Mirror(url, str(tmp_path / "two"), OPTIONS)
    assert other.pull() == good
    # Nothing complete in the prefix: a fresh start, with no file in the staging folder (but its hidden copy
    # of the run's id).
    for key in stored(client, bucket):
        if key.endswith(checkpoints.STATE_FILE):
            client.delete_object(Bucket=bucket, Key=f"runs/a/{key}")
    assert other.pull() is None and [f for f in os.listdir(tmp_path / "two") if not f.startswith(".")] == []


def test_a_missing_bucket_is_one_clear_error_before_anything_is_written(prefix, tmp_path):
    url, bucket, _ = prefix
    mirror = s3_mirror.Mirror(url.replace(bucket, bucket + "-gone"), str(tmp_path / "staging"), OPTIONS)
    with pytest.raises(UserError, match=f"bucket '{bucket}-gone' does not exist.*--output"):
        mirror.check()


def test_credentials_that_cannot_delete_keep_older_checkpoints_and_still_upload_every_new_one(
    prefix, net, tmp_path, any_s3_server, caplog
):
    url, bucket, client = prefix
    staging = tmp_path / "one"
    proxy = CuttingProxy(any_s3_server.url)
    proxy.deny_deletes = True
    mirror = s3_mirror.Mirror(url, str(staging), dataclasses.replace(OPTIONS, endpoint=proxy.url))
    model, optimizer = net
    try:
        names, summary = [], {}
        staging.mkdir()
        (staging / "features.keras").write_bytes(b"the model, saved as a head's files first")
        for step in (1, 2):  # --keep-checkpoints 1: the first is pruned on disk, and cannot be in S3
            names.append(os.path.basename(save(staging, step, model, optimizer, keep=1)))
            assert mirror.push_checkpoint(str(staging / "checkpoints" / names[-1])) and mirror.uploaded == names[-1]
        (staging / "metrics.csv").write_text("epoch\n")
        (staging / "features.keras").unlink()  # ... and whole at the end
        mirror.finish(summary)
    finally:
        proxy.stop()
    assert mirror.uploads.failed_checkpoints == 0 and summary["output_uploads"]["files"] == mirror.uploads.files
    keys = stored(client, bucket)
    assert all(f"checkpoints/{n}/{checkpoints.STATE_FILE}" in keys for n in names) and "summary.json" in keys
    assert "older checkpoints stay in" in caplog.text and "access denied" in caplog.text
    assert "files of an earlier form of the model stay in" in caplog.text and "features.keras" in keys


def test_keys_that_would_land_outside_the_staging_folder_are_refused_before_anything_is_written(
    moto_prefix, net, tmp_path, monkeypatch
):
    # Whoever may write to the prefix chooses its keys: an empty part makes the rest of a key an absolute
    # path, '..' climbs out of the folder, a part longer than a file name may be cannot be written (with the
    # room its temporary name takes). A resume and the commands that read a run refuse such a key, naming
    # it, before they write anything; one that the disk cannot hold all the same (a path longer than 4096
    # bytes) stops them at its download, named, in one line too.
    url, bucket, client = moto_prefix
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    finished_run(tmp_path / "one", url, *net)
    [name] = prefix_checkpoints(client, bucket)
    outside = tmp_path / "outside"
    for rel, named in (
        (f"{outside}/planted", None),  # runs/a//<tmp_path>/outside/planted: an absolute path
        (f"checkpoints/{name}/../../../outside/planted", None),
        ("tensorboard/./events", None),
        ("labels.json/planted", "labels.json"),  # a file and a folder of one name
        ("x" * 300, None),
        ("/".join(["y" * 140] * 30), None),
    ):
        key = f"runs/a/{rel}"
        client.put_object(Bucket=bucket, Key=key, Body=b"planted")
        for read in (
            lambda: s3_mirror.Mirror(url, str(tmp_path / "two"), OPTIONS).pull(),
            lambda: s3_mirror.open_run(url, OPTIONS),
        ):
            with pytest.raises(UserError, match=re.escape(f"S3 key s3://{bucket}/runs/a/{named or rel} ")) as e:
                read()
            assert "\n" not in str(e.value)
        client.delete_object(Bucket=bucket, Key=key)
    assert not outside.exists()


def test_folder_markers_are_no_files_to_a_resume_or_the_commands_that_read_a_run(
    moto_prefix, net, tmp_path, monkeypatch
):
    # The S3 console's "Create folder" makes an empty object whose key ends in '/'.
    url, bucket, client = moto_prefix
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    files = finished_run(tmp_path / "one", url, *net)
    [name] = prefix_checkpoints(client, bucket)
    for marker in ("runs/", "runs/a/", "runs/a/tensorboard/", "runs/a/checkpoints/", f"runs/a/checkpoints/{name}/"):
        client.put_object(Bucket=bucket, Key=marker, Body=b"")
    run_dir, _ = s3_mirror.open_run(url, OPTIONS)
    assert {rel: (Path(run_dir) / rel).read_bytes() for rel in files} == files
    other = tmp_path / "two"
    assert s3_mirror.Mirror(url, str(other), OPTIONS).pull() == name
    assert {rel: (other / rel).read_bytes() for rel in files} == files


def test_a_prefix_that_holds_anything_but_a_run_is_refused_before_anything_is_written(prefix, tmp_path):
    url, bucket, client = prefix
    team = url.replace("/runs/a/", "/team/")
    for key in ("team/images/cat/1.jpg", "team/other-run/model.keras"):
        client.put_object(Bucket=bucket, Key=key, Body=b"someone else's")
    before = stored(client, bucket, "team/")
    with pytest.raises(UserError, match=re.escape(f"--output {team} holds 2 object(s) that are not")) as e:
        s3_mirror.Mirror(team, str(tmp_path / "staging"), OPTIONS).check()
    assert "images/cat/1.jpg" in str(e.value) and "a prefix of its own" in str(e.value)
    assert stored(client, bucket, "team/") == before


def test_a_run_deletes_only_what_it_uploaded(prefix, net, tmp_path):
    url, bucket, client = prefix
    model, optimizer = net
    staging = tmp_path / "one"
    mirror = new_run(url, staging)
    (staging / "features.keras").write_bytes(os.urandom(500))  # the model, saved as a head's files first
    assert mirror.push_checkpoint(save(staging, 1, model, optimizer, keep=1))
    # Beside the run, in its prefix: someone's notes, and a folder that only looks like a checkpoint.
    client.put_object(Bucket=bucket, Key="runs/a/notes.txt", Body=b"someone's notes")
    client.put_object(Bucket=bucket, Key="runs/a/checkpoints/epoch-0099/notes.txt", Body=b"someone's notes")
    (staging / "features.keras").unlink()
    (staging / "model.keras").write_bytes(os.urandom(500))  # ... then whole
    assert mirror.push_checkpoint(save(staging, 2, model, optimizer, keep=1))
    mirror.finish({})
    keys = stored(client, bucket)
    assert "features.keras" not in keys and "model.keras" in keys and "summary.json" in keys
    assert prefix_checkpoints(client, bucket) == {"epoch-0000-step-000002", "epoch-0099"}
    assert "notes.txt" in keys
    # --no-resume: the run's checkpoints go; what is not the run's stays.
    assert s3_mirror.Mirror(url, str(staging), OPTIONS).remove_checkpoints() == 1
    assert prefix_checkpoints(client, bucket) == {"epoch-0099"} and "notes.txt" in stored(client, bucket)


def test_the_best_checkpoint_of_early_stop_survives_a_resume_from_the_prefix(prefix, net, tmp_path):
    url, bucket, client = prefix
    model, optimizer = net
    one = tmp_path / "one"
    mirror = new_run(url, one)
    for epoch in (1, 2, 3):  # epoch 1 scored best; --keep-checkpoints 1 keeps it beside the newest
        assert mirror.push_checkpoint(save(one, 0, model, optimizer, keep=1, epoch=epoch, best_epoch=0))
    assert prefix_checkpoints(client, bucket) == {"epoch-0001", "epoch-0003"}
    newest = 3
    for machine, epoch in (("two", 4), ("one", 5)):  # another machine, then the first one again
        staging = tmp_path / machine
        again = s3_mirror.Mirror(url, str(staging), OPTIONS)
        again.check()
        assert again.pull() == f"epoch-{newest:04d}"
        # The checkpoint restore_best loads at the end, and which the next upload keeps in the prefix.
        assert checkpoints.of_epoch_end(str(staging), 1) is not None
        assert again.push_checkpoint(save(staging, 0, model, optimizer, keep=1, epoch=epoch, best_epoch=0))
        assert prefix_checkpoints(client, bucket) == {"epoch-0001", f"epoch-{epoch:04d}"}
        newest = epoch


def test_no_resume_into_a_finished_run_keeps_its_model_usable_until_the_new_one_replaces_it(
    prefix, net, tmp_path, monkeypatch
):
    # On disk, a run started over in the folder of a finished one leaves its model and what describes it
    # (labels.json, run_config.yaml) until its own end replaces the three together; so in S3.
    url, bucket, client = prefix
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    model, optimizer = net
    old = finished_run(tmp_path / "old", url, model, optimizer)
    values = {"data": {"train": str(tmp_path / "images")}, "run": {"output": url, "resume": False}}
    cfg = s3_mirror.stage(config.build(values))
    stages.prepare_output(cfg, Context())
    images = ImageSet([str(tmp_path / "images" / c / "1.png") for c in "xy"], [0, 1], ["x", "y"])
    describe(Job(cfg, images, None, 32, "fp32", get_spec(cfg.model.name)))  # as training starts
    mirror = s3_mirror.of(cfg.run.output)
    assert mirror.remove_checkpoints() == 1
    assert mirror.push_checkpoint(save(Path(cfg.run.output), 1, model, optimizer))
    keys = stored(client, bucket)
    assert f"checkpoints/epoch-0000-step-000001/{checkpoints.STATE_FILE}" in keys
    now = {rel: client.get_object(Bucket=bucket, Key=f"runs/a/{rel}")["Body"].read() for rel in old}
    assert now == old


def test_report_reads_a_run_in_s3_through_the_endpoint_it_is_given(moto_prefix, net, tmp_path, monkeypatch, s3_server):
    # As predict, evaluate and export do (test_s3_jobs.py): a store other than AWS, with no AWS_ENDPOINT_URL.
    # (On moto alone: a process of the CLI per server would cost more than it tells.)
    url, bucket, client = moto_prefix
    finished_run(tmp_path / "one", url, *net)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    proc = run([*HVD_TRAIN, "report", url, "--s3-endpoint", s3_server.url], HVD_TRAIN_CACHE=str(tmp_path / "c"))
    assert proc.returncode == 0, output_of(proc)
    assert "report.html" in stored(client, bucket)


def test_a_manifest_from_the_prefix_that_names_files_outside_its_checkpoint_makes_it_damaged(
    prefix, net, tmp_path, caplog
):
    # state.json is the manifest: a planted one that names /abs/path or ../../x would have verify() read any
    # file of the machine (and take the checkpoint for complete where that file matches). save() writes plain
    # names; anything else makes the checkpoint damaged, and the resume passes over it.
    url, bucket, client = prefix
    model, optimizer = net
    mirror = s3_mirror.Mirror(url, str(tmp_path / "one"), OPTIONS)
    mirror.check()
    good = os.path.basename(save(tmp_path / "one", 1, model, optimizer))
    assert mirror.push_checkpoint(str(tmp_path / "one" / "checkpoints" / good))
    secret = tmp_path / "secret"
    secret.write_bytes(b"a file of the machine")
    manifest = json.loads((tmp_path / "one" / "checkpoints" / good / checkpoints.STATE_FILE).read_bytes())
    # The download folder is two/checkpoints/.NAME.download-PID: three levels below tmp_path.
    planted = {"epoch-0008": str(secret), "epoch-0009": "../../../secret"}
    for name, rel in planted.items():
        body = {**manifest, "files": {rel: checkpoints._digest(str(secret))}}
        body["checksum"] = checkpoints._body_checksum(body)
        client.put_object(Bucket=bucket, Key=f"runs/a/checkpoints/{name}/state.json", Body=json.dumps(body).encode())
    record_as_the_runs(client, bucket, *planted)
    assert s3_mirror.Mirror(url, str(tmp_path / "two"), OPTIONS).pull() == good
    for name, rel in planted.items():
        assert f"{name}: state.json names {rel!r}, which is no file of a checkpoint's folder" in caplog.text


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_copy_in_the_staging_folder_is_downloaded_again_and_never_costs_the_prefix_its_checkpoints(
    prefix, net, tmp_path, monkeypatch
):
    # The staging folder's copy of the checkpoint to resume from has the prefix's manifest, but a file of it
    # rotted on disk: it is downloaded again. Were it trusted, the resume would set it aside, find no other
    # (the pull removes them), start over, and its first upload would prune the prefix's good checkpoints.
    url, bucket, client = prefix
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    model, optimizer = net
    values = {"data": {"train": str(tmp_path / "images")}, "run": {"output": url}}
    cfg = s3_mirror.stage(config.build(values))
    staging = Path(cfg.run.output)
    stages.prepare_output(cfg, Context())
    mirror = s3_mirror.of(cfg.run.output)
    names = []
    for epoch in (1, 2, 3):
        names.append(os.path.basename(save(staging, 0, model, optimizer, keep=2, epoch=epoch)))
        assert mirror.push_checkpoint(str(staging / "checkpoints" / names[-1]))
    flip_a_byte(staging / "checkpoints" / names[-1] / checkpoints.LOCAL_FILE)
    cfg = s3_mirror.stage(config.build(values))  # the same command again, on the same machine
    stages.prepare_output(cfg, Context())
    found = s3_mirror.latest_checkpoint(cfg.run.output)
    assert found is not None and os.path.basename(found.path) == names[-1]
    assert prefix_checkpoints(client, bucket) == set(names[1:])
    # And should the copy the pull took fail to verify when the run restores it (a disk that fails under
    # it), the run stops, naming it, rather than start over: the prefix keeps its checkpoints.
    flip_a_byte(staging / "checkpoints" / names[-1] / checkpoints.LOCAL_FILE)
    with pytest.raises(UserError, match=f"checkpoint {names[-1]} of {re.escape(url)} did not verify") as e:
        s3_mirror.latest_checkpoint(cfg.run.output)
    assert "\n" not in str(e.value)
    assert prefix_checkpoints(client, bucket) == set(names[1:])


def test_a_staging_folder_of_an_earlier_hvd_train_keeps_what_an_outage_kept_back(prefix, net, tmp_path):
    # An earlier hvd_train kept no record, in the prefix or in the staging folder. Its staging folder, caught
    # in an outage, holds a checkpoint the prefix lacks: it is the run's, as the checkpoint before it is in
    # the prefix byte for byte, and goes up. A staging folder that shares no checkpoint with the prefix
    # (another run's) keeps none of its own.
    url, bucket, client = prefix
    model, optimizer = net
    staging, other = tmp_path / "one", tmp_path / "other"
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    staging.mkdir()
    kept_back = two_up_and_one_kept_back(mirror, staging, model, optimizer)
    save(other, 0, model, optimizer, keep=3, epoch=1)
    save(other, 0, model, optimizer, keep=3, epoch=4)
    client.delete_object(Bucket=bucket, Key=f"runs/a/{RECORD}")
    (staging / RECORD).unlink()
    assert s3_mirror.Mirror(url, str(other), OPTIONS).pull() == "epoch-0002"
    assert not (other / "checkpoints" / "epoch-0004").exists()
    again = s3_mirror.Mirror(url, str(staging), OPTIONS)
    again.check()
    assert again.pull() == kept_back
    assert f"checkpoints/{kept_back}/{checkpoints.STATE_FILE}" in stored(client, bucket)


def test_a_symbolic_link_in_the_staging_folder_leads_no_download_out_of_it(prefix, net, tmp_path):
    url, bucket, client = prefix
    finished_run(tmp_path / "one", url, *net)
    outside, staging = tmp_path / "outside", tmp_path / "two"
    outside.mkdir()
    staging.mkdir()
    (staging / "tensorboard").symlink_to(outside)  # made by hand, or by a tool that links logs elsewhere
    with pytest.raises(UserError, match=r"^tensorboard/events would be written outside the staging folder .*link"):
        s3_mirror.Mirror(url, str(staging), OPTIONS).pull()
    assert list(outside.iterdir()) == []
