"""What differs between Keras 2 (tf-keras) and Keras 3 in the model's code, asked in one place.

Each function answers one question the same way on both: a variable's key
(Keras 3 variables have no ``ref()`` and are unhashable), a layer walk
(``submodules`` is tf-keras'), the random generators a step reseeds, the
metrics' results (Keras 3 nests the compiled ones), a variable's numpy dtype.
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
