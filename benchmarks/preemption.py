"""What stopping, checkpointing and elastic recovery cost, measured with real jobs.

    python benchmarks/preemption.py [--skip-resnet] [--out DIR]

1. SIGTERM to horovodrun (2 ranks) -> the checkpoint of that step is complete:
   seconds, for the demo model (MobileNetV2, 64 px, batch 16) and ResNet50 at
   224 px (batch 16), with each model's step time and checkpoint size.
   horovodrun kills its workers 5 s after passing SIGTERM on.
2. The stop check: one 2-float allreduce per step (horovodrun -np 2, Gloo),
   against a demo step.
3. ``--checkpoint-every``: seconds per checkpoint, and per step for N = 50.
4. Elastic: a worker of three killed mid-epoch; seconds from the kill until
   the survivors train again, and the images redone.

Prints Markdown; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    TF_CPP_MIN_LOG_LEVEL="3",
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
)

STOP_CHECK = """
import statistics, time
import tensorflow as tf
from hvd_train import config
from hvd_train.distributed import gradients, start
from hvd_train.model.network import Net, use_step_seeded_dropout
from hvd_train.model.catalogue import build_model
from hvd_train.model.schedules import WarmupSchedule

ctx = start.init(threads_per_rank=1)
cfg = config.build({"data": {"train": "d", "batch_size": 16}, "model": {"weights": "none"}, "run": {"output": "o"}})
use_step_seeded_dropout()
net = Net(build_model(cfg.model, 5, 64, load_weights=False), cfg, 1, ctx.rank)
gradients.broadcast_variables(net.variables, ctx)
images = tf.random.stateless_uniform((16, 64, 64, 3), seed=(1, 2)) * 255
batch = (images, tf.zeros((16,), tf.int32), tf.zeros((16,), tf.int64))
it = iter(tf.data.Dataset.from_tensors(batch).repeat())
plain = tf.function(lambda it: net.model.train_step(next(it)[:2]))  # the same step without the flags
rates = WarmupSchedule(0.01, 0.01, 0, 1).parameters()
full = lambda it: net.run_steps(it, 1, (0, 0, 0.0), (0, 0, 16, 16, 16), rates)  # noqa: E731
for f in (plain, full):
    for _ in range(10):
        f(it)
times = {plain: [], full: []}
for _ in range(15):
    for f in (plain, full):
        for _ in range(20):
            t0 = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy(), f(it))
            times[f].append(time.perf_counter() - t0)
import numpy as np
for _ in range(50):
    ctx.allreduce_sum(np.zeros(2), name="boundary")
t0 = time.perf_counter()
for _ in range(1000):
    ctx.allreduce_sum(np.zeros(2), name="boundary")
alone = (time.perf_counter() - t0) / 1000
if ctx.is_root:
    p, w = statistics.median(times[plain]), statistics.median(times[full])
    print("STEP_MS", 1000 * p, 1000 * w, 1000 * alone, flush=True)
"""


def records(folder: Path) -> list[dict]:
    out = []
    for path in glob.glob(str(folder / "rank-*.jsonl")):
        out += [json.loads(line) for line in Path(path).read_text().splitlines()]
    return out


def train_command(data: Path, out: Path, samples: Path, model: list[str], *extra: str) -> list[str]:
    return [
        str(BIN / "hvd-train"),
        "train",
        "--data",
        str(data),
        "--output",
        str(out),
        "--no-tensorboard",
        "--val-split",
        "0",
        "--threads-per-rank",
        "1",
        "--sample-log",
        str(samples),
        *model,
        *extra,
    ]


def sigterm_to_checkpoint(data: Path, work: Path, name: str, model: list[str], warm_steps: int) -> dict:
    """Seconds from SIGTERM to horovodrun until the step's checkpoint is complete."""
    out, samples = work / f"{name}-run", work / f"{name}-samples"
    command = [str(BIN / "horovodrun"), "-np", "2", "--gloo", *train_command(data, out, samples, model)]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while len([r for r in records(samples) if r["rank"] == 0]) < warm_steps:
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read()[-3000:])
        time.sleep(0.01)
    steps = sorted(r["time"] for r in records(samples) if r["rank"] == 0)
    step_seconds = statistics.median([b - a for a, b in zip(steps, steps[1:])][-5:])
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate()[0]
    ended = time.time() - t0
    [state] = [p for p in glob.glob(str(out / "checkpoints" / "epoch-*-step-*" / "state.json"))]
    written = json.loads(Path(state).read_text())["time"]
    size = sum(f.stat().st_size for f in Path(state).parent.iterdir())
    stopped = "stopped by SIGTERM" in output
    saves = re.findall(r"INFO checkpoint \S+-step-\S+ \(([0-9.]+) s\)", output)
    return {
        "save_seconds": float(saves[-1]) if saves else float("nan"),
        "model": name,
        "step_seconds": step_seconds,
        "signal_to_checkpoint": written - t0,
        "signal_to_exit": ended,
        "checkpoint_mb": size / 1e6,
        "stopped_cleanly": stopped,
    }


def stop_check_cost() -> tuple[float, float, float]:
    """Median demo step (ms) without and with the flags (alternating blocks of steps in one job),
    and one 2-number allreduce on its own (ms), as long steps add after them."""
    out = subprocess.run(
        [str(BIN / "horovodrun"), "-np", "2", "--gloo", sys.executable, "-c", STOP_CHECK],
        env=ENV,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    plain, full, alone = out.split("STEP_MS")[1].split()[:3]
    return float(plain), float(full), float(alone)


def elastic_recovery(data: Path, work: Path) -> dict:
    """Kill one of three workers mid-epoch; seconds until training again, images redone."""
    hosts, out, samples = work / "hosts", work / "elastic-run", work / "elastic-samples"
    hosts.write_text("localhost:2\n127.0.0.1:1\n")
    discover = f"bash {Path(__file__).resolve().parent.parent / 'launch/discover-hosts.sh'} {hosts}"
    model = ["--model", "MobileNetV2", "--weights", "none", "--image-size", "64", "--batch-size", "16"]
    command = [
        str(BIN / "horovodrun"),
        "-np",
        "3",
        "--min-np",
        "2",
        "--max-np",
        "3",
        "--host-discovery-script",
        discover,
        "--network-interface",
        "lo",
        *train_command(data, out, samples, model, "--epochs", "3", "--elastic", "--commit-every", "5"),
    ]
    proc = subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not any(r["epoch"] == 1 and r["step"] >= 7 for r in records(samples)):
        if proc.poll() is not None:
            raise RuntimeError("elastic job ended early")
        time.sleep(0.02)
    victim = None
    for path in glob.glob(str(samples / "rank-*.jsonl")):
        pid = int(Path(path).stem.split("-")[2])
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        if b"HOROVOD_HOSTNAME=127.0.0.1\0" in environ:
            victim = pid
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    proc.wait()
    summary = json.loads((out / "summary.json").read_text())
    [reset] = summary["elastic_resets"]
    again = min(r["time"] for r in records(samples) if r["size"] == 2 and r["time"] > killed)
    return {
        "detected_after": reset["since"] - killed,
        "training_again_after": again - killed,
        "steps_redone": reset["lost_steps"],
        "images_redone": reset["lost_images"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-resnet", action="store_true", help="measure the demo model only")
    parser.add_argument("--out", help="work folder (default: a temporary one)")
    args = parser.parse_args()
    from hvd_train import compat  # noqa: F401
    from hvd_train.demo import make_demo_data

    work = Path(args.out or tempfile.mkdtemp(prefix="hvd-train-preempt-"))
    data = Path(make_demo_data(str(work / "data"), per_class=200, size=64))
    demo = ["--model", "MobileNetV2", "--weights", "none", "--image-size", "64", "--batch-size", "16"]
    resnet = ["--model", "ResNet50", "--weights", "none", "--image-size", "224", "--batch-size", "16"]
    rows = [sigterm_to_checkpoint(data, work, "MobileNetV2-64px-demo", [*demo, "--epochs", "20"], 40)]
    if not args.skip_resnet:
        rows.append(sigterm_to_checkpoint(data, work, "ResNet50-224px", [*resnet, "--epochs", "5"], 5))
    plain_ms, full_ms, alone_ms = stop_check_cost()
    elastic = elastic_recovery(data, work)

    print(f"\n{platform.machine()}, {os.cpu_count()} CPUs; horovodrun -np 2 (Gloo), one thread per rank\n")
    print("| model | step (s) | checkpoint (MB) | SIGTERM -> checkpoint complete (s) | SIGTERM -> job ended (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['step_seconds']:.3f} | {r['checkpoint_mb']:.0f} | {r['signal_to_checkpoint']:.2f} | "
            f"{r['signal_to_exit']:.2f}{'' if r['stopped_cleanly'] else ' (killed: no clean stop)'} |"
        )
    print(
        f"\nStop check (flags summed inside the step, MobileNetV2 64 px, batch 16, 2 ranks): median step "
        f"{plain_ms:.2f} ms without, {full_ms:.2f} ms with: {full_ms - plain_ms:+.2f} ms "
        f"({100 * (full_ms - plain_ms) / plain_ms:+.2f}%). Steps over 0.25 s also agree right after the step "
        f"with one 2-number allreduce: {alone_ms:.2f} ms (under 1% of such a step)."
    )
    for r in rows:
        save = r["save_seconds"]
        print(
            f"--checkpoint-every 50 on {r['model']}: one save {save:.2f} s, {save / 50 * 1000:.1f} ms per step "
            f"= {100 * save / 50 / r['step_seconds']:.2f}% of a step."
        )
    print(
        f"\nElastic (3 workers, one killed mid-epoch): failure noticed after {elastic['detected_after']:.1f} s, "
        f"training again after {elastic['training_again_after']:.1f} s; {elastic['steps_redone']} step(s), "
        f"{elastic['images_redone']} images redone."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
