"""The end of an epoch on every rank: metrics averaged over ranks, BatchNorm statistics synced, held-out scores.

``close_epoch`` gives the epoch's logs (the same on every rank); ``evaluate_held_out``
scores every held-out image exactly once, spread over the ranks, and is what
the final evaluation calls too.
"""

from __future__ import annotations

import numpy as np

from hvd_train.data.images import why_undecodable
from hvd_train.data.pipeline import EvalInput, eval_dataset
from hvd_train.data.streams import input_errors
from hvd_train.distributed import gradients, start
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.model.network import Net
from hvd_train.results.evaluation import EvalResult, evaluate_sharded
from hvd_train.results.evaluation import evaluate as score
from hvd_train.results.multilabel import MultiLabelResult, evaluate_multi
from hvd_train.training.job import History, Job

log = get_logger("train")


class HeldOut:
    """This rank's held-out input, built once and read again at every epoch's end.

    Building it traces its decoding functions, about half a second on a CPU
    at every epoch's end when it was built anew. Another rank, world size or
    batch (an elastic reset) builds it again.
    """

    def __init__(self, job: Job):
        self.job = job
        self._key: tuple | None = None
        self._input: EvalInput | None = None

    def input(self, ctx: Context, batch_size: int) -> EvalInput:
        cfg = self.job.cfg
        threads = start.cpu_threads(ctx, cfg.horovod.threads_per_rank)
        key = (ctx.rank, ctx.size, batch_size, threads)
        if key != self._key:
            self._input = eval_dataset(
                self.job.val,
                rank=ctx.rank,
                size=ctx.size,
                batch_size=batch_size,
                image_size=self.job.image_size,
                crop_fraction=cfg.data.crop_fraction,
                preprocess=self.job.spec.preprocess_input(),
                threads=threads,
                s3=cfg.data.s3_options(),
                alpha_background=cfg.data.alpha_background,
            )
            self._key = key
        return self._input


def close_epoch(
    job: Job,
    ctx: Context,
    net: Net,
    epoch: int,
    batch_size: int,
    history: History,
    steps: int,
    seconds: float,
    waited,
    held_out: HeldOut,
    diverged,
) -> dict:
    """The logs of ``epoch``, the same on every rank; kept in ``history.epochs``.

    Args:
        batch_size: images per worker per step.
        steps, seconds: the steps this process ran in the epoch and their time (0 when none).
        waited: seconds this rank's input waited on storage in the epoch, or None without a storage reader.
        held_out: the held-out input, kept from epoch to epoch.
        diverged: makes the error of a diverged run (``Boundary.diverged``).

    Raises:
        Diverged: on every rank, when the epoch's loss is not finite.
    """
    logs = _averaged_metrics(net, ctx)
    if net.loss_diverged(logs["loss"]):  # the same average on every rank: all stop here
        raise diverged(f"the epoch's loss ({logs['loss']}, averaged over {ctx.size} rank(s))")
    _report_undecodable(job, ctx, history, epoch)
    logs["lr"] = float(net.optimizer.learning_rate.numpy())
    images = steps * batch_size * ctx.size
    logs["epoch_seconds"] = seconds
    logs["images_per_sec"] = images / seconds if seconds > 0 else None
    if waited is not None:
        _report_input_wait(ctx, epoch, waited, logs)
    # Horovod: BatchNorm statistics agree on all ranks before evaluation and saving.
    gradients.average_variables(net.statistics(), ctx, name=f"model_statistics.{epoch}")
    if job.val is not None:
        with net.averaged():  # --ema: the averaged weights are the ones scored (and saved)
            result = evaluate_held_out(job, ctx, net, batch_size, history, f"val.{epoch}", held_out)
        if isinstance(result, MultiLabelResult):
            logs.update(val_loss=result.loss, val_map=result.map, val_f1=result.f1)
        else:
            logs.update(val_loss=result.loss, val_accuracy=result.accuracy, val_top5=result.top5)
    history.epochs[epoch] = logs
    return logs


def evaluate_held_out(
    job: Job, ctx: Context, net: Net, batch_size: int, history: History, name: str, held_out: HeldOut | None = None
) -> EvalResult:
    """Scores every held-out image once (all ranks take part); kept as ``history.last_eval``."""
    inputs = (held_out or HeldOut(job)).input(ctx, batch_size)
    with input_errors(ctx.rank, inputs.reader):
        if getattr(job.val, "label_sets", None) is not None:  # a multi-label set: exact counts and average precision
            result = evaluate_multi(net.model, inputs.dataset, ctx, job.cfg.data.threshold, name=name)
        elif hasattr(net, "score_batch"):  # --head-parallel: scored by each group over all classes
            result = evaluate_sharded(net, inputs.dataset, len(job.classes), ctx, name=name)
        else:
            result = score(net.model, inputs.dataset, len(job.classes), ctx, name=name)
    history.last_eval = result
    if result.skipped:
        _skipped(job, ctx, history, [job.val.paths[i] for i in result.skipped], "evaluation")
    return result


def _report_undecodable(job: Job, ctx: Context, history: History, epoch: int) -> None:
    """Lists the training images that could not be decoded in ``epoch`` (on every rank alike)."""
    mine = sorted(history.undecodable)
    history.undecodable.clear()
    # Horovod: a count first, so the ranks gather the list only when there is one.
    if not ctx.allreduce_sum(np.array([len(mine)], np.float64), name=f"undecodable.{epoch}")[0]:
        return
    found = sorted({i for part in ctx.allgather_object(mine, name=f"undecodable_ids.{epoch}") for i in part})
    _skipped(job, ctx, history, [job.train.paths[i] for i in found], "training")


def _skipped(job: Job, ctx: Context, history: History, paths: list[str], when: str) -> None:
    """Records images met in ``when`` that could not be decoded; with ``--on-bad-image fail``, stops on all ranks.

    Every rank calls this with the same ``paths``, so all keep the same
    record and all stop alike.
    """
    new = [p for p in paths if p not in history.skipped]
    if not new:
        return
    # Rank 0 says why (it reads the few files again); the others only need the paths.
    reasons = why_undecodable(new, job.cfg.data.s3_options()) if ctx.is_root else [""] * len(new)
    if job.cfg.data.on_bad_image == "fail":
        reason = ctx.broadcast_object(reasons[0], name=f"bad_image.{when}")
        more = f" (and {len(new) - 1} more)" if len(new) > 1 else ""
        raise UserError(
            f"cannot decode image {new[0]}: {reason}{more}, met during {when}; fix or remove it and rerun "
            f"(the run resumes from its last checkpoint), or pass --on-bad-image skip.",
            agreed=True,
        )
    for path, reason in zip(new, reasons):
        history.skipped[path] = (reason, when)
    if ctx.is_root:
        treated = "given no weight" if when == "training" else "not scored"
        log.warning("skipped %d image(s) met during %s that cannot be decoded (%s):", len(new), when, treated)
        for path, reason in zip(new, reasons):
            log.warning("  skipped %s: %s", path, reason)


def _averaged_metrics(net: Net, ctx: Context) -> dict:
    mine = net.metric_results()
    names = sorted(mine)
    # Horovod: the epoch's loss and accuracy averaged over ranks.
    total = ctx.allreduce_sum(np.array([mine[k] for k in names], np.float64), name="metrics")
    return {k: float(v) / ctx.size for k, v in zip(names, total)}


def _report_input_wait(ctx: Context, epoch: int, waited: float, logs: dict) -> None:
    worst = max(ctx.allgather_object(waited, name=f"wait.{epoch}"))
    logs["input_wait_seconds"] = worst
    seconds = float(logs.get("epoch_seconds") or 0.0)
    if ctx.is_root:
        log.info(
            "epoch %d: input waited %.2f s on storage (slowest rank; %.0f%% of the epoch's %.1f s)",
            epoch + 1,
            worst,
            100.0 * worst / seconds if seconds else 0.0,
            seconds,
        )
