"""The learning rate: linear scaling, gradual warmup, then step or cosine decay.

Goyal et al. (2017), "Accurate, Large Minibatch SGD": with k workers the
learning rate is k times the single-worker rate, reached by a linear warmup
from the single-worker rate over the first epochs. The warmup lives inside
the schedule object, as in Keras' ``CosineDecay(warmup_steps=...)``: the
optimizer evaluates it at its own ``iterations``, so a restored optimizer
resumes at the right rate, and nothing pokes ``optimizer.lr`` from a callback
(Horovod's ``LearningRateWarmupCallback`` does, and crashes on Keras >= 2.11
optimizers).
"""

from __future__ import annotations

import math

import tensorflow as tf

from hvd_train.compat import keras


# Registered so that optimizers can be rebuilt from their config: Horovod's
# DistributedOptimizer does exactly that when it wraps one.
@keras.saving.register_keras_serializable(package="hvd_train")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup from ``initial_lr`` to ``peak_lr``, then a decay.

    Args:
        initial_lr: rate at step 0 (one worker's rate).
        peak_lr: rate at the end of warmup (scaled to the global batch).
        warmup_steps: steps of linear warmup; 0 starts at ``peak_lr``.
        total_steps: steps of the whole run; cosine reaches 0 there.
        decay: ``cosine``, ``step`` or ``constant`` after warmup.
        drop_factor: with ``step``, the rate is multiplied by this every
            ``drop_period_steps`` steps, counted from step 0.
        drop_period_steps: steps between drops.
    """

    def __init__(
        self,
        initial_lr: float,
        peak_lr: float,
        warmup_steps: int,
        total_steps: int,
        decay: str = "cosine",
        drop_factor: float = 0.1,
        drop_period_steps: int = 1,
        name: str = "WarmupSchedule",
    ):
        super().__init__()
        if decay not in ("cosine", "step", "constant"):
            raise ValueError(f"`decay` must be cosine, step or constant. Received: decay={decay!r}")
        if total_steps <= 0:
            raise ValueError(f"`total_steps` must be > 0. Received: total_steps={total_steps}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0. Received: warmup_steps={warmup_steps}")
        if drop_period_steps <= 0:
            raise ValueError(f"`drop_period_steps` must be > 0. Received: drop_period_steps={drop_period_steps}")
        self.initial_lr = float(initial_lr)
        self.peak_lr = float(peak_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = int(total_steps)
        self.decay = decay
        self.drop_factor = float(drop_factor)
        self.drop_period_steps = int(drop_period_steps)
        self.name = name

    def __call__(self, step):
        with tf.name_scope(self.name):
            step = tf.cast(step, tf.float32)
            peak = tf.constant(self.peak_lr, tf.float32)
            if self.decay == "cosine":
                span = max(1, self.total_steps - self.warmup_steps)
                progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
                decayed = peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
            elif self.decay == "step":
                drops = tf.floor(step / self.drop_period_steps)
                decayed = peak * tf.pow(tf.constant(self.drop_factor, tf.float32), drops)
            else:
                decayed = peak
            if self.warmup_steps == 0:
                return decayed
            fraction = tf.minimum(step / self.warmup_steps, 1.0)
            warm = self.initial_lr + (self.peak_lr - self.initial_lr) * fraction
            return tf.where(step < self.warmup_steps, warm, decayed)

    def get_config(self):
        return {
            "initial_lr": self.initial_lr,
            "peak_lr": self.peak_lr,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "decay": self.decay,
            "drop_factor": self.drop_factor,
            "drop_period_steps": self.drop_period_steps,
            "name": self.name,
        }
