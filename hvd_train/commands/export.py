"""``hvd-train export``: the trained classifier as SavedModel, TFLite and ONNX, preprocessing inside."""

from __future__ import annotations

import argparse
import os

from hvd_train.commands._common import (
    CSV_LABELS,
    CSV_PATHS,
    add_csv_arguments,
    add_s3_endpoint_argument,
    csv_options,
    positive_int,
)

FORMATS = ("savedmodel", "tflite", "onnx")
QUANTIZATIONS = ("none", "float16", "int8")


def formats(text: str) -> list[str]:
    given = [f.strip().lower() for f in text.split(",") if f.strip()]
    unknown = [f for f in given if f not in FORMATS]
    if unknown or not given:
        raise argparse.ArgumentTypeError(
            f"unknown format {', '.join(map(repr, unknown)) or repr(text)}: give any of {','.join(FORMATS)}, "
            "comma separated"
        )
    return sorted(set(given), key=FORMATS.index)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="export a trained run as SavedModel, TFLite and ONNX with its preprocessing inside",
        description="Export the model of a finished run (its --output folder) for serving: a SavedModel that takes "
        "encoded images or uint8 tensors and answers with probabilities, top-k indices and class names; TFLite "
        "and ONNX files that take a uint8 image already cut to size. Each export folder holds labels.json, a "
        "README of the input contract and manifest.json (source run, weights digest, SHA-256 of each file, "
        "versions). --check runs every file in its own runtime against `hvd-train predict`.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --output folder (or S3 prefix) of `hvd-train train`")
    parser.add_argument(
        "--format",
        type=formats,
        default=list(FORMATS),
        help=f"formats to write, comma separated, any of {','.join(FORMATS)} (default: all)",
    )
    parser.add_argument("--output", metavar="DIR", help="folder to write (made anew; default: RUN_DIR/export)")
    parser.add_argument(
        "--quantize",
        choices=QUANTIZATIONS,
        default="none",
        help="weights of the TFLite and ONNX files; the SavedModel stays float32 (default: none)",
    )
    parser.add_argument(
        "--calibration-images",
        type=positive_int,
        default=200,
        help="int8: training images to calibrate on, drawn with a fixed seed (default: 200)",
    )
    parser.add_argument(
        "--calibration-data",
        metavar="PATH",
        help="int8: a local folder (or CSV) of images to calibrate on (default: the run's training images)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run each file in its runtime (TensorFlow, LiteRT, ONNX Runtime) and compare with predict; "
        "exit 1 when a format misses its goal",
    )
    parser.add_argument(
        "--check-data",
        metavar="DIR",
        help="labelled images (one folder per class, or a CSV of labels) to check on (default: the run's held-out "
        "images)",
    )
    parser.add_argument(
        "--top-k", type=positive_int, default=5, help="class indices and names the SavedModel returns (default: 5)"
    )
    add_csv_arguments(parser, *CSV_PATHS, *CSV_LABELS)
    add_s3_endpoint_argument(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from hvd_train.data.storage import S3Options
    from hvd_train.distributed import start
    from hvd_train.errors import UserError
    from hvd_train.files import read_json
    from hvd_train.log import get_logger
    from hvd_train.results.export import folder as export_folder
    from hvd_train.results.inference import load_trained
    from hvd_train.training import s3_mirror

    log = get_logger("export")
    args.table = csv_options(args, args.check_data, args.calibration_data)
    ctx = start.init()
    if ctx.size > 1:
        raise UserError("hvd-train export runs as one process: run it without horovodrun or mpirun.")
    # A run in S3: its local copy; the export is uploaded beside it.
    args.run_dir, mirror = s3_mirror.open_run(args.run_dir, S3Options(endpoint=args.s3_endpoint), "RUN_DIR")
    trained = load_trained(args.run_dir)
    summary = read_json(os.path.join(args.run_dir, "summary.json"), {})
    folder = args.output or os.path.join(args.run_dir, "export")
    if os.path.abspath(folder) == os.path.abspath(args.run_dir):
        raise UserError(
            f"--output {folder} is the run folder itself; give a folder of its own (default: RUN_DIR/export)."
        )
    if os.path.exists(folder) and not (os.path.isdir(folder) and export_folder.is_export(folder)):
        raise UserError(
            f"--output {folder} exists and is not a folder hvd-train export wrote (it has no manifest.json of "
            "one), so it is not replaced; give a new folder, or remove that one yourself."
        )
    _check_installed(args)
    calibrate = args.quantize == "int8" and not {"tflite", "onnx"}.isdisjoint(args.format)
    data = None  # the run's own images, read again only where no other images are given
    if (args.check and not args.check_data) or (calibrate and not args.calibration_data):
        data = _run_images(args.run_dir, ctx, args.s3_endpoint)
    calibration = _calibration(args, data) if calibrate else None
    check = _check_images(args, data, trained, ctx) if args.check else None
    manifest = export_folder.export(
        args.run_dir,
        trained,
        summary,
        args.format,
        args.quantize,
        folder,
        min(args.top_k, len(trained.classes)),
        calibration,
        check,
    )
    log.info("exported %s to %s", ", ".join(e["path"] for e in manifest["formats"]), os.path.abspath(folder))
    if mirror is not None:
        mirror.push_outputs()
    if "check" not in manifest:
        return 0
    failed = 0
    log.info("parity with predict on %d images (%s):", manifest["check"]["images"], manifest["check"]["source"])
    for result in manifest["check"]["formats"]:
        line = (
            f"  {result['name']:<16} top-1 agreement {result['top1_agreement']:.2%}, "
            f"max |Δp| {result['max_abs_diff']:.2e}"
        )
        if "decision_agreement" in result:  # a multi-label run's
            line += f", decisions {result['decision_agreement']:.2%} alike"
        if "accuracy" in result:
            line += f", accuracy {result['accuracy']:.4f} (predict {result['predict_accuracy']:.4f})"
        if "serving_uint8" in result:
            pixels_in = result["serving_uint8"]
            line += (
                f"; serving_uint8 top-1 agreement {pixels_in['top1_agreement']:.2%}, "
                f"max |Δp| {pixels_in['max_abs_diff']:.2e}"
            )
        if result["passed"]:
            log.info("%s", line)
        else:
            failed += 1
            log.error("%s: FAILED, %s", line, "; ".join(result["failed"]))
    return 1 if failed else 0


# What each format needs beyond TensorFlow, to write it and (--check) to run it: the `export` extra.
NEEDS = {"onnx": (("tf2onnx", "onnxruntime"), ("onnxruntime",)), "tflite": ((), ("ai_edge_litert",))}


def _check_installed(args) -> None:
    from importlib.util import find_spec

    from hvd_train.errors import UserError

    for fmt in args.format:
        write, run = NEEDS.get(fmt, ((), ()))
        missing = [m for m in (*write, *(run if args.check else ())) if find_spec(m) is None]
        if missing:
            raise UserError(
                f"--format {fmt}{' --check' if args.check else ''} needs {' and '.join(missing)}, not installed "
                "here; install them with: pip install 'hvd_train[export]'"
            )


def _run_images(run_dir: str, ctx, endpoint: str = ""):
    """The run's training and held-out images, split as training split them (``endpoint``: their store's, where
    given, not the one the run was trained with)."""
    import dataclasses

    from hvd_train.config import from_sources
    from hvd_train.errors import UserError
    from hvd_train.training.stages import training_sets

    cfg = from_sources(None, os.path.join(run_dir, "run_config.yaml"))
    if endpoint:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, s3_endpoint=endpoint))
    try:
        return training_sets(cfg.data, cfg.run.seed, ctx)
    except UserError as e:
        raise UserError(
            f"the run's images ({cfg.data.train}) cannot be read again: {e} Pass --check-data and, for int8, "
            "--calibration-data instead."
        ) from None


def _where(data) -> str:
    """The folder or URL a listed image set or shard set came from."""
    return getattr(data, "url", "") or data.prefix.rstrip("/") or "a list of files"


def _local_paths(data, flag: str, fix: str) -> list[str]:
    from hvd_train.data.folder import ImageSet
    from hvd_train.errors import UserError

    if not isinstance(data, ImageSet):
        raise UserError(f"{flag}: {_where(data)} is a packed shard set, which the export reads no images from; {fix}")
    paths = [str(p) for p in data.paths]
    if paths and paths[0].startswith("s3://"):
        raise UserError(f"{flag}: the images are in S3, which the export does not read; {fix}")
    return paths


def _calibration(args, data):
    import numpy as np

    from hvd_train.commands.predict import expand
    from hvd_train.data.images import find_bad_images
    from hvd_train.errors import UserError
    from hvd_train.log import get_logger
    from hvd_train.results.export.parity import Images

    if args.calibration_data:
        paths = expand([args.calibration_data], args.table)
        source = args.calibration_data
    else:
        fix = "pass --calibration-data with a local folder of training-like images."
        train, _ = data
        paths = _local_paths(train, "int8 calibration", fix)
        source = f"the run's training images ({_where(train)})"
    if not paths:
        raise UserError("int8 needs calibration images and found none; pass --calibration-data with a folder of them.")
    if len(paths) > args.calibration_images:
        rng = np.random.default_rng(0)
        paths = [paths[i] for i in sorted(rng.choice(len(paths), args.calibration_images, replace=False))]
    # Decoded once each first: an image that cannot be is left out, as training leaves it out.
    bad = dict(find_bad_images(paths))
    if bad:
        log = get_logger("export")
        log.warning("int8 calibration: skipping %d image(s) that cannot be decoded:", len(bad))
        for path, reason in bad.items():
            log.warning("  skipped %s: %s", path, reason)
        paths = [p for p in paths if p not in bad]
        if not paths:
            raise UserError(f"none of the int8 calibration images of {source} can be decoded; check them.")
    return Images(paths, None, f"{len(paths)} of {source}")


def _check_images(args, data, trained, ctx):
    from hvd_train.data.sources import checked, open_data
    from hvd_train.errors import UserError
    from hvd_train.results.export.parity import Images

    fix = "pass --check-data with a local folder of labelled images (one folder per class) or a CSV of labels."
    if args.check_data:
        from hvd_train.config import DataConfig

        s3 = DataConfig(s3_endpoint=args.s3_endpoint).s3_options()
        table = trained.table_options(args.table)  # a multi-label run's labels split as the run's
        images = open_data(args.check_data, "--check-data", s3, classes=trained.classes, table=table)
        source = args.check_data
    else:
        _, images = data
        if images is None:
            raise UserError(f"the run held no images out (--val-split 0, no --val-data); {fix}")
        source = f"the run's held-out images ({_where(images)})"
    _local_paths(images, "--check", fix)
    images = checked(images, "--check-data", "skip", ctx, check="full")
    paths = [str(p) for p in images.paths]
    if not paths:
        raise UserError(f"no readable images to check on in {source}; {fix}")
    # A multi-label set's labels are sets: its check is on decisions, not on one class an image.
    labels = None if trained.multi_label else [int(x) for x in images.labels]
    return Images(paths, labels, source)
