"""``hvd-train report RUN_DIR``: one self-contained HTML page about a run."""

from __future__ import annotations

import argparse

from hvd_train.commands._common import add_s3_endpoint_argument


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write RUN_DIR/report.html: summary, curves, confusion matrix, per-class accuracy, throughput",
        description="Write one self-contained HTML page about a training run: the summary, the training curves, "
        "the confusion matrix and per-class accuracy (worst classes first), throughput per epoch, world size "
        "and versions, and the resolved configuration. The pictures are embedded: the page loads nothing else.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output folder (or S3 prefix) of `hvd-train train`")
    parser.add_argument("--output", help="where to write the page (default: RUN_DIR/report.html)")
    add_s3_endpoint_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train.data.storage import S3Options
    from hvd_train.log import get_logger
    from hvd_train.results import report_page
    from hvd_train.training import s3_mirror

    run_dir, mirror = s3_mirror.open_run(args.run_dir, S3Options(endpoint=args.s3_endpoint), "RUN_DIR")
    path = report_page.write(run_dir, args.output)
    if mirror is not None:  # a run in S3: the page goes up beside it, unless written elsewhere
        mirror.push_outputs()
    get_logger().info("wrote %s", path)
    return 0
