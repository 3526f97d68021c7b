"""The learning-rate range test (Smith, 2015; fastai's ``lr_find``).

One process trains a throw-away copy of the run's model on the run's real
training images, with the run's optimizer, batch and augmentation, while
the learning rate grows exponentially from ``start`` to ``end`` over
``steps`` steps. It stops early once the loss has blown up: its
exponential moving average (fastai's, bias-corrected) is four times its
lowest value, or the loss is not finite. The suggested base learning rate
is a tenth of the rate where the loss, smoothed by a centred moving average
over a tenth of the sweep, was lowest: one order of magnitude below the
edge of divergence, Smith's rule of thumb. Where the loss stays flat until
it diverges (weak features, a hard task), it is a tenth of the rate where
the loss first rose (``suggest``). The centred average, unlike the
moving average that stops the sweep, does not lag: on a loss that falls and
then stays flat until it explodes, the lagging average keeps falling on the
plateau and puts its minimum at the explosion.

The rate found is the rate of one worker with ``--batch-size`` images, the
``--base-lr`` of a run: training scales it with the global batch (Goyal et
al.) after the warmup.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from hvd_train import files
from hvd_train.errors import UserError
from hvd_train.log import get_logger
from hvd_train.results import plots

log = get_logger("lr_find")

CSV = "lr_find.csv"
RESULT = "lr_find.json"
START, END, STEPS = 1e-7, 10.0, 200
SMOOTHING = 0.98  # of the loss's exponential moving average (bias-corrected)
BLOW_UP = 4.0  # stop when the smoothed loss exceeds this many times its lowest value


@dataclass
class Sweep:
    """The range test's record.

    Attributes:
        lrs: learning rate of each step.
        losses: training loss of each step.
        smoothed: bias-corrected exponential moving average of the losses (the stop rule).
        centred: centred moving average of the losses (the suggestion).
        suggestion: the suggested base learning rate, or None when the loss never fell.
        stopped: why the sweep ended.
        seconds: time taken.
    """

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    centred: list[float] = field(default_factory=list)
    suggestion: float | None = None
    stopped: str = ""
    seconds: float = 0.0


def centred_average(losses: list[float]) -> np.ndarray:
    """The losses averaged over a centred window of about a tenth of the sweep (at least 5 steps)."""
    values = np.asarray(losses, dtype=float)
    window = max(5, (values.size // 10) | 1)
    kernel = np.ones(window)
    return np.convolve(values, kernel, "same") / np.convolve(np.ones_like(values), kernel, "same")


def suggest(lrs: list[float], losses: list[float]) -> float | None:
    """The suggested base learning rate, from the finite losses of a sweep (one per rate of ``lrs``).

    * The smoothed loss fell by 10% or more: a tenth of the rate at its lowest point.
    * It stayed flat (within 10%) until it rose: a tenth of the rate where it first rose
      10% above its start, the edge of divergence (weak features, a hard task: the loss
      answers to no rate below the edge).
    * None when the lowest point is the last step (the edge was never reached) or
      when the loss neither fell nor rose (nothing to tell from).
    """
    if len(losses) < 10:
        return None
    smooth = centred_average(losses)
    best = int(np.argmin(smooth))
    start = smooth[: max(5, (len(losses) // 10) | 1)].mean()
    if best == len(losses) - 1:
        return None
    if smooth[best] <= 0.9 * start:
        return float(lrs[best]) / 10
    risen = np.flatnonzero(smooth > 1.1 * start)
    return float(lrs[int(risen[0])]) / 10 if risen.size else None


def run(job, *, steps: int = STEPS, start: float = START, end: float = END, threads: int = 0) -> Sweep:
    """Sweeps the learning rate on a copy of ``job``'s model, in this process alone.

    Args:
        job: the run's ``job.Job`` (configuration, training images, input size).
        steps: most steps of the sweep.
        start, end: first and last learning rate of the exponential sweep.

    Raises:
        UserError: bad arguments, or the weights cannot be loaded.
    """
    # TensorFlow loads here, not with this module: `hvd-train --help` reads the sweep's defaults above.
    from hvd_train.compat import keras, tf
    from hvd_train.data.pipeline import train_input
    from hvd_train.data.sharding import Segment
    from hvd_train.model import kerases, optimizers
    from hvd_train.model.catalogue import HEAD_LAYER, build_model, head_activation

    cfg = job.cfg
    if not (0 < start < end) or steps < 10:
        raise UserError(f"the sweep needs 0 < start < end and at least 10 steps; got {start:g}..{end:g}, {steps}.")
    if cfg.run.deterministic:  # the same initial weights, batches and augmentation every time
        keras.utils.set_random_seed(cfg.run.seed)
    model = build_model(cfg.model, len(job.classes), job.image_size, load_weights=True, activation=head_activation(cfg))
    # The run's optimizer (its weight decay, and what it leaves undecayed); no --ema, which changes no step.
    optimizer = optimizers.make(cfg.optim, start, ema=False, variables=model.trainable_variables)
    head = {kerases.key(v) for v in model.get_layer(HEAD_LAYER).trainable_variables}
    mult = cfg.optim.head_lr_mult
    # A multi-label set's batches are multi-hot rows on a sigmoid head: the run's binary cross-entropy.
    loss_fn = (
        keras.losses.BinaryCrossentropy() if cfg.data.multi_label else keras.losses.SparseCategoricalCrossentropy()
    )

    @tf.function(autograph=False)  # as the training step (see model.network.Net)
    def step(images, labels, ids):
        with tf.GradientTape() as tape:
            # Stand-ins for images that cannot be decoded (negative ids) weigh nothing, as in training.
            loss = loss_fn(labels, model(images, training=True), tf.cast(ids >= 0, tf.float32))
        variables = model.trainable_variables
        grads, _ = optimizers.clip(tape.gradient(loss, variables), cfg.optim)  # --clip-value, --clip-norm
        if mult != 1.0:
            grads = [g * mult if g is not None and kerases.key(v) in head else g for g, v in zip(grads, variables)]
        optimizer.apply_gradients(zip(grads, variables))
        return loss

    batch = min(cfg.data.batch_size, len(job.train))
    epochs = math.ceil(steps * batch / len(job.train))
    segments = [(Segment.whole(e, len(job.train), 1, batch, 1, cfg.run.seed), 0) for e in range(epochs)]
    made = train_input(
        job.train,
        segments,
        rank=0,
        image_size=job.image_size,
        augment=cfg.data.augment,
        magnitude=cfg.data.augment_magnitude,
        preprocess=job.spec.preprocess_input(),
        seed=cfg.run.seed,
        threads=threads,
        s3=cfg.data.s3_options(),
        alpha_background=cfg.data.alpha_background,
    )
    sweep = Sweep()
    started = time.perf_counter()
    average, best = 0.0, math.inf
    factor = (end / start) ** (1 / (steps - 1))
    for i, (images, labels, ids) in enumerate(made.dataset.take(steps)):
        lr = start * factor**i
        optimizer.learning_rate.assign(lr)
        loss = float(step(images, labels, ids))
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        smooth = average / (1 - SMOOTHING ** (i + 1))
        sweep.lrs.append(lr)
        sweep.losses.append(loss)
        sweep.smoothed.append(smooth if math.isfinite(loss) else math.nan)
        if not math.isfinite(loss) or not math.isfinite(smooth):
            sweep.stopped = f"the loss was not finite at lr {lr:.3g}"
            break
        best = min(best, smooth)
        if i >= 10 and smooth > BLOW_UP * best:
            sweep.stopped = f"the loss blew up at lr {lr:.3g}"
            break
    else:
        sweep.stopped = f"reached lr {sweep.lrs[-1]:.3g} after {len(sweep.lrs)} steps"
    sweep.seconds = time.perf_counter() - started
    finite = [i for i, loss in enumerate(sweep.losses) if math.isfinite(loss)]
    sweep.centred = [math.nan] * len(sweep.losses)
    if finite:
        for i, value in zip(finite, centred_average([sweep.losses[i] for i in finite])):
            sweep.centred[i] = float(value)
    sweep.suggestion = suggest([sweep.lrs[i] for i in finite], [sweep.losses[i] for i in finite])
    return sweep


def write(sweep: Sweep, folder: str) -> None:
    """``lr_find.csv``, ``lr_find.json`` and ``lr_find.png`` in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["step", "lr", "loss", "smoothed_loss", "centred_loss"])
    for i, row in enumerate(zip(sweep.lrs, sweep.losses, sweep.smoothed, sweep.centred)):
        writer.writerow([i, *(f"{v:.6g}" for v in row)])
    files.write_text(os.path.join(folder, CSV), table.getvalue())
    result = {"suggested_base_lr": sweep.suggestion, "steps": len(sweep.lrs), "stopped": sweep.stopped}
    files.write_json(os.path.join(folder, RESULT), result)

    path = os.path.join(folder, plots.LR_FIND)
    plots.draw(path, lambda: plots.lr_find(sweep.lrs, sweep.losses, sweep.centred, sweep.suggestion, path))


def saved_suggestion(folder: str) -> float | None:
    """The suggestion an earlier sweep wrote to ``folder`` (a resumed ``--base-lr auto`` run keeps it)."""
    try:
        with open(os.path.join(folder, RESULT), encoding="utf-8") as f:
            value = json.load(f).get("suggested_base_lr")
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and value > 0 else None
