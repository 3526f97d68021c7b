"""``hvd-train pack SRC DST``: an image folder into TFRecord shards plus a manifest."""

from __future__ import annotations

import argparse

from hvd_train.commands._common import CSV_PATHS, CSV_TRAINING, add_alpha_argument, add_csv_arguments, csv_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "pack",
        help="pack an image folder (local or s3://) into TFRecord shards (local or s3://)",
        description="Write the images of SRC/<class>/.../<image> (or of a CSV of labels) into TFRecord shards "
        "of about --shard-size bytes at DST, in a seeded random order, with DST/manifest.json (classes, images "
        "per shard, bytes, SHA-256, record offsets). Unreadable images follow --on-bad-image and are listed in "
        "the manifest. "
        "Images with transparent pixels are stored composited over --alpha-background (as PNG). "
        "The manifest is written last: an interrupted pack leaves no manifest. With --val-split, the held-out "
        "images go to DST/val and the rest to DST/train. Under horovodrun or mpirun each process packs a part "
        "of the images and rank 0 writes the manifest.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="labelled image folder or CSV of labels, local or s3://")
    parser.add_argument("dst", metavar="DST", help="folder or s3://bucket/prefix/ for the shards")
    parser.add_argument("--shard-size", default="128MB", help="target bytes per shard, e.g. 128MB, 1GB, 65536")
    parser.add_argument("--on-bad-image", choices=("skip", "fail"), default="skip", help="skip (and list) or fail")
    parser.add_argument("--val-split", type=float, default=0.0, help="fraction of each class packed into DST/val")
    parser.add_argument("--seed", type=int, default=42, help="seed of the split and of the record order")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing shard set at DST")
    add_alpha_argument(parser, default="white", help="colour transparent pixels are composited over, stored as PNG")
    parser.add_argument("--s3-endpoint", default="", help="URL of an S3-compatible store (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--s3-concurrency", type=int, default=32, help="S3 requests in flight")
    add_csv_arguments(parser, *CSV_PATHS, *CSV_TRAINING)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train.data import packed, storage
    from hvd_train.distributed import start
    from hvd_train.errors import UserError

    if not 0.0 <= args.val_split < 1.0:
        raise UserError(f"--val-split {args.val_split} is invalid; use a fraction in [0, 1).")
    if args.s3_concurrency < 1:
        raise UserError(f"--s3-concurrency {args.s3_concurrency} is invalid; use a whole number >= 1.")
    table = csv_options(args, args.src)
    s3 = storage.S3Options(endpoint=args.s3_endpoint, concurrency=args.s3_concurrency)
    # Under horovodrun/mpirun every rank packs a part; alone, one process packs all.
    ctx = start.init()
    packed.pack(
        args.src,
        args.dst,
        shard_size=packed.parse_size(args.shard_size),
        on_bad_image=args.on_bad_image,
        seed=args.seed,
        s3=s3,
        overwrite=args.overwrite,
        val_split=args.val_split,
        alpha_background=args.alpha_background,
        ctx=ctx,
        table=table,
    )
    return 0
