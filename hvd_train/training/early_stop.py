"""``--early-stop PATIENCE``: stop once the held-out score has not improved for PATIENCE epochs; save the best.

Every rank sees the same held-out scores (they are summed over all ranks),
so every rank takes the same decision after the same epoch, with no
exchange of its own. The best epoch and its score are part of the
``TrainState``, in checkpoints and elastic commits alike: a resumed run
counts on where it stopped, and a rerun with a larger patience or more
epochs trains on. The checkpoint written at the best epoch's end is kept
whatever ``--keep-checkpoints`` says (``checkpoints.save``); at the end,
``restore_best`` loads it (the averaged weights with it under ``--ema``),
and the final evaluation scores it again.
"""

from __future__ import annotations

import math

from hvd_train.config.choices import RunConfig
from hvd_train.distributed import gradients
from hvd_train.distributed.context import Context
from hvd_train.log import get_logger
from hvd_train.model.network import Net
from hvd_train.training import checkpoints, sharded_stages
from hvd_train.training.job import Job
from hvd_train.training.state import TrainState

log = get_logger("train")


def better(metric: str, score: float, best: float | None) -> bool:
    """Whether ``score`` beats ``best`` (strictly): lower for a loss, higher otherwise."""
    if score is None or not math.isfinite(score):
        return False
    if best is None:
        return True
    return score < best if metric.endswith("loss") else score > best


def note(run: RunConfig, state: TrainState, epoch: int, logs: dict, is_root: bool) -> None:
    """Records epoch ``epoch``'s held-out score in ``state`` (before ``state.next_epoch``)."""
    if not run.early_stop:
        return
    score = logs.get(run.early_stop_metric)
    if better(run.early_stop_metric, score, state.best_score):
        state.best_epoch, state.best_score = epoch, float(score)
    elif is_root and state.best_score is None:
        log.warning("early stop: %s of epoch %d is %s, not a score to keep", run.early_stop_metric, epoch + 1, score)
    elif is_root:
        log.info(
            "early stop: %s %.4f, no better than %.4f of epoch %d (%d of %d epochs without a better one)",
            run.early_stop_metric,
            score if score is not None else math.nan,
            state.best_score,
            state.best_epoch + 1,
            epoch - state.best_epoch,
            run.early_stop,
        )


def exhausted(run: RunConfig, state: TrainState) -> bool:
    """Whether the patience is used up: ``early_stop`` finished epochs after the best without a better one."""
    return bool(run.early_stop) and state.best_epoch >= 0 and state.epoch - 1 - state.best_epoch >= run.early_stop


def restore_best(job: Job, ctx: Context, net: Net, state: TrainState) -> int | None:
    """Loads the best epoch's weights on every rank when a later epoch ended the run.

    The best epoch's checkpoint may be of the other layout of the head (a run
    resumed with or without ``--head-parallel`` since): it is read as a resume
    reads it (``sharded_stages.restore_any_layout``).

    Returns:
        The epoch (1-based) whose weights the net holds now, or None when
        they are the last epoch's already (or there is no best).

    Raises:
        UserError: on every rank, when the best epoch's checkpoint does not fit this model.
    """
    run = job.cfg.run
    if not run.early_stop or state.best_epoch < 0 or state.best_epoch == state.epoch - 1:
        return None

    def load() -> tuple[int, object, str, str] | None:
        found = checkpoints.of_epoch_end(run.output, state.best_epoch + 1)
        if found is None:
            log.warning(
                "early stop: the checkpoint of the best epoch (%d) is gone from %s; the last epoch's weights "
                "are saved instead",
                state.best_epoch + 1,
                checkpoints.folder(run.output),
            )
            return None
        local, head = sharded_stages.restore_any_layout(job, net, found)
        log.info(
            "early stop: the model of epoch %d (%s %.4f) is the one saved, from %s",
            state.best_epoch + 1,
            run.early_stop_metric,
            state.best_score,
            found.path,
        )
        # The values of each rank, equal at an epoch's end (the statistics and their averages
        # are averaged over the ranks then): the first rank's row.
        return state.best_epoch + 1, local[0], head, found.path

    loaded = ctx.on_root(load, name="best_epoch")
    if loaded is None:
        return None
    epoch, row, head, path = loaded
    # Horovod: every rank takes rank 0's weights of the best epoch, and its statistics.
    gradients.broadcast_variables(net.variables, ctx)
    net.write_local(row)
    sharded_stages.take_head(net, ctx, head, path)  # --head-parallel: each rank's classes of the best epoch's head
    return epoch
