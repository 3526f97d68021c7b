"""How good are `hvd-train plan`'s predictions? Measured here, and against published results.

    python benchmarks/planner.py [--model MobileNetV2] [--image-size 128] [--batch-size 32] [--skip-local]

Here (root, for the network namespaces), one TensorFlow thread and one core per rank:
1. one worker: `hvd-train bench --mode synthetic` pinned to one core -> step time;
2. np=2 on this host: the link measured with `plan --measure-link`, the
   prediction of `plan`, and `bench` measured with `mpirun --bind-to core`;
3. np=2 across two network namespaces whose veth link is shaped with tc
   (token bucket at 1 Gbit/s and at 100 Mbit/s): the same three steps.

Published results, from their per-GPU rates and links:
- Horovod's benchmarks (Pascal GPUs, 25 Gbit/s RoCE, batch 64, fp32): 16 GPUs
  on 4 servers, and the 512-GPU claim (90% Inception V3 and ResNet-101, 68% VGG-16);
- NVIDIA DeepLearningExamples EfficientNet-B0, TF2, DGX A100 (8 GPUs, NVLink):
  7.54x TF32 (batch 512), 5.98x AMP (batch 1024).

Prints Markdown; benchmarks/RESULTS.md keeps the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "tests"))

ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    TF_CPP_MIN_LOG_LEVEL="3",
    OMPI_ALLOW_RUN_AS_ROOT="1",
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    OMPI_MCA_rmaps_base_oversubscribe="1",
)
HVD = str(BIN / "hvd-train")


def sh(cmd: list, env: dict | None = None) -> str:
    done = subprocess.run([str(c) for c in cmd], env=env or ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout


def bench_args(args, out: Path) -> list:
    return [
        "bench",
        "--mode",
        "synthetic",
        "--model",
        args.model,
        "--image-size",
        args.image_size,
        "--batch-size",
        args.batch_size,
        "--classes",
        "1000",
        "--precision",
        "fp32",
        "--threads-per-rank",
        "1",
        "--iters",
        args.iters,
        "--json",
        out,
    ]


def plan(args, one: Path, loaded: list[Path], link: Path, hosts: int, overlap: float) -> float:
    out = one.with_name(f"plan-{link.stem}-{overlap}.json")
    sh(
        [HVD, "plan", "--model", args.model, "--batch-size", args.batch_size, "--bench", one, "--link", link]
        + ["--loaded-bench", *loaded]
        + ["--workers", "2", "--workers-per-host", str(2 // hosts), "--overlap", overlap, "--json", out]
    )
    return json.loads(out.read_text())["rows"][0]["images_per_sec"]


def measured_total(path: Path) -> float:
    return json.loads(path.read_text())["results"]["synthetic"]["total"]


def local(args, work: Path) -> list[dict]:
    rows = []
    one = work / "one.json"
    sh(["taskset", "-c", "0", HVD, *bench_args(args, one)])
    # One worker per core, at the same time, no communication: what each computes with its host full.
    loaded = [work / f"loaded-{core}.json" for core in (0, 1)]
    running = [
        subprocess.Popen(["taskset", "-c", str(core), HVD, *map(str, bench_args(args, path))], env=ENV)
        for core, path in enumerate(loaded)
    ]
    if any(p.wait() for p in running):
        raise RuntimeError("a loaded bench failed")
    mpirun = ["mpirun", "-np", "2", "--bind-to", "core", "--map-by", "core", "-x", "PATH", "-x", "TF_CPP_MIN_LOG_LEVEL"]
    link = work / "link-local.json"
    sh([*mpirun, HVD, "plan", "--measure-link", "--json", link])
    two = work / "two-local.json"
    sh([*mpirun, HVD, *bench_args(args, two)])
    rows.append(row("np=2, one host (loopback)", args, one, loaded, link, two, hosts=1))

    import netns

    try:
        with netns.two_hosts() as (ns, addr):
            agent = REPO / "tests" / "launched" / "netns-agent"
            wrapper = work / "pinned"
            wrapper.write_text(f'#!/bin/sh\nexec taskset -c "$OMPI_COMM_WORLD_RANK" {HVD} "$@"\n')
            wrapper.chmod(0o755)
            env = {**ENV, "HVD_TRAIN_NETNS_MAP": f"{addr['a']}={ns['a']} {addr['b']}={ns['b']}"}
            across = ["ip", "netns", "exec", ns["a"], "mpirun", "-np", "2", "-H", f"{addr['a']}:1,{addr['b']}:1"]
            across += ["--mca", "plm_rsh_agent", agent, "--mca", "btl_tcp_if_include", "hvd0"]
            across += ["--mca", "oob_tcp_if_include", "hvd0", "--bind-to", "none", "-x", "PATH"]
            across += ["-x", "TF_CPP_MIN_LOG_LEVEL", "-x", "HOROVOD_GLOO_IFACE=hvd0", str(wrapper)]
            for rate in ("1gbit", "100mbit"):
                netns.shape(ns, rate)
                link = work / f"link-{rate}.json"
                sh([*across, "plan", "--measure-link", "--json", link], env)
                two = work / f"two-{rate}.json"
                sh([*across, *bench_args(args, two)], env)
                rows.append(row(f"np=2, two namespaces, tc {rate}", args, one, loaded, link, two, hosts=2))
    except netns.Unavailable as e:
        print(f"(two-host runs skipped: {e})")
    return rows


def row(name: str, args, one: Path, loaded: list[Path], link: Path, two: Path, hosts: int) -> dict:
    measured = measured_total(two)
    fitted = json.loads(link.read_text())
    predictions = {overlap: plan(args, one, loaded, link, hosts, overlap) for overlap in (0.0, 1.0)}
    return {
        "case": name,
        "link": f"{fitted['bandwidth'] * 8 / 1e9:.3g} Gbit/s, {fitted['latency'] * 1e6:.0f} us",
        "one": measured_total(one),
        "loaded": sum(measured_total(p) for p in loaded) / len(loaded),
        "measured": measured,
        "predicted": predictions,
    }


def published() -> list[dict]:
    from hvd_train.perf import planner

    gbe25 = planner.Link(25e9 / 8, 10e-6)  # RoCE-capable 25 Gbit/s
    pcie = planner.Link(10e9, 10e-6)
    nvlink = planner.Link(300e9, 5e-6)  # A100: 600 GB/s both ways, 300 each way
    horovod = [
        # model, parameters (with the 1000-class top), one Pascal GPU at batch 64 (Horovod's 2017 table)
        ("Inception V3", 23_851_784, 134.4, {16: 15.0 / 16, 512: 0.90}),
        ("ResNet-101", 44_707_176, 119.4, {16: 14.6 / 16, 512: 0.90}),
        ("VGG-16", 138_357_544, 130.9, {16: 13.7 / 16, 512: 0.68}),
    ]
    cases = []
    for name, params, rate, measured in horovod:
        setup = planner.Setup(
            step_seconds=64 / rate,
            batch=64,
            gradient_bytes=params * 4,
            intra=pcie,
            inter=gbe25,
            workers_per_host=4,
            fusion_bytes=64 * 2**20,  # Horovod's default then
            cycle_seconds=0.005,
            overlap=1.0,
        )
        for workers, efficiency in measured.items():
            p = planner.predict(setup, workers)
            cases.append(
                {
                    "case": f"Horovod docs: {name}, {workers} Pascal GPUs on {workers // 4} servers, 25 GbE RoCE",
                    "predicted": p.efficiency,
                    "measured": efficiency,
                    "bottleneck": p.bottleneck,
                }
            )
    for name, rate, batch, scaling in (("TF32", 1209, 512, 7.54), ("AMP", 3454, 1024, 5.98)):
        setup = planner.Setup(
            step_seconds=batch / rate,
            batch=batch,
            gradient_bytes=5_288_548 * 4,
            intra=nvlink,
            inter=planner.Link(200e9 / 8, 5e-6),
            workers_per_host=8,
            overlap=1.0,
        )
        p = planner.predict(setup, 8)
        cases.append(
            {
                "case": f"NVIDIA EfficientNet-B0 {name}, 8x A100 (one DGX A100, NVLink), batch {batch}",
                "predicted": p.efficiency,
                "measured": scaling / 8,
                "bottleneck": p.bottleneck,
            }
        )
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="MobileNetV2")
    parser.add_argument("--image-size", default="128")
    parser.add_argument("--batch-size", default="32")
    parser.add_argument("--iters", default="6")
    parser.add_argument("--skip-local", action="store_true", help="published cases only")
    parser.add_argument("--out", help="work folder (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="hvd-train-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    if not args.skip_local:
        rows = local(args, work)
        print(f"\n{args.model} {args.image_size} px, batch {args.batch_size}, fp32, one core per rank\n")
        header = "| case | link (measured) | one worker img/s (host full) | np=2 measured | predicted, overlap 0 |"
        print(header + " error | overlap 1 | error |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            p0, p1 = r["predicted"][0.0], r["predicted"][1.0]
            print(
                f"| {r['case']} | {r['link']} | {r['one']:.1f} ({r['loaded']:.1f}) | {r['measured']:.1f} | {p0:.1f} | "
                f"{100 * (p0 / r['measured'] - 1):+.1f}% | {p1:.1f} | {100 * (p1 / r['measured'] - 1):+.1f}% |"
            )
    print("\n| published case | measured efficiency | predicted | error (points) | predicted bottleneck |")
    print("|---|---|---|---|---|")
    for c in published():
        print(
            f"| {c['case']} | {c['measured']:.2f} | {c['predicted']:.2f} | "
            f"{100 * (c['predicted'] - c['measured']):+.1f} | {c['bottleneck']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
