"""The stages that set a run up, in the order ``run`` calls them, the same on every rank.

1. ``prepare_output``: rank 0 makes the output folder (or says why it cannot).
2. ``load_data``: rank 0 lists the images, every rank checks its share, all agree
   (``training_sets``); the model spec and the precision are resolved once, into the ``Job``.
3. ``resolve_base_lr``: ``--base-lr auto`` runs the range test on rank 0.
4. ``build_net``: rank 0 loads the weights; Horovod's ``DistributedOptimizer``.
5. ``start_state``: a fresh ``TrainState``, or rank 0 restores the latest intact
   checkpoint; weights and optimizer state are broadcast from rank 0. Only
   now, with training about to start, are the run's labels and configuration
   written (``finish.describe``): a run that fails before leaves the model
   and what describes it as they were.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from hvd_train.compat import keras
from hvd_train.config import DataConfig, TrainConfig
from hvd_train.data import records as records_module
from hvd_train.data.folder import ImageSet, split_per_class
from hvd_train.data.packed import ShardSet
from hvd_train.data.sources import Data, checked, open_data, own_held_out
from hvd_train.distributed import gradients, start
from hvd_train.distributed.context import Context
from hvd_train.distributed.groups import shard_range
from hvd_train.errors import UserError
from hvd_train.log import Ticker, get_logger
from hvd_train.model import compute
from hvd_train.model.catalogue import HEAD_LAYER, build_model, get_spec, head_activation, resolve_bn
from hvd_train.model.head_start import start_head
from hvd_train.model.network import Net, use_step_seeded_dropout
from hvd_train.model.sharded_net import ShardedNet
from hvd_train.training import checkpoints, lr_find, resume_checks, s3_mirror
from hvd_train.training.finish import describe
from hvd_train.training.job import History, Job, fresh_state
from hvd_train.training.sharded_stages import head_groups, restore_any_layout, take_head
from hvd_train.training.state import TrainState

log = get_logger("train")


def prepare_output(cfg: TrainConfig, ctx: Context) -> None:
    """Rank 0 makes the output folder, or says why it cannot.

    An S3 ``--output``: its staging folder (a cache), and a prefix that can be listed and written;
    a resume makes the staging folder a copy of the run in the prefix (``s3_mirror.Mirror.pull``).
    Nothing of an earlier run changes until training starts (``start_state``):
    a mistyped ``--data`` must not cost it its checkpoints, nor its model the
    ``labels.json`` and ``run_config.yaml`` that describe it.
    """

    def prepare() -> None:
        out = cfg.run.output
        try:
            os.makedirs(out, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-")
            probe.close()
        except OSError as e:
            raise UserError(f"cannot write to output folder {out} ({e.strerror}); choose another --output.") from None
        mirror = s3_mirror.of(out)
        if mirror is not None:
            mirror.check()
            if cfg.run.resume:  # names the checkpoint that start_state must restore (s3_mirror.latest_checkpoint)
                mirror.pull()
            else:  # the checkpoints go once training starts, the model beside them with the new run's end
                mirror.pull_outputs()

    ctx.on_root(prepare, name="prepare_output")


def load_data(cfg: TrainConfig, ctx: Context) -> Job:
    """The checked training and held-out images, the same on every rank."""
    threads = start.cpu_threads(ctx, cfg.horovod.threads_per_rank)
    train_set, val_set = training_sets(cfg.data, cfg.run.seed, ctx, threads)
    if cfg.run.early_stop and val_set is None:
        raise UserError(
            f"--early-stop {cfg.run.early_stop} watches the held-out images, and --data {cfg.data.train} with "
            f"--val-split {cfg.data.val_split} leaves none; give --val-data, or a larger --val-split.",
            agreed=True,
        )
    spec = get_spec(cfg.model.name)
    # Horovod: one precision for all ranks (rank 0 looks at its GPU for "auto").
    numerics = ctx.broadcast_object(
        compute.resolve(cfg.compute.precision, cfg.horovod.grad_accum) if ctx.is_root else None, name="precision"
    )
    job = Job(cfg, train_set, val_set, cfg.data.image_size or spec.default_size, numerics, spec)
    bn_mode, bn_momentum = resolve_bn(cfg.model)
    log.info(
        "%d classes; %d training images, %d held-out; %s at %dx%d (weights %s, BatchNorm %s%s, %s%s)",
        len(train_set.classes),
        len(train_set),
        len(val_set) if val_set else 0,
        spec.name,
        job.image_size,
        job.image_size,
        cfg.model.weights,
        bn_mode,
        f", momentum {bn_momentum}" if bn_mode == "train" and bn_momentum else "",
        numerics,
        f", XLA {cfg.compute.xla}" if cfg.compute.xla != "off" else "",
    )
    return job


def resolve_base_lr(job: Job, ctx: Context) -> Job:
    """``--base-lr auto``: rank 0 runs the learning-rate range test; every rank gets its suggestion.

    A resumed run keeps the rate its first attempt found (``lr_find.json``),
    so the schedule it resumes is the one its checkpoint was made with.
    """
    cfg = job.cfg
    if cfg.optim.base_lr != "auto":
        return job

    def find() -> float:
        out = cfg.run.output
        if cfg.run.resume and checkpoints.latest(out) is not None:
            saved = lr_find.saved_suggestion(out)
            if saved:
                log.info("--base-lr auto: %.4g, as found by this run's range test (%s)", saved, lr_find.RESULT)
                return saved
        log.info("--base-lr auto: the learning-rate range test runs on rank 0 first (up to %d steps)", lr_find.STEPS)
        sweep = lr_find.run(job, threads=start.cpu_threads(ctx, cfg.horovod.threads_per_rank))
        lr_find.write(sweep, out)
        if sweep.suggestion is None:
            raise UserError(
                f"--base-lr auto: the range test found no rate: from {lr_find.START:g} to {lr_find.END:g} the "
                f"training loss neither fell nor rose, or still fell at the end ({sweep.stopped}; see "
                f"{os.path.join(out, 'lr_find.png')}); check the data and labels, or pass --base-lr with a number."
            )
        log.info(
            "--base-lr auto: %.4g per worker (range test: %d steps in %.0f s, %s; a tenth of %.3g)",
            sweep.suggestion,
            len(sweep.lrs),
            sweep.seconds,
            sweep.stopped,
            sweep.suggestion * 10,
        )
        return sweep.suggestion

    found = ctx.on_root(find, name="lr_find")
    optim = dataclasses.replace(cfg.optim, base_lr=found)
    return dataclasses.replace(job, cfg=dataclasses.replace(cfg, optim=optim))


def build_net(job: Job, ctx: Context, collective: bool = True) -> Net:
    """The model (rank 0 loads the weights), Horovod's optimizer and the compiled step.

    Args:
        collective: all ranks build together and agree on errors; False for a
            worker joining an elastic job, which receives everything by
            broadcast and must not start a collective of its own.
    """
    cfg = job.cfg
    if cfg.run.deterministic:
        keras.utils.set_random_seed(cfg.run.seed)
    use_step_seeded_dropout()
    compute.set_policy(job.precision)

    head = head_groups(cfg, ctx, len(job.classes))
    outputs = len(job.classes) if head is None else shard_range(len(job.classes), head.parallel, head.shard)[1]

    def build():
        # Rank 0 alone loads (maybe downloads) the weights; the others get them by
        # broadcast, so a download failure must stop every rank, not just rank 0.
        load = ctx.is_root and collective
        return build_model(cfg.model, outputs, job.image_size, load_weights=load, activation=head_activation(cfg))

    with Ticker(log, f"building {job.spec.name}"):
        base = ctx.agree(build, name="build_model") if collective else build()
    if head is not None:  # its shard starts from its columns of the same head
        return ShardedNet(
            base, cfg, cfg.run.seed, ctx.rank, job.precision, head, len(job.classes), class_counts=job.train.counts()
        )
    layer = base.get_layer(HEAD_LAYER)  # the head every layout starts from (a sharded run: its columns of it)
    start_head(layer.kernel, layer.bias, 0, len(job.classes), cfg.run.seed)
    return Net(base, cfg, cfg.run.seed, ctx.rank, job.precision, class_counts=job.train.counts())


def start_state(job: Job, ctx: Context, net: Net) -> tuple[TrainState, History]:
    """A fresh state, or the one of the latest intact checkpoint; every rank gets rank 0's.

    Returns:
        The state and an empty history.
    """
    cfg = job.cfg
    plan = job.plan(ctx.size)
    log.info(
        "%d worker(s) x batch %d x accumulation %d = global batch %d; %d steps/epoch; "
        "lr %.4g -> %.4g over %g warmup epoch(s), then %s",
        ctx.size,
        plan.batch_size,
        cfg.horovod.grad_accum,
        plan.global_batch,
        plan.steps_per_epoch,
        cfg.optim.base_lr,
        plan.scaled_lr,
        cfg.optim.warmup_epochs,
        cfg.optim.lr_schedule,
    )
    recipe = recipe_options(cfg)
    if recipe and ctx.is_root:
        log.info("recipe: %s", ", ".join(recipe))

    def restore():
        out = cfg.run.output
        if not cfg.run.resume:
            removed, mirror = checkpoints.remove_all(out), s3_mirror.of(out)
            if mirror is not None:
                removed = max(removed, mirror.remove_checkpoints())
            if removed:
                log.info("--no-resume: removed %d checkpoint(s) of an earlier run from %s", removed, out)
            return None
        found = s3_mirror.latest_checkpoint(out)
        if found is None:
            return None
        resume_checks.same_recipe(job, found)
        changed = resume_checks.same_data(job, found)
        rows, head = restore_any_layout(job, net, found)
        return found.path, found.state.to_dict(), rows, changed, found.info, head

    def restore_then_describe():
        restored = restore()
        # Training starts: the run's labels and configuration are written now, where no
        # earlier model would be left beside the wrong ones (finish.describe).
        try:
            describe(job)
        except OSError as e:
            raise UserError(
                f"cannot write labels.json and run_config.yaml to {cfg.run.output} ({e.strerror}); "
                "free space there or choose another --output."
            ) from None
        return restored

    with Ticker(log, "looking for a checkpoint to resume from"):
        restored = ctx.on_root(restore_then_describe, name="restore")
    # Horovod: every rank starts from rank 0's weights and optimizer state.
    gradients.broadcast_variables(net.variables, ctx)
    if restored is None:
        return fresh_state(job, plan), History()
    path, values, rows, changed, info, head = restored
    take_head(net, ctx, head, path)
    state = TrainState.from_dict(values)
    # Each rank takes back its own BatchNorm statistics and metric sums, or
    # their mean when the workers are not the same ones.
    same_workers = rows.shape[0] == ctx.size == state.world_size
    net.write_local(rows[ctx.rank] if same_workers else rows.mean(axis=0))
    if changed:
        # --allow-data-change: the positions of the interrupted epoch mean other files now.
        state.restart_epoch(len(job.train))
    log.info(
        "resuming from %s: %d epoch(s) done, %d of %d images of epoch %d consumed, step %d",
        path,
        state.epoch,
        state.samples,
        state.total,
        state.epoch + 1,
        state.step,
    )
    if state.global_batch != plan.global_batch:
        log.warning(
            "the global batch was %d and is %d now; the learning rate follows the new one",
            state.global_batch,
            plan.global_batch,
        )
    history = History()
    history.resumed_from = path
    metrics = info.get("metrics") or {}
    if metrics and state.epoch > 0:
        history.resumed_metrics = (state.epoch - 1, metrics)
    # The images skipped before the stop, and those met undecodable but not reported yet (by
    # their index in the list, which means other files when the list changed).
    history.skipped = {path: (reason, when) for path, reason, when in info.get("skipped", ())}
    if changed:  # --allow-data-change: only those still in the lists
        listed = {*job.train.paths, *(job.val.paths if job.val is not None else ())}
        history.skipped = {path: why for path, why in history.skipped.items() if path in listed}
    elif ctx.is_root:
        history.undecodable = set(info.get("undecodable", ()))
    return state, history


def recipe_options(cfg: TrainConfig) -> list[str]:
    """The recipe options of ``cfg`` that differ from plain training, as flags (``--ema 0.999``, ...)."""
    o, d, r = cfg.optim, cfg.data, cfg.run
    chosen = [
        ("--optimizer", o.optimizer, o.optimizer != "sgd"),
        ("--weight-decay", o.weight_decay, o.weight_decay),
        ("--label-smoothing", o.label_smoothing, o.label_smoothing),
        ("--class-weights", o.class_weights, o.class_weights != "none"),
        ("--ema", o.ema, o.ema),
        ("--augment", f"randaugment, magnitude {d.augment_magnitude:g}", d.augment == "randaugment"),
        ("--mixup", d.mixup, d.mixup),
        ("--cutmix", d.cutmix, d.cutmix),
        ("--early-stop", f"{r.early_stop} on {r.early_stop_metric}", r.early_stop),
    ]
    return [f"{flag} {value}" for flag, value, used in chosen if used]


def training_sets(cfg: DataConfig, seed: int, ctx: Context, threads: int = 0) -> tuple[Data, Data | None]:
    """The training images and the held-out images (None when there are none).

    Raises:
        UserError: on every rank, for any problem with the data.
    """
    s3 = cfg.s3_options()

    records = cfg.record_options()
    val_records = dataclasses.replace(records, split=cfg.val_data_split)
    records = dataclasses.replace(records, split=cfg.data_split)

    def listing():
        table = dataclasses.replace(cfg.table_options(), split=cfg.data_split)
        if not cfg.val:  # a CSV's held-out rows or a TFDS folder's held-out split, if it has them
            train, held = own_held_out(cfg.train, s3, table, records, cfg.val_data_split)
            if held is not None:
                return train, held
        else:
            train = open_data(cfg.train, "--data", s3, table=table, records=records)
            table = dataclasses.replace(table, split=cfg.val_data_split)
            return train, open_data(cfg.val, "--val-data", s3, classes=train.classes, table=table, records=val_records)
        if cfg.val_split > 0:
            if isinstance(train, ShardSet):
                raise UserError(records_module.undivided(train, cfg.train))
            return split_per_class(train, cfg.val_split, seed)
        return train, None

    started = time.perf_counter()
    # Other tools' TFRecords: their index made by all ranks, when it is missing (of a TFDS folder's held-out split too).
    for url, flag, options, held_out in (
        (cfg.train, "--data", records, False),
        (cfg.val, "--val-data", val_records, True),
    ):
        records_module.prepare(url or cfg.train, flag if url else "--data", s3, options, ctx, held_out)
    train, val = ctx.on_root(listing, name="list_data")
    records_module.refuse_unused(records, train, val)
    records_module.refuse_split(cfg.data_split, "--data-split", train, cfg.train)
    records_module.refuse_split(cfg.val_data_split, "--val-data-split", val, cfg.val or cfg.train)
    if isinstance(train, ImageSet):
        held = train.nbytes() + (val.nbytes() if isinstance(val, ImageSet) else 0)
        log.info(
            "listed %d images in %.1f s; the list takes %.1f MB on each rank",
            len(train) + (len(val) if val is not None else 0),
            time.perf_counter() - started,
            held / 1e6,
        )
    for data, flag in ((train, "--data"), (val, "--val-data")):
        background = getattr(data, "alpha_background", "")
        if background and background != cfg.alpha_background and ctx.is_root:
            log.warning(
                "%s %s was packed with transparent pixels composited over %s; --alpha-background %s "
                "cannot change that: pack it again with --alpha-background %s, or pass --alpha-background %s",
                flag,
                data.url,
                background,
                cfg.alpha_background,
                cfg.alpha_background,
                background,
            )
    train = checked(train, "--data", cfg.on_bad_image, ctx, threads, s3, cfg.check_images)
    if val is not None:
        val = checked(val, "--val-data" if cfg.val else "--data", cfg.on_bad_image, ctx, threads, s3, cfg.check_images)
        if len(val) == 0:
            val = None
    if val is None and ctx.is_root:
        log.warning("no held-out images (--val-data not given, --val-split 0): accuracy is not measured")
    return train, val
