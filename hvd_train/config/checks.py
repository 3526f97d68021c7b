"""Validation of a resolved configuration: every value checked once, before any rank reads data."""

from __future__ import annotations

import math
import os
from typing import Any

from hvd_train.config import own_model
from hvd_train.config.choices import ADAMW_WEIGHT_DECAY, TrainConfig
from hvd_train.data.storage import is_s3, redact_url
from hvd_train.data.table import is_table
from hvd_train.errors import UserError


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks every value; raises UserError naming the flag and the fix."""
    d, m, o, h, r = cfg.data, cfg.model, cfg.optim, cfg.horovod, cfg.run
    _require(bool(d.train), "--data", d.train, "give the image folder, CSV of labels or shard set to train on")
    _require(bool(r.output), "--output", r.output, "give a folder for the results")
    _require(0.0 <= d.val_split < 1.0, "--val-split", d.val_split, "use a fraction in [0, 1)")
    _require(d.image_size == 0 or d.image_size >= 32, "--image-size", d.image_size, "use 0 or >= 32")
    _require(d.batch_size >= 1, "--batch-size", d.batch_size, "use a whole number >= 1")
    _require(d.min_images_per_label >= 1, "--min-images-per-label", d.min_images_per_label, "use a whole number >= 1")
    if not (is_table(d.train) or is_table(d.val)):
        for flag, value in d.table_options().given()[:1]:
            why = "it tells how a CSV of labels is read, and neither --data nor --val-data names one"
            _require(False, flag, value, why)
    _require(d.label_offset >= 0, "--label-offset", d.label_offset, "use a whole number >= 0 (1 for labels from 1)")
    _require(0.1 <= d.crop_fraction <= 1.0, "--crop-fraction", d.crop_fraction, "use (0.1, 1]")
    _require(d.s3_concurrency >= 1, "--s3-concurrency", d.s3_concurrency, "use a whole number >= 1")
    _require(d.s3_max_attempts >= 1, "--s3-max-attempts", d.s3_max_attempts, "use a whole number >= 1")
    _require(
        not d.s3_endpoint or d.s3_endpoint.startswith(("http://", "https://")),
        "--s3-endpoint",
        redact_url(d.s3_endpoint),
        "give a URL such as http://127.0.0.1:9000",
    )
    _require(
        not (own_model.is_own(m.name) and m.weights == "imagenet"),
        "--weights",
        m.weights,
        f"--model {m.name} is a backbone of your own, without ImageNet weights: pass none, or a weights file of it",
    )
    _require(m.trainable_layers >= 0, "--trainable-layers", m.trainable_layers, "use a number >= 0")
    _require(0.0 <= m.dropout < 1.0, "--dropout", m.dropout, "use a rate in [0, 1)")
    _require(0.0 <= m.bn_momentum < 1.0, "--bn-momentum", m.bn_momentum, "use [0, 1)")
    _require(
        not (m.freeze_backbone and m.trainable_layers),
        "--trainable-layers",
        m.trainable_layers,
        "drop it or --freeze-backbone: they contradict",
    )
    _require(
        o.base_lr == "auto" or (o.base_lr > 0 and math.isfinite(o.base_lr)),
        "--base-lr",
        o.base_lr,
        "use a number > 0, or auto",
    )
    _require(0.0 <= o.momentum < 1.0, "--momentum", o.momentum, "use [0, 1)")
    _require(o.warmup_epochs >= 0, "--warmup-epochs", o.warmup_epochs, "use a number >= 0")
    _require(0.0 < o.lr_drop_factor <= 1.0, "--lr-drop-factor", o.lr_drop_factor, "use (0, 1]")
    _require(o.lr_drop_period >= 1, "--lr-drop-period", o.lr_drop_period, "use a whole number >= 1")
    _require(o.head_lr_mult > 0, "--head-lr-mult", o.head_lr_mult, "use a number > 0")
    _require(0.0 <= o.weight_decay < 1.0, "--weight-decay", o.weight_decay, "use [0, 1), e.g. 0.05 with adamw")
    # AdamW with no decay is Adam under another name: a run or a sweep that says adamw and 0 meant one of them.
    _require(
        o.optimizer != "adamw" or o.weight_decay > 0,
        "--weight-decay",
        o.weight_decay,
        f"--optimizer adamw decays weights: give --weight-decay > 0, or leave it out for {ADAMW_WEIGHT_DECAY} "
        "(Keras's default), or use adam",
    )
    _require(
        r.track == "none" or not h.elastic,
        "--track",
        r.track,
        "tracking an elastic job (whose rank 0 may change) is not supported yet: drop --track or --elastic",
    )
    _require(
        not (is_s3(r.output) and h.elastic),
        "--output",
        r.output,
        "an elastic job's rank 0 may change to a host without its staging folder: give --output a folder every "
        "host reaches, or drop --elastic",
    )
    _require(0.0 <= d.augment_magnitude <= 10.0, "--augment-magnitude", d.augment_magnitude, "use 0 to 10, e.g. 9")
    _require(0.0 <= o.ema < 1.0, "--ema", o.ema, "use a decay in [0, 1), e.g. 0.999 (0: off)")
    for flag, alpha in (("--mixup", d.mixup), ("--cutmix", d.cutmix)):
        _require(
            0.0 <= alpha <= 10.0 and math.isfinite(alpha),
            flag,
            alpha,
            "use an alpha in [0, 10], e.g. 0.2 or 1.0 (0: off)",
        )
    for flag, limit in (("--clip-value", o.clip_value), ("--clip-norm", o.clip_norm)):
        _require(limit >= 0 and math.isfinite(limit), flag, limit, "use a number > 0, e.g. 1.0 (0: off)")
    _require(0.0 <= o.label_smoothing < 1.0, "--label-smoothing", o.label_smoothing, "use [0, 1), e.g. 0.1")
    _require(
        o.head_lr_mult == 1.0 or o.optimizer == "sgd",
        "--head-lr-mult",
        o.head_lr_mult,
        "it is applied by scaling the head's gradients, which only equals a learning-rate "
        "multiplier for --optimizer sgd; use sgd or drop --head-lr-mult",
    )
    _require(h.grad_accum >= 1, "--grad-accum", h.grad_accum, "use a whole number >= 1")
    _require(h.threads_per_rank >= 0, "--threads-per-rank", h.threads_per_rank, "use 0 or more")
    _require(h.commit_every >= 1, "--commit-every", h.commit_every, "use a whole number >= 1")
    _require(h.fusion_threshold_mb >= 0, "--fusion-threshold-mb", h.fusion_threshold_mb, "use 0 or more")
    _require(h.cycle_time_ms >= 0, "--cycle-time-ms", h.cycle_time_ms, "use 0 or more")
    c = cfg.compute
    _require(c.steps_per_call >= 1, "--steps-per-call", c.steps_per_call, "use a whole number >= 1")
    _require(
        not (c.precision == "mixed_float16" and h.grad_accum > 1),
        "--grad-accum",
        h.grad_accum,
        "with --precision mixed_float16 the loss scale may change between the accumulated passes, which "
        "would mix gradients of different scales; use --precision mixed_bfloat16 or fp32, or drop --grad-accum",
    )
    _require(
        not (c.xla == "jit" and h.grad_accum > 1),
        "--grad-accum",
        h.grad_accum,
        "--xla jit allreduces the gradients of every step outside the compiled part; use --xla auto or off",
    )
    _require(
        not (h.elastic and h.grad_accum > 1),
        "--grad-accum",
        h.grad_accum,
        "an elastic job cannot roll back gradients accumulated between updates; drop --grad-accum or --elastic",
    )
    _require(h.head_parallel >= -1, "--head-parallel", h.head_parallel, "use G >= 1, -1 (all workers) or 0 (no)")
    _require(
        h.head_parallel or h.head_save == "auto",
        "--head-save",
        h.head_save,
        "it chooses how a sharded head is saved; add --head-parallel G, or drop --head-save",
    )
    _multi_label(cfg)
    try:
        parse_every(r.checkpoint_every)
    except ValueError:
        _require(
            False,
            "--checkpoint-every",
            r.checkpoint_every,
            "give a number of steps (500) or a duration (90s, 15m, 2h)",
        )
    try:
        parse_every(r.log_every)
    except ValueError:
        _require(False, "--log-every", r.log_every, "give a number of steps (200) or a duration (30s, 5m)")
    _require(r.epochs >= 1, "--epochs", r.epochs, "use a whole number >= 1")
    _require(r.early_stop >= 0, "--early-stop", r.early_stop, "use a number of epochs >= 1 (0: off)")
    _require(
        not r.early_stop or bool(d.val) or d.val_split > 0,
        "--early-stop",
        r.early_stop,
        "it watches the held-out images: give --val-data or --val-split > 0, or drop --early-stop",
    )
    _require(r.keep_checkpoints >= 1, "--keep-checkpoints", r.keep_checkpoints, "use 1 or more")
    for flag, folder in (("--data", d.train), ("--val-data", d.val)):
        _require(
            not folder or not _inside(r.output, folder),
            "--output",
            r.output,
            f"it is inside {flag} {folder}, where its files would be read as a class; choose another folder",
        )
        # A prefix holds its run alone: no images of the run's in it (a run deletes what it uploaded, and
        # refuses a prefix that holds anything else).
        _require(
            not folder or not folder.startswith("s3://") or not _inside(folder, r.output),
            "--output",
            r.output,
            f"{flag} {folder} is inside it, and an S3 prefix holds its run alone; give --output a prefix of its own",
        )
    _require(bool(m.weights), "--weights", m.weights, "use imagenet, none, or the path of a weights file")
    return cfg


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or below it: two folders on disk, or two S3 prefixes (by bucket and
    whole parts: ``s3://b/x-run`` is not below ``s3://b/x``)."""
    if folder.startswith("s3://") or path.startswith("s3://"):
        parts = [[p for p in url[len("s3://") :].split("/") if p] for url in (path, folder)]
        return path.startswith("s3://") and folder.startswith("s3://") and parts[0][: len(parts[1])] == parts[1]
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def _require(ok: bool, flag: str, value: Any, fix: str) -> None:
    if not ok:
        raise UserError(f"`{flag}` is invalid. Received: {flag.lstrip('-').replace('-', '_')}={value!r}; {fix}.")


def parse_every(text: str) -> tuple[int, float]:
    """Reads ``--checkpoint-every`` and ``--log-every``: ``(steps, 0)``, ``(0, seconds)``, or ``(0, 0)`` for none.

    ``500`` is steps; ``90s``, ``15m``, ``2h`` are durations; ``""`` is none.

    Raises:
        ValueError: anything else.
    """
    text = str(text or "").strip().lower()
    if not text:
        return 0, 0.0
    if text.isdigit():
        if int(text) < 1:
            raise ValueError(text)
        return int(text), 0.0
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = text[:-1], text[-1:]
    try:
        seconds = float(number) * units[unit]
    except (KeyError, ValueError):
        raise ValueError(text) from None
    if not seconds > 0:
        raise ValueError(text)
    return 0, seconds


def _multi_label(cfg: TrainConfig) -> None:
    """``--multi-label``: a CSV's sets of labels, a sigmoid head; what does not apply to it is refused."""
    d, o, h = cfg.data, cfg.optim, cfg.horovod
    if not d.multi_label:
        for flag, value, default in (("--label-separator", d.label_separator, ""), ("--threshold", d.threshold, 0.5)):
            _require(value == default, flag, value, "it applies to multi-label sets; add --multi-label, or drop it")
        metric = cfg.run.early_stop_metric
        _require(
            not (cfg.run.early_stop and metric in ("val_map", "val_f1")),
            "--early-stop-metric",
            metric,
            "a multi-label set's score; add --multi-label, or watch val_accuracy, val_top5 or val_loss",
        )
        return
    _require(0.0 < d.threshold < 1.0, "--threshold", d.threshold, "use a probability in (0, 1), e.g. 0.5")
    for url, flag in ((d.train, "--data"), (d.val, "--val-data")):
        _require(not url or is_table(url), flag, url, "a multi-label set is read from a CSV of labels; give one")
    for flag, value, used, why in (
        ("--mixup", d.mixup, d.mixup, "mixup blends one label a row"),
        ("--cutmix", d.cutmix, d.cutmix, "CutMix blends one label a row"),
        ("--head-parallel", h.head_parallel, h.head_parallel, "the sharded head normalises a softmax across shards"),
        ("--class-weights", o.class_weights, o.class_weights == "auto", "its weights are one class a row"),
        (
            "--label-smoothing",
            o.label_smoothing,
            o.label_smoothing,
            "binary cross-entropy would smooth every class's target towards 0.5, not the softmax's 1/classes",
        ),
        (
            "--early-stop-metric",
            cfg.run.early_stop_metric,
            bool(cfg.run.early_stop) and cfg.run.early_stop_metric in ("val_accuracy", "val_top5"),
            "a multi-label set is scored by val_map, val_f1 or val_loss",
        ),
    ):
        _require(not used, flag, value, f"with --multi-label {why}; drop one of them")
