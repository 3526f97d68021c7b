"""What of an S3 prefix is a run's (``training.run_record``): its record trusted only as a run writes it, one
writer at a time, and runs that never nest; in one process against each real test S3 server (moto, rclone)."""

import dataclasses
import json
import os
import re

import pytest

from hvd_train.errors import UserError
from hvd_train.training import checkpoints, s3_mirror
from hvd_train.training.run_record import RECORD, OtherWriter

from s3_runs import OPTIONS, finished_run, new_run, prefix_checkpoints, save, stored
from s3proxy import CuttingProxy


def test_a_record_that_lists_what_no_run_writes_is_refused_whole(prefix, net, tmp_path):
    # finish() deletes from the prefix the files of the record that the staging folder no longer has: a
    # record listing the newest checkpoint's manifest among its files would cost the run that checkpoint.
    url, bucket, client = prefix
    finished_run(tmp_path / "one", url, *net)
    [name] = prefix_checkpoints(client, bucket)
    before = stored(client, bucket)
    record = json.loads(client.get_object(Bucket=bucket, Key=f"runs/a/{RECORD}")["Body"].read())
    for field, listed in (
        ("files", f"checkpoints/{name}/{checkpoints.STATE_FILE}"),
        ("files", "tensorboard/.events.tmp-1"),
        ("files", ".hvd_train-run.json"),
        ("checkpoints", "notes"),
        ("checkpoints", "epoch-0001/x"),
    ):
        planted = {**record, field: [*record[field], listed]}
        client.put_object(Bucket=bucket, Key=f"runs/a/{RECORD}", Body=json.dumps(planted).encode())
        refused = f"^{re.escape(url + RECORD)} is not the record .*{re.escape(repr(listed))}"
        with pytest.raises(UserError, match=refused):
            s3_mirror.Mirror(url, str(tmp_path / "one"), OPTIONS).check()
    # A field of another type: "files": "metrics" would be read as the names m, e, t, r, i, c and s.
    for field, value in (("files", "metrics"), ("files", [1]), ("checkpoints", {"epoch-0001": 1}), ("run", 5)):
        client.put_object(Bucket=bucket, Key=f"runs/a/{RECORD}", Body=json.dumps({**record, field: value}).encode())
        what = "its run id is no string" if field == "run" else f"its {field!r} is no list of names"
        with pytest.raises(UserError, match=f"^{re.escape(url + RECORD)} is not the record .*\\({what}\\)"):
            s3_mirror.Mirror(url, str(tmp_path / "one"), OPTIONS).check()
    assert stored(client, bucket).keys() == before.keys()


def test_a_second_writer_of_a_run_stops_the_first_before_it_uploads_or_deletes_anything(
    prefix, net, tmp_path, any_s3_server
):
    # Machine B resumes the run while A still writes it (a requeued job whose earlier one lives, a double
    # launch). B's start writes B into the record, so that A finds it changed even where B adds nothing to it:
    # A stops before it uploads (its files would mix with B's checkpoint of the same name) or prunes (with
    # --keep-checkpoints 1, the checkpoint B resumed from). B goes on.
    url, bucket, client = prefix
    model, optimizer = net
    one, two = tmp_path / "one", tmp_path / "two"
    first = new_run(url, one)
    assert first.push_checkpoint(save(one, 0, model, optimizer, keep=1, epoch=1))
    second = s3_mirror.Mirror(url, str(two), OPTIONS)
    second.check()
    assert second.pull() == "epoch-0001"
    before = stored(client, bucket)
    with pytest.raises(OtherWriter, match=f"^another process \\(.* pid {os.getpid()} from .*\\) wrote ") as e:
        first.push_checkpoint(save(one, 0, model, optimizer, keep=1, epoch=2))
    assert f"{url}{RECORD} since this one read it: that process writes the run in {url} now" in str(e.value)
    assert "and goes on" in str(e.value) and "\n" not in str(e.value)
    assert "let that one finish (or stop it), then rerun this command to resume the run" in str(e.value)
    assert stored(client, bucket) == before
    assert second.push_checkpoint(save(two, 0, model, optimizer, keep=1, epoch=2))
    assert prefix_checkpoints(client, bucket) == {"epoch-0002"}
    # A record write of A's that B's start overtook, where the store makes conditional writes (moto; rclone's
    # serve s3 ignores the condition, and the read-back before each write and upload is the check there).
    url = url.replace("/runs/a/", "/runs/b/")
    late, early = (
        s3_mirror.Mirror(url, str(tmp_path / "late"), OPTIONS),
        s3_mirror.Mirror(url, str(tmp_path / "e"), OPTIONS),
    )
    assert late.record.checkpoints == set()  # its listing found nothing
    read = late._ours()  # nor its read-back: the two start at once
    early.check()
    if any_s3_server.kind == "moto":
        with pytest.raises(OtherWriter, match=f"^another process \\(.*\\) wrote {re.escape(url + RECORD)}"):
            late._put_if(late.record.to_bytes(), read)
    with pytest.raises(OtherWriter, match=f"^another process \\(.*\\) wrote {re.escape(url + RECORD)}"):
        late._put_record(force=True)  # what its check() does


def test_a_writer_that_loses_the_run_midway_through_a_checkpoint_never_completes_it(prefix, net, tmp_path):
    # B takes the run up while A uploads its epoch-0002, which A's record lists already: B's own epoch-0002
    # changes nothing in the record. Were A to upload its manifest all the same, A's and B's files of one
    # checkpoint would mix in the prefix.
    url, bucket, client = prefix
    model, optimizer = net
    one, two = tmp_path / "one", tmp_path / "two"
    first, second = s3_mirror.Mirror(url, str(one), OPTIONS), s3_mirror.Mirror(url, str(two), OPTIONS)
    first.check()
    assert first.push_checkpoint(save(one, 0, model, optimizer, epoch=1))
    upload, taken = first._upload, []

    def and_meanwhile_b_starts(path, rel):
        if rel.startswith("checkpoints/epoch-0002/") and not taken:
            second.check()
            taken.append(second.pull())
        upload(path, rel)

    first._upload = and_meanwhile_b_starts
    with pytest.raises(OtherWriter):
        first.push_checkpoint(save(one, 0, model, optimizer, epoch=2))
    assert taken == ["epoch-0001"]
    assert f"checkpoints/epoch-0002/{checkpoints.STATE_FILE}" not in stored(client, bucket)
    assert second.push_checkpoint(save(two, 0, model, optimizer, epoch=2))
    third = tmp_path / "three"
    assert s3_mirror.Mirror(url, str(third), OPTIONS).pull() == "epoch-0002"
    for part in os.listdir(two / "checkpoints" / "epoch-0002"):
        assert (third / "checkpoints" / "epoch-0002" / part).read_bytes() == (
            two / "checkpoints/epoch-0002" / part
        ).read_bytes()


def test_runs_in_s3_do_not_nest(prefix, net, tmp_path, monkeypatch):
    # A run in s3://b/r/ and one in s3://b/r/sub/: their staging folders nest too, and the outer run's sync
    # would remove or replace the inner one's files, or upload them as its own.
    url, bucket, client = prefix
    model, optimizer = net
    monkeypatch.setenv("HVD_TRAIN_CACHE", str(tmp_path / "cache"))
    finished_run(tmp_path / "outer", url, model, optimizer)
    inner_url, moved = f"{url}sub/", f"s3://{bucket}/runs/a-sub/"
    how = f"move it out (aws s3 mv --recursive {inner_url} {moved}) and resume it with --output {moved}."
    with pytest.raises(
        UserError, match=f"^--output {re.escape(inner_url)} is inside the run in {re.escape(url)} "
    ) as e:
        s3_mirror.Mirror(inner_url, str(tmp_path / "outer" / "sub"), OPTIONS).check()
    assert str(e.value).endswith(f"to resume this run (an earlier hvd_train let it start there), {how}")
    assert not [key for key in stored(client, bucket) if key.startswith("sub/")]
    # An inner run an earlier hvd_train let start: the outer one is refused in turn ...
    inner = s3_mirror.Mirror(inner_url, str(tmp_path / "outer" / "sub"), OPTIONS)
    (tmp_path / "outer" / "sub").mkdir(exist_ok=True)  # its check() made it
    (tmp_path / "outer" / "sub" / "metrics.csv").write_text("epoch\n1\n")
    assert inner.push_checkpoint(save(tmp_path / "outer" / "sub", 0, model, optimizer, epoch=1))
    with pytest.raises(
        UserError, match=f"^--output {re.escape(url)} holds another run, in {re.escape(inner_url)} "
    ) as e:
        s3_mirror.Mirror(url, str(tmp_path / "outer"), OPTIONS).check()
    assert str(e.value).endswith(
        f"to resume both (an earlier hvd_train let them nest), {how.replace('it out', 'the inner one out')}"
    )
    # ... and where it resumes all the same (a check of an earlier hvd_train), it neither takes the inner
    # run's files for its own nor touches its staging folder: the inner metrics.csv that an outage kept back.
    (tmp_path / "outer" / "sub" / "metrics.csv").write_text("epoch\n1\n2\n")
    outer = s3_mirror.Mirror(url, str(tmp_path / "outer"), OPTIONS)
    assert outer.pull() is not None
    assert (tmp_path / "outer" / "sub" / "metrics.csv").read_text() == "epoch\n1\n2\n"
    assert outer.push_checkpoint(save(tmp_path / "outer", 0, model, optimizer, epoch=2))
    assert not [rel for rel in outer.record.files if rel.startswith("sub/")]
    # The commands that read a run copy it into a staging folder of their own, and read neither the inner
    # run's files nor a training's staging folder (whose outputs may not have gone up).
    staged = s3_mirror.staging_folder(url)
    os.makedirs(staged)
    with open(os.path.join(staged, "metrics.csv"), "w") as f:
        f.write("epoch\n1\n2\n3\n")  # a training of the prefix on this machine, in an outage
    run_dir, _ = s3_mirror.open_run(url, OPTIONS)
    assert open(os.path.join(staged, "metrics.csv")).read() == "epoch\n1\n2\n3\n"
    assert run_dir != staged
    assert os.path.isfile(os.path.join(run_dir, "summary.json")) and not os.path.exists(os.path.join(run_dir, "sub"))
    # Moved out as the errors say (aws s3 mv: a copy and a delete of each key), both resume.
    for key in [k for k in stored(client, bucket) if k.startswith("sub/")]:
        client.copy_object(
            Bucket=bucket, Key=f"runs/a-sub/{key[4:]}", CopySource={"Bucket": bucket, "Key": f"runs/a/{key}"}
        )
        client.delete_object(Bucket=bucket, Key=f"runs/a/{key}")
    s3_mirror.Mirror(url, str(tmp_path / "outer"), OPTIONS).check()
    inner = s3_mirror.Mirror(moved, str(tmp_path / "moved"), OPTIONS)
    inner.check()
    assert inner.pull() == "epoch-0001"


def test_a_store_without_conditional_writes_keeps_the_check_that_reads_the_record_back(
    prefix, net, tmp_path, any_s3_server
):
    # A store that refuses a PUT with If-Match or If-None-Match (501 NotImplemented) takes the record plainly; a
    # second writer is caught all the same, by the record read back before every write and upload.
    url, bucket, client = prefix
    model, optimizer = net
    proxy = CuttingProxy(any_s3_server.url)
    proxy.refuse_conditions = True
    options = dataclasses.replace(OPTIONS, endpoint=proxy.url)
    try:
        first = s3_mirror.Mirror(url, str(tmp_path / "one"), options)
        first.check()
        assert first.push_checkpoint(save(tmp_path / "one", 0, model, optimizer, epoch=1))
        s3_mirror.Mirror(url, str(tmp_path / "two"), options).check()
        with pytest.raises(OtherWriter):
            first.push_checkpoint(save(tmp_path / "one", 0, model, optimizer, epoch=2))
    finally:
        proxy.stop()
    assert prefix_checkpoints(client, bucket) == {"epoch-0001"}


def test_a_record_write_whose_answer_was_lost_is_known_for_this_process_own(prefix, net, tmp_path, any_s3_server):
    # The store takes the record, and the network loses its answer: botocore's retry of a conditional write then
    # finds the record changed (by this very write), and a write that never got an answer leaves the run with
    # no way to know what the prefix holds. Its next read-back finds this process's own record there, not
    # another writer's.
    url, bucket, client = prefix
    model, optimizer = net
    one, proxy = tmp_path / "one", CuttingProxy(any_s3_server.url)
    mirror = s3_mirror.Mirror(url, str(one), dataclasses.replace(OPTIONS, endpoint=proxy.url))
    try:
        mirror.check()
        proxy.lose_answers, proxy.lose_answers_of = 1, RECORD  # the retry gets an answer
        assert mirror.push_checkpoint(save(one, 0, model, optimizer, epoch=1))
        proxy.lose_answers = -1  # no write of it gets one: the checkpoint waits in the staging folder
        assert not mirror.push_checkpoint(save(one, 0, model, optimizer, epoch=2))
        assert proxy.answers_lost >= 3 and mirror.uploads.failed_checkpoints == 1
        proxy.lose_answers = 0
        assert mirror.push_checkpoint(save(one, 0, model, optimizer, epoch=3))
    finally:
        proxy.stop()
    record = json.loads(client.get_object(Bucket=bucket, Key=f"runs/a/{RECORD}")["Body"].read())
    assert "epoch-0003" in record["checkpoints"] and prefix_checkpoints(client, bucket) == {"epoch-0003"}


def test_a_writer_that_lost_the_run_deletes_nothing_from_the_prefix(prefix, net, tmp_path):
    # Deletes act on the record as this process read it, maybe minutes before: --no-resume's (read at its start,
    # acted on once training starts), a prune after an upload, the end's. Another writer that took the run up
    # meanwhile may have resumed from what they would delete.
    url, bucket, client = prefix
    model, optimizer = net
    one, two, three = tmp_path / "one", tmp_path / "two", tmp_path / "three"
    first = s3_mirror.Mirror(url, str(one), OPTIONS)
    first.check()
    assert first.push_checkpoint(save(one, 0, model, optimizer, keep=1, epoch=1))
    # --no-resume on machine A, which checked the prefix as it started, and B resumes before A's training starts.
    restart, second = s3_mirror.Mirror(url, str(one), OPTIONS), s3_mirror.Mirror(url, str(two), OPTIONS)
    restart.check()
    second.check()
    assert second.pull() == "epoch-0001"
    with pytest.raises(OtherWriter):
        restart.remove_checkpoints()
    assert prefix_checkpoints(client, bucket) == {"epoch-0001"}
    # C takes the run up from B while B uploads epoch-0002, which has no manifest yet, and resumes from
    # epoch-0001: B's prune (--keep-checkpoints 1) would delete it.
    third, taken = s3_mirror.Mirror(url, str(three), OPTIONS), []
    upload = second._upload

    def and_meanwhile_c_starts(path, rel):
        if rel == f"checkpoints/epoch-0002/{checkpoints.STATE_FILE}":
            third.check()
            taken.append(third.pull())
        upload(path, rel)

    second._upload = and_meanwhile_c_starts
    with pytest.raises(OtherWriter):
        second.push_checkpoint(save(two, 0, model, optimizer, keep=1, epoch=2))
    assert taken == ["epoch-0001"] and "epoch-0001" in prefix_checkpoints(client, bucket)
    # D takes the run up from C as C's end uploads summary.json: C's end deletes no file of the run.
    (three / "features.keras").write_bytes(b"the model, saved as a head's files first")
    assert third.push_checkpoint(save(three, 0, model, optimizer, keep=1, epoch=3))
    (three / "features.keras").unlink()  # ... and whole at the end
    (three / "model.keras").write_bytes(b"the model")
    upload = third._upload

    def and_meanwhile_d_starts(path, rel):
        upload(path, rel)
        if rel == "summary.json":
            s3_mirror.Mirror(url, str(tmp_path / "four"), OPTIONS).check()

    third._upload = and_meanwhile_d_starts
    with pytest.raises(OtherWriter):
        third.finish({})
    assert "features.keras" in stored(client, bucket)


def test_credentials_that_may_not_look_above_the_prefix_find_no_run_around_it(prefix, tmp_path, any_s3_server):
    # A train looks for a run around its prefix with a HEAD of each parent's record; a policy that ends at the
    # prefix answers 403 to those: there is no run it could write into, and the train goes on.
    url, bucket, client = prefix
    inner = f"{url}deep/run/"
    proxy = CuttingProxy(any_s3_server.url)
    proxy.deny_heads_outside = "runs/a/deep/run/"
    try:
        s3_mirror.Mirror(inner, str(tmp_path / "one"), dataclasses.replace(OPTIONS, endpoint=proxy.url)).check()
    finally:
        proxy.stop()
    assert f"deep/run/{RECORD}" in stored(client, bucket)
