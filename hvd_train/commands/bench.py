"""``hvd-train bench``: images/s of the model alone, the input alone, or both."""

from __future__ import annotations

import argparse
import os

from hvd_train import files
from hvd_train.commands._common import positive_int


def add_parser(subparsers) -> None:
    from hvd_train.config import AUGMENTATIONS, MODEL_HELP, PRECISIONS, XLA_MODES
    from hvd_train.config.choices import STEPS_PER_CALL

    parser = subparsers.add_parser(
        "bench",
        help="measure images/s: the model on random tensors, the input pipeline, or both",
        description="Measure training throughput on this machine, as one process or under horovodrun / mpirun. "
        "--mode synthetic: the training step on random tensors (like Horovod's synthetic benchmarks); "
        "--mode io: the input pipeline alone on real images (like MXNet's --test-io); --mode full: real images "
        "through the training step. Prints images/s per rank (min / median / max over the timed iterations "
        "after the warm-up, and the host's share of the time between calls of the steps), the total, and the "
        "scaling efficiency against --baseline; --json writes it all.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--mode", choices=("synthetic", "io", "full"), default="synthetic", help="what to measure")
    parser.add_argument("--model", default="ResNet50", help=MODEL_HELP)
    parser.add_argument("--image-size", type=positive_int, default=224, help="model input side in pixels")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per worker per step")
    parser.add_argument("--classes", type=positive_int, default=1000, help="outputs of the head (synthetic)")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto", help="numeric precision")
    parser.add_argument("--xla", choices=XLA_MODES, default="off", help="XLA compilation of the step")
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to float16")
    parser.add_argument("--data", default="", help="image folder or shard set, local or s3:// (io, full)")
    parser.add_argument("--augment", choices=AUGMENTATIONS, default="crop,flip", help="augmentation (io, full)")
    parser.add_argument(
        "--decode",
        choices=("fused", "full", "both"),
        default="both",
        help="io: decode only a JPEG's crop, the whole image, or measure both in one run",
    )
    parser.add_argument("--warmup-batches", type=int, default=10, help="steps before timing")
    parser.add_argument("--batches-per-iter", type=positive_int, default=10, help="steps per timed iteration")
    parser.add_argument("--iters", type=positive_int, default=10, help="timed iterations")
    parser.add_argument(
        "--steps-per-call",
        type=positive_int,
        default=STEPS_PER_CALL,
        help="training steps per call of the compiled step, as hvd-train train runs them (synthetic, full)",
    )
    parser.add_argument("--threads-per-rank", type=int, default=0, help="CPU threads per process (0: auto)")
    parser.add_argument(
        "--baseline", default="", help="one worker's images/s, or the --json of a one-worker run: for the efficiency"
    )
    parser.add_argument("--json", default="", help="write the result to this file (rank 0)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train.errors import UserError
    from hvd_train.model.catalogue import get_spec
    from hvd_train.perf import bench

    try:
        get_spec(args.model)
        if args.warmup_batches < 0 or args.threads_per_rank < 0:
            raise UserError("--warmup-batches and --threads-per-rank must be 0 or more.")
        if args.xla == "auto":
            from hvd_train.model import compute

            compute.xla_environment("auto")
        cfg = bench.BenchConfig(
            mode=args.mode,
            model=args.model,
            image_size=args.image_size,
            batch_size=args.batch_size,
            classes=args.classes,
            precision=args.precision,
            xla=args.xla,
            fp16_allreduce=args.fp16_allreduce,
            data=args.data,
            augment=args.augment,
            decode=args.decode if args.mode == "io" else "fused",
            warmup_batches=args.warmup_batches,
            batches_per_iter=args.batches_per_iter,
            iters=args.iters,
            steps_per_call=args.steps_per_call,
            threads_per_rank=args.threads_per_rank,
            baseline=bench.read_baseline(args.baseline) if args.baseline else 0.0,
        )
    except UserError as e:
        raise UserError(str(e), agreed=True) from None

    from hvd_train.distributed import start
    from hvd_train.model import compute

    ctx = start.init(args.threads_per_rank)
    compute.use_xla(args.xla)
    result = bench.run(cfg, ctx)
    if ctx.is_root:
        bench.print_result(result)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)  # its folder, if new
            files.write_json(args.json, result)
    return 0
