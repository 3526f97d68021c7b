"""The end of a run: final evaluation, the identical-weights check, ``model.keras`` and ``summary.json``.

What describes the saved model (``labels.json``: the class of each output;
``run_config.yaml``: the backbone, its preprocessing and crop) changes only
together with it: ``describe`` writes them when a run starts training in a
folder that holds no model yet, and ``finish`` writes them again with the
model, then ``summary.json`` last, with the SHA-256 of all three
(``model_files``), which ``inference.load_trained`` checks.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

from hvd_train import files
from hvd_train.compat import keras
from hvd_train.data import storage
from hvd_train.distributed import cpus, start
from hvd_train.distributed.context import Context
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.model import compute, kerases
from hvd_train.model.catalogue import build_model, head_activation
from hvd_train.model.network import Net
from hvd_train.model.sharded_net import features_view, stage_head
from hvd_train.results import plots
from hvd_train.results.evaluation import EvalResult
from hvd_train.results.inference import CONFIG, FEATURES, LABELS, MODEL, model_files
from hvd_train.results.multilabel import MultiLabelResult, multi_label_summary
from hvd_train.training import early_stop, epoch_end, s3_mirror, sharded_stages
from hvd_train.training.job import History, Job, median_rate
from hvd_train.training.state import TrainState

log = get_logger("train")


def describe(job: Job, force: bool = False) -> bool:
    """Rank 0 writes ``labels.json`` and ``run_config.yaml`` of ``job``, each atomically.

    Args:
        force: write them even where the folder holds a model (``finish``, just
            before it replaces that model). Otherwise (training starts) the
            files of an earlier run's model stay until a new model replaces it.

    Returns:
        Whether they were written.
    """
    out = job.cfg.run.output
    if not force and os.path.exists(os.path.join(out, MODEL)):
        return False
    files.write_json(os.path.join(out, LABELS), list(job.classes))
    files.write_text(os.path.join(out, CONFIG), job.cfg.to_yaml())
    return True


@dataclass(frozen=True)
class Outcome:
    """What a run leaves on each rank.

    Attributes:
        summary: the numbers of ``summary.json``.
        model: the trained model of this rank.
    """

    summary: dict
    model: keras.Model


def finish(job: Job, ctx: Context, net: Net, state: TrainState, history: History) -> Outcome:
    """Final evaluation, identical-weights check, ``model.keras`` and ``summary.json``."""
    cfg = job.cfg
    final = history.last_eval
    best = early_stop.restore_best(job, ctx, net, state)
    if best is not None:
        final = None  # the best epoch's weights, scored again
    # --ema: the averaged weights are the model from here on (the checkpoints keep both).
    net.use_averages()
    if final is None and job.val is not None:
        final = epoch_end.evaluate_held_out(job, ctx, net, state.batch_size, history, "val.final")
    digests = ctx.allgather_object(_weights_digest(net.model), name="weights_digest")
    identical = len(set(digests)) == 1
    if not identical:
        log.error("ranks ended with different weights: %s", digests)
    summary = _summary(job, ctx, state, final, history, digests, identical)
    if cfg.run.early_stop:
        summary["early_stop"] = {
            "metric": cfg.run.early_stop_metric,
            "patience": cfg.run.early_stop,
            "best_epoch": state.best_epoch + 1,
            "best_score": state.best_score,
            "epochs_trained": state.epoch,
            "saved_epoch": best or state.epoch,
        }

    def write(head: str | None) -> None:
        try:
            _write_outputs(job, net, summary, final, head)
        except OSError as e:
            raise UserError(
                f"cannot write the run's outputs to {cfg.run.output} ({e.strerror or e}); free space there, "
                "then rerun the same command: it resumes from the last checkpoint and writes them."
            ) from None

    # Horovod: the other ranks wait for rank 0's writes, so that every rank of the job ends
    # together (a launcher that ends a job when its first rank ends cuts nothing short), and
    # ends with rank 0's error if there is one.
    # --head-parallel: the head, whole, gathered by rank 0 from the first group for the saved model.
    head = stage_head(net, ctx, cfg.run.output)
    try:
        ctx.on_root(lambda: write(head), name="outputs")
    finally:
        if head is not None:
            shutil.rmtree(head, ignore_errors=True)
    multi = isinstance(final, MultiLabelResult)
    if ctx.is_root:
        if multi:
            log.info(
                "held-out mAP %.4f, F1 %.4f at %g on %d images (scored in %.1f s); %.1f images/s on %d worker(s)",
                final.map,
                final.f1,
                final.threshold,
                final.count,
                final.seconds,
                summary["images_per_sec"] or 0,
                ctx.size,
            )
        elif final is not None:
            log.info(
                "held-out accuracy %.4f top-1, %.4f top-%d on %d images (scored in %.1f s); "
                "%.1f images/s on %d worker(s)",
                final.accuracy,
                final.top5,
                final.k,
                final.count,
                final.seconds,
                summary["images_per_sec"] or 0,
                ctx.size,
            )
        if cfg.run.tensorboard:
            from hvd_train.training.tracking.hparams import write_hparams

            write_hparams(cfg, summary)
        if history.tracker is not None:
            history.tracker.finish(summary)
    mirror = s3_mirror.of(cfg.run.output)
    if mirror is not None:  # an S3 --output: everything up, summary.json last
        ctx.on_root(lambda: mirror.finish(summary), name="upload_outputs")
    elif ctx.is_root:
        log.info("outputs in %s", cfg.run.output)
    return Outcome(summary, net.model)


def _write_outputs(job: Job, net: Net, summary: dict, final: EvalResult | None, head: str | None = None) -> None:
    """Rank 0: the model and what describes it, then ``summary.json`` that ties them together, then pictures.

    Args:
        head: the sharded head's files (``--head-parallel``): the saved model is the ordinary one, head whole.
    """
    cfg = job.cfg

    def build():
        return build_model(
            cfg.model, len(job.classes), job.image_size, load_weights=False, activation=head_activation(cfg)
        )

    form, name = "whole", MODEL
    if head is not None:
        form, why = sharded_stages.save_form(cfg, net, len(job.classes))
        log.info("%s", why)
    if form == "files":  # the network up to the head, and the head's arrays beside it
        name = FEATURES
        sharded_stages.remove_other_form(cfg.run.output, form)
        sharded_stages.move_head_files(head, cfg.run.output)
        export = keras.Model(net.model.inputs, kerases.outputs_of(net.model), name=net.model.name)
        if job.precision != "fp32":
            export = compute.float32_copy(net.model, lambda: features_view(build()))
    elif head is not None:
        with compute.float32_policy():
            export = net.full_model(build, head)
    elif job.precision == "fp32":
        export = keras.Model(net.model.inputs, kerases.outputs_of(net.model), name=net.model.name)
    else:
        # The saved model computes in float32: inference never meets float16.
        export = compute.float32_copy(
            net.model,
            lambda: build_model(
                cfg.model, len(job.classes), job.image_size, load_weights=False, activation=head_activation(cfg)
            ),
        )
    # The model written beside its place first, then what describes it, then the model moved into
    # place: the three change together, within a rename of each other.
    _save_model_atomically(export, os.path.join(cfg.run.output, name), before_rename=lambda: describe(job, force=True))
    if form == "whole":
        sharded_stages.remove_other_form(cfg.run.output, form)
    summary["saved_model"] = form
    summary["model_files"] = model_files(cfg.run.output)
    files.write_json(os.path.join(cfg.run.output, "summary.json"), summary)
    if final is not None and not isinstance(final, MultiLabelResult):
        path = os.path.join(cfg.run.output, plots.CONFUSION)
        plots.draw(
            path, lambda: plots.confusion(final.confusion, job.classes, path, f"held-out ({final.count} images)")
        )


def _summary(job, ctx, state, final: EvalResult | None, history: History, digests, identical) -> dict:
    if isinstance(final, MultiLabelResult):
        scored = multi_label_summary(final, job.classes)
        return {**_summary(job, ctx, state, None, history, digests, identical), **scored}
    cfg = job.cfg
    rate, first = median_rate(history)
    return {
        "val_accuracy": final.accuracy if final else None,
        "base_lr": cfg.optim.base_lr,
        "val_top5": final.top5 if final else None,
        "val_top_k": final.k if final else None,
        "val_loss": final.loss if final else None,
        "val_images": final.count if final else 0,
        "val_per_class_accuracy": dict(zip(job.classes, final.per_class_accuracy())) if final else None,
        "val_confusion_matrix": plots.confusion_to_json(final.confusion) if final else None,
        "world_size": ctx.size,
        # Rank 0's CPU threads and where the number came from (affinity mask, cgroup quota).
        "cpu": (ctx.cpu or cpus.budget(ctx.local_size)).to_json(),
        "batch_size": state.batch_size,
        "global_batch": state.global_batch,
        "steps_per_epoch": job.plan(ctx.size, state).steps_per_epoch,
        "epochs": cfg.run.epochs,
        "image_size": job.image_size,
        "model": job.spec.name,
        # The first epoch includes graph tracing and pipeline warm-up; report the
        # steady state when there is one, and the first epoch separately.
        "images_per_sec": rate,
        "images_per_sec_first_epoch": first,
        "weights_identical_across_ranks": identical,
        "weights_digest": digests[0],
        "deterministic": cfg.run.deterministic,
        "precision": job.precision,
        "xla": cfg.compute.xla,
        "steps_per_call": cfg.compute.steps_per_call,
        "horovod_environment": {k: os.environ.get(k) for k in sorted(_HOROVOD_TUNING)},
        "resumed_from": history.resumed_from,
        "world_sizes": history.world_sizes,
        "elastic_resets": history.resets,
        "checkpoint_seconds": round(history.checkpoint_seconds, 3),
        "check_images": cfg.data.check_images,
        "skipped_images": skipped_images(job, history),
        "val_seconds": round(final.seconds, 3) if final else None,
        **_input_stats(ctx, history),
        **start.versions(),
    }


def skipped_images(job: Job, history: History) -> list[dict]:
    """Every image left out because it cannot be decoded: found by the check before training, or met later."""
    found = [
        {"path": path, "reason": reason, "found": "check"}
        for data in (job.train, job.val)
        for path, reason in getattr(data, "skipped", ())
    ]
    found += [{"path": p, "reason": reason, "found": when} for p, (reason, when) in history.skipped.items()]
    return found


# The Horovod settings that shape its speed, as the workers saw them.
_HOROVOD_TUNING = (
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_TIMELINE",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_GLOO_TIMEOUT_SECONDS",
    "HOROVOD_GLOO_RENDEZVOUS_TIMEOUT_SECONDS",
)


def _input_stats(ctx: Context, history: History) -> dict:
    gathered = ctx.allgather_object((history.input_stats, storage.retried_reads()), name="input_stats")
    stats = [s for s, _ in gathered]
    # Per rank: seconds the input pipeline waited for S3 objects or shard
    # blocks that were not fetched yet (an upper bound on the training stall
    # they caused), objects fetched, bytes read, and S3 reads made again
    # after their connection broke mid-body.
    return {
        "input_wait_seconds": [round(s["wait_seconds"], 3) if s else None for s in stats],
        "input_objects": [s["objects"] if s else None for s in stats],
        "input_bytes": [s["bytes"] if s else None for s in stats],
        "input_retried_reads": [retried for _, retried in gathered],
    }


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def _save_model_atomically(model, path: str, before_rename=None) -> None:
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".model-") as tmp:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        model.save(tmp_path)
        if before_rename is not None:
            before_rename()
        os.replace(tmp_path, path)
