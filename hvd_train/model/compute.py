"""How the model computes: numeric precision and XLA.

Precision: fp32, or mixed float16 / bfloat16 compute with float32 weights.

Under ``mixed_float16`` small gradients underflow float16, so the loss is
multiplied by a dynamic loss scale before the backward pass and the
gradients are divided by it before the update; a step whose gradients are
not finite is skipped and the scale halved. With Horovod the order is
``LossScaleOptimizer(DistributedOptimizer(opt))`` (tf-keras' docstring,
NVIDIA's DeepLearningExamples, horovod#2989 and #3807): the allreduce sees
the scaled gradients, so every rank sees the same sums, finds the same
non-finite values, and skips the same step. ``mixed_bfloat16`` has float32's
range and needs no loss scale.

The head's softmax always computes in float32 (``catalogue.build_model``), and
the saved model is rebuilt in float32 (``float32_copy``), so inference
outside training never meets float16.

XLA: ``--xla auto`` turns on TensorFlow's auto-clustering, which compiles
what it can and leaves the rest (Horovod's ops among it) to TensorFlow;
``--xla jit`` compiles the forward and backward pass of the step
(``classifier.Classifier``; with a sharded head, the backbone's passes
around the head's exchanges: ``sharded_net.ShardedNet``).
"""

from __future__ import annotations

import contextlib
import os

from hvd_train.compat import keras, keras_3

POLICIES = {"fp32": "float32", "mixed_float16": "mixed_float16", "mixed_bfloat16": "mixed_bfloat16"}


def resolve(requested: str, grad_accum: int = 1) -> str:
    """The precision ``auto`` stands for on this machine.

    ``auto`` is mixed_float16 on GPUs with tensor cores (compute capability
    7.0 or more) and fp32 elsewhere (CPUs gain nothing from float16). With
    ``grad_accum`` > 1 it avoids float16, whose loss scale can change
    between accumulated passes: mixed_bfloat16 from compute capability 8.0,
    fp32 below.
    """
    if requested != "auto":
        return requested
    from hvd_train.compat import tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "fp32"
    capability = tuple(tf.config.experimental.get_device_details(gpus[0]).get("compute_capability") or (0, 0))
    if capability < (7, 0):
        return "fp32"
    if grad_accum > 1:
        return "mixed_bfloat16" if capability >= (8, 0) else "fp32"
    return "mixed_float16"


def set_policy(precision: str) -> None:
    """Sets Keras' global dtype policy; layers built afterwards follow it."""
    keras.mixed_precision.set_global_policy(POLICIES[precision])


def wrap_optimizer(optimizer, precision: str):
    """Adds dynamic loss scaling around ``optimizer`` under mixed_float16."""
    if precision != "mixed_float16":
        return optimizer
    return keras.mixed_precision.LossScaleOptimizer(optimizer)


def is_loss_scaled(optimizer) -> bool:
    return isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)


def loss_scale_variables(optimizer) -> list:
    """The loss scale and its counter of good steps (not among ``optimizer.variables``).

    Every rank must hold the same values: they are broadcast and
    checkpointed with the other optimizer state.
    """
    if not is_loss_scaled(optimizer) or keras_3():  # Keras 3 keeps them among ``optimizer.variables``
        return []
    return [optimizer._loss_scale.current_loss_scale, optimizer.dynamic_counter]


def current_loss_scale(optimizer) -> float:
    """The dynamic loss scale's value now (under ``mixed_float16``)."""
    scale = optimizer.dynamic_scale if keras_3() else optimizer.loss_scale
    return float(scale.numpy())


@contextlib.contextmanager
def float32_policy():
    """Inside: layers are built in float32, whatever the run's precision."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def float32_copy(model: keras.Model, build) -> keras.Model:
    """``model``'s architecture rebuilt with float32 layers, holding its weights.

    Args:
        build: makes the architecture (called with the float32 policy in place).
    """
    with float32_policy():
        copy = build()
    copy.set_weights(model.get_weights())
    return copy


def xla_environment(mode: str) -> None:
    """Sets the XLA flags of ``--xla``; call before TensorFlow compiles anything."""
    if mode != "auto":
        return
    flags = os.environ.get("TF_XLA_FLAGS", "")
    # Auto-clustering; on CPUs it also needs --tf_xla_cpu_global_jit to cluster anything.
    for flag in ("--tf_xla_auto_jit=2", "--tf_xla_cpu_global_jit"):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["TF_XLA_FLAGS"] = flags


def use_xla(mode: str) -> None:
    """Turns on auto-clustering for ``--xla auto`` (after ``xla_environment``)."""
    if mode == "auto":
        from hvd_train.compat import tf

        tf.config.optimizer.set_jit("autoclustering")
