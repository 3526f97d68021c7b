"""Throughput measurements: the model alone, the input pipeline alone, or both.

* ``synthetic``: the training step on one batch of random tensors, cached,
  like Horovod's synthetic benchmarks: what the model and the allreduce
  allow, with no input cost.
* ``io``: the input pipeline alone on real data (read, decode, augment,
  resize, batch), like the ``--test-io`` mode of MXNet's image
  classification example: what the input can feed. For JPEG with random
  crops it measures the fused crop-and-decode and the whole-image decode in
  the same run (``--decode both``).
* ``full``: real data through the training step.

Timing follows Horovod's synthetic benchmark: warm-up batches first (graph
tracing, pipeline start), then ``iters`` iterations of ``batches_per_iter``
steps; each iteration's images/s is timed on every rank, the host waiting
for the device only at the end of an iteration (the steps run
``steps_per_call`` per call, as in training). The result gives, per rank,
the min / median / max over the iterations, the total over ranks, the
efficiency against a single-worker figure (``--baseline``), and the host's
share of the timed time: the gaps between one call of the steps ending and
the next starting, from the calls' own timestamps.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("bench")


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        mode: ``synthetic``, ``io`` or ``full``.
        model: keras.applications model name.
        image_size: model input side.
        batch_size: images per worker per step.
        classes: outputs of the head (synthetic; real data has its own).
        precision: ``auto``, ``fp32``, ``mixed_float16``, ``mixed_bfloat16``.
        xla: ``off``, ``auto``, ``jit``.
        fp16_allreduce: compress gradients to float16 for the allreduce.
        data: image folder or shard set (``io`` and ``full``).
        augment: training augmentation (``io`` and ``full``).
        decode: ``fused`` (JPEG crops decoded alone), ``full``, or ``both`` (``io``).
        warmup_batches: steps before timing.
        batches_per_iter: steps per timed iteration.
        iters: timed iterations.
        steps_per_call: training steps per call of the compiled step (``synthetic``, ``full``).
        threads_per_rank: TensorFlow CPU threads per process (0: usable CPUs / ranks sharing them).
        baseline: images/s of one worker, for the scaling efficiency (0: none).
    """

    mode: str = "synthetic"
    model: str = "ResNet50"
    image_size: int = 224
    batch_size: int = 32
    classes: int = 1000
    precision: str = "auto"
    xla: str = "off"
    fp16_allreduce: bool = False
    data: str = ""
    augment: str = "crop,flip"
    decode: str = "fused"
    warmup_batches: int = 10
    batches_per_iter: int = 10
    iters: int = 10
    steps_per_call: int = 1
    threads_per_rank: int = 0
    baseline: float = 0.0


@dataclass
class Timings:
    """Per-iteration images/s of one rank (one pipeline variant in ``io`` mode).

    Attributes:
        rates: images/s of each timed iteration.
        seconds: seconds of each timed iteration.
        host_share: the part of the timed time between one call of the steps
            ending and the next starting (None: not measured, ``io``).
    """

    rates: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    host_share: float | None = None

    def summary(self, batch: int, steps_per_iter: int) -> dict:
        """Per-iteration min / median / max images/s, the median step, and images/s over all iterations."""
        r = self.rates
        out = {
            "min": min(r),
            "median": statistics.median(r),
            "max": max(r),
            "step_seconds": statistics.median(self.seconds) / steps_per_iter,
            "overall": batch * steps_per_iter * len(self.seconds) / sum(self.seconds),
        }
        if self.host_share is not None:
            out["host_share"] = self.host_share
        return out


def run(cfg: BenchConfig, ctx: Context) -> dict:
    """Measures ``cfg.mode`` on this rank; every rank returns the same result dict.

    Raises:
        UserError: a bad option or data.
    """
    if cfg.mode in ("io", "full") and not cfg.data:
        raise UserError(f"--mode {cfg.mode} reads real images: give --data DIR (a folder or a shard set).")
    if cfg.mode == "io":
        variants = ["fused", "full"] if cfg.decode == "both" else [cfg.decode]
        timings = {v: _io(cfg, ctx, fused=v == "fused") for v in variants}
    else:
        timings = {cfg.mode: _train_steps(cfg, ctx)}
    gathered = ctx.allgather_object({k: (t.rates, t.seconds, t.host_share) for k, t in timings.items()}, name="bench")
    return _result(cfg, ctx, gathered)


def _result(cfg: BenchConfig, ctx: Context, gathered: list[dict]) -> dict:
    from hvd_train.distributed import start

    variants = {}
    for name in gathered[0]:
        per_rank = []
        for rank, by_variant in enumerate(gathered):
            timed = Timings(*by_variant[name])
            per_rank.append({"rank": rank, **timed.summary(cfg.batch_size, cfg.batches_per_iter)})
        total = sum(r["overall"] for r in per_rank)
        entry = {"per_rank": per_rank, "total": total, "per_worker": total / ctx.size}
        if cfg.baseline:
            entry["efficiency"] = total / (ctx.size * cfg.baseline)
        variants[name] = entry
    result = {
        "config": asdict(cfg),
        "world_size": ctx.size,
        # Horovod's own grouping: one local rank 0 per host (host names may be
        # rewritten by the loopback fix, or equal across containers).
        "hosts": sum(ctx.allgather_object(ctx.local_rank == 0, name="bench_hosts")),
        "results": variants,
        **start.versions(),
    }
    if "fused" in variants and "full" in variants:
        result["fused_over_full"] = variants["fused"]["total"] / variants["full"]["total"]
    return result


def _batches(cfg: BenchConfig):
    return cfg.warmup_batches, cfg.iters * cfg.batches_per_iter


def _report(ctx: Context, label: str, step: int, total: int, rate: float) -> None:
    if ctx.is_root:
        log.info("%s: step %d/%d, %.1f images/s (rank 0)", label, step, total, rate)


def _train_steps(cfg: BenchConfig, ctx: Context) -> Timings:
    """Times the real training step (``network.Net``) on random or real batches."""
    from hvd_train.compat import tf
    from hvd_train.config import TrainConfig, build
    from hvd_train.distributed import gradients
    from hvd_train.model import compute, schedules
    from hvd_train.model.catalogue import build_model
    from hvd_train.model.network import REPORT_FLAGS, Net, use_step_seeded_dropout

    numerics = ctx.broadcast_object(compute.resolve(cfg.precision) if ctx.is_root else None, name="bench_precision")
    train_cfg: TrainConfig = build(
        {
            "data": {"train": cfg.data or "synthetic", "batch_size": cfg.batch_size, "augment": cfg.augment},
            "model": {"name": cfg.model, "weights": "none"},
            "compute": {"precision": numerics, "xla": cfg.xla, "steps_per_call": cfg.steps_per_call},
            "horovod": {"fp16_allreduce": cfg.fp16_allreduce, "threads_per_rank": cfg.threads_per_rank},
            "run": {"output": "bench"},
        }
    )
    if cfg.mode == "full":
        images_set, dataset = _real_input(cfg, ctx)
        classes = len(images_set.classes)
    else:
        classes = cfg.classes
    compute.set_policy(numerics)
    use_step_seeded_dropout()
    base = ctx.agree(lambda: build_model(train_cfg.model, classes, cfg.image_size, load_weights=False), name="build")
    net = Net(base, train_cfg, seed=1, rank=ctx.rank, precision=numerics)
    net.timestamps = True
    # Horovod: every rank starts from rank 0's weights.
    gradients.broadcast_variables(net.variables, ctx)
    if cfg.mode != "full":
        images = tf.random.stateless_uniform((cfg.batch_size, cfg.image_size, cfg.image_size, 3), seed=(1, ctx.rank))
        labels = tf.random.stateless_uniform((cfg.batch_size,), seed=(2, ctx.rank), maxval=classes, dtype=tf.int32)
        batch = (images * 2 - 1, labels, tf.zeros((cfg.batch_size,), tf.int64))
        dataset = tf.data.Dataset.from_tensors(batch).cache().repeat()
    iterator = iter(dataset)
    no_flags, progress = (False, False, 0.0), (0, 0, 1, 1, 1)  # steps nobody stops; any rate
    rates = schedules.WarmupSchedule(0.01, 0.01, 0, 1).parameters()
    reports = []

    def run_steps(steps: int) -> None:
        while steps:
            call = min(steps, cfg.steps_per_call)
            _, report = net.run_steps(iterator, call, no_flags, progress, rates)
            reports.append(report)
            steps -= call
        reports[-1].numpy()  # the device is done with them, on every rank

    label = f"{cfg.mode} {cfg.model} {cfg.image_size}px batch {cfg.batch_size} {numerics}"
    out = _timed(cfg, ctx, label, run_steps, reports.clear)
    times = [r.numpy()[REPORT_FLAGS : REPORT_FLAGS + 2] for r in reports]  # each timed call's start and end
    busy = sum(end - start for start, end in times)
    out.host_share = 1.0 - busy / (times[-1][1] - times[0][0]) if len(times) > 1 else 0.0
    return out


def _timed(cfg: BenchConfig, ctx: Context, label: str, run_steps, before_timing=None) -> Timings:
    """Runs the warm-up, then times ``iters`` calls of ``run_steps(batches_per_iter)``, reporting each."""
    warmup, _ = _batches(cfg)
    if warmup:
        run_steps(warmup)
    if before_timing is not None:
        before_timing()
    out = Timings()
    for i in range(cfg.iters):
        started = time.perf_counter()
        run_steps(cfg.batches_per_iter)
        seconds = time.perf_counter() - started
        out.seconds.append(seconds)
        out.rates.append(cfg.batch_size * cfg.batches_per_iter / seconds)
        _report(ctx, label, (i + 1) * cfg.batches_per_iter, cfg.iters * cfg.batches_per_iter, out.rates[-1])
    return out


def _real_input(cfg: BenchConfig, ctx: Context, fused: bool = True):
    """The images, and rank ``ctx.rank``'s batches of them: enough for the warm-up and the timed steps."""
    from hvd_train.data.pipeline import train_input
    from hvd_train.data.sharding import Segment
    from hvd_train.data.sources import open_data
    from hvd_train.data.storage import S3Options
    from hvd_train.distributed import start
    from hvd_train.model.catalogue import get_spec

    data = ctx.on_root(lambda: open_data(cfg.data, "--data", S3Options()), name="bench_data")
    n = len(data)
    warmup, timed = _batches(cfg)
    per_epoch = Segment.whole(0, n, ctx.size, cfg.batch_size).steps
    epochs = -(-(warmup + timed) // per_epoch)
    segments = [(Segment.whole(e, n, ctx.size, cfg.batch_size, seed=1), 0) for e in range(epochs)]
    made = train_input(
        data,
        segments,
        rank=ctx.rank,
        image_size=cfg.image_size,
        augment=cfg.augment,
        preprocess=get_spec(cfg.model).preprocess_input(),
        seed=1,
        threads=start.cpu_threads(ctx, cfg.threads_per_rank),
        fused_jpeg=fused,
    )
    return data, made.dataset


def _io(cfg: BenchConfig, ctx: Context, fused: bool) -> Timings:
    """Times the input pipeline alone: batches taken as fast as it makes them."""
    _, dataset = _real_input(cfg, ctx, fused)
    iterator = iter(dataset)

    def run_steps(steps: int) -> None:
        for _ in range(steps):
            images, *_ = next(iterator)
        images.numpy()

    label = f"io ({'fused crop decode' if fused else 'whole decode'}) {cfg.image_size}px batch {cfg.batch_size}"
    return _timed(cfg, ctx, label, run_steps)


def print_result(result: dict) -> None:
    """The result as a few lines of text (rank 0)."""
    cfg = result["config"]
    print(
        f"hvd-train bench --mode {cfg['mode']}: {cfg['model']} {cfg['image_size']}px, batch {cfg['batch_size']} "
        f"per worker, {result['world_size']} worker(s) on {result['hosts']} host(s)"
    )
    for name, entry in result["results"].items():
        print(f"  {name}:")
        for r in entry["per_rank"]:
            print(
                f"    rank {r['rank']}: {r['overall']:.1f} images/s "
                f"(per iteration min {r['min']:.1f} / median {r['median']:.1f} / max {r['max']:.1f})"
                + (f", host {100 * r['host_share']:.1f}% of the time" if "host_share" in r else "")
            )
        line = f"    total {entry['total']:.1f} images/s ({entry['per_worker']:.1f} per worker)"
        if "efficiency" in entry:
            line += f"; scaling efficiency {entry['efficiency']:.2f} against {cfg['baseline']:.1f} images/s on one"
        print(line)
    if "fused_over_full" in result:
        print(f"  fused crop decode / whole decode: {result['fused_over_full']:.2f}x")


def read_baseline(text: str) -> float:
    """``--baseline``: a number of images/s, or the JSON of an earlier one-worker run."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        with open(text, encoding="utf-8") as f:
            earlier = json.load(f)
        entry = next(iter(earlier["results"].values()))
        return float(entry["per_worker"])
    except (OSError, ValueError, KeyError, StopIteration) as e:
        raise UserError(
            f"--baseline {text!r} is neither images/s nor the JSON of hvd-train bench ({e}); "
            f"give a number or a file written with --json."
        ) from None
