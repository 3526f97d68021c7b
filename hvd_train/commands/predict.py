"""``hvd-train predict``: class and probability for image files or folders."""

from __future__ import annotations

import argparse
import csv
import os
import sys

from hvd_train.commands._common import CSV_PATHS, add_csv_arguments, add_trained_model_arguments, csv_options


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="predict the class of images; writes CSV path,label,probability",
        description="Predict the class of each image given (files, folders searched recursively, or CSVs whose "
        "rows name images, as --data takes them); of a multi-label run, every label whose probability reaches "
        "the threshold (CSV path,labels,scores). "
        "Under horovodrun the images are split among ranks; rank 0 writes the CSV in input order.",
    )
    add_trained_model_arguments(parser)
    parser.add_argument("paths", nargs="+", metavar="PATH", help="image files, folders, or CSVs naming images")
    parser.add_argument("--output", default="-", help="CSV file to write (default: standard output)")
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="a multi-label run's decision: the probability a label needs (default: the run's)",
    )
    add_csv_arguments(parser, *CSV_PATHS)
    parser.set_defaults(run=run)


def expand(paths: list[str], table=None) -> list[str]:
    """Image files named by ``paths`` (folders searched recursively, sorted; a CSV's rows in their order)."""
    from hvd_train.data.folder import is_image_name
    from hvd_train.data.table import is_table, table_images
    from hvd_train.errors import UserError

    files = []
    for path in paths:
        if is_table(path):
            files.extend(table_images(path, "PATH", table))
        elif os.path.isdir(path):
            found = sorted(
                os.path.join(d, n)
                for d, _, names in os.walk(path)
                for n in names
                if is_image_name(n) and not n.startswith(".")
            )
            if not found:
                raise UserError(f"folder {path} holds no images (jpg, jpeg, png, gif, bmp); check the PATH.")
            files.extend(found)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise UserError(f"{path} does not exist; PATH takes image files, folders or CSVs of image paths.")
    return files


def run(args: argparse.Namespace) -> int:
    from hvd_train.data.folder import ImageSet
    from hvd_train.data.pipeline import predict_dataset
    from hvd_train.data.sources import checked
    from hvd_train.data.storage import S3Options
    from hvd_train.distributed import start
    from hvd_train.results.inference import load_trained
    from hvd_train.training import s3_mirror

    table = csv_options(args, *args.paths)
    ctx = start.init()
    s3 = S3Options(endpoint=args.s3_endpoint)
    args.model_dir = ctx.agree(lambda: s3_mirror.open_run(args.model_dir, s3)[0], name="open_run")
    files = ctx.on_root(lambda: expand(args.paths, table), name="predict_list")
    trained = ctx.agree(lambda: load_trained(args.model_dir), name="load_model")
    threshold = trained.decision(args.threshold, agreed=True)
    # Every image decoded before predicting: a few files, and each must get an answer or a reason.
    images = ImageSet(files, [0] * len(files), ["unlabelled"])
    readable = checked(images, "PATH", args.on_bad_image, ctx, check="full")
    mine = readable.paths[ctx.rank :: ctx.size]
    rows = []
    if mine:
        probs = trained.model.predict(
            predict_dataset(
                mine,
                batch_size=args.batch_size,
                image_size=trained.image_size,
                crop_fraction=trained.crop_fraction,
                preprocess=trained.preprocess,
                alpha_background=args.alpha_background or trained.alpha_background,
            ),
            verbose=0,
        )
        if trained.multi_label:
            separator = joiner(trained)
            rows += [answers(path, p, trained.classes, threshold, separator) for path, p in zip(mine, probs)]
        else:
            rows += [answer(path, p, trained.classes) for path, p in zip(mine, probs)]
    gathered = ctx.allgather_object(rows, name="predict_rows")
    header = ["path", "labels", "scores"] if trained.multi_label else ["path", "label", "probability"]
    # Horovod: the other ranks wait for rank 0's CSV, so that every rank ends together.
    ctx.on_root(lambda: _write_rows(args, files, gathered, header), name="predict_write")
    return 0


def answer(path: str, probabilities, classes: list[str]) -> tuple[str, str, float]:
    """``(path, label, probability)`` of one image; no label (and nan) where its scores are not finite (a
    diverged model), as ``evaluate`` counts such an image: no class, a miss."""
    import math

    best = int(probabilities.argmax())
    if not all(math.isfinite(float(p)) for p in probabilities):
        return path, "", math.nan
    return path, classes[best], float(probabilities[best])


def joiner(trained) -> str:
    """What joins a multi-label run's labels in a cell: its ``--label-separator``, else a space, or, where a
    class's name holds a space (a 0/1 column's header), the first of ``| ; + ~`` that no name holds (the file
    then trains as a CSV with that ``--label-separator``)."""
    if trained.label_separator:
        return trained.label_separator
    if not any(any(ch.isspace() for ch in name) for name in trained.classes):
        return " "
    return next((c for c in "|;+~" if not any(c in name for name in trained.classes)), "|")


def answers(path: str, probabilities, classes: list[str], threshold: float, separator: str) -> tuple[str, str, str]:
    """``(path, labels, scores)`` of one image of a multi-label run: every class whose probability reaches
    ``threshold``, the likeliest first, joined by the run's ``separator`` (so the CSV reads back as a multi-label
    set), with their probabilities in the same order; none (and nan) where its scores are not finite."""
    import math

    import numpy as np

    from hvd_train.results.multilabel import decide

    p = np.asarray(probabilities, np.float32)
    if not np.isfinite(p).all():
        return path, "", str(math.nan)
    over = sorted(np.flatnonzero(decide(p, threshold)).tolist(), key=lambda c: (-p[c], c))
    return path, separator.join(classes[c] for c in over), separator.join(f"{p[c]:.6f}" for c in over)


def _write_rows(args, files: list[str], gathered: list, header: list[str]) -> None:
    """Rank 0: one CSV row per readable image, in the order the paths were given."""
    from hvd_train.errors import UserError

    by_path = {row[0]: row for part in gathered for row in part}
    # A file name that is not UTF-8 is written back as the bytes it has on disk.
    try:
        out = (
            open(args.output, "w", newline="", encoding="utf-8", errors="surrogateescape")
            if args.output != "-"
            else None
        )
    except OSError as e:
        raise UserError(
            f"cannot write {args.output} ({e.strerror or e}); pass --output with a file you can write."
        ) from None
    if out is None:
        sys.stdout.reconfigure(errors="surrogateescape")
    try:
        writer = csv.writer(out or sys.stdout)
        writer.writerow(header)
        for path in files:
            if path in by_path:
                _, label, prob = by_path[path]
                writer.writerow([path, label, prob if isinstance(prob, str) else f"{prob:.6f}"])
        if out is None:
            sys.stdout.flush()  # a reader gone (| head) is met here, not in the interpreter's exit
    finally:
        if out:
            out.close()
