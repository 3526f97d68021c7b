"""``hvd-train lr-find``: the learning-rate range test on a run's real data and model."""

from __future__ import annotations

import argparse

from hvd_train import config


def add_parser(subparsers) -> None:
    from hvd_train.training import lr_find

    parser = subparsers.add_parser(
        "lr-find",
        help="learning-rate range test: suggests --base-lr (writes lr_find.png and lr_find.csv)",
        description="The learning-rate range test (Smith, 2015; fastai's lr_find): train a throw-away copy of the "
        "model on the real training images while the learning rate grows exponentially, stop when the loss blows "
        "up, and suggest a tenth of the rate where the smoothed loss was lowest as --base-lr (the rate of one "
        "worker with --batch-size images). Takes the options of `hvd-train train`; writes lr_find.png, "
        "lr_find.csv and lr_find.json to --output. Runs in one process (under a launcher, on rank 0).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--steps", type=int, default=lr_find.STEPS, help="most steps of the sweep")
    sweep.add_argument("--start-lr", type=float, default=lr_find.START, help="first learning rate")
    sweep.add_argument("--end-lr", type=float, default=lr_find.END, help="last learning rate")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import os

    from hvd_train.data.storage import is_s3
    from hvd_train.errors import UserError

    try:
        cfg = config.from_sources(args)
        if is_s3(cfg.run.output):
            raise UserError(
                f"lr-find writes its plot and table to a folder; give --output a folder, not {cfg.run.output} "
                "(train --base-lr auto runs the same test for a run whose --output is in S3)."
            )
        if not (0 < args.start_lr < args.end_lr) or args.steps < 10:
            raise UserError(
                f"the sweep needs 0 < --start-lr < --end-lr and --steps >= 10; "
                f"got {args.start_lr:g}, {args.end_lr:g}, {args.steps}."
            )
    except UserError as e:
        raise UserError(str(e), agreed=True) from None
    from hvd_train.distributed import start
    from hvd_train.log import get_logger
    from hvd_train.model.catalogue import get_spec
    from hvd_train.training import lr_find, stages

    get_spec(cfg.model.name)
    ctx = start.init(cfg.horovod.threads_per_rank, cfg.run.deterministic)
    stages.prepare_output(cfg, ctx)
    job = stages.load_data(cfg, ctx)

    def sweep():
        threads = start.cpu_threads(ctx, cfg.horovod.threads_per_rank)
        found = lr_find.run(job, steps=args.steps, start=args.start_lr, end=args.end_lr, threads=threads)
        lr_find.write(found, cfg.run.output)
        return found

    found = ctx.on_root(sweep, name="lr_find")
    if not ctx.is_root:
        return 0
    log = get_logger()
    log.info("%d steps in %.0f s; %s", len(found.lrs), found.seconds, found.stopped)
    log.info(
        "wrote %s", ", ".join(os.path.join(cfg.run.output, f) for f in ("lr_find.png", lr_find.CSV, lr_find.RESULT))
    )
    if found.suggestion is None:
        raise UserError(
            f"no rate found: from {args.start_lr:g} to {args.end_lr:g} the training loss neither fell nor rose, "
            f"or still fell at the end; look at lr_find.png, check the data and labels, or widen "
            f"--start-lr/--end-lr."
        )
    print(f"suggested --base-lr {found.suggestion:.3g}  (a tenth of {found.suggestion * 10:.3g}; see lr_find.png)")
    return 0
