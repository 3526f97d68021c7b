"""``hvd-train plan``: predicted images/s and scaling efficiency for N workers on H hosts."""

from __future__ import annotations

import argparse

from hvd_train.commands._common import positive_int

DEFAULT_WORKERS = "1,2,4,8,16,32,64,128"


def add_parser(subparsers) -> None:
    from hvd_train.config import MODEL_HELP
    from hvd_train.config.choices import OPTIMIZERS

    parser = subparsers.add_parser(
        "plan",
        help="predict images/s and scaling efficiency for N workers before renting them",
        description="Predict images/s, scaling efficiency and the bottleneck (compute, network, input) for "
        "1, 2, 4, ... workers, from one worker's measured step time (hvd-train bench --mode synthetic --json), "
        "the gradient bytes of the model, and the links within and between hosts (given, or measured with "
        "--measure-link under horovodrun / mpirun across two hosts). Ring allreduce model: "
        "2(n-1)/n * S/B + 2(n-1) * latency per fused buffer, overlapping the backward pass.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--measure-link", action="store_true", help="measure allreduce bandwidth and latency instead")
    parser.add_argument("--model", default="ResNet50", help=MODEL_HELP)
    parser.add_argument("--classes", type=positive_int, default=1000, help="outputs of the head")
    parser.add_argument("--params", type=int, default=0, help="trainable parameters (0: count them from the model)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per worker per step")
    parser.add_argument("--grad-accum", type=positive_int, default=1, help="backward passes per update")
    parser.add_argument("--fp16-allreduce", action="store_true", help="gradients travel as float16")
    parser.add_argument("--bench", default="", help="JSON of hvd-train bench --mode synthetic on one worker")
    parser.add_argument(
        "--loaded-bench",
        nargs="+",
        default=[],
        help="JSONs of one bench per worker of a host, run at the same time (CPU hosts: their cores are shared)",
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="one worker's step, seconds (instead of --bench)")
    parser.add_argument("--images-per-sec", type=float, default=0.0, help="one worker's images/s (instead of --bench)")
    parser.add_argument("--io-bench", default="", help="JSON of hvd-train bench --mode io: what the input feeds")
    parser.add_argument("--input-rate", type=float, default=0.0, help="images/s one worker's input feeds (0: plenty)")
    parser.add_argument("--workers", default=DEFAULT_WORKERS, help="worker counts to predict, comma separated")
    parser.add_argument("--workers-per-host", type=positive_int, default=8, help="workers (GPUs) on each host")
    parser.add_argument("--intra-bandwidth", default="10GB/s", help="link between workers of a host")
    parser.add_argument("--intra-latency", default="10us", help="latency within a host")
    parser.add_argument("--inter-bandwidth", default="25Gbit", help="link between hosts (per host)")
    parser.add_argument("--inter-latency", default="50us", help="latency between hosts")
    parser.add_argument("--link", action="append", default=[], help="JSON of --measure-link (replaces that link)")
    parser.add_argument("--fusion-threshold-mb", type=float, default=128.0, help="Horovod fusion buffer")
    parser.add_argument("--cycle-time-ms", type=float, default=1.0, help="Horovod cycle time")
    parser.add_argument(
        "--overlap",
        type=float,
        default=1.0,
        help="share of the backward pass the allreduce hides behind: about 1 on GPUs, 0 on CPUs",
    )
    parser.add_argument("--base-lr", type=float, default=0.01, help="learning rate of one worker")
    parser.add_argument(
        "--head-parallel",
        type=int,
        default=0,
        help="also compare the head data-parallel against sharded by class over groups of G workers (0: no)",
    )
    parser.add_argument("--head-features", type=int, default=0, help="the head's inputs (0: the model's)")
    parser.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZERS,
        help="the run's optimizer: the head's memory counts the values it keeps per weight",
    )
    parser.add_argument(
        "--head-slots", type=int, default=0, help="optimizer values per weight (0: --optimizer's; SGD 1, Adam 2)"
    )
    parser.add_argument("--json", default="", help="write the plan (or the measured link) to this file")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.measure_link:
        return _measure_link(args)
    import json

    from hvd_train.errors import UserError
    from hvd_train.model.catalogue import get_spec
    from hvd_train.perf import planner

    get_spec(args.model)
    workers = _worker_counts(args.workers)
    step = _step_seconds(args)
    params = args.params or _count_parameters(args.model, args.classes)
    if params <= 0:
        raise UserError(f"--params {params}: a model has at least one trainable parameter.")
    intra = planner.Link(
        planner.parse_bandwidth(args.intra_bandwidth, "--intra-bandwidth"),
        planner.parse_latency(args.intra_latency, "--intra-latency"),
    )
    inter = planner.Link(
        planner.parse_bandwidth(args.inter_bandwidth, "--inter-bandwidth"),
        planner.parse_latency(args.inter_latency, "--inter-latency"),
    )
    for path in args.link:
        measured = _read_json(path, "--link")
        link = planner.Link(float(measured["bandwidth"]), float(measured["latency"]))
        if measured.get("hosts", 1) > 1:
            inter = link
        else:
            intra = link
    setup = planner.Setup(
        step_seconds=step,
        batch=args.batch_size,
        gradient_bytes=params * (2 if args.fp16_allreduce else 4),
        intra=intra,
        inter=inter,
        workers_per_host=args.workers_per_host,
        fusion_bytes=args.fusion_threshold_mb * 1024 * 1024,
        cycle_seconds=args.cycle_time_ms / 1000,
        overlap=args.overlap,
        input_rate=_input_rate(args),
        base_lr=args.base_lr,
        accum=args.grad_accum,
        loaded_step_seconds=_loaded_step(args),
    )
    rows = planner.table(setup, workers)
    _print(args, setup, params, rows)
    heads = _head_layouts(args, setup, workers) if args.head_parallel else []
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            plan = {"setup": _plain(setup), "params": params, "rows": [_plain(r) for r in rows]}
            json.dump({**plan, "head": heads} if heads else plan, f, indent=2)
            f.write("\n")
    return 0


def _head_layouts(args, setup, workers: list[int]) -> list[dict]:
    """Prints and gives the head's cost in both layouts for each worker count that groups of G divide."""
    from hvd_train.errors import UserError
    from hvd_train.model import optimizers
    from hvd_train.perf import head_plan

    g = args.head_parallel
    if g < 2:
        raise UserError(f"--head-parallel {g}: give the workers of one group, 2 or more (0: no comparison).")
    features = args.head_features or _head_features(args.model, args.classes)
    slots = args.head_slots or optimizers.OPTIMIZERS[args.optimizer].slots
    head = head_plan.Head(args.classes, features, setup.batch, slots)
    fusion, cycle = setup.fusion_bytes, setup.cycle_seconds
    print(
        f"\nthe head, {args.classes:,} classes x {features:,} features: data-parallel against sharded over groups of "
        f"{g} (--head-parallel {g}); per worker and step"
    )
    print(f"{'workers':>7} {'layout':>9} {'MB sent':>10} {'comm s':>9} {'head MB':>10}  use")
    out = []
    for n in (n for n in workers if n >= g and n % g == 0):
        data_link, group_link, peer_link = head_plan.links(n, g, setup.workers_per_host, setup.intra, setup.inter)
        data = head_plan.data_parallel(head, n, data_link, fusion, cycle)
        split = head_plan.sharded(head, n, g, group_link, peer_link, fusion, cycle)
        best = "sharded" if split.seconds < data.seconds else "data"
        for name, cost in (("data", data), ("sharded", split)):
            mark = "<-" if name == best else ""
            print(
                f"{n:>7} {name:>9} {cost.wire_bytes / 1e6:>10.2f} {cost.seconds:>9.4f} "
                f"{cost.memory_bytes / 1e6:>10.1f}  {mark}"
            )
        crossing = head_plan.crossover(head, n, g, setup.workers_per_host, setup.intra, setup.inter, fusion, cycle)
        out.append({"workers": n, "data": _plain(data), "sharded": _plain(split), "use": best, "crossover": crossing})
    for row in out:
        where = f"from about {row['crossover']:,} classes" if row["crossover"] else "below 100 M classes: never"
        print(f"{row['workers']} workers: the sharded head communicates less time {where}")
    return out


def _head_features(model: str, classes: int) -> int:
    from hvd_train import compat  # noqa: F401
    from hvd_train.config import ModelConfig
    from hvd_train.model.catalogue import HEAD_LAYER, build_model, get_spec

    spec = get_spec(model)
    built = build_model(ModelConfig(name=spec.name, weights="none"), classes, spec.default_size, load_weights=False)
    return int(built.get_layer(HEAD_LAYER).kernel.shape[0])


def _worker_counts(text: str) -> list[int]:
    from hvd_train.errors import UserError

    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise UserError(f"--workers {text!r}: give whole numbers >= 1, comma separated, e.g. {DEFAULT_WORKERS}.")
    return counts


def _read_json(path: str, flag: str) -> dict:
    import json

    from hvd_train.errors import UserError

    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {flag} {path} ({e}); give a JSON file written by hvd-train.") from None


def _step_seconds(args) -> float:
    from hvd_train.errors import UserError

    given = [bool(args.bench), args.step_time > 0, args.images_per_sec > 0]
    if sum(given) != 1:
        raise UserError(
            "give one worker's speed, once: --bench FILE.json (hvd-train bench --mode synthetic --json on one "
            "worker), --step-time SECONDS or --images-per-sec RATE."
        )
    if args.step_time > 0:
        return args.step_time
    if args.images_per_sec > 0:
        return args.batch_size / args.images_per_sec
    result = _read_json(args.bench, "--bench")
    try:
        entry = next(iter(result["results"].values()))
        cfg = result["config"]
    except (KeyError, StopIteration, AttributeError):
        raise UserError(f"--bench {args.bench} is not the JSON of hvd-train bench.") from None
    if cfg.get("batch_size") != args.batch_size:
        raise UserError(
            f"--bench {args.bench} was measured at batch {cfg.get('batch_size')}, not --batch-size "
            f"{args.batch_size}; measure at the batch you plan to use."
        )
    return args.batch_size / float(entry["per_worker"])


def _loaded_step(args) -> float:
    """One worker's step while all workers of its host compute: the mean of the benches run together."""
    if not args.loaded_bench:
        return 0.0
    rates = []
    for path in args.loaded_bench:
        result = _read_json(path, "--loaded-bench")
        rates.append(float(next(iter(result["results"].values()))["per_worker"]))
    return args.batch_size / (sum(rates) / len(rates))


def _input_rate(args) -> float:
    if args.io_bench:
        result = _read_json(args.io_bench, "--io-bench")
        entry = result["results"].get("fused") or next(iter(result["results"].values()))
        return float(entry["per_worker"])
    return max(0.0, args.input_rate)


def _count_parameters(model: str, classes: int) -> int:
    from hvd_train import compat  # noqa: F401
    from hvd_train.config import ModelConfig
    from hvd_train.model.catalogue import build_model, get_spec

    spec = get_spec(model)
    built = build_model(ModelConfig(name=spec.name, weights="none"), classes, spec.default_size, load_weights=False)
    return int(sum(int(w.shape.num_elements()) for w in built.trainable_weights))


def _print(args, setup, params: int, rows) -> None:
    single = setup.batch / setup.step_seconds
    print(
        f"{args.model}: {params / 1e6:.1f}M trainable parameters, {setup.gradient_bytes / 1e6:.1f} MB per "
        f"allreduce ({'float16' if args.fp16_allreduce else 'float32'}); one worker: {setup.step_seconds:.3f} s "
        f"per step of {setup.batch} = {single:.1f} images/s"
        + (f", {setup.batch / setup.loaded_step_seconds:.1f} with its host full" if setup.loaded_step_seconds else "")
        + (f", input feeds {setup.input_rate:.1f}" if setup.input_rate else "")
    )
    print(
        f"links: within a host {_rate(setup.intra.bandwidth)}, {setup.intra.latency * 1e6:.1f} us; between hosts "
        f"{_rate(setup.inter.bandwidth)}, {setup.inter.latency * 1e6:.1f} us; {setup.workers_per_host} workers per "
        f"host; overlap {setup.overlap:g}"
    )
    print(
        f"{'workers':>7} {'hosts':>5} {'global batch':>12} {'lr':>8} {'step s':>8} {'(range)':>17} "
        f"{'images/s':>10} {'efficiency':>10}  bottleneck"
    )
    for r in rows:
        low, high = r.step_range
        print(
            f"{r.workers:>7} {r.hosts:>5} {r.global_batch:>12} {r.lr:>8.4g} {r.step_seconds:>8.3f} "
            f"{f'{low:.3f}-{high:.3f}':>17} {r.images_per_sec:>10.1f} {r.efficiency:>10.2f}  {r.bottleneck}"
        )


def _rate(bytes_per_second: float) -> str:
    return f"{bytes_per_second * 8 / 1e9:.3g} Gbit/s ({bytes_per_second / 1e9:.3g} GB/s)"


def _plain(obj) -> dict:
    import dataclasses

    return dataclasses.asdict(obj)


def _measure_link(args) -> int:
    """Times allreduces of 4 KB to 64 MB across the job's ranks and fits bandwidth and latency."""
    import json
    import statistics
    import time

    import numpy as np

    from hvd_train.distributed import start
    from hvd_train.errors import UserError
    from hvd_train.perf import planner

    ctx = start.init(threads_per_rank=1)
    if ctx.size < 2:
        raise UserError(
            "--measure-link needs at least 2 ranks: run it under horovodrun or mpirun, one rank per host "
            "to measure the link between hosts.",
            agreed=True,
        )
    # Horovod: hosts as the launcher placed the ranks (host names may repeat, e.g. in containers).
    hosts = max(1, ctx.size // ctx.local_size)
    sizes, seconds = [], []
    for power in range(12, 27, 2):
        data = np.ones(2**power // 4, np.float32)
        for _ in range(2):
            ctx.allreduce_sum(data, name="link")
        times = []
        for _ in range(5):
            started = time.perf_counter()
            ctx.allreduce_sum(data, name="link")
            times.append(time.perf_counter() - started)
        # Horovod: the slowest rank's time is the allreduce's.
        slowest = max(ctx.allgather_object(statistics.median(times), name="link_times"))
        sizes.append(float(data.nbytes))
        seconds.append(slowest)
        if ctx.is_root:
            print(f"  {data.nbytes / 1e6:9.3f} MB  {slowest * 1000:9.3f} ms", flush=True)
    link = planner.fit_link(sizes, seconds, ctx.size, cycle=args.cycle_time_ms / 1000)
    if ctx.is_root:
        where = "between hosts" if hosts > 1 else "within a host"
        flag = "inter" if hosts > 1 else "intra"
        print(
            f"{ctx.size} ranks on {hosts} host(s), {where}: {_rate(link.bandwidth)}, latency "
            f"{link.latency * 1e6:.1f} us  (plan --{flag}-bandwidth {link.bandwidth:.4g} "
            f"--{flag}-latency {link.latency:.3g}s)"
        )
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "workers": ctx.size,
                        "hosts": hosts,
                        "bandwidth": link.bandwidth,
                        "latency": link.latency,
                        "sizes": sizes,
                        "seconds": seconds,
                    },
                    f,
                    indent=2,
                )
                f.write("\n")
    return 0
