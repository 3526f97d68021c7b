"""The learning rate: linear scaling, gradual warmup, then step or cosine decay.

Goyal et al. (2017), "Accurate, Large Minibatch SGD": with k workers the
learning rate is k times the single-worker rate, reached by a linear warmup
from the single-worker rate over the first epochs.

The schedule is keyed on training progress measured in epochs (images seen
divided by images per epoch), not on a step counter: a step holds more or
fewer images when the number of workers changes (an elastic job, or a rerun
on another cluster), and the rate must not jump then. The compiled steps
compute each step's rate themselves (``graph_rate``, the same formulas in
TensorFlow ops) from the images seen, which the step counter inside the
call gives; the schedule's numbers are an argument of the call, not traced
constants, so a new peak (another number of workers) needs no new trace and
the host assigns nothing per step. (Horovod's ``LearningRateWarmupCallback``
is not used: it writes floats over Keras >= 2.11 optimizer variables and
crashes.)
"""

from __future__ import annotations

import math

import numpy as np


def linear_scaling(base_lr: float, global_batch: int, batch_size: int) -> float:
    """The peak rate for ``global_batch`` images per update: ``base_lr`` is one worker's rate at ``batch_size``.

    Goyal et al.: the learning rate grows linearly with the global batch
    (workers x batch x accumulation), so each image moves the weights as much
    as it would on one worker.
    """
    return base_lr * (global_batch / batch_size)


def of_run(optim, epochs: int, peak_lr: float) -> WarmupSchedule:
    """The schedule of a run: from ``--base-lr`` up to ``peak_lr`` (``linear_scaling``), then the decay.

    Args:
        optim: the run's ``OptimConfig`` (warmup, decay and its steps).
        epochs: the run's ``--epochs``.
        peak_lr: the rate scaled to the run's global batch.
    """
    return WarmupSchedule(
        initial_lr=optim.base_lr,
        peak_lr=peak_lr,
        warmup_epochs=optim.warmup_epochs,
        total_epochs=epochs,
        decay=optim.lr_schedule,
        drop_factor=optim.lr_drop_factor,
        drop_period_epochs=optim.lr_drop_period,
    )


class WarmupSchedule:
    """Linear warmup from ``initial_lr`` to ``peak_lr``, then a decay; a function of epochs.

    Args:
        initial_lr: rate at the start (one worker's rate).
        peak_lr: rate at the end of warmup (scaled to the global batch).
        warmup_epochs: epochs of linear warmup; 0 starts at ``peak_lr``.
        total_epochs: epochs of the whole run; cosine reaches 0 there.
        decay: ``cosine``, ``step`` or ``constant`` after warmup.
        drop_factor: with ``step``, the rate is multiplied by this every
            ``drop_period_epochs`` epochs, counted from the start.
        drop_period_epochs: epochs between drops.
    """

    def __init__(
        self,
        initial_lr: float,
        peak_lr: float,
        warmup_epochs: float,
        total_epochs: float,
        decay: str = "cosine",
        drop_factor: float = 0.1,
        drop_period_epochs: float = 1.0,
    ):
        if decay not in ("cosine", "step", "constant"):
            raise ValueError(f"`decay` must be cosine, step or constant. Received: decay={decay!r}")
        if total_epochs <= 0:
            raise ValueError(f"`total_epochs` must be > 0. Received: total_epochs={total_epochs}")
        if warmup_epochs < 0:
            raise ValueError(f"`warmup_epochs` must be >= 0. Received: warmup_epochs={warmup_epochs}")
        if drop_period_epochs <= 0:
            raise ValueError(f"`drop_period_epochs` must be > 0. Received: drop_period_epochs={drop_period_epochs}")
        self.initial_lr = float(initial_lr)
        self.peak_lr = float(peak_lr)
        self.warmup_epochs = float(warmup_epochs)
        self.total_epochs = float(total_epochs)
        self.decay = decay
        self.drop_factor = float(drop_factor)
        self.drop_period_epochs = float(drop_period_epochs)

    def __call__(self, epochs: float) -> float:
        """The rate after ``epochs`` epochs of training (fractional)."""
        t = float(epochs)
        if t < self.warmup_epochs:
            return self.initial_lr + (self.peak_lr - self.initial_lr) * t / self.warmup_epochs
        if self.decay == "cosine":
            span = max(self.total_epochs - self.warmup_epochs, 1e-12)
            progress = min(max((t - self.warmup_epochs) / span, 0.0), 1.0)
            return self.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            # A tolerance keeps a drop exactly at the period even after float sums of image counts.
            drops = math.floor(t / self.drop_period_epochs + 1e-9)
            return self.peak_lr * self.drop_factor**drops
        return self.peak_lr

    def parameters(self) -> np.ndarray:
        """The numbers ``graph_rate`` reads, as one float64 vector."""
        return np.array(
            [
                self.initial_lr,
                self.peak_lr,
                self.warmup_epochs,
                self.total_epochs,
                self.drop_factor,
                self.drop_period_epochs,
            ],
            np.float64,
        )

    def get_config(self) -> dict:
        return {
            "initial_lr": self.initial_lr,
            "peak_lr": self.peak_lr,
            "warmup_epochs": self.warmup_epochs,
            "total_epochs": self.total_epochs,
            "decay": self.decay,
            "drop_factor": self.drop_factor,
            "drop_period_epochs": self.drop_period_epochs,
        }

    @classmethod
    def from_config(cls, config: dict) -> WarmupSchedule:
        return cls(**config)


def graph_rate(decay: str, parameters, epochs):
    """``WarmupSchedule.__call__`` in TensorFlow ops, in float64, for a compiled step.

    Args:
        decay: the schedule's ``decay`` (a Python value: each kind is its own trace).
        parameters: ``WarmupSchedule.parameters()``, as a tensor.
        epochs: the training progress in epochs, a float64 scalar tensor.
    """
    from hvd_train.compat import tf

    initial, peak, warmup, total, factor, period = tf.unstack(parameters)
    warming = initial + (peak - initial) * epochs / tf.maximum(warmup, 1e-300)
    if decay == "cosine":
        span = tf.maximum(total - warmup, 1e-12)
        progress = tf.clip_by_value((epochs - warmup) / span, 0.0, 1.0)
        after = peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
    elif decay == "step":
        after = peak * tf.pow(factor, tf.floor(epochs / period + 1e-9))
    else:
        after = peak
    return tf.where(epochs < warmup, warming, after)
