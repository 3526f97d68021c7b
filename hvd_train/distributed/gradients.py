"""Data parallelism's arithmetic: the distributed optimizer, and weights made equal on every rank.

Under Keras 3 only ``horovod.tensorflow``'s collectives are used: Horovod's
Keras layer hooks methods a Keras 3 optimizer never calls (its
``apply_gradients`` would average nothing), so the step averages the
gradients itself (``allreduce_gradients``), and variables are broadcast and
averaged through the ``tf.Variable`` each Keras 3 variable holds.
"""

from __future__ import annotations

import os

from hvd_train import compat  # (the chosen Keras must be in place before Horovod)
from hvd_train.distributed.context import Context


def distributed_optimizer(optimizer, *, fp16_allreduce: bool, grad_accum: int):
    """Wraps a Keras optimizer so that gradients are averaged over all ranks; Keras 3: returns it as it is
    (the step averages with ``allreduce_gradients``, and accumulates itself)."""
    if compat.keras_3():  # the step averages and accumulates (``model.classifier``)
        return optimizer
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

    if not compat.keras_3():
        hvd.broadcast_variables(variables, root_rank=root)
        return
    # Horovod names each broadcast after its variable, and Keras 3 names variables after layers and
    # optimizers numbered within the process (a rank that ran lr-find first counts further): the ranks
    # would wait for broadcasts of different names. Named by place in the list, they meet (named after
    # Horovod's op, as an elastic job tells a failed collective by it: ``elastic.is_horovod_failure``).
    from hvd_train.compat import tf

    held = [_tf_variable(v) for v in variables]

    def broadcast():
        for i, variable in enumerate(held):
            variable.assign(hvd.broadcast(variable, root_rank=root, name=f"HorovodBroadcast_variable_{i}"))

    tf.function(broadcast, autograph=False)()


def _tf_variable(variable):
    """The ``tf.Variable`` behind ``variable`` (a Keras 3 variable holds one, which its ``value`` would cast
    inside an autocast scope; a tf-keras one is one)."""
    return variable._value if compat.keras_3() and hasattr(variable, "_value") else variable


def allreduce_gradients(grads, fp16: bool = False) -> list:
    """Averages gradients over all ranks, like ``DistributedOptimizer`` does (for use in a ``tf.function``)."""
    import horovod.tensorflow as hvd

    from hvd_train.compat import tf

    if not hvd.is_initialized():  # a model used outside a job (a notebook, a test): nothing to average with
        return list(grads)
    present = [(i, g) for i, g in enumerate(grads) if g is not None]
    # Sparse gradients (an embedding's) are averaged as dense ones.
    dense = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for _, g in present]
    if hvd.size() == 1 and os.environ.get("HOROVOD_ELASTIC") != "1":
        # One process, whose size cannot change: its own gradients, as Horovod's DistributedOptimizer skips
        # its allreduce then (a copy through Horovod's thread each step: a tenth of a small model's step).
        averaged = dense
    else:
        # Named: Horovod would name it after the first gradient's tensor, which Keras 3 may name otherwise on
        # another rank (after Horovod's op: see ``broadcast_variables``).
        compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        name = "HorovodGroupedAllreduce_gradients"
        averaged = hvd.grouped_allreduce(dense, op=hvd.Average, compression=compression, name=name)
    out = list(grads)
    for (i, _), value in zip(present, averaged):
        out[i] = value
    return out


def average_variables(variables, ctx: Context, name: str) -> None:
    """Sets each variable to its mean over all ranks (in place)."""
    if ctx.size == 1 or not variables:
        return
    import horovod.tensorflow as hvd

    averaged = hvd.grouped_allreduce([_tf_variable(v).read_value() for v in variables], op=hvd.Average, name=name)
    for variable, value in zip(variables, averaged):
        variable.assign(value)
