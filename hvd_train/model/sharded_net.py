"""``Net`` with its classification head split by class over a group of ranks (``--head-parallel``).

``net.model`` is the network up to the head's input (the features), so
what Keras checkpoints and Horovod broadcasts, the backbone and its
optimizer, is the same whatever the layout. The head is this rank's shard
(``sharded_head``): the kernel and bias of its classes, with an optimizer
of their own (plain Keras: their gradients come averaged from
``head_step``), initialised from ``(seed, block of classes)`` so that every
layout starts from the same head. Checkpoints hold it whole
(``training/head_files``), so a run resumes on any world size and any G;
an unsplit run reads it whole, and a split run takes an unsplit run's
head from its checkpoint (``whole_head_files``).
"""

from __future__ import annotations

import math
import os

import numpy as np

from hvd_train.compat import keras, tf
from hvd_train.config import TrainConfig
from hvd_train.distributed import gradients
from hvd_train.distributed.groups import HeadGroups, shard_range
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.compute import is_loss_scaled
from hvd_train.model.network import Net, keras_optimizer
from hvd_train.model.sharded_head import head_scores, head_step
from hvd_train.training import head_files

# The head is drawn in blocks of this many classes, each from its own key: any shard takes its columns.
HEAD_BLOCK = 1024


def initial_columns(features: int, classes: int, first: int, count: int, seed: int) -> np.ndarray:
    """Columns ``first ..`` of the whole head's starting kernel: Glorot-uniform over ``features`` x ``classes``
    (Keras's Dense default), the same values whatever the split."""
    limit = math.sqrt(6.0 / (features + classes))
    blocks = []
    for block in range(first // HEAD_BLOCK, (first + count - 1) // HEAD_BLOCK + 1):
        key = tf.constant([seed, block], tf.int64)
        blocks.append(tf.random.stateless_uniform([features, HEAD_BLOCK], key, -limit, limit).numpy())
    whole = np.concatenate(blocks, axis=1)
    start = first - (first // HEAD_BLOCK) * HEAD_BLOCK
    return whole[:, start : start + count]


class ShardedNet(Net):
    """A rank's backbone, its shard of the head, their optimizers and the compiled step.

    Args:
        base: ``catalogue.build_model`` with a head of this rank's classes.
        head: the groups of ranks (``groups.register``).
        classes: all classes of the head.
        (the rest as ``Net``'s)
    """

    def __init__(
        self,
        base,
        cfg: TrainConfig,
        seed: int,
        rank: int,
        precision: str,
        head: HeadGroups,
        classes: int,
        class_counts=None,
    ):
        layer = base.get_layer(HEAD_LAYER)
        super().__init__(
            keras.Model(base.inputs, layer.input, name=base.name), cfg, seed, rank, precision, class_counts=class_counts
        )
        self.head, self.classes = head, classes
        self.first, self.count = shard_range(classes, head.parallel, head.shard)
        self.kernel, self.bias = layer.kernel, layer.bias
        self.kernel.assign(initial_columns(int(self.kernel.shape[0]), classes, self.first, self.count, seed))
        self.bias.assign(tf.zeros_like(self.bias))
        self._smoothing = cfg.optim.label_smoothing
        self._head_lr_mult = cfg.optim.head_lr_mult
        self.head_optimizer = keras_optimizer(cfg)
        if cfg.optim.weight_decay:
            self.head_optimizer.exclude_from_weight_decay(var_list=[self.bias])
        self.head_optimizer.build([self.kernel, self.bias])

    def _rates(self) -> list[tf.Variable]:
        return [self.optimizer.learning_rate, self.head_optimizer.learning_rate]

    def _update(self, images, labels, weights, targets) -> None:
        optimizer, variables = self.optimizer, self.model.trainable_variables
        scaled = is_loss_scaled(optimizer)
        with tf.GradientTape() as tape:
            features = self.model(images, training=True)
        step = head_step(
            features,
            labels,
            weights,
            self.kernel,
            self.bias,
            first=self.first,
            classes=self.classes,
            groups=self.head,
            smoothing=self._smoothing,
            scale=optimizer.loss_scale if scaled else 1.0,
        )
        grads = tape.gradient(features, variables, output_gradients=step.d_features)
        # Horovod: the backbone's gradients averaged over every rank, as data parallelism does.
        grads = gradients.allreduce_gradients(grads, fp16=self.model.fp16_allreduce)
        if scaled:
            grads = optimizer.get_unscaled_gradients(grads)
        if scaled:  # what the loss scale checks before it applies them
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads if g is not None])
        optimizer.apply_gradients(zip(grads, variables))
        head = [(step.d_kernel * self._head_lr_mult, self.kernel), (step.d_bias * self._head_lr_mult, self.bias)]

        def apply_head():
            self.head_optimizer.apply_gradients(head)
            return tf.constant(True)

        if scaled:  # a step the loss scale skips (every rank alike: the gradients are averaged) skips the head too
            tf.cond(finite, apply_head, lambda: tf.constant(False))
        else:
            apply_head()
        metrics = {m.name: m for m in self.model.metrics}
        metrics["loss"].update_state(step.loss)
        correct = tf.cast(tf.equal(step.predicted, tf.cast(labels, tf.int32)), tf.float32)
        keras.metrics.Mean.update_state(metrics["accuracy"], correct, sample_weight=weights)

    # --- the head in checkpoints and the saved model -------------------------

    def head_arrays(self) -> dict[str, tf.Variable]:
        """The head's variables by file name: kernel, bias, then the optimizer's values for each."""
        return head_arrays(self.kernel, self.bias, self.head_optimizer)

    def gather_head(self, folder: str | None) -> None:
        """Writes the whole head's arrays to ``folder`` (rank 0); every rank of the first group takes part."""
        for name, variable in self.head_arrays().items():
            head_files.gather_into(folder, name, variable.numpy(), self.head, self.classes)

    def restore_head(self, folder: str | None, is_root: bool) -> None:
        """Takes this rank's columns of the head saved in ``folder`` (rank 0 reads; every rank takes part)."""
        for name, variable in self.head_arrays().items():
            variable.assign(
                head_files.broadcast_columns(
                    folder if is_root else None, name, variable.numpy(), self.first, self.classes
                )
            )
        self.head_optimizer.iterations.assign(self.optimizer.iterations)

    def full_model(self, build, folder: str) -> keras.Model:
        """The ordinary model, the whole head loaded from ``folder`` (``gather_head``): rank 0, to save."""
        full = build()
        for layer in self.model.layers:
            if layer.weights:
                full.get_layer(layer.name).set_weights(layer.get_weights())
        head = full.get_layer(HEAD_LAYER)
        for variable, name in ((head.kernel, "kernel"), (head.bias, "bias")):
            variable.assign(np.load(head_files.path_of(folder, name), mmap_mode="r"))
        return full

    def score_batch(self, images, labels, k: int):
        """Held-out scores of one batch over all classes (``head_scores``); every rank of the group calls it."""
        features = self.model(images, training=False)
        return head_scores(features, labels, self.kernel, self.bias, first=self.first, groups=self.head, k=k)


def head_arrays(kernel, bias, optimizer) -> dict[str, tf.Variable]:
    """The head's variables by file name (``head_files``): kernel, bias, then ``optimizer``'s values for each
    (``slot-m-predictions-kernel``: the same names for the split head's optimizer and a whole model's)."""
    arrays = {"kernel": kernel, "bias": bias}
    for variable in optimizer.variables:
        name = variable.name.split(":")[0]
        if name.endswith((f"/{HEAD_LAYER}/kernel", f"/{HEAD_LAYER}/bias")):
            arrays["slot-" + name.replace("/", "-")] = variable
    return arrays


def features_view(model) -> keras.Model:
    """``model`` up to its head's input: what a split run's checkpoint holds of it."""
    return keras.Model(model.inputs, model.get_layer(HEAD_LAYER).input, name=model.name)


def staging(output: str) -> str:
    """Where rank 0 collects the head before it moves into a checkpoint or the saved model."""
    return os.path.join(output, "checkpoints", f".head-{os.getpid()}")


def stage_head(net, ctx, output: str) -> str | None:
    """The split head's files gathered into a staging folder of rank 0 (every rank takes part); None without."""
    if not isinstance(net, ShardedNet):
        return None
    folder = staging(output) if ctx.is_root else None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    net.gather_head(folder)
    return folder


def whole_head_files(cfg: TrainConfig, classes: int, image_size: int, precision: str, ckpt: str, folder: str) -> None:
    """Writes the head of an unsplit run's checkpoint ``ckpt`` to ``folder`` as ``head_files`` (rank 0).

    The whole model and its optimizer are built once and restored, as the
    run that wrote them held them: a head that run could hold fits here.
    """
    from hvd_train.model.catalogue import build_model
    from hvd_train.model.compute import wrap_optimizer
    from hvd_train.model.network import make_optimizer

    full = build_model(cfg.model, classes, image_size, load_weights=False)
    optimizer = wrap_optimizer(make_optimizer(cfg), precision)
    optimizer.build(full.trainable_variables)
    tf.train.Checkpoint(model=full, optimizer=optimizer).read(ckpt).assert_existing_objects_matched().expect_partial()
    layer = full.get_layer(HEAD_LAYER)
    os.makedirs(folder, exist_ok=True)
    for name, variable in head_arrays(layer.kernel, layer.bias, optimizer).items():
        np.save(head_files.path_of(folder, name), variable.numpy())
