"""``Net`` with its classification head sharded by class over a group of ranks (``--head-parallel``).

``net.model`` is the network up to the head's input (the features), so
what Keras checkpoints and Horovod broadcasts, the backbone and its
optimizer, is the same whatever the layout. The head is this rank's shard
(``sharded_head``): the kernel and bias of its classes, with an optimizer
of their own (plain Keras: their gradients come averaged from
``head_step``), started from its columns of the head every layout starts
from (``head_start``). Checkpoints hold it whole
(``model/sharded_files``), so a run resumes on any world size and any G;
an unsharded run reads it whole, and a sharded run takes an unsharded run's
head from its checkpoint (``whole_head_files``).
"""

from __future__ import annotations

import os

import numpy as np

from hvd_train.compat import keras, keras_3, tf
from hvd_train.config import TrainConfig
from hvd_train.distributed import gradients
from hvd_train.distributed.groups import HeadGroups, shard_range
from hvd_train.model import kerases, optimizers, sharded_files
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.classifier import Accumulation, clip_unscaled
from hvd_train.model.compute import is_loss_scaled
from hvd_train.model.head_start import start_head
from hvd_train.model.mixing import Mixer
from hvd_train.model.network import Net, start_averages
from hvd_train.model.sharded_head import head_scores, head_step, peers_average


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
        if self._mixer is not None:  # its classes are the head's, not the width of the features ``Net`` was given
            self._mixer = Mixer(cfg.data.mixup, cfg.data.cutmix, classes)
        self.first, self.count = shard_range(classes, head.parallel, head.shard)
        self.kernel, self.bias = layer.kernel, layer.bias
        start_head(self.kernel, self.bias, self.first, classes, seed)
        self._smoothing = cfg.optim.label_smoothing
        # --xla jit: the backbone's forward pass compiled, and with it the backward pass TensorFlow derives from
        # it (its intermediate values kept as outputs, not computed again); the head's exchanges run between the
        # two, outside XLA (Horovod's collectives have no XLA kernel on CPUs, and allgathers none anywhere).
        self._forward = self._features
        if cfg.compute.xla == "jit":
            self._forward = tf.function(self._features, jit_compile=True)
        self._head_lr_mult = cfg.optim.head_lr_mult
        self.head_optimizer = optimizers.make(cfg.optim, variables=[self.kernel, self.bias])
        self._optim = cfg.optim
        self.head_optimizer.build([self.kernel, self.bias])
        if self._ema:  # --ema: the head's average moves as the backbone's, by the same decay
            self.head_optimizer.ema_momentum = self._ema_decay
            start_averages(self.head_optimizer, [self.kernel, self.bias])
        # --grad-accum: the head's gradients added up over the passes of an update (whole at checkpoints).
        self._accum = cfg.horovod.grad_accum
        sums = [] if self._accum == 1 or keras_3() else [self.kernel, self.bias]
        self._sums = [tf.Variable(tf.zeros_like(v), trainable=False) for v in sums]
        self._passes = tf.Variable(0, dtype=tf.int64, trainable=False, name="head_passes")
        # Keras 3: the step's own accumulation, of the backbone's gradients and the head's together.
        self._accumulation = None
        if keras_3() and self._accum > 1:
            variables = [*self.model.trainable_variables, self.kernel, self.bias]
            self._accumulation = Accumulation(variables, self._accum, self.optimizer)

    def _features(self, images):
        return self.model(images, training=True)

    def _accumulate(self, passes: int) -> None:
        """Not the model's: this step adds up the backbone's gradients and the head shard's together
        (``__init__``, once the shard exists)."""

    def averages(self) -> list[tuple[tf.Variable, tf.Variable]]:
        """``Net.averages``, then the head shard's kernel and bias with their averages (``--ema``)."""
        if not self._ema:
            return []
        head = self.head_optimizer._model_variables_moving_average  # Keras's, in the order ``build`` had them
        return super().averages() + list(zip([self.kernel, self.bias], head, strict=True))

    def _rates(self) -> list[tf.Variable]:
        return [self.optimizer.learning_rate, self.head_optimizer.learning_rate]

    def _update(self, images, labels, weights, mixed) -> None:
        if keras_3():
            return self._keras3_update(images, labels, weights, mixed)
        optimizer, variables = self.optimizer, self.model.trainable_variables
        before = optimizer.iterations.read_value()
        with tf.GradientTape() as tape:
            step, handed = self._head_pass(tape, images, labels, weights, mixed)
        # Horovod's DistributedOptimizer, as the data-parallel step: the gradients averaged over every rank
        # (--fp16-allreduce compressed; --grad-accum: added up locally, averaged at each update); under a
        # loss scale, the sum scaled (in float32), then the gradients unscaled.
        applies, grads_and_vars = tf.constant(True), []
        if variables:
            grads_and_vars = optimizer.compute_gradients(handed, variables, tape=tape)
            if is_loss_scaled(optimizer):  # a step the scale skips (every rank alike) skips the head too
                finite = [tf.reduce_all(tf.math.is_finite(g)) for g, _ in grads_and_vars if g is not None]
                applies = tf.reduce_all(finite)
        head = [step.d_kernel, step.d_bias]
        if self._sums:  # --grad-accum: the head's passes added up, applied with the backbone's update
            for total, grad in zip(self._sums, head):
                total.assign_add(grad)
            self._passes.assign_add(1)
            applies = tf.equal(self._passes % self._accum, 0)
            head = [total / self._accum for total in self._sums]
        head, head_square = self._averaged_head(head, applies)
        # --clip-value, --clip-norm: on the averaged, unscaled gradients of the whole model, before
        # --head-lr-mult (a step the loss scale skips: its factor is not finite, and nothing is applied).
        factor = tf.constant(1.0)
        if optimizers.clips(self._optim):
            grads, kept = zip(*grads_and_vars) if grads_and_vars else ((), ())
            grads, factor = optimizers.clip(list(grads), self._optim, head_square)
            grads_and_vars = list(zip(grads, kept))
        if variables:
            optimizer.apply_gradients(grads_and_vars)
        else:
            # --freeze-backbone with no head norm: nothing before the head trains. The backbone's
            # optimizer still counts the passes, as Horovod's counts them (the step of the schedule,
            # dropout's keys, the head's Adam correction).
            optimizer.iterations.assign_add(1)
        self._apply_head(head, factor, before, applies)
        self._update_metrics(step, labels, weights)

    def _head_pass(self, tape, images, labels, weights, mixed):
        """The forward pass on ``tape`` and the sharded head's step (``head_step``) off it: the step, and the sum
        by which the loss reaches the backbone through its features. ``mixed`` (``mixing.Mixed``): a mixed batch's
        two labels and share a row, whose first labels the step takes for ``labels``."""
        features = self._forward(images)
        with tape.stop_recording():
            step = head_step(
                features,
                labels if mixed is None else mixed.first,
                weights,
                self.kernel,
                self.bias,
                first=self.first,
                classes=self.classes,
                groups=self.head,
                smoothing=self._smoothing,
                mixed=None if mixed is None else (mixed.second, mixed.share),
            )
        # This sum has the loss's gradient for every backbone variable (the features' gradient held constant),
        # taken in float32 as the head's loss.
        return step, tf.reduce_sum(tf.cast(features, tf.float32) * step.d_features)

    def _averaged_head(self, head: list, applies):
        """Where the step ``applies``: this shard's gradients ``head`` averaged over its peers (--clip-value:
        clipped), and the squares of the head's shards summed: the whole head's part of the global norm
        (--clip-norm; 0 without). Elsewhere ``head`` as it is, and 0."""
        clip_norm = bool(self._optim.clip_norm)

        def averaged():
            grads = optimizers.clip_values(peers_average(head, self.head), self._optim)
            # Summed over the job (every group holds the same averaged shards), not the group: one allreduce
            # gives every rank the same bits, where groups could add their shards in another order.
            square = (
                self.head.job_sum(optimizers.square_norm(grads), "head.square") / self.head.layout.groups
                if clip_norm
                else 0.0
            )
            return [*grads, tf.cast(square, tf.float32)]

        *head, square = tf.cond(applies, averaged, lambda: [*head, tf.constant(0.0)])
        return head, square

    def _apply_head(self, head: list, factor, before, applies) -> None:
        """Where the step ``applies``: the head's averaged gradients, times the clip ``factor`` and
        --head-lr-mult, applied by its optimizer at the backbone's count ``before`` (Adam's bias correction:
        the data-parallel step's one optimizer); tf-keras' --grad-accum sums emptied."""

        def apply_head():
            grads = [g * factor * self._head_lr_mult for g in head]
            self.head_optimizer.iterations.assign(before)
            self.head_optimizer.apply_gradients(zip(grads, [self.kernel, self.bias]))
            for total in self._sums:
                total.assign(tf.zeros_like(total))
            return tf.constant(True)

        tf.cond(applies, apply_head, lambda: tf.constant(False))

    def _update_metrics(self, step, labels, weights) -> None:
        metrics = kerases.metric_objects(self.model)
        metrics["loss"].update_state(step.loss)
        correct = tf.cast(tf.equal(step.predicted, tf.cast(labels, tf.int32)), tf.float32)
        keras.metrics.Mean.update_state(metrics["accuracy"], correct, sample_weight=weights)

    def _keras3_update(self, images, labels, weights, mixed) -> None:
        """Keras 3: as ``_update``, without Horovod's Keras layer (``Classifier._keras3_step``): the backbone's
        gradients of the loss scaled, the head's and theirs added up locally over ``--grad-accum``'s passes, then
        one update (``_keras3_apply``)."""
        variables = self.model.trainable_variables
        scaled = is_loss_scaled(self.optimizer)
        with tf.GradientTape() as tape:
            step, handed = self._head_pass(tape, images, labels, weights, mixed)
            if scaled:
                handed = self.optimizer.scale_loss(handed)
        grads = [*(tape.gradient(handed, variables) if variables else []), step.d_kernel, step.d_bias]
        if self._accumulation is not None:
            self._accumulation.add(grads, lambda sums: self._keras3_apply(sums, variables, scaled))
        else:
            self._keras3_apply(grads, variables, scaled)
        self._update_metrics(step, labels, weights)

    def _keras3_apply(self, grads, variables, scaled: bool) -> None:
        """Keras 3: one update from ``grads`` (the backbone's, loss-scaled, then the head shard's kernel and
        bias; sums of ``--grad-accum``'s passes): averaged, clipped over the whole model, applied."""
        optimizer, passes = self.optimizer, self._accum
        before = tf.identity(optimizer.iterations.value)
        backbone, head = list(grads[: len(variables)]), [g / passes for g in grads[len(variables) :]]
        backbone = gradients.allreduce_gradients(backbone, fp16=self.model.fp16_allreduce)
        if passes > 1:
            backbone = [None if g is None else g / passes for g in backbone]
        # A step the loss scale skips (every rank sees the same averages) skips the head too.
        applies = optimizer.check_finite(backbone) if scaled and variables else tf.constant(True)
        head, head_square = self._averaged_head(head, applies)
        factor = tf.constant(1.0)
        if optimizers.clips(self._optim):
            backbone, factor = clip_unscaled(backbone, self._optim, optimizer, scaled, head_square)
        if variables:
            optimizer.apply(backbone, variables)
            if scaled:  # a skipped step counted in ``iterations``, as tf-keras counts it
                optimizer.iterations.assign_add(tf.cast(tf.logical_not(applies), optimizer.iterations.dtype))
        else:
            optimizer.iterations.assign_add(1)  # --freeze-backbone with no head norm: the passes still counted

        self._apply_head(head, factor, before, applies)

    def value_groups(self) -> dict[str, list[tf.Variable]]:
        """``Net.value_groups``, with this rank's shard of the head and its optimizer's values."""
        groups = super().value_groups()
        groups["weights"] += [self.kernel, self.bias]
        groups["optimizer values"] += [v for v in self.head_optimizer.variables if tf.as_dtype(v.dtype).is_floating]
        return groups

    # --- the head in checkpoints and the saved model -------------------------

    def head_arrays(self) -> dict[str, tf.Variable]:
        """The head's variables by file name: kernel, bias, then the optimizer's values for each."""
        return head_arrays(self.kernel, self.bias, self.head_optimizer)

    def gather_head(self, folder: str | None) -> None:
        """Writes the whole head's arrays to ``folder`` (rank 0); every rank of the first group takes part."""
        for name, variable in self.head_arrays().items():
            sharded_files.gather_into(folder, name, variable.numpy(), self.head, self.classes)

    def restore_head(self, folder: str | None, is_root: bool) -> None:
        """Takes this rank's columns of the head saved in ``folder`` (rank 0 reads; every rank takes part)."""
        for name, variable in self.head_arrays().items():
            variable.assign(
                sharded_files.broadcast_columns(
                    folder if is_root else None, name, variable.numpy(), self.first, self.classes, self.head
                )
            )

    def full_model(self, build, folder: str) -> keras.Model:
        """The ordinary model, the whole head loaded from ``folder`` (``gather_head``): rank 0, to save."""
        full = build()
        for layer in self.model.layers:
            if layer.weights:
                full.get_layer(layer.name).set_weights(layer.get_weights())
        sharded_files.load_whole(full.get_layer(HEAD_LAYER), folder)
        return full

    def score_batch(self, images, labels, k: int):
        """Held-out scores of one batch over all classes (``head_scores``); every rank of the group calls it."""
        features = self.model(images, training=False)
        return head_scores(features, labels, self.kernel, self.bias, first=self.first, groups=self.head, k=k)


class ShardedScorer:
    """A saved model whose head was saved as files (``--head-save files``), its head sharded over every rank of
    ``evaluate``: each rank reads its columns and the ranks score each batch together (``score_batch``)."""

    def __init__(self, features: keras.Model, folder: str, classes: int, rank: int, size: int):
        from hvd_train.distributed.groups import Layout, register

        self.model, self.head = features, register(Layout(size, size), rank)  # one group: Horovod's global set
        self.first, count = shard_range(classes, size, rank)
        self.kernel, self.bias = (
            tf.constant(sharded_files.read_columns(folder, n, self.first, count, classes)) for n in ("kernel", "bias")
        )

    score_batch = ShardedNet.score_batch


def head_arrays(kernel, bias, optimizer) -> dict[str, tf.Variable]:
    """The head's variables by file name (``sharded_files``): kernel, bias, then ``optimizer``'s values for each
    (``slot-m-predictions-kernel``: the same names for the sharded head's optimizer and a whole model's)."""
    arrays = {"kernel": kernel, "bias": bias}
    # tf-keras names a slot ``m/predictions/kernel``, Keras 3 ``predictions_kernel_momentum``.
    theirs = (f"{HEAD_LAYER}_kernel_", f"{HEAD_LAYER}_bias_")
    for variable in optimizer.variables:
        name = variable.name.split(":")[0]
        if name.startswith(theirs) if keras_3() else name.endswith((f"/{HEAD_LAYER}/kernel", f"/{HEAD_LAYER}/bias")):
            arrays["slot-" + name.replace("/", "-")] = variable
    return arrays


def features_view(model) -> keras.Model:
    """``model`` up to its head's input: what a sharded run's checkpoint holds of it."""
    return keras.Model(model.inputs, model.get_layer(HEAD_LAYER).input, name=model.name)


def staging(output: str) -> str:
    """Where rank 0 collects the head before it moves into a checkpoint or the saved model."""
    return os.path.join(output, "checkpoints", f".head-{os.getpid()}")


def stage_head(net, ctx, output: str) -> str | None:
    """The sharded head's files gathered into a staging folder of rank 0 (every rank takes part); None without."""
    if not isinstance(net, ShardedNet):
        return None
    folder = staging(output) if ctx.is_root else None
    if folder is not None:
        os.makedirs(folder, exist_ok=True)
    net.gather_head(folder)
    return folder


def whole_head_files(cfg: TrainConfig, classes: int, image_size: int, precision: str, ckpt: str, folder: str) -> None:
    """Writes the head of an unsharded run's checkpoint ``ckpt`` to ``folder`` as ``sharded_files`` (rank 0).

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
        np.save(sharded_files.path_of(folder, name), variable.numpy())
