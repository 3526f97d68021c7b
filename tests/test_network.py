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
    """Keras 3's BatchNormalization computes op by op (a fifth of a small model's step on a CPU): a training
    step's layers run TensorFlow's fused op, as tf-keras' do, with Keras's outputs, gradients (of the layer's
    scale and offset too) and moving statistics. On Keras 3 a layer with an epsilon below cuDNN's least, and a
    layer not trainable (normalised by its moving statistics), keep Keras's call, with the same."""
    import collections

    from hvd_train.compat import KERAS_MAJOR, tf
    from hvd_train.model import kerases

    def model(fused):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((8, 8, 4))
        x = keras.layers.Conv2D(6, 3, name="convolution")(inputs)
        x = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-6, name="tiny_epsilon")(x)
        x = keras.layers.ReLU()(x)
        # Last of those normalising by the batch: no later one undoes its scale and offset.
        x = keras.layers.BatchNormalization(momentum=0.5, epsilon=1e-3, name="fusable")(x)
        frozen = keras.layers.BatchNormalization(name="frozen")
        frozen.trainable = False
        outputs = keras.layers.Dense(3, name="outputs")(keras.layers.GlobalAveragePooling2D()(frozen(x)))
        built = keras.Model(inputs, outputs)
        if fused:
            kerases.fuse_batch_norm(built)
        return built

    images = tf.random.stateless_normal([5, 8, 8, 4], (1, 2)) * 3 + 1

    def trained(net):
        """One step's gradients by variable path, the moving statistics after it, the inference outputs, and the
        step's op types."""

        @tf.function(autograph=False)
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum((net(images, training=True) - 1.0) ** 2)
            return tape.gradient(loss, net.trainable_variables)

        seen = {name_of(v).removesuffix(":0"): g.numpy() for v, g in zip(net.trainable_variables, step())}
        for name in ("fusable", "tiny_epsilon"):
            layer = net.get_layer(name)
            seen[f"{name} moving mean"], seen[f"{name} moving variance"] = (
                layer.moving_mean.numpy(),
                layer.moving_variance.numpy(),
            )
        seen["inference"] = net(images, training=False).numpy()
        graph = step.get_concrete_function().graph
        ops = collections.Counter(op.type for op in graph.get_operations())
        for function in graph.as_graph_def().library.function:
            ops.update(node.op for node in function.node_def)
        return seen, ops

    plain, _ = trained(model(fused=False))
    fused, ops = trained(model(fused=True))
    # Forward and backward fused (tf-keras fuses the other two layers too).
    expected = 1 if KERAS_MAJOR == 3 else 3
    assert ops["FusedBatchNormV3"] == expected and ops["FusedBatchNormGradV3"] == expected, ops
    assert plain.keys() == fused.keys() and len(plain) == 13, plain.keys()  # 8 gradients, 4 statistics, outputs
    for name, value in plain.items():
        np.testing.assert_allclose(fused[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    for name in ("fusable/gamma", "fusable/beta", "fusable moving mean", "inference"):
        assert np.abs(plain[name]).max() > 1e-3, f"{name}: nothing to compare"
    assert np.abs(plain["fusable moving variance"] - 1.0).max() > 1e-3, "nothing to compare"
