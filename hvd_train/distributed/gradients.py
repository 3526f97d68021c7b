"""Data parallelism's arithmetic: the distributed optimizer, and weights made equal on every rank."""

from __future__ import annotations

from hvd_train import compat  # noqa: F401  (Keras 2 must be in place before Horovod)
from hvd_train.distributed.context import Context


def distributed_optimizer(optimizer, *, fp16_allreduce: bool, grad_accum: int):
    """Wraps a Keras optimizer so that gradients are averaged over all ranks."""
    import horovod.tensorflow.keras as hvd_keras

    from hvd_train.compat import tf

    wrapped = hvd_keras.DistributedOptimizer(
        optimizer,
        # Horovod: halve the bytes on the wire; gradients are summed in float32 again.
        compression=hvd_keras.Compression.fp16 if fp16_allreduce else hvd_keras.Compression.none,
        # Horovod: accumulate N local batches before one allreduce and update.
        backward_passes_per_step=grad_accum,
        average_aggregated_gradients=True,
    )
    # Horovod makes its gradient allreduce a tf.function with AutoGraph, made
    # when the optimizer is (eagerly). Its Python has no control flow on
    # tensors (each gradient's tf.cond is explicit), but converting it and the
    # allreduce it calls, once per gradient, took seconds of every rank's first
    # step (see model.network.Net). The same function, traced as written:
    reduce = getattr(wrapped, "_allreduce_grads", None)
    if hasattr(reduce, "python_function"):
        plain = tf.function(reduce.python_function, autograph=False)
        wrapped._allreduce_grads = plain
        helper = getattr(wrapped, "_agg_helper", None)
        if helper is not None and getattr(helper, "_allreduce_grads", None) is reduce:
            helper._allreduce_grads = plain
    return wrapped


def broadcast_variables(variables, ctx: Context, root: int = 0) -> None:
    """Gives every rank rank ``root``'s values of ``variables`` (weights, optimizer state)."""
    if ctx.size == 1:
        return
    import horovod.tensorflow as hvd

    hvd.broadcast_variables(variables, root_rank=root)


def allreduce_gradients(grads, fp16: bool = False) -> list:
    """Averages gradients over all ranks, like ``DistributedOptimizer`` does (for use in a ``tf.function``)."""
    import horovod.tensorflow as hvd

    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    present = [(i, g) for i, g in enumerate(grads) if g is not None]
    averaged = hvd.grouped_allreduce([g for _, g in present], op=hvd.Average, compression=compression)
    out = list(grads)
    for (i, _), value in zip(present, averaged):
        out[i] = value
    return out


def average_variables(variables, ctx: Context, name: str) -> None:
    """Sets each variable to its mean over all ranks (in place)."""
    if ctx.size == 1 or not variables:
        return
    import horovod.tensorflow as hvd

    averaged = hvd.grouped_allreduce([v.read_value() for v in variables], op=hvd.Average, name=name)
    for variable, value in zip(variables, averaged):
        variable.assign(value)
