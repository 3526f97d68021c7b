"""The stages of a run that shards its head (``--head-parallel``): its groups, a resume from an unsharded run, and
the saved model's form (``--head-save``)."""

from __future__ import annotations

import contextlib
import os
import shutil

from hvd_train.compat import tf
from hvd_train.config import TrainConfig
from hvd_train.distributed import groups, memory
from hvd_train.distributed.context import Context
from hvd_train.distributed.groups import HeadGroups
from hvd_train.errors import UserError, first_line
from hvd_train.log import get_logger
from hvd_train.model import sharded_files
from hvd_train.results.inference import FEATURES, HEAD_ARRAYS, MODEL
from hvd_train.training import checkpoints
from hvd_train.training.job import Job

log = get_logger("train")


def unsharded_head(job: Job, found: checkpoints.Found) -> str:
    """The head of an unsharded run's checkpoint, written whole to a staging folder (rank 0)."""
    from hvd_train.model.sharded_net import staging, whole_head_files

    folder = staging(job.cfg.run.output) + "-resume"
    try:
        whole_head_files(
            job.cfg, len(job.classes), job.image_size, job.precision, os.path.join(found.path, "ckpt"), folder
        )
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        raise UserError(
            f"checkpoint {found.path} does not fit this model ({first_line(e, limit=200)}); use a new "
            "--output, or --no-resume to start over."
        ) from None
    return folder


def restore_any_layout(job: Job, net, found: checkpoints.Found):
    """Rank 0 restores ``found``, of a run with its head sharded or not, into ``net``, of either layout.

    Returns:
        The checkpoint's rows of local values, and the folder of the head's files that ``take_head``
        splits over the ranks of a ``ShardedNet`` (``found.path``, or a staging folder for the head of an
        unsharded run's checkpoint).

    Raises:
        UserError: the checkpoint does not fit this model.
    """
    from hvd_train.model.catalogue import HEAD_LAYER
    from hvd_train.model.sharded_net import ShardedNet, features_view, head_arrays

    head = found.path
    if isinstance(net, ShardedNet):
        if not sharded_files.has_head(found.path):  # an unsharded run's checkpoint: its head, whole, into files
            head = unsharded_head(job, found)
        sharded_files.check(head, net.head_arrays(), net.classes)
        rows = checkpoints.restore(found, net.model, net.optimizer)["rows"]
    elif sharded_files.has_head(found.path):  # a sharded run's checkpoint: the whole head from its files
        layer = net.model.get_layer(HEAD_LAYER)
        arrays = head_arrays(layer.kernel, layer.bias, net.optimizer)
        classes = len(job.classes)
        sharded_files.check(found.path, arrays, classes)
        rows = checkpoints.restore(found, features_view(net.model), net.optimizer, partial=True)["rows"]
        for name, variable in arrays.items():
            variable.assign(sharded_files.read_columns(found.path, name, 0, classes, classes))
    else:
        rows = checkpoints.restore(found, net.model, net.optimizer)["rows"]
    return rows, head


def take_head(net, ctx: Context, head: str | None, path: str | None) -> None:
    """A ``ShardedNet``'s ranks each take their classes of the head in ``head`` (rank 0's, from
    ``restore_any_layout`` of checkpoint ``path``); a staging folder is removed after. Nothing otherwise."""
    from hvd_train.model.sharded_net import ShardedNet

    if not isinstance(net, ShardedNet):
        return
    net.restore_head(head, ctx.is_root)
    if ctx.is_root and head != path:
        shutil.rmtree(head, ignore_errors=True)


def head_groups(cfg: TrainConfig, ctx: Context, classes: int) -> HeadGroups | None:
    """``--head-parallel``: the groups that shard the head, registered with Horovod; None without.

    Raises:
        UserError: on every rank alike, for a G this job or these classes cannot have.
    """
    parallel = cfg.horovod.head_parallel
    if not parallel:
        return None
    parallel = ctx.size if parallel == -1 else parallel
    if cfg.horovod.elastic:  # the world an elastic job gets (after a reset too): the G nearest that fits it
        asked, parallel = parallel, groups.nearest_parallel(parallel, ctx.size, classes)
        if parallel != asked and ctx.is_root:
            log.warning(
                "--head-parallel %d does not fit %d worker(s) and %d classes: the head is sharded over groups of %d "
                "(%s)",
                asked,
                ctx.size,
                classes,
                parallel,
                "the next that does: shards no larger" if parallel > asked else "fewer workers or classes than that",
            )
    try:
        groups.check(parallel, ctx.size, classes)
        if cfg.horovod.head_parallel == 1 or (parallel == 1 and not cfg.horovod.elastic):
            raise UserError(
                f"--head-parallel {cfg.horovod.head_parallel} shards the head over one worker, which shards nothing: "
                f"drop --head-parallel (this job has {ctx.size} worker(s))."
            )
    except UserError as e:  # every rank finds the same: rank 0 says it
        raise UserError(str(e), agreed=True) from None
    if ctx.is_root:
        log.info(
            "the head's %d classes sharded over groups of %d workers (%d group(s)), about %d classes a worker",
            classes,
            parallel,
            ctx.size // parallel,
            classes // parallel,
        )
    return groups.register(groups.Layout(ctx.size, parallel), ctx.rank)


def choose_save(asked: str, needed: int, room: memory.Room) -> tuple[str, str]:
    """How rank 0 saves a sharded head, ``whole`` or ``files`` (``--head-save``), and why, in one line.

    Args:
        needed: bytes rank 0 needs to build and write the whole model.
        room: what rank 0 may still allocate.
    """
    size = f"{needed / 2**30:.2f} GiB"
    if asked == "whole" or (asked == "auto" and needed <= room.bytes):
        why = "--head-save whole" if asked == "whole" else f"saving it takes {size}, rank 0 has room for {room}"
        return "whole", f"the model saved whole in {MODEL} ({why})"
    why = "--head-save files" if asked == "files" else f"saving it whole takes {size}, rank 0 has room for {room} only"
    return "files", (
        f"the model saved as {FEATURES} and the head's arrays ({why}); `hvd-train evaluate` under horovodrun -np N "
        "scores it with the head sharded N ways"
    )


def save_form(cfg: TrainConfig, net, classes: int) -> tuple[str, str]:
    """``choose_save`` for this run: the whole model is built, then written (a copy of its weights)."""
    width = int(net.kernel.shape[0])
    needed = 2 * 4 * ((width + 1) * classes + net.model.count_params())
    return choose_save(cfg.horovod.head_save, needed, memory.room())


def move_head_files(staging: str, output: str) -> None:
    """The kernel and bias gathered into ``staging`` moved into ``output``, beside ``features.keras``."""
    for name in HEAD_ARRAYS:
        os.replace(sharded_files.path_of(staging, name), sharded_files.path_of(output, name))


def remove_other_form(output: str, form: str) -> None:
    """The files of the other form of saved model, from an earlier run into ``output``."""
    stale = [MODEL] if form == "files" else [FEATURES, *(sharded_files.path_of("", n) for n in HEAD_ARRAYS)]
    for name in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output, name))
