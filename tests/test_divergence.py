"""A run whose loss turns non-finite (``training.divergence``): every rank stops after the same step, the last
finite checkpoint stays the resume point, and one line says what diverged and what to try."""

import hashlib

import pytest

from conftest import HVD_TRAIN, TINY, launch, output_of, read_json


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.multiprocess
def test_a_diverging_run_stops_on_every_rank_keeps_its_last_finite_checkpoint_and_says_what_to_try(
    demo_small, tmp_path
):
    out = tmp_path / "run"
    train = [*HVD_TRAIN, "train", "--data", demo_small, "--val-split", "0.2", "--output", out, *TINY]
    proc = launch("hvd-train-launch", 2, train)  # an epoch at the default rate: a finite checkpoint
    assert proc.returncode == 0, output_of(proc)
    finite = digests(out / "checkpoints" / "epoch-0001")
    summary = (out / "summary.json").read_bytes()

    # Two more epochs at a rate no model survives, keeping one checkpoint: a checkpoint of the diverged
    # weights would push the finite one out.
    diverging = [*train, "--epochs", "3", "--base-lr", "1e9", "--keep-checkpoints", "1", "--steps-per-call", "1"]
    proc = launch("hvd-train-launch", 2, diverging)
    assert proc.returncode == 3, output_of(proc)
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, output_of(proc)  # agreed: rank 0 says it, once
    said = errors[0]
    assert "training diverged:" in said and "turned non-finite in epoch 2/3" in said, said
    assert f"the last finite checkpoint, {out}/checkpoints/epoch-0001, is kept" in said, said
    assert "--base-lr 1e+09" in said and "lr-find" in said and "--no-resume" in said, said
    # Nothing of the diverged epoch was written: the checkpoint, the finished run's summary, the metrics.
    assert [p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")] == ["epoch-0001"]
    assert digests(out / "checkpoints" / "epoch-0001") == finite
    assert (out / "summary.json").read_bytes() == summary and read_json(out / "summary.json")["epochs"] == 1
    assert [row.split(",")[0] for row in (out / "metrics.csv").read_text().splitlines()[1:]] == ["1"]
