"""From ``--data`` / ``--val-data`` to checked lists of images that all ranks share.

Rank 0 lists the folders once and shares the lists; then every rank decodes
its share of the images once to find unreadable ones, and all ranks agree on
what is skipped. The result is identical on every rank, which is what makes
sharding and step counts agree.
"""

from __future__ import annotations

from hvd_train.config import DataConfig
from hvd_train.data.folder import ImageSet, list_folder, split_per_class
from hvd_train.data.images import find_bad_images, report_bad_images
from hvd_train.distributed import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger

log = get_logger("data")


def training_sets(cfg: DataConfig, seed: int, ctx: Context, threads: int = 0) -> tuple[ImageSet, ImageSet | None]:
    """The training images and the held-out images (None when there are none).

    Raises:
        UserError: on every rank, for any problem with the data.
    """

    def listing():
        train = list_folder(cfg.train, "--data")
        if cfg.val:
            return train, list_folder(cfg.val, "--val-data", classes=train.classes)
        if cfg.val_split > 0:
            return split_per_class(train, cfg.val_split, seed)
        return train, None

    train, val = ctx.on_root(listing, name="list_data")
    train = checked(train, "--data", cfg.on_bad_image, ctx, threads)
    if val is not None:
        val = checked(val, "--val-data" if cfg.val else "--data", cfg.on_bad_image, ctx, threads)
        if len(val) == 0:
            val = None
    if val is None and ctx.is_root:
        log.warning("no held-out images (--val-data not given, --val-split 0): accuracy is not measured")
    return train, val


def evaluation_set(path: str, classes: list[str], flag: str, policy: str, ctx: Context, threads: int = 0) -> ImageSet:
    """Held-out images of ``path``, labelled with the trained ``classes``."""
    images = ctx.on_root(lambda: list_folder(path, flag, classes=classes), name="list_eval")
    return checked(images, flag, policy, ctx, threads)


def checked(images: ImageSet, flag: str, policy: str, ctx: Context, threads: int = 0) -> ImageSet:
    """``images`` without the ones that cannot be decoded, the same on every rank.

    Each rank decodes every ``size``-th image; the lists of failures are
    gathered so all ranks skip (or fail on) the same images.
    """
    mine = images.paths[ctx.rank :: ctx.size]
    mine_bad = ctx.agree(lambda: find_bad_images(mine, threads), name=f"check{flag}")
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
