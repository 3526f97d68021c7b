"""Elastic training with real horovodrun processes, killed for real (CPU).

As Horovod's own tests do it on one machine: two names for this host
(``localhost`` and ``127.0.0.1``) play two hosts, the discovery script
(launch/discover-hosts.sh) reads a hostfile the test rewrites, and every
worker records its pid and the images of each step (``--sample-log``).
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from hvd_train.distributed.start import ELASTIC_GLOO_TIMEOUT
from hvd_train.model.schedules import WarmupSchedule

from conftest import BIN, HVD_TRAIN, TINY, kill_group, output_of, read_json, run, start

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parent.parent
TRAIN_IMAGES = 90  # demo_small: 23 x 5 images, 20% held out


def launch(
    hostfile, samples, out, np_, min_np, max_np, *extra, epochs=6, timeout=30, cooldown=None, seen=None, program=None
):
    """Starts the elastic job; ``seen``: a file made once horovodrun has run the discovery script; ``program``: what
    each worker runs (hvd-train)."""
    discover = f"bash {REPO / 'launch/discover-hosts.sh'} {hostfile}" + (f" && touch {seen}" if seen else "")
    command = [
        "bash",
        REPO / "launch/horovodrun.sh",
        "--np",
        str(np_),
        "--min-np",
        str(min_np),
        "--max-np",
        str(max_np),
        "--host-discovery-script",
        discover,
        "--elastic-timeout",
        str(timeout),
        "--network-interface",
        "lo",
        *(["--blacklist-cooldown-range", *map(str, cooldown)] if cooldown else []),
        "--",
        "train",
        "--elastic",
        "--commit-every",
        "2",
        *TINY,
        "--epochs",
        str(epochs),
        "--val-split",
        "0.2",
        "--output",
        out,
        "--sample-log",
        samples,
        *extra,
    ]
    # launch/horovodrun.sh runs the horovodrun it finds on PATH, as a user's shell would.
    return start(command, HVD_TRAIN=str(program or BIN / "hvd-train"), PATH=f"{BIN}:{os.environ['PATH']}")


def records(samples):
    """Every step of every process, with its launch rank and pid (commit and rollback lines left out)."""
    out = []
    for path in Path(samples).glob("rank-*.jsonl"):
        _, launch_rank, pid = path.stem.split("-")
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "event" not in record:
                out.append({**record, "launch_rank": int(launch_rank), "pid": int(pid)})
    return out


def committed(samples):
    """The steps that were kept: each process's steps followed by a commit before any rollback.

    Steps after a process's last commit (a lost worker's last ones) and steps a
    rollback undid were trained on and then thrown away with their gradients.
    """
    kept = []
    for path in Path(samples).glob("rank-*.jsonl"):
        pending = []
        for line in path.read_text().splitlines():
            record = json.loads(line)
            event = record.get("event")
            if event == "commit":
                kept += pending
                pending = []
            elif event == "rollback":
                pending = []
            else:
                pending.append(record)
    return kept


def write_hosts(hostfile, text):
    """Replaces the hostfile at once: the discovery script never reads half of it."""
    tmp = hostfile.with_name(hostfile.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, hostfile)


def wait_until(proc, condition, what, timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}\n{finish(proc)}"
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def finish(proc, timeout=400):
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the job did not end within {timeout} s\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def pids(samples):
    return [int(path.stem.split("-")[2]) for path in Path(samples).glob("rank-*.jsonl")]


def host_of(pid):
    """The host name horovodrun started a worker for.

    Horovod ranks the hosts in the order it first saw them; the hosts that one discovery adds are
    ordered among themselves as a Python set iterates (not as the discovery script lists them).
    """
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"HOROVOD_HOSTNAME="))


def rank_of(pid):
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(e.split(b"=", 1)[1] for e in environ if e.startswith(b"HOROVOD_RANK=")))


def check_every_epoch_complete(out, samples, epochs, train=TRAIN_IMAGES, held_out=25):
    """metrics.csv has every epoch; every image was trained on in every epoch (in a step that was kept);
    held-out images counted once."""
    summary = read_json(out / "summary.json")
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    assert [r.split(",")[0] for r in rows] == [str(e) for e in range(1, epochs + 1)]
    steps = committed(samples)
    for epoch in range(epochs):
        seen = {i for r in steps if r["epoch"] == epoch for i in r["ids"]}
        assert seen == set(range(train)), f"epoch {epoch + 1} skipped {train - len(seen)} image(s)"
    assert summary["val_images"] == held_out
    return summary


def test_losing_rank_0_rolls_back_and_the_survivors_go_on_with_every_output_on_the_new_rank_0(demo_small, tmp_path):
    # One job for both: the lost worker is rank 0, alone on 127.0.0.1 (the host with one slot), so
    # two survivors go on, and the one started as rank 1 finishes as rank 0 and writes the outputs.
    hostfile, samples, out, seen = tmp_path / "hosts", tmp_path / "samples", tmp_path / "run", tmp_path / "seen"
    # Horovod ranks the hosts in the order it first saw them (host_of): 127.0.0.1 alone first, then
    # localhost:2 once horovodrun has run the discovery script.
    write_hosts(hostfile, "127.0.0.1:1\n")
    options = ["--data", demo_small, "--elastic-batch", "keep-global-batch"]
    proc = launch(hostfile, samples, out, 3, 2, 3, *options, epochs=4, seen=seen)
    wait_until(proc, seen.exists, "discovery of the hosts")
    write_hosts(hostfile, "127.0.0.1:1\nlocalhost:2\n")
    # Kill rank 0 (the worker on 127.0.0.1) in the middle of epoch 3.
    wait_until(proc, lambda: any(r["epoch"] == 2 and r["step"] >= 2 for r in records(samples)), "epoch 3")
    started = {rank_of(pid): pid for pid in pids(samples)}
    assert sorted(started) == [0, 1, 2] and host_of(started[0]) == "127.0.0.1", {p: host_of(p) for p in pids(samples)}
    victim, other = started[0], started[1]
    prefix = "[1]<stderr>:"  # horovodrun names a worker's lines by the rank it started with
    subprocess.run(["kill", "-KILL", str(victim)], check=True)
    killed_at = time.time()
    proc = finish(proc)
    assert proc.returncode == 0, output_of(proc)
    summary = check_every_epoch_complete(out, samples, 4)
    assert summary["world_size"] == 2 and summary["weights_identical_across_ranks"] is True
    [reset] = summary["elastic_resets"]
    assert (reset["from"], reset["to"]) == (3, 2) and reset["lost_steps"] <= 2
    # Noticed after the kill (by the survivor that talked to the lost worker at once, by the other
    # after Gloo's timeout, 5 s in elastic jobs). How long a reset takes is measured by
    # benchmarks/preemption.py, not here: finish()'s timeout is what catches a reset that hangs.
    assert reset["since"] >= killed_at - 1 and reset["seconds"] > 0
    assert "elastic: training again on 2 worker(s)" in proc.stderr
    # keep-global-batch: 3 x 8 before, 2 x 12 after, and the learning rate follows the images seen without a jump.
    assert (summary["global_batch"], summary["batch_size"]) == (24, 12)
    schedule = WarmupSchedule(0.01, 0.03, warmup_epochs=2, total_epochs=4, decay="cosine")
    for row in (out / "metrics.csv").read_text().splitlines()[1:]:
        epoch, lr = int(row.split(",")[0]), float(row.split(",")[6])
        ends = schedule(epoch - 24 / TRAIN_IMAGES), schedule(epoch)  # the rate of the epoch's last step
        assert min(ends) - 1e-6 <= lr <= max(ends) + 1e-6, (epoch, lr, ends)
    # After the loss, the rest of epoch 3 was dealt to the two survivors.
    after = [r for r in records(samples) if r["epoch"] == 2 and r["size"] == 2]
    assert {r["rank"] for r in after} == {0, 1}
    # The process started as rank 1 finished as rank 0 and wrote every output.
    assert (out / "model.keras").is_file() and (out / "checkpoints" / "epoch-0004").is_dir()
    assert re.search(re.escape(prefix) + r".*held-out accuracy", proc.stderr), output_of(proc)
    moved = [r for r in records(samples) if r["pid"] == other and r["size"] == 2]
    assert moved and all(r["rank"] == 0 for r in moved)


@pytest.mark.both_kerases
def test_a_worker_added_mid_run_gets_the_state_and_joins(demo_small, tmp_path):
    hostfile, samples, out = tmp_path / "hosts", tmp_path / "samples", tmp_path / "run"
    write_hosts(hostfile, "localhost:1\n")
    # The added worker starts late, as one on a new node does (TensorFlow's import from a slow disk, a busy host):
    # longer than the Gloo timeout of an elastic job's collectives. The first worker, reset at its next commit,
    # waits for it at the rendezvous.
    late = tmp_path / "late-worker"
    delay = f'[ "$HOROVOD_HOSTNAME" = 127.0.0.1 ] && sleep {2 * ELASTIC_GLOO_TIMEOUT}'
    late.write_text(f'#!/bin/sh\n{delay}\nexec {BIN / "hvd-train"} "$@"\n')
    late.chmod(0o755)
    # One worker: 12 steps an epoch. The new worker joins at the next commit after discovery sees
    # it (the first worker waits there while it starts), in epoch 2 or after: 6 epochs, as 3 could
    # end (in 2 s) before discovery's next look.
    # With the recipe options whose state is more than the weights: the joining worker must get the
    # averaged weights (--ema) and the best epoch (--early-stop) too, and mix and augment as the others do.
    recipe = ["--ema", "0.9", "--mixup", "0.2", "--cutmix", "1.0", "--early-stop", "9", "--augment", "randaugment"]
    proc = launch(hostfile, samples, out, 1, 1, 2, "--data", demo_small, *recipe, epochs=6, program=late)
    wait_until(proc, lambda: len(records(samples)) >= 15, "step 15")
    write_hosts(hostfile, "localhost:1\n127.0.0.1:1\n")
    proc = finish(proc)
    assert proc.returncode == 0, output_of(proc)
    summary = check_every_epoch_complete(out, samples, 6)
    assert summary["world_sizes"][0] == 1 and summary["world_size"] == 2
    # The new worker started from the state it received: both ranks end with the same weights.
    assert summary["weights_identical_across_ranks"] is True
    first = {r["pid"] for r in records(samples) if r["epoch"] == 0}
    joined = [r for r in records(samples) if r["pid"] not in first]
    assert len(first) == 1 and joined, "one worker started, another joined"
    assert min(r["epoch"] for r in joined) >= 1, "the new worker joined mid-run, not from the start"
    assert summary["early_stop"]["saved_epoch"] == summary["early_stop"]["best_epoch"], summary["early_stop"]


def test_fewer_workers_than_min_np_fails_clearly_within_the_elastic_timeout(demo_small, tmp_path):
    hostfile, samples, out = tmp_path / "hosts", tmp_path / "samples", tmp_path / "run"
    write_hosts(hostfile, "localhost:1\n127.0.0.1:1\n")
    # A short elastic timeout: the wait for a second worker that never comes is what this job ends by.
    proc = launch(hostfile, samples, out, 2, 2, 2, "--data", demo_small, epochs=30, timeout=3)
    wait_until(proc, lambda: len(records(samples)) >= 8, "step 8")
    subprocess.run(["kill", "-KILL", str(pids(samples)[0])], check=True)
    proc = finish(proc, timeout=120)  # a job that waited for ever would fail here
    assert proc.returncode != 0
    both = proc.stdout + proc.stderr
    assert "elastic: the workers changed; waiting for the new set (at least --min-np" in both, output_of(proc)
    assert "Timed out waiting for" in both and "at least 2 Horovod processes" in both, output_of(proc)
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert left == [], "no process of the job is left"


@pytest.mark.both_kerases
def test_a_sharded_head_loses_a_worker_takes_another_gives_one_back_and_its_groups_follow_the_world(
    demo_small, tmp_path
):
    """--head-parallel 2 on four workers: two groups of 2, so Horovod holds process sets of its own (each
    group's, each shard's peers). Rank 0 is killed: the survivors finalize those sets alone (our Horovod patch:
    unpatched, each of them aborted), the head is re-split from the commit over the three left (2 does not divide
    3: one group of 3, shards no larger), a fourth worker joins (groups of 2 again), and a slot taken out of the
    hosts gives one back (groups of 3: Horovod skips the sync after a removal, which a sharded head needs). The
    held-out images are the training images, so ``evaluate`` of the saved model, one process holding the whole
    head, scores what the sharded head scored."""
    hostfile, samples, out, seen = tmp_path / "hosts", tmp_path / "samples", tmp_path / "run", tmp_path / "seen"
    write_hosts(hostfile, "127.0.0.1:1\n")
    options = ["--data", demo_small, "--val-data", demo_small, "--head-parallel", "2", "--val-split", "0"]
    proc = launch(hostfile, samples, out, 4, 3, 4, *options, epochs=10, seen=seen)
    wait_until(proc, seen.exists, "discovery of the hosts")
    write_hosts(hostfile, "127.0.0.1:1\nlocalhost:3\n")
    wait_until(proc, lambda: any(r["epoch"] == 1 and r["step"] >= 1 for r in records(samples)), "epoch 2")
    started = {rank_of(pid): pid for pid in pids(samples)}
    assert sorted(started) == [0, 1, 2, 3] and host_of(started[0]) == "127.0.0.1"
    subprocess.run(["kill", "-KILL", str(started[0])], check=True)
    wait_until(proc, lambda: any(r["size"] == 3 for r in records(samples)), "training on 3 workers")
    write_hosts(hostfile, "127.0.0.1:1\nlocalhost:4\n")  # 127.0.0.1 is out (its worker was lost): one more here
    wait_until(proc, lambda: any(r["pid"] not in started.values() for r in records(samples)), "a new worker")
    write_hosts(hostfile, "127.0.0.1:1\nlocalhost:3\n")
    proc = finish(proc)
    assert proc.returncode == 0, output_of(proc)
    summary = check_every_epoch_complete(out, samples, 10, train=115, held_out=115)
    lost, added, removed = summary["elastic_resets"]
    assert (lost["from"], lost["to"], lost["head_parallel"]) == (4, 3, 3), lost
    assert (added["to"], added["head_parallel"]) == (4, 2), added
    assert (removed["to"], removed["head_parallel"]) == (3, 3), removed
    assert lost["since"] < added["since"] < removed["since"]  # each change timed from its own start
    assert "--head-parallel 2 does not fit 3 worker(s) and 5 classes: the head is sharded over groups of 3" in (
        proc.stderr
    ), output_of(proc)
    assert summary["world_size"] == 3 and summary["weights_identical_across_ranks"] is True
    assert [r["size"] for r in records(samples) if r["epoch"] == 9][-1] == 3
    report = tmp_path / "evaluation.json"
    proc = run([*HVD_TRAIN, "evaluate", "--model-dir", out, "--data", demo_small, "--report", report])
    assert proc.returncode == 0, output_of(proc)
    scored = read_json(report)
    assert scored["images"] == 115 and scored["accuracy"] == pytest.approx(summary["val_accuracy"], abs=1e-9)
    assert scored["loss"] == pytest.approx(summary["val_loss"], rel=1e-4)
