"""``hvd-train evaluate``: exact accuracy of a trained model on labelled images."""

from __future__ import annotations

import argparse
import os

from hvd_train import files
from hvd_train.commands._common import (
    CSV_LABELS,
    CSV_PATHS,
    RECORD_FIELDS,
    add_csv_arguments,
    add_record_arguments,
    add_trained_model_arguments,
    csv_options,
    record_options,
)

SHOWN = 25  # classes and pairs printed when there are many classes


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "evaluate",
        help="exact accuracy, top-5, per-class accuracy and confusion matrix",
        description="Score every image of DIR/<class>/... (or of a CSV of labels, or of a shard set) once "
        "(across all ranks under horovodrun) with the model of a finished run. Prints the results and writes "
        "them as JSON.",
    )
    add_trained_model_arguments(parser)
    parser.add_argument(
        "--data",
        required=True,
        help="labelled image folder, CSV of labels, shard set or TFRecord files, local or s3://, classes as in "
        "training",
    )
    add_csv_arguments(parser, *CSV_PATHS, *CSV_LABELS)
    add_record_arguments(parser)
    parser.add_argument(
        "--data-split",
        default="",
        help="a TFDS folder's split or a CSV's rows to score (default: validation, else test)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="a multi-label run's decision: the probability a label needs (default: the run's)",
    )
    parser.add_argument(
        "--report",
        help="JSON file to write (default: MODEL_DIR/evaluation.json); confusion.png is drawn beside it",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from hvd_train.data.pipeline import eval_dataset
    from hvd_train.data.records import refuse_split, refuse_unused
    from hvd_train.data.sources import evaluation_set
    from hvd_train.data.storage import S3Options
    from hvd_train.data.streams import input_errors
    from hvd_train.data.table import is_table
    from hvd_train.distributed import start
    from hvd_train.errors import UserError
    from hvd_train.model.sharded_net import ShardedScorer
    from hvd_train.results.evaluation import evaluate, evaluate_sharded
    from hvd_train.results.inference import load_trained
    from hvd_train.results.multilabel import evaluate_multi
    from hvd_train.training import s3_mirror

    table = dataclasses.replace(csv_options(args, args.data), split=args.data_split)  # refused before it starts
    ctx = start.init()
    s3 = S3Options(endpoint=args.s3_endpoint)
    # A run in S3: every rank reads its local copy (the staging folder); rank 0 uploads the report.
    args.model_dir, mirror = ctx.agree(lambda: s3_mirror.open_run(args.model_dir, s3), name="open_run")
    # A head saved as files is sharded over the ranks (each holds its columns), whole in one process.
    trained = ctx.agree(lambda: load_trained(args.model_dir, sharded=ctx.size > 1), name="load_model")
    if trained.head is not None and len(trained.classes) < ctx.size:
        raise UserError(
            f"{args.model_dir} has {len(trained.classes)} classes, fewer than the {ctx.size} processes that would "
            "shard its head: evaluate it with fewer processes.",
            agreed=True,
        )
    threshold = trained.decision(args.threshold, agreed=True)
    if trained.multi_label:  # its CSV's label column holds sets of labels, split as the run split them
        if not is_table(args.data):
            raise UserError(
                f"{args.model_dir} is a multi-label run, scored on a CSV of labels, and --data {args.data} is none; "
                "give one (its labels split as the run's --label-separator).",
                agreed=True,
            )
        table = trained.table_options(table)
    # Other tools' records are read as the run read its own (the same labels, the same names), but for what is given.
    records = dataclasses.replace(record_options(args, trained.data, trained.classes), split=args.data_split)
    given = any(getattr(args, name) is not None for name in RECORD_FIELDS)
    images = evaluation_set(
        args.data, trained.classes, "--data", args.on_bad_image, ctx, s3=s3, table=table, records=records
    )
    if given:
        refuse_unused(records, images)
    refuse_split(args.data_split, "--data-split", images, args.data)
    held_out = eval_dataset(
        images,
        rank=ctx.rank,
        size=ctx.size,
        batch_size=args.batch_size,
        image_size=trained.image_size,
        crop_fraction=trained.crop_fraction,
        preprocess=trained.preprocess,
        s3=s3,
        alpha_background=args.alpha_background or trained.alpha_background,
    )
    with input_errors(ctx.rank, held_out.reader, during="evaluation"):
        if trained.multi_label:  # exact counts at the threshold and average precision
            result = evaluate_multi(trained.model, held_out.dataset, ctx, threshold, name="evaluate")
        elif trained.head is None:
            result = evaluate(trained.model, held_out.dataset, len(trained.classes), ctx, name="evaluate")
        else:
            scorer = ShardedScorer(trained.model, trained.head, len(trained.classes), ctx.rank, ctx.size)
            result = evaluate_sharded(scorer, held_out.dataset, len(trained.classes), ctx, name="evaluate")
    if result.skipped and args.on_bad_image == "fail":
        first = images.paths[result.skipped[0]]
        raise UserError(
            f"cannot decode image {first} ({len(result.skipped)} in all), met during evaluation; "
            f"fix or remove it, or pass --on-bad-image skip.",
            agreed=True,
        )

    # Horovod: the other ranks wait for rank 0's report, so that every rank ends together (a
    # launcher that ends a job soon after its first rank ends, as srun --wait, cuts nothing short).
    def report() -> None:
        _report(args, ctx, trained, images, result, s3)
        if mirror is not None:
            mirror.push_outputs()

    ctx.on_root(report, name="evaluate_report")
    return 0


def _report(args, ctx, trained, images, result, s3) -> None:
    """Rank 0: the skipped images, ``evaluation.json``, the printed table and ``confusion.png``."""
    from hvd_train.data.images import why_undecodable
    from hvd_train.log import get_logger
    from hvd_train.results import plots

    met = [images.paths[i] for i in result.skipped]
    skipped = [{"path": p, "reason": r, "found": "check"} for p, r in getattr(images, "skipped", ())]
    skipped += [{"path": p, "reason": r, "found": "evaluation"} for p, r in zip(met, why_undecodable(met, s3))]
    for item in skipped[len(skipped) - len(met) :]:
        get_logger().warning("skipped %s (cannot be decoded, not scored): %s", item["path"], item["reason"])
    if trained.multi_label:
        _report_multi(args, ctx, trained, result, skipped)
        return
    per_class = result.per_class_accuracy()
    report = {
        "data": args.data,
        "images": result.count,
        "accuracy": result.accuracy,
        "top5": result.top5,
        "top_k": result.k,
        "loss": result.loss,
        "classes": trained.classes,
        "per_class_accuracy": dict(zip(trained.classes, per_class)),
        "confusion_matrix": plots.confusion_to_json(result.confusion),
        "world_size": ctx.size,
        "seconds": round(result.seconds, 3),
        "skipped_images": skipped,
    }
    path = _write_report(args, report)
    width = max(len(c) for c in trained.classes)
    print(f"images    {result.count}")
    print(f"accuracy  {result.accuracy:.4f}")
    print(f"top-{result.k}     {result.top5:.4f}")
    print(f"loss      {result.loss:.4f}")
    if result.confusion.unanswered():  # a diverged model: no class for these, each a miss
        print(f"no class  {result.confusion.unanswered()} (their scores are not finite; each counts as a miss)")
    many = len(trained.classes) > plots.MANY_CLASSES
    shown = list(zip(trained.classes, per_class))
    if many:  # the worst; every class is in the report
        shown = sorted((s for s in shown if s[1] is not None), key=lambda s: s[1])[:SHOWN]
        print(f"the {len(shown)} classes of lowest accuracy (all {len(trained.classes)} in {path}):")
    for name, acc in shown:
        print(f"  {name:<{width}}  {'-' if acc is None else f'{acc:.4f}'}")
    if many:
        print(f"the {SHOWN} most confused pairs (true class -> predicted: images, share of the true class)")
        for true, taken, n, share in plots.most_confused(result.confusion, trained.classes, SHOWN):
            print(f"  {true} -> {taken}: {n}, {share:.3f}")
    else:
        print("confusion matrix (rows: true class, columns: predicted)")
        for name, row in zip(trained.classes, result.confusion.dense().tolist()):
            print(f"  {name:<{width}}  " + " ".join(f"{n:5d}" for n in row))
    picture = os.path.join(os.path.dirname(os.path.abspath(path)), plots.CONFUSION)
    drawn = plots.draw(
        picture, lambda: plots.confusion(result.confusion, trained.classes, picture, f"evaluate {args.data}")
    )
    get_logger().info("wrote %s%s", path, f" and {picture}" if drawn else "")


def _report_multi(args, ctx, trained, result, skipped: list[dict]) -> None:
    """Rank 0: a multi-label run's ``evaluation.json`` and printed scores (counts, precision, recall, F1 and
    average precision per class; the worst ``SHOWN`` by average precision when there are many classes)."""
    from hvd_train.log import get_logger
    from hvd_train.results import plots
    from hvd_train.results.multilabel import scores

    found = scores(result, trained.classes)
    report = {
        "data": args.data,
        "task": "multi_label",
        **found,
        "classes": trained.classes,
        "world_size": ctx.size,
        "skipped_images": skipped,
    }
    path = _write_report(args, report)

    def shown(x) -> str:
        return "-" if x is None else f"{x:.4f}"

    print(f"images     {found['images']}")
    print(f"mAP        {shown(found['map'])}")
    print(f"F1         {shown(found['f1'])} (micro, at {found['threshold']:g})")
    print(f"precision  {shown(found['precision'])}")
    print(f"recall     {shown(found['recall'])}")
    print(f"loss       {shown(found['loss'])}")
    rows = list(found["per_class"].items())
    if len(rows) > plots.MANY_CLASSES:  # the worst; every class is in the report
        rows = sorted((r for r in rows if r[1]["ap"] is not None), key=lambda r: r[1]["ap"])[:SHOWN]
        print(f"the {len(rows)} classes of lowest average precision (all {len(trained.classes)} in {path}):")
    width = max(len(c) for c in trained.classes)
    print(f"  {'class':<{width}}  positives  precision  recall     F1         AP")
    for name, c in rows:
        numbers = "  ".join(f"{shown(c[k]):<9}" for k in ("precision", "recall", "f1", "ap"))
        print(f"  {name:<{width}}  {c['positives']:<9}  {numbers}".rstrip())
    get_logger().info("wrote %s", path)


def _write_report(args, report: dict) -> str:
    """Writes ``report`` to ``--report`` (default ``MODEL_DIR/evaluation.json``); returns its path.

    Raises:
        UserError: the file cannot be written (one line naming it and the fix).
    """
    from hvd_train.errors import UserError

    path = args.report or os.path.join(args.model_dir, "evaluation.json")
    try:
        files.write_json(path, report)
    except OSError as e:
        raise UserError(
            f"cannot write {path} ({e.strerror or e}); pass --report with a folder you can write."
        ) from None
    return path
