"""Keras 3 against Keras 2 (tf-keras): the same trainer, side by side, in alternating runs.

Each round runs, for HVD_TRAIN_KERAS=2 then 3 (the order flips every round, so a machine that slows
down or speeds up weighs on both alike):

* ``hvd-train bench --mode synthetic`` (MobileNetV2, 64 px, batch 32, one process): the training
  step alone, images/s (median of the timed iterations);
* ``hvd-train demo`` (2 ranks under horovodrun, its own options): the whole run, its summary's
  images/s and held-out accuracy, and the wall time of the command.

    python benchmarks/kerases.py [--rounds 2] [--no-demo] [--out DIR]

Prints a Markdown table and the ratios Keras 3 / Keras 2; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BIN = os.path.dirname(sys.executable)


def bench(keras: str, out: str) -> float:
    report = os.path.join(out, f"bench-{keras}.json")
    command = [os.path.join(BIN, "hvd-train"), "bench", "--mode", "synthetic", "--model", "MobileNetV2"]
    command += ["--image-size", "64", "--batch-size", "32", "--classes", "5", "--json", report]
    subprocess.run(command, check=True, capture_output=True, text=True, env=dict(os.environ, HVD_TRAIN_KERAS=keras))
    with open(report) as f:
        return float(next(iter(json.load(f)["results"].values()))["total"])


def demo(keras: str, out: str) -> dict:
    run = os.path.join(out, f"demo-{keras}")
    command = [os.path.join(BIN, "hvd-train"), "demo", "--data", os.path.join(out, "data"), "--output", run]
    env = dict(os.environ, HVD_TRAIN_KERAS=keras, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    started = time.perf_counter()
    subprocess.run([*command, "--", "--no-resume"], check=True, capture_output=True, text=True, env=env)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    return {
        "images_per_sec": summary["images_per_sec"],
        "accuracy": summary["val_accuracy"],
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-demo", action="store_true", help="the synthetic bench alone")
    parser.add_argument("--out", default=None, help="work folder (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="hvd-kerases-")
    os.makedirs(out, exist_ok=True)
    seen: dict[str, dict[str, list]] = {k: {"bench": [], "demo": []} for k in ("2", "3")}
    for round_ in range(args.rounds):
        order = ("2", "3") if round_ % 2 == 0 else ("3", "2")
        for keras in order:
            seen[keras]["bench"].append(bench(keras, out))
            print(f"round {round_ + 1} Keras {keras}: bench {seen[keras]['bench'][-1]:.1f} images/s", flush=True)
        if not args.no_demo:
            for keras in order:
                seen[keras]["demo"].append(demo(keras, out))
                print(f"round {round_ + 1} Keras {keras}: demo {seen[keras]['demo'][-1]}", flush=True)
    print()
    print("| Keras | bench synthetic, images/s | median | demo images/s | median | demo wall s | held-out |")
    print("|---|---|---|---|---|---|---|")
    medians = {}

    def shown(values, form):
        return ", ".join(format(v, form) for v in values) or "-"

    for keras in ("2", "3"):
        b, d = seen[keras]["bench"], seen[keras]["demo"]
        rates = [x["images_per_sec"] for x in d]
        medians[keras] = (statistics.median(b), statistics.median(rates) if rates else None)
        demo_median = format(medians[keras][1], ".1f") if rates else "-"
        walls, accuracies = shown([x["seconds"] for x in d], ".0f"), shown([x["accuracy"] for x in d], ".3f")
        print(
            f"| {keras} | {shown(b, '.1f')} | {medians[keras][0]:.1f} | {shown(rates, '.1f')} | {demo_median} | "
            f"{walls} | {accuracies} |"
        )
    print()
    print(f"Keras 3 / Keras 2, bench: {medians['3'][0] / medians['2'][0]:.3f}")
    if medians["2"][1]:
        print(f"Keras 3 / Keras 2, demo: {medians['3'][1] / medians['2'][1]:.3f}")


if __name__ == "__main__":
    main()
