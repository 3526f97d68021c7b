"""From ``--data`` / ``--val-data`` to checked lists of images that all ranks share.

Rank 0 lists the folders (local or S3) or reads the shard set's manifest
once and shares the result; then every rank decodes its share of a folder's
images once to find unreadable ones, and all ranks agree on what is skipped
(``hvd-train pack`` checked the images of a shard set already). The result
is identical on every rank, which is what makes sharding and step counts
agree.
"""

from __future__ import annotations

from hvd_train.data import packed
from hvd_train.data.folder import ImageSet, list_folder
from hvd_train.data.images import find_bad_images, report_bad_images
from hvd_train.data.packed import ShardSet
from hvd_train.data.storage import S3Options
from hvd_train.distributed import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")


Data = ImageSet | ShardSet


def open_data(url: str, flag: str, s3: S3Options, classes: list[str] | None = None) -> Data:
    """The image folder or shard set at ``url`` (local or ``s3://``)."""
    if packed.is_shard_set(url, s3):
        return packed.load(url, flag, s3, classes)
    return list_folder(url, flag, classes=classes, s3=s3)


def evaluation_set(
    path: str, classes: list[str], flag: str, policy: str, ctx: Context, threads: int = 0, s3: S3Options | None = None
) -> Data:
    """Held-out images of ``path``, labelled with the trained ``classes``."""
    s3 = s3 or S3Options()
    images = ctx.on_root(lambda: open_data(path, flag, s3, classes=classes), name="list_eval")
    return checked(images, flag, policy, ctx, threads, s3)


def checked(images: Data, flag: str, policy: str, ctx: Context, threads: int = 0, s3: S3Options | None = None) -> Data:
    """``images`` without the ones that cannot be decoded, the same on every rank.

    Each rank decodes every ``size``-th image; the lists of failures are
    gathered so all ranks skip (or fail on) the same images. Shard sets were
    checked when they were packed.
    """
    if isinstance(images, ShardSet):
        return images
    mine = images.paths[ctx.rank :: ctx.size]
    mine_bad = ctx.agree(lambda: find_bad_images(mine, threads, s3), name=f"check{flag}")
    bad = sorted(item for part in ctx.allgather_object(mine_bad, name=f"bad{flag}") for item in part)
    try:
        report_bad_images(bad, policy, flag, log if ctx.is_root else None)
    except UserError as e:
        raise UserError(str(e), agreed=True) from None
    if not bad:
        return images
    kept = images.without({p for p, _ in bad})
    empty = [c for c, n in zip(kept.classes, kept.counts()) if n == 0]
    if empty and flag == "--data":
        raise UserError(
            f"class {empty[0]!r} has no readable images left after skipping bad ones ({flag}); "
            f"add readable images or remove the class folder.",
            agreed=True,
        )
    return kept
