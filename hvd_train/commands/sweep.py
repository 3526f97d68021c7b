"""``hvd-train sweep SWEEP.yaml --output DIR``: many training runs, searched by Optuna."""

from __future__ import annotations

import argparse

from hvd_train.commands._common import positive_int


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "sweep",
        help="search training options over many runs (Optuna): trials in parallel, pruning, resume",
        description="Run the trials of a sweep file (docs/experiments.md): each a Horovod job of `hvd-train train` "
        "in OUTPUT/trial-NNNN, searched by Optuna (grid, random or TPE), hopeless ones pruned early (median or "
        "successive halving). "
        "Writes OUTPUT/sweep.html, sweep.json and best.yaml (the best trial's configuration, for "
        "`hvd-train train --config`). A study named otherwise than OUTPUT (--study) has all of these in "
        "OUTPUT/STUDY. Stopped (SIGTERM), the same command goes on.",
    )
    parser.add_argument("sweep_file", metavar="SWEEP.yaml", help="the sweep: base options, searched options, trials")
    parser.add_argument("--output", required=True, help="the sweep's folder (its study, trials and pages)")
    parser.add_argument("--trials", type=positive_int, help="trials in all (default: the file's)")
    parser.add_argument("--parallel", type=positive_int, help="trials at once (default: the file's, else 1)")
    parser.add_argument("--workers", type=positive_int, help="workers of each trial (default: the file's, else 1)")
    parser.add_argument(
        "--storage", help="the study's database URL, e.g. postgresql://user@host/db (default: OUTPUT/study.db)"
    )
    parser.add_argument(
        "--study",
        help="the study's name in the storage (default: the --output folder's name); another name has its "
        "trials and pages in OUTPUT/STUDY",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train.data.storage import is_s3
    from hvd_train.errors import UserError
    from hvd_train.experiments import spec
    from hvd_train.experiments.sweep import SweepRun

    if is_s3(args.output):
        raise UserError(
            f"a sweep keeps its study and trials in a folder; give --output a folder, not {args.output} "
            "(a single train run can write to S3)."
        )
    sweep = spec.load(
        args.sweep_file,
        trials=args.trials,
        parallel=args.parallel,
        workers=args.workers,
        storage=args.storage,
        study=args.study,
    )
    return SweepRun(sweep, args.output).run()
