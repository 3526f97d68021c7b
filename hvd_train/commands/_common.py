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


# DataConfig's options of a CSV of labels, which the commands that read labelled images take as train does.
TABLE_FIELDS = ("image_root", "path_column", "label_column", "min_images_per_label")


def add_table_arguments(parser: argparse.ArgumentParser, training: bool = True) -> None:
    """``--image-root``, ``--path-column``, ``--label-column`` and (``training``) ``--min-images-per-label``, as
    ``train`` has them."""
    import dataclasses

    from hvd_train.config import DataConfig

    for f in dataclasses.fields(DataConfig):
        if f.name in TABLE_FIELDS[: None if training else -1]:
            kind = positive_int if isinstance(f.default, int) else str
            parser.add_argument(f.metadata["flag"], dest=f.name, type=kind, default=f.default, help=f.metadata["help"])


def table_options(args: argparse.Namespace, data: str):
    """The ``data.table.TableOptions`` of ``add_table_arguments``' options, for the CSV ``data``.

    Raises:
        UserError: such an option is given and ``data`` is no CSV of labels.
    """
    from hvd_train.data.table import TableOptions, is_table
    from hvd_train.errors import UserError

    options = TableOptions(
        args.path_column, args.label_column, args.image_root, getattr(args, "min_images_per_label", 2)
    )
    given = [f"--{name.replace('_', '-')}" for name in TABLE_FIELDS[:-1] if getattr(args, name)]
    if given and not is_table(data):
        raise UserError(f"{given[0]} tells how a CSV of labels is read, and {data} is none; leave it out.")
    return options
