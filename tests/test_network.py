import numpy as np
import pytest

from hvd_train.compat import keras
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.classifier import Classifier

pytestmark = pytest.mark.both_kerases


def one_step_deltas(mult):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(5, name="backbone")(inputs)
    outputs = keras.layers.Dense(3, activation="softmax", name=HEAD_LAYER)(hidden)
    model = Classifier(inputs, outputs)
    model.head_lr_mult = mult
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    before = {name_of(w): w.numpy().copy() for w in model.trainable_weights}
    x = np.random.default_rng(1).normal(size=(8, 6)).astype("float32")
    model.train_on_batch(x, np.arange(8) % 3)
    return {name_of(w): w.numpy() - before[name_of(w)] for w in model.trainable_weights}


def name_of(weight) -> str:
    """``predictions/kernel``: Keras 3's path, tf-keras' name (Keras 3's name is the last part alone)."""
    return getattr(weight, "path", weight.name)


def test_head_lr_mult_scales_only_the_head_update():
    plain, boosted = one_step_deltas(1.0), one_step_deltas(10.0)
    for name in plain:
        factor = 10.0 if name.startswith(HEAD_LAYER) else 1.0
        assert np.abs(plain[name]).sum() > 0
        np.testing.assert_allclose(boosted[name], factor * plain[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mult", [1.0, 3.0])
def test_train_step_reports_loss_and_metrics(mult):
    inputs = keras.Input((4,))
    model = Classifier(inputs, keras.layers.Dense(2, activation="softmax", name=HEAD_LAYER)(inputs))
    model.head_lr_mult = mult
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    logs = model.train_on_batch(np.ones((4, 4), "float32"), np.array([0, 1, 0, 1]), return_dict=True)
    assert set(logs) == {"loss", "accuracy"} and logs["accuracy"] == pytest.approx(0.5)


def test_batch_norm_runs_as_one_fused_op_and_computes_what_keras_computes():
    """Keras 3's BatchNormalization computes op by op (a fifth of a small model's step on a CPU): the step's
    layers run TensorFlow's fused op, as tf-keras' do, with Keras's outputs, gradients and moving statistics;
    a layer with an epsilon below cuDNN's least, Keras 3's own call, with the same."""
    import collections

    from hvd_train.compat import tf
    from hvd_train.model import kerases

    def model(fused):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8, 8, 4))
        x = keras.layers.Conv2D(6, 3)(inputs)
        x = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3, name="fusable")(x)
        x = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-6, name="tiny_epsilon")(x)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(x))
        built = keras.Model(inputs, outputs)
        if fused:
            kerases.fuse_batch_norm(built)
        return built

    images = tf.random.stateless_normal([5, 8, 8, 4], (1, 2)) * 3 + 1

    def trained(net):
        """One step's gradients, the moving statistics after it, the inference outputs, the step's op types."""

        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(net(images, training=True) ** 2)
            return tape.gradient(loss, net.trainable_variables)

        grads = step()
        statistics = [v.numpy() for layer in net.layers[2:4] for v in (layer.moving_mean, layer.moving_variance)]
        graph = step.get_concrete_function().graph
        ops = collections.Counter(op.type for op in graph.get_operations())
        for function in graph.as_graph_def().library.function:
            ops.update(node.op for node in function.node_def)
        return [*(g.numpy() for g in grads), *statistics, net(images, training=False).numpy()], ops

    plain, _ = trained(model(fused=False))
    fused, ops = trained(model(fused=True))
    # Fused ops forward and backward (Keras 3: the tiny epsilon's layer is Keras's own, cuDNN would refuse it).
    assert ops["FusedBatchNormV3"] >= 1 and ops["FusedBatchNormGradV3"] >= 1, ops
    for a, b in zip(plain, fused, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert np.abs(plain[-1]).max() > 0.1 and not np.allclose(plain[-3], 1.0), "trivial statistics"
