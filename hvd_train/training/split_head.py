"""The stages of a run that split its head (``--head-parallel``): its groups, and a resume from an unsplit run."""

from __future__ import annotations

import os

from hvd_train.compat import tf
from hvd_train.config import TrainConfig
from hvd_train.distributed import groups
from hvd_train.distributed.context import Context
from hvd_train.distributed.groups import HeadGroups
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.training import checkpoints
from hvd_train.training.job import Job

log = get_logger("train")


def unsplit_head(job: Job, found: checkpoints.Found) -> str:
    """The head of an unsplit run's checkpoint, written whole to a staging folder (rank 0)."""
    from hvd_train.model.sharded_net import staging, whole_head_files

    folder = staging(job.cfg.run.output) + "-resume"
    try:
        whole_head_files(
            job.cfg, len(job.classes), job.image_size, job.precision, os.path.join(found.path, "ckpt"), folder
        )
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        raise UserError(
            f"checkpoint {found.path} does not fit this model ({str(e).strip().splitlines()[0][:200]}); use a new "
            "--output, or --no-resume to start over."
        ) from None
    return folder


def head_groups(cfg: TrainConfig, ctx: Context, classes: int) -> HeadGroups | None:
    """``--head-parallel``: the groups that split the head, registered with Horovod; None without.

    Raises:
        UserError: on every rank alike, for a G this job or these classes cannot have.
    """
    parallel = cfg.horovod.head_parallel
    if not parallel:
        return None
    parallel = ctx.size if parallel == -1 else parallel
    try:
        groups.check(parallel, ctx.size, classes)
        if parallel == 1:
            raise UserError(
                f"--head-parallel {cfg.horovod.head_parallel} splits the head over one worker, which is no split: "
                f"drop --head-parallel (this job has {ctx.size} worker(s))."
            )
    except UserError as e:  # every rank finds the same: rank 0 says it
        raise UserError(str(e), agreed=True) from None
    if ctx.is_root:
        log.info(
            "the head's %d classes split over groups of %d workers (%d group(s)), about %d classes a worker",
            classes,
            parallel,
            ctx.size // parallel,
            classes // parallel,
        )
    return groups.register(groups.Layout(ctx.size, parallel), ctx.rank)
