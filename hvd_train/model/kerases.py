"""What differs between Keras 2 (tf-keras) and Keras 3 in the model's code, asked in one place.

Each function answers one question the same way on both: a variable's key
(Keras 3 variables have no ``ref()`` and are unhashable), a layer walk
(``submodules`` is tf-keras'), the random generators a step reseeds, the
metrics' results (Keras 3 nests the compiled ones), a variable's numpy dtype;
and Keras 3's BatchNormalization made to run as one fused op, as tf-keras' does.
"""

from __future__ import annotations

from hvd_train.compat import keras, keras_3, tf


def key(variable):
    """A hashable key of ``variable``, the same for every read of it."""
    return id(variable) if keras_3() else variable.ref()


def outputs_of(model):
    """``model``'s outputs to build another model on: the one tensor itself under Keras 3, whose model made with
    ``outputs=[t]`` gives a list of one (tf-keras unwraps it)."""
    outputs = model.outputs
    return outputs[0] if keras_3() and len(outputs) == 1 else outputs


def layers(model) -> list:
    """Every layer in ``model``, nested ones included."""
    if keras_3():
        return list(model._flatten_layers(include_self=False, recursive=True))
    return list(model.submodules)


def fuse_batch_norm(model) -> None:
    """Keras 3: ``model``'s BatchNormalization layers normalise a training step's batch with TensorFlow's fused
    op, as tf-keras' do.

    Keras 3 computes the moments and the normalisation op by op, forward and backward: a fifth of a
    MobileNetV2 step on a CPU. Where the fused op computes the same (float32 variables, 4-D channels-last
    inputs, no mask, no renorm, not synchronised, an epsilon cuDNN takes), the layer's ``call`` becomes
    ``_fused_call``; elsewhere it stays Keras's. A layer that normalises by its moving statistics (inference,
    or not trainable: ``--bn-mode inference``) keeps Keras's call too: a scale and an offset, and the fused op's
    gradient in that mode has no deterministic GPU kernel (``--deterministic``). Only this process's layers
    change: a saved model is Keras's own.
    """
    if not keras_3():
        return
    import types

    for layer in layers(model):
        if type(layer) is keras.layers.BatchNormalization and _fusable(layer):
            layer.call = types.MethodType(_fused_call, layer)


def _fusable(layer) -> bool:
    return (
        layer.axis in (-1, 3)
        and layer.variable_dtype == "float32"
        and not layer.renorm
        and not layer.synchronized
        and layer.epsilon >= 1.001e-5  # cuDNN's least
    )


def _fused_call(layer, inputs, training=None, mask=None):
    """Keras 3's ``BatchNormalization.call`` of a training step through ``FusedBatchNormV3``: float32 inside as
    Keras's; the moving statistics updated by Keras's formula with the batch's variance (the op gives it
    divided by n - 1)."""
    if not (training and layer.trainable) or mask is not None or len(inputs.shape) != 4:
        return type(layer).call(layer, inputs, training=training, mask=mask)
    x = tf.cast(inputs, tf.float32)
    channels = x.shape[-1]
    scale = tf.convert_to_tensor(layer.gamma) if layer.scale else tf.ones([channels])
    offset = tf.convert_to_tensor(layer.beta) if layer.center else tf.zeros([channels])
    y, mean, variance, _, _, _ = tf.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=tf.zeros([0]), variance=tf.zeros([0]),
        epsilon=layer.epsilon, data_format="NHWC", is_training=True,
    )  # fmt: skip
    count = tf.cast(tf.size(x) // channels, tf.float32)
    variance = variance * tf.maximum(count - 1.0, 0.0) / tf.maximum(count, 1.0)
    momentum = layer.momentum
    layer.moving_mean.assign(layer.moving_mean * momentum + mean * (1.0 - momentum))
    layer.moving_variance.assign(layer.moving_variance * momentum + variance * (1.0 - momentum))
    return tf.cast(y, layer.compute_dtype)


def numpy_dtype(variable):
    """The numpy dtype of ``variable``'s values (Keras 3 names dtypes by strings)."""
    return tf.as_dtype(variable.dtype).as_numpy_dtype


def use_step_seeded_dropout() -> None:
    """Makes tf-keras layers draw random numbers from ``tf.random.Generator`` objects (before the model is
    built). Keras 3's layers draw from ``SeedGenerator`` objects, whose state is a variable already."""
    if not keras_3():
        keras.backend.experimental.enable_tf_random_generator()


def step_generators(model) -> list:
    """The random generators of ``model``'s layers (dropout's), which ``reseed`` sets at every step."""
    if keras_3():
        return [generator for layer in layers(model) for generator in getattr(layer, "_seed_generators", [])]
    return [
        layer._random_generator._generator
        for layer in layers(model)
        if isinstance(getattr(getattr(layer, "_random_generator", None), "_generator", None), tf.random.Generator)
    ]


def reseed(generators: list, key, step) -> None:
    """Sets each generator from ``(key, step, its place)``: the same numbers after a resume (in a step's graph).

    tf-keras: a Philox generator's key and counter. Keras 3: a ``SeedGenerator``'s state ``[seed, counter]``
    (each draw uses it, then adds 1 to the counter), both of which its TensorFlow ops take modulo 2**31 - 2:
    the seed is the step, the counter ``key`` (the run's seed and the rank) modulo 32,767 in its high bits and
    the generator's place below (at most 2**31 - 65,537: no value wraps), with room for ``65536 // generators``
    draws of a layer in one step (256 for up to 256 generators). No two (rank, step, layer) of a run below 2**31
    steps and 32,767 ranks share one.
    """
    count = len(generators)
    stride = max(1, 65_536 // max(count, 1))
    for i, generator in enumerate(generators):
        if keras_3():
            counter = tf.math.floormod(tf.cast(key, tf.int64), 32_767) * 65_536 + i * stride
            state = tf.stack([tf.cast(step, tf.int64), counter])
            generator.state.assign(tf.cast(state, generator.state.dtype))
        else:
            generator.reset_from_key_counter(key, tf.stack([step, tf.constant(i, tf.int64)]))


def metric_results(model) -> dict:
    """The model's metrics by name (``loss``, ``accuracy``), as tensors."""
    if keras_3():
        return dict(model.get_metrics_result())
    return {m.name: m.result() for m in model.metrics}


def metric_objects(model) -> dict:
    """The model's metrics by name (``loss``, ``accuracy``), as the objects that hold them."""
    if keras_3():
        return {"loss": model._loss_tracker, **{m.name: m for m in model._compile_metrics.metrics}}
    return {m.name: m for m in model.metrics}


def update_loss_metric(model, loss, images) -> None:
    """Keras 3: adds a batch's loss to the epoch's (tf-keras' ``compute_loss`` does it itself)."""
    if keras_3():
        model._loss_tracker.update_state(loss, sample_weight=tf.shape(images)[0])
