"""The optimizers a run can take, as one table, and the clipping of the averaged gradients.

A new optimizer is one entry of ``OPTIMIZERS`` (a constructor and the
values it keeps per weight) and its name in ``config.choices.OPTIMIZERS``,
which a test holds to this table. Training (``Net``), the sharded head's
own optimizer, ``lr-find`` and ``plan`` all build or count from here, so
each uses what the run uses: its weight decay, its exclusions from decay
and its ``--ema``.

Clipping (``--clip-value``, ``--clip-norm``) acts on the gradients every
rank holds alike: averaged over the ranks (and over the passes of
``--grad-accum``), unscaled under a loss scale, before the head's
``--head-lr-mult``. A value that is not finite stays so, so that a loss
scale still sees the overflow and skips the step on every rank.

Importing this module imports no TensorFlow: ``plan`` reads the table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hvd_train.config import OptimConfig


@dataclass(frozen=True)
class Kind:
    """One optimizer of the table.

    Attributes:
        build: ``(keras, learning_rate, optim, ema)`` to a Keras optimizer; ``ema``: the keyword arguments of
            ``--ema`` (none when off).
        slots: values it keeps per weight (momentum; Adam's two moments): what ``plan`` counts.
    """

    build: Callable
    slots: int


def _sgd(keras, learning_rate: float, o: OptimConfig, ema: dict):
    return keras.optimizers.SGD(
        learning_rate=learning_rate, momentum=o.momentum, weight_decay=o.weight_decay or None, **ema
    )


def _adam(keras, learning_rate: float, o: OptimConfig, ema: dict):
    return keras.optimizers.Adam(learning_rate=learning_rate, weight_decay=o.weight_decay or None, **ema)


def _adamw(keras, learning_rate: float, o: OptimConfig, ema: dict):
    return keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=o.weight_decay, **ema)


OPTIMIZERS = {
    "sgd": Kind(_sgd, slots=1),
    "adam": Kind(_adam, slots=2),
    "adamw": Kind(_adamw, slots=2),
}


def make(o: OptimConfig, learning_rate: float | None = None, *, ema: bool = True, variables=()):
    """The Keras optimizer ``o`` names, plain (Horovod's wrapper and a loss scale go around it elsewhere).

    The learning rate is a plain variable (``o.base_lr`` unless given): each
    compiled step sets it from the schedule. Weight decay is Keras's
    decoupled one (``leave_undecayed``: of ``variables``, the kernels alone).
    ``ema``: keep ``--ema``'s averages (Keras updates them after each update
    it applies: not after an accumulated pass, nor a step the loss scale skips).
    """
    from hvd_train.compat import keras

    averages = {"use_ema": True, "ema_momentum": o.ema} if ema and o.ema else {}
    optimizer = OPTIMIZERS[o.optimizer].build(keras, o.base_lr if learning_rate is None else learning_rate, o, averages)
    return leave_undecayed(optimizer, o, variables)


def leave_undecayed(optimizer, o: OptimConfig, variables):
    """``optimizer``, which decays no variable of rank 1 among ``variables`` (BatchNorm's and LayerNorm's
    scales and offsets, biases): each update shrinks every kernel by ``learning rate x weight_decay`` of itself,
    and nothing else. A wrapper made from an optimizer's configuration (Horovod's) does not keep this: call it
    on the wrapper."""
    undecayed = [v for v in variables if len(v.shape) <= 1]
    if o.weight_decay and undecayed:
        optimizer.exclude_from_weight_decay(var_list=undecayed)
    return optimizer


def clips(o: OptimConfig) -> bool:
    """Whether the run clips its gradients."""
    return bool(o.clip_value or o.clip_norm)


def clip_values(grads: list, o: OptimConfig) -> list:
    """``--clip-value``: each finite gradient value into ``[-v, v]`` (a value that is not finite stays)."""
    from hvd_train.compat import tf

    if not o.clip_value:
        return list(grads)
    v = o.clip_value
    return [
        None if g is None else tf.where(tf.math.is_finite(g), tf.clip_by_value(g, -v, v), g) for g in map(_dense, grads)
    ]


def square_norm(grads: list):
    """The sum of the squares of every gradient value, in float32."""
    from hvd_train.compat import tf

    return tf.add_n(
        [tf.constant(0.0)] + [tf.reduce_sum(tf.square(tf.cast(_dense(g), tf.float32))) for g in grads if g is not None]
    )


def clip(grads: list, o: OptimConfig, others_square=0.0):
    """``--clip-value``, then ``--clip-norm`` over the global norm of ``grads`` and of the gradients whose
    squared norm is ``others_square`` (already value-clipped: the sharded head's). The gradients clipped, and
    the factor ``c / max(norm, c)`` the others take too (1 without ``--clip-norm``; not finite when the norm
    is not, so a loss scale still skips the step)."""
    from hvd_train.compat import tf

    grads = clip_values(grads, o)
    if not o.clip_norm:
        return grads, tf.constant(1.0)
    norm = tf.sqrt(others_square + square_norm(grads))
    factor = tf.where(tf.math.is_finite(norm), o.clip_norm / tf.maximum(norm, o.clip_norm), norm)
    return [None if g is None else g * tf.cast(factor, g.dtype) for g in grads], factor


def _dense(g):
    from hvd_train.compat import tf

    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
