"""Arguments shared by the commands that use a trained model."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1. Received: {text!r}")
    return value


def natural_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0. Received: {text!r}")
    return value


def endpoint_url(text: str) -> str:
    if text and not text.startswith(("http://", "https://")):
        from hvd_train.data.storage import redact_url

        raise argparse.ArgumentTypeError(f"give a URL such as http://127.0.0.1:9000. Received: {redact_url(text)!r}")
    return text


def add_s3_endpoint_argument(parser: argparse.ArgumentParser) -> None:
    """``--s3-endpoint``: the store of a run, or of images, in ``s3://``."""
    parser.add_argument(
        "--s3-endpoint",
        type=endpoint_url,
        default="",
        help="URL of an S3-compatible store, for a run or images in s3:// (default: AWS_ENDPOINT_URL or AWS)",
    )


def add_trained_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model-dir``, ``--batch-size``, ``--on-bad-image``, ``--alpha-background`` and ``--s3-endpoint``."""
    parser.add_argument("--model-dir", required=True, help="the --output folder (or S3 prefix) of `hvd-train train`")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="images per worker per batch")
    parser.add_argument(
        "--on-bad-image", choices=("skip", "fail"), default="skip", help="skip (and list) or fail on unreadable images"
    )
    add_alpha_argument(parser, default=None, help="colour under transparent pixels (default: the training run's)")
    add_s3_endpoint_argument(parser)


def add_alpha_argument(parser: argparse.ArgumentParser, default: str | None, help: str) -> None:
    """``--alpha-background white|black|gray``."""
    from hvd_train.config import ALPHA_BACKGROUNDS

    parser.add_argument("--alpha-background", choices=ALPHA_BACKGROUNDS, default=default, help=help)


# DataConfig's options of a CSV of labels, which the other commands that read one take as train does.
CSV_PATHS = ("image_root", "path_column")  # where the images are: every command that reads a CSV
CSV_LABELS = ("label_column", "split_column")  # what labels them: evaluate and export's checks
CSV_TRAINING = ("label_column", "min_images_per_label", "split_column")  # pack, whose CSV is a training set


def add_csv_arguments(parser: argparse.ArgumentParser, *names: str) -> None:
    """DataConfig's options ``names`` (``CSV_PATHS`` and the like), with the flags and help ``train`` has."""
    import dataclasses

    from hvd_train.config import DataConfig

    for f in dataclasses.fields(DataConfig):
        if f.name in names:
            kind = positive_int if isinstance(f.default, int) else str
            parser.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=f.default, help=f.metadata["help"])


def csv_options(args: argparse.Namespace, *urls: str):
    """The ``data.table.TableOptions`` of the options ``add_csv_arguments`` gave, for the data ``urls``.

    Raises:
        UserError: such an option is given and none of ``urls`` is a CSV of labels (it would do nothing).
    """
    from hvd_train.data.table import TableOptions, is_table
    from hvd_train.errors import UserError

    default = TableOptions()
    options = TableOptions(
        getattr(args, "path_column", default.path_column),
        getattr(args, "label_column", default.label_column),
        getattr(args, "image_root", default.image_root),
        getattr(args, "min_images_per_label", default.min_per_label),
        getattr(args, "split_column", default.split_column),
    )
    given = [flag for flag, _ in options.given()]
    named = [url for url in urls if url]
    if given and not any(map(is_table, named)):
        what = f"{named[0]} is none" if named else "none is given"
        raise UserError(f"{given[0]} tells how a CSV of labels is read, and {what}; leave it out.")
    return options


RECORD_FIELDS = ("record_image_key", "record_label_key", "label_offset", "class_names")
RECORD_OWN = ("image_key", "label_key", "label_offset", "class_names")  # their names in RecordOptions


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """DataConfig's options of other tools' TFRecords, with the flags and help ``train`` has; None when not given
    (``record_options`` then takes the run's)."""
    import dataclasses

    from hvd_train.config import DataConfig

    for f in dataclasses.fields(DataConfig):
        if f.name in RECORD_FIELDS:
            kind = natural_int if isinstance(f.default, int) else str
            parser.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=None, help=f.metadata["help"])


def record_options(args: argparse.Namespace, run: dict | None = None, classes: list[str] | None = None):
    """The ``data.features.RecordOptions`` of the options ``add_record_arguments`` gave, each one not given taken
    from ``run`` (a run's ``data`` options), else its default. The run's ``--class-names`` are its ``classes``
    (the file it named may be elsewhere now)."""
    from hvd_train.data.features import RecordOptions

    run = run or {}
    values = {}
    for name, own in zip(RECORD_FIELDS, RECORD_OWN):
        given = getattr(args, name, None)
        values[own] = given if given is not None else run.get(name, getattr(RecordOptions(), own))
    if getattr(args, "class_names", None) is None and values["class_names"] and classes:
        values["class_names"], values["class_list"] = "", tuple(classes)
    return RecordOptions(**values)
