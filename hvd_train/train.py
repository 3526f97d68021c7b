"""One training run, on every rank: the Horovod recipe from data to outputs.

1. Data: rank 0 lists, every rank checks its share of images, all agree.
2. Model: rank 0 loads the weights; the others receive them by broadcast.
3. Optimizer: ``DistributedOptimizer`` around SGD/Adam whose learning rate is
   a ``WarmupSchedule`` (linear scaling, gradual warmup, decay).
4. Resume: rank 0 restores the latest checkpoint; model and optimizer state
   are broadcast from rank 0 before the first step.
5. ``fit`` with every rank running the same number of steps; metrics and
   BatchNorm statistics averaged over ranks; exact evaluation after every
   epoch; rank 0 writes everything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from hvd_train import checkpoints, distributed
from hvd_train.callbacks import ExactEvaluation, make_callbacks
from hvd_train.compat import keras
from hvd_train.config import Plan, TrainConfig, make_plan
from hvd_train.data.pipeline import eval_dataset, input_failure, train_dataset, train_shards
from hvd_train.data.shards import ShardSet
from hvd_train.data.sources import training_sets
from hvd_train.distributed import Context
from hvd_train.errors import UserError
from hvd_train.evaluation import evaluate
from hvd_train.log import get_logger
from hvd_train.models import HEAD_LAYER, build_model, get_spec, resolve_bn
from hvd_train.schedules import WarmupSchedule

log = get_logger("train")


class Classifier(keras.Model):
    """A functional model whose train step can scale the new head's gradients.

    With SGD, multiplying a variable's gradient by m is the same as
    multiplying its learning rate by m (MATLAB's WeightLearnRateFactor).
    """

    head_lr_mult: float = 1.0

    def train_step(self, data):
        images, labels = data
        with tf.GradientTape() as tape:
            probs = self(images, training=True)
            loss = self.compute_loss(images, labels, probs)
        # Horovod: DistributedOptimizer.compute_gradients allreduces the gradients.
        grads_and_vars = self.optimizer.compute_gradients(loss, self.trainable_variables, tape=tape)
        if self.head_lr_mult != 1.0:
            head = {v.ref() for v in self.get_layer(HEAD_LAYER).trainable_variables}
            grads_and_vars = [
                (g * self.head_lr_mult if g is not None and v.ref() in head else g, v) for g, v in grads_and_vars
            ]
        self.optimizer.apply_gradients(grads_and_vars)
        return self.compute_metrics(images, labels, probs, None)


@dataclass(frozen=True)
class Outcome:
    """What a run leaves on each rank.

    Attributes:
        summary: the numbers of ``summary.json``.
        model: the trained model of this rank.
    """

    summary: dict
    model: keras.Model


def run(cfg: TrainConfig, ctx: Context) -> Outcome:
    """Trains, evaluates and writes the outputs of ``cfg`` on this rank.

    Every rank of the job calls this with the same configuration.

    Returns:
        The summary (also written to ``summary.json`` by rank 0) and the model.

    Raises:
        UserError: on every rank, for bad data, weights or options.
    """
    out = cfg.run.output
    ctx.on_root(lambda: _prepare_output(cfg), name="prepare_output")
    threads = distributed.cpu_threads(ctx, cfg.horovod.threads_per_rank)

    train_set, val_set = training_sets(cfg.data, cfg.run.seed, ctx, threads)
    spec = get_spec(cfg.model.name)
    image_size = cfg.data.image_size or spec.default_size
    plan = make_plan(cfg, ctx.size, len(train_set))
    bn_mode, bn_momentum = resolve_bn(cfg.model)
    log.info(
        "%d classes; %d training images, %d held-out; %s at %dx%d (weights %s, BatchNorm %s%s)",
        len(train_set.classes),
        len(train_set),
        len(val_set) if val_set else 0,
        spec.name,
        image_size,
        image_size,
        cfg.model.weights,
        bn_mode,
        f", momentum {bn_momentum}" if bn_mode == "train" and bn_momentum else "",
    )
    log.info(
        "%d worker(s) x batch %d x accumulation %d = global batch %d; %d steps/epoch; "
        "lr %.4g -> %.4g over %d warmup steps, then %s",
        ctx.size,
        cfg.data.batch_size,
        cfg.horovod.grad_accum,
        plan.global_batch,
        plan.steps_per_epoch,
        cfg.optim.base_lr,
        plan.scaled_lr,
        plan.warmup_steps,
        cfg.optim.lr_schedule,
    )
    if ctx.is_root:
        _write_json(os.path.join(out, "labels.json"), train_set.classes)

    # Rank 0 alone loads (maybe downloads) the weights; the others get them by
    # broadcast, so a download failure must stop every rank, not just rank 0.
    base = ctx.agree(
        lambda: build_model(cfg.model, len(train_set.classes), image_size, load_weights=ctx.is_root),
        name="build_model",
    )
    model = Classifier(base.inputs, base.outputs, name=base.name)
    model.head_lr_mult = cfg.optim.head_lr_mult

    optimizer, schedule = _make_optimizer(cfg, plan)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
    # Optimizer state must exist before it can be restored and broadcast.
    optimizer.build(model.trainable_variables)

    def restore():
        found = checkpoints.latest(out) if cfg.run.resume else None
        if found is None:
            return 0
        path, state = found
        checkpoints.restore(path, model, optimizer)
        epoch = int(state["epoch"])
        # The schedule reads the step counter: count the steps of the finished
        # epochs as this job takes them, which differs when the number of
        # workers or the batch changed since the checkpoint.
        optimizer.iterations.assign(epoch * plan.steps_per_epoch)
        log.info("resuming from %s: %d epoch(s) done", path, epoch)
        if state.get("global_batch") != plan.global_batch:
            log.warning(
                "the global batch was %s and is %d now; the learning rate follows the new one",
                state.get("global_batch"),
                plan.global_batch,
            )
        return epoch

    initial_epoch = ctx.on_root(restore, name="restore")
    # Horovod: every rank starts from rank 0's weights and optimizer state.
    distributed.broadcast_variables(model.variables, ctx)
    distributed.broadcast_variables(optimizer.variables, ctx)

    s3 = cfg.data.s3_options()

    def make_val():
        return eval_dataset(
            val_set,
            rank=ctx.rank,
            size=ctx.size,
            batch_size=cfg.data.batch_size,
            image_size=image_size,
            crop_fraction=cfg.data.crop_fraction,
            preprocess=spec.preprocess_input(),
            threads=threads,
            s3=s3,
        )

    evaluation = ExactEvaluation(make_val, len(train_set.classes), ctx) if val_set else None
    history = None
    reader = None
    if initial_epoch < cfg.run.epochs:
        options = dict(
            rank=ctx.rank,
            size=ctx.size,
            batch_size=cfg.data.batch_size,
            image_size=image_size,
            augment=cfg.data.augment,
            preprocess=spec.preprocess_input(),
            seed=cfg.run.seed,
            initial_epoch=initial_epoch,
            epochs=cfg.run.epochs,
            steps=plan.steps_per_epoch,
            threads=threads,
            s3=s3,
        )
        if isinstance(train_set, ShardSet):
            shard = train_shards(train_set, **options)
        else:
            shard = train_dataset(train_set.paths, train_set.labels, **options)
        reader = shard.reader
        callbacks = make_callbacks(
            ctx=ctx,
            schedule=schedule,
            images_per_epoch=plan.steps_per_epoch * cfg.data.batch_size * ctx.size,
            evaluation=evaluation,
            output=out,
            initial_epoch=initial_epoch,
            keep_checkpoints=cfg.run.keep_checkpoints,
            tensorboard=cfg.run.tensorboard,
            state={"world_size": ctx.size, "global_batch": plan.global_batch},
            reader=reader,
        )
        try:
            history = model.fit(
                shard.dataset,
                epochs=cfg.run.epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=shard.steps_per_epoch,
                callbacks=callbacks,
                # Horovod: progress output from rank 0 only.
                verbose=(1 if _interactive() else 2) if ctx.is_root else 0,
            )
        except tf.errors.OpError as e:
            # Only this rank knows: it ends the job (cli.main).
            failure = input_failure()
            if failure is not None:
                # S3 gave up after its retries, or a shard is corrupt.
                if isinstance(failure, UserError):
                    raise UserError(f"rank {ctx.rank}: {failure}") from None
                raise failure from None
            if not isinstance(
                e, (tf.errors.NotFoundError, tf.errors.InvalidArgumentError, tf.errors.PermissionDeniedError)
            ):
                raise
            # Images were checked at the start; failing now means one changed
            # during the run.
            reason = e.message.strip().splitlines()[0].split(" [[", 1)[0]
            raise UserError(
                f"rank {ctx.rank} could not read its input during training ({reason}); "
                f"was an image deleted or changed while training? Fix the data and rerun (--resume continues)."
            ) from None
    else:
        log.info("all %d epochs are done already (checkpoint in %s); evaluating", cfg.run.epochs, out)

    final = evaluation.last if evaluation and evaluation.last is not None else None
    if final is None and val_set:
        final = evaluate(model, make_val(), len(train_set.classes), ctx, name="val.final")

    digests = ctx.allgather_object(_weights_digest(model), name="weights_digest")
    identical = len(set(digests)) == 1
    if not identical:
        log.error("ranks ended with different weights: %s", digests)
    input_stats = ctx.allgather_object(reader.stats() if reader else None, name="input_stats")
    summary = _summary(cfg, ctx, plan, image_size, final, history, digests, identical, input_stats)
    if ctx.is_root:
        export = keras.Model(model.inputs, model.outputs, name=model.name)
        _save_model_atomically(export, os.path.join(out, "model.keras"))
        _write_json(os.path.join(out, "summary.json"), summary)
        if final is not None:
            log.info(
                "held-out accuracy %.4f (top-%d %.4f) on %d images; %.1f images/s on %d worker(s)",
                final.accuracy,
                final.k,
                final.top5,
                final.count,
                summary["images_per_sec"] or 0,
                ctx.size,
            )
        log.info("outputs in %s", out)
    return Outcome(summary, model)


def _make_optimizer(cfg: TrainConfig, plan: Plan):
    """The Horovod-wrapped optimizer and its learning-rate schedule."""
    schedule = WarmupSchedule(
        initial_lr=cfg.optim.base_lr,
        peak_lr=plan.scaled_lr,
        warmup_steps=plan.warmup_steps,
        total_steps=plan.total_steps,
        decay=cfg.optim.lr_schedule,
        drop_factor=cfg.optim.lr_drop_factor,
        drop_period_steps=plan.drop_period_steps,
    )
    if cfg.optim.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=schedule, momentum=cfg.optim.momentum)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=schedule)
    optimizer = distributed.distributed_optimizer(
        optimizer, fp16_allreduce=cfg.horovod.fp16_allreduce, grad_accum=cfg.horovod.grad_accum
    )
    return optimizer, schedule


def _prepare_output(cfg: TrainConfig) -> None:
    out = cfg.run.output
    try:
        os.makedirs(out, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-")
        probe.close()
    except OSError as e:
        raise UserError(f"cannot write to output folder {out} ({e.strerror}); choose another --output.") from None
    if not cfg.run.resume:
        shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    with open(os.path.join(out, "run_config.yaml"), "w", encoding="utf-8") as f:
        f.write(cfg.to_yaml())


def _summary(cfg, ctx, plan, image_size, final, history, digests, identical, input_stats) -> dict:
    rates = []
    if history is not None:
        rates = [float(r) for r in history.history.get("images_per_sec", [])]
    # The first epoch includes graph tracing and pipeline warm-up; report the
    # steady state when there is one, and the first epoch separately.
    steady = rates[1:] if len(rates) > 1 else rates
    return {
        "val_accuracy": final.accuracy if final else None,
        "val_top5": final.top5 if final else None,
        "val_top_k": final.k if final else None,
        "val_loss": final.loss if final else None,
        "val_images": final.count if final else 0,
        "world_size": ctx.size,
        "batch_size": cfg.data.batch_size,
        "global_batch": plan.global_batch,
        "steps_per_epoch": plan.steps_per_epoch,
        "epochs": cfg.run.epochs,
        "image_size": image_size,
        "model": get_spec(cfg.model.name).name,
        "images_per_sec": statistics.median(steady) if steady else None,
        "images_per_sec_first_epoch": rates[0] if rates else None,
        "weights_identical_across_ranks": identical,
        "weights_digest": digests[0],
        # Per rank: seconds the input pipeline waited for S3 objects or shard
        # blocks that were not fetched yet (an upper bound on the training
        # stall they caused), objects fetched, and bytes read.
        "input_wait_seconds": [round(s["wait_seconds"], 3) if s else None for s in input_stats],
        "input_objects": [s["objects"] if s else None for s in input_stats],
        "input_bytes": [s["bytes"] if s else None for s in input_stats],
        **distributed.versions(),
    }


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def _save_model_atomically(model, path: str) -> None:
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".model-") as tmp:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        model.save(tmp_path)
        os.replace(tmp_path, path)


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def _interactive() -> bool:
    return sys.stdout.isatty()
