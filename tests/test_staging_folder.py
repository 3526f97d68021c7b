"""The staging folder of a run in S3 (``training.s3_mirror``): what it keeps and gives back, in one process against
each real test S3 server (moto, rclone)."""

import contextlib
import dataclasses
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_train import config
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.training import checkpoints, s3_mirror, stages
from hvd_train.training.run_record import RECORD

from conftest import job_env, kill_group
from s3_runs import OPTIONS, finished_run, save, stored, two_up_and_one_kept_back


def test_a_read_fault_of_a_moment_costs_no_checkpoint_its_turn(prefix, net, tmp_path, monkeypatch):
    # A file server that fails over answers a read with EIO for a moment. A checkpoint just downloaded, or one
    # an outage kept back in the staging folder, is read again before it counts as damaged: else the resume
    # takes an older one from the prefix, and the pull removes the kept-back one. (No disk of this machine
    # fails on demand: the fault is made at the read of a file's bytes that verify() makes.)
    url, _, _ = prefix
    model, optimizer = net
    one = tmp_path / "one"
    mirror = s3_mirror.Mirror(url, str(one), OPTIONS)
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
    assert s3_mirror.Mirror(url, str(tmp_path / "two"), OPTIONS).pull() == "epoch-0002"
    assert s3_mirror.Mirror(url, str(one), OPTIONS).pull() == kept_back
    assert len(failed) == 2


def test_credentials_in_the_url_are_refused_and_never_shown(tmp_path, monkeypatch):
    # s3://KEY:SECRET@bucket/x: a folder named after it would hold the secret, and a message that showed it
    # redacted as s3://bucket/x would look like a valid --output.
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path))
    for url in ("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bkt/x", "s3://AKIAEXAMPLE@bkt/x", "s3://:wJalrXUtnFEMI@bkt/x"):
        for flag in ("--output", "--model-dir"):
            with pytest.raises(UserError, match=f"^{flag} holds user:password@ before its bucket") as e:
                s3_mirror.staging_folder(url, flag=flag)
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
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    for epoch in (1, 2):
        assert mirror.push_checkpoint(save(staging, 0, *net, epoch=epoch))
    assert s3_mirror.Mirror(url, str(tmp_path / "two"), OPTIONS).pull() == "epoch-0002"
    assert "metrics.csv" in stored(client, bucket) and not [k for k in stored(client, bucket) if "ppp" in k]
    assert caplog.text.count(f"pictures/{long_name} of {staging} is not uploaded to {url}: its name has a part") == 1


@contextlib.contextmanager
def another_process(script: str, *args: str):
    """``script`` run by another Python process of this machine (the test server in its environment, as in this
    one's), from when it prints its first line; it goes on with each line written to it, and ends with this
    block."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=job_env(),
        start_new_session=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n", "the other process did not start (see its stderr)"
        yield proc
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        kill_group(proc)


# A training of the run in argv[1] staged in argv[2], still running: what its check() does first (TensorFlow,
# which the rest of it loads, takes seconds to start).
TRAINS = """
import sys
from hvd_train.training import staging_folders
staging_folders.hold(sys.argv[2], sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_second_training_of_one_output_on_one_machine_stops_before_it_touches_the_first_ones_staging_folder(
    moto_prefix, tmp_path
):
    # A requeued job whose earlier one still runs, or the same command launched twice: a resume makes the
    # staging folder a copy of the prefix, and would replace or remove what the first has not uploaded yet.
    # S3 cannot tell: the first has written nothing since. The second stops, naming the folder.
    url, _, _ = moto_prefix
    staging = tmp_path / "one"
    with another_process(TRAINS, url, str(staging)):
        (staging / "metrics.csv").write_text("epoch\n1\n")  # the running one's, not uploaded yet
        for step in ("check", "pull"):
            again = s3_mirror.Mirror(url, str(staging), OPTIONS)
            refused = f"^the staging folder {re.escape(str(staging))} of --output {re.escape(url.rstrip('/'))} is used"
            with pytest.raises(UserError, match=refused) as e:
                getattr(again, step)()
            assert "let that one end (or stop it), then rerun this command" in str(e.value)
        assert (staging / "metrics.csv").read_text() == "epoch\n1\n"
    s3_mirror.Mirror(url, str(staging), OPTIONS).check()  # it ended: nothing of it stays held


# A command that reads the run in argv[1] (an evaluate), its evaluation.json written but not uploaded yet; it
# uploads it once told to go on.
EVALUATES = """
import os, sys
from hvd_train.data.storage import S3Options
from hvd_train.training import s3_mirror
folder, mirror = s3_mirror.open_run(sys.argv[1], S3Options(max_attempts=2))
with open(os.path.join(folder, "evaluation.json"), "w") as f:
    f.write('{"accuracy": 0.5}')
print("ready", flush=True)
sys.stdin.readline()
mirror.push_outputs()
"""


def test_commands_that_read_one_run_at_once_on_one_machine_lose_none_of_each_others_files(
    moto_prefix, net, tmp_path, monkeypatch
):
    # Each copies the run where no other process of the machine works: in one folder, a report's copy of the
    # run would remove the evaluation.json of an evaluate that has not uploaded it yet (it is not the run's).
    url, bucket, client = moto_prefix
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    finished_run(tmp_path / "one", url, *net)
    with another_process(EVALUATES, url):
        run_dir, mirror = s3_mirror.open_run(url, OPTIONS)  # a report, meanwhile
        (Path(run_dir) / "report.html").write_text("<html></html>")
        mirror.push_outputs()
        assert s3_mirror.open_run(url, OPTIONS)[0] == run_dir  # this process's copy, as long as it runs
    assert {"evaluation.json", "report.html"} <= set(stored(client, bucket))
    assert run_dir == s3_mirror.staging_folder(url, kind="read+1")


def test_a_staging_folder_of_the_run_under_another_id_keeps_what_an_outage_kept_back(prefix, net, tmp_path):
    # The record deleted (as the error of a record no run writes advises), the run's next start draws a new id,
    # and the staging folder's copy names the one before. A checkpoint of it that the prefix holds byte for byte
    # says it is the run's all the same: the newer one that an outage kept back goes up.
    url, bucket, client = prefix
    model, optimizer = net
    staging = tmp_path / "one"
    mirror = s3_mirror.Mirror(url, str(staging), OPTIONS)
    mirror.check()
    kept_back = two_up_and_one_kept_back(mirror, staging, model, optimizer)
    client.delete_object(Bucket=bucket, Key=f"runs/a/{RECORD}")
    again = s3_mirror.Mirror(url, str(staging), OPTIONS)
    again.check()
    assert again.pull() == kept_back
    assert f"checkpoints/{kept_back}/{checkpoints.STATE_FILE}" in stored(client, bucket)


def test_a_run_staged_before_the_store_was_in_the_staging_folders_name_keeps_what_an_outage_kept_back(
    moto_prefix, net, tmp_path, monkeypatch, s3_server
):
    # An hvd_train before staged a run with --s3-endpoint in runs/BUCKET/PREFIX, as one without; the same
    # command now stages it in runs/HOST:PORT/BUCKET/PREFIX. The checkpoint an outage kept back in the folder
    # before, and the outputs beside it, are the run's: they move to the new one and go up. A folder there of
    # another run (another store's bucket of the same name) stays as it is.
    url, bucket, client = moto_prefix
    model, optimizer = net
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    at_endpoint = dataclasses.replace(OPTIONS, endpoint=s3_server.url)
    beside = url.replace("/runs/a/", "/runs/b/")
    before, other = Path(s3_mirror.staging_folder(url)), Path(s3_mirror.staging_folder(beside))
    mirror = s3_mirror.Mirror(url, str(before), at_endpoint)
    mirror.check()
    kept_back = two_up_and_one_kept_back(mirror, before, model, optimizer)
    (before / "metrics.csv").write_text("epoch\n1\n2\n3\n")
    save(other, 0, model, optimizer, epoch=4)
    for output in (url, beside):
        values = {"data": {"train": str(tmp_path / "images"), "s3_endpoint": s3_server.url}, "run": {"output": output}}
        cfg = s3_mirror.stage(config.build(values))
        stages.prepare_output(cfg, Context())
    assert os.path.basename(s3_mirror.latest_checkpoint(s3_mirror.staging_folder(url, s3_server.url)).path) == kept_back
    keys = stored(client, bucket)
    assert f"checkpoints/{kept_back}/{checkpoints.STATE_FILE}" in keys
    assert client.get_object(Bucket=bucket, Key="runs/a/metrics.csv")["Body"].read() == b"epoch\n1\n2\n3\n"
    assert not (before / "checkpoints" / kept_back).exists()
    assert (other / "checkpoints" / "epoch-0004").is_dir()
