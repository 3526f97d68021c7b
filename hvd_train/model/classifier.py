"""The Keras model a data-parallel rank trains: its step, from the batch to the update.

The gradients are averaged over every rank (Horovod's ``DistributedOptimizer``,
or outside XLA with ``--xla jit``), unscaled under a loss scale, clipped
(``optimizers.clip``), the head's multiplied by ``--head-lr-mult``, then
applied by the outermost optimizer.

Under Keras 3 no Horovod Keras layer is used (its hooks are never called by
a Keras 3 optimizer): the step scales the loss, takes the gradients,
averages them with ``horovod.tensorflow``'s grouped allreduce, and hands the
averages to the outermost optimizer's ``apply``, so that a loss scale's
finite check sees the same gradients on every rank. A skipped step is
counted in ``iterations`` as tf-keras counts it.
"""

from __future__ import annotations

from hvd_train.compat import keras, keras_3, tf
from hvd_train.config import OptimConfig
from hvd_train.distributed import gradients
from hvd_train.model import kerases, optimizers
from hvd_train.model.catalogue import HEAD_LAYER
from hvd_train.model.compute import is_loss_scaled


class Classifier(keras.Model):
    """A functional model whose train step can scale the new head's gradients.

    With SGD, multiplying a variable's gradient by m is the same as
    multiplying its learning rate by m (MATLAB's WeightLearnRateFactor).

    Attributes:
        head_lr_mult: factor of the head's gradients.
        xla_jit: compile the forward and backward pass with XLA, and
            allreduce the gradients outside the compiled function.
        fp16_allreduce: compress the gradients to float16 for the allreduce
            (the ``xla_jit`` path does its own allreduce).
        optim: the run's optimizer options (``--clip-value``, ``--clip-norm``).
    """

    head_lr_mult: float = 1.0
    xla_jit: bool = False
    fp16_allreduce: bool = False
    optim: OptimConfig = OptimConfig()
    _accumulation = None  # Keras 3 with --grad-accum: ``Accumulation`` (``accumulate``)

    def accumulate(self, passes: int) -> None:
        """Keras 3, ``--grad-accum``: each step adds its gradients up locally, and every ``passes``-th allreduces
        their mean once and applies it (Horovod's ``backward_passes_per_step`` under tf-keras)."""
        if passes > 1:
            # Not an attribute Keras tracks: the sums are no state of the model's checkpoints, which come
            # between whole updates.
            accumulation = Accumulation(self.trainable_variables, passes, self.optimizer)
            object.__setattr__(self, "_accumulation", accumulation)

    def train_step(self, data, targets=None):
        """One update; the loss is against ``targets`` when given (mixed ones), the metrics against the labels."""
        images, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
        targets = labels if targets is None else targets
        variables = self.trainable_variables
        if keras_3():
            return self._keras3_step(images, labels, weights, targets, variables)
        if self.xla_jit:
            grads, probs = self._compiled_gradients(images, targets, weights)
            # Horovod: the allreduce runs outside XLA (no XLA kernel for it).
            grads = gradients.allreduce_gradients(grads, fp16=self.fp16_allreduce)
            if is_loss_scaled(self.optimizer):
                grads = self.optimizer.get_unscaled_gradients(grads)
            grads_and_vars = list(zip(grads, variables))
        else:
            with tf.GradientTape() as tape:
                probs = self(images, training=True)
                loss = self.compute_loss(images, targets, probs, weights)
            # Horovod: DistributedOptimizer.compute_gradients allreduces the gradients
            # (under a LossScaleOptimizer: scale the loss, allreduce, unscale).
            grads_and_vars = self.optimizer.compute_gradients(loss, variables, tape=tape)
        # --clip-value, --clip-norm: on the averaged, unscaled gradients, the same on every rank.
        if optimizers.clips(self.optim):
            grads, kept = zip(*grads_and_vars)
            grads_and_vars = list(zip(optimizers.clip(list(grads), self.optim)[0], kept))
        grads, kept = zip(*grads_and_vars)
        grads_and_vars = list(zip(self._head_multiplied(list(grads), kept), kept))
        # A LossScaleOptimizer skips the update (and halves its scale) when a gradient
        # is not finite: every rank sees the same allreduced gradients, so all skip.
        self.optimizer.apply_gradients(grads_and_vars)
        return self.compute_metrics(images, labels, probs, weights)

    def _head_multiplied(self, grads: list, variables) -> list:
        """``--head-lr-mult``: the gradients of the head's ``variables`` multiplied."""
        if self.head_lr_mult == 1.0:
            return grads
        head = {kerases.key(v) for v in self.get_layer(HEAD_LAYER).trainable_variables}
        return [
            g * self.head_lr_mult if g is not None and kerases.key(v) in head else g for g, v in zip(grads, variables)
        ]

    def _keras3_step(self, images, labels, weights, targets, variables):
        """Keras 3: this rank's scaled gradients, averaged over the ranks, clipped unscaled, then applied."""
        scaled = is_loss_scaled(self.optimizer)
        if self.xla_jit:
            grads, probs, loss = self._compiled_gradients(images, targets, weights)
        else:
            with tf.GradientTape() as tape:
                probs = self(images, training=True)
                loss = self.compute_loss(images, targets, probs, weights)
                scaled_loss = self.optimizer.scale_loss(loss) if scaled else loss
            grads = tape.gradient(scaled_loss, variables)
        kerases.update_loss_metric(self, loss, images)
        if self._accumulation is not None:
            passes = self._accumulation.passes
            self._accumulation.add(grads, lambda sums: self._keras3_update(sums, variables, scaled, passes))
        else:
            self._keras3_update(grads, variables, scaled)
        return self.compute_metrics(images, labels, probs, weights)

    def _keras3_update(self, grads, variables, scaled: bool, passes: int = 1):
        """Keras 3: averages ``grads`` (sums of ``passes`` passes) over the ranks, clips and multiplies them,
        and applies them."""
        # Horovod's collectives (no Keras layer): every rank gets the same averages; of accumulated sums, the
        # mean over the passes after the allreduce, as Horovod's accumulation divides.
        grads = gradients.allreduce_gradients(grads, fp16=self.fp16_allreduce)
        if passes > 1:
            grads = [None if g is None else g / passes for g in grads]
        if optimizers.clips(self.optim):
            grads = clip_unscaled(grads, self.optim, self.optimizer, scaled)[0]
        grads = self._head_multiplied(list(grads), variables)
        if scaled:
            finite = self.optimizer.check_finite(grads)
            self.optimizer.apply(grads, variables)
            # tf-keras counts a skipped step in ``iterations``, Keras 3 does not: counted alike on both.
            skipped = tf.cast(tf.logical_not(finite), self.optimizer.iterations.dtype)
            self.optimizer.iterations.assign_add(skipped)
        else:
            self.optimizer.apply(grads, variables)

    @tf.function(jit_compile=True, autograph=False)
    def _compiled_gradients(self, images, labels, weights=None):
        """This rank's gradients (scaled by the loss scale under mixed_float16) and predictions; Keras 3: and
        the loss (its metric is updated outside)."""
        with tf.GradientTape() as tape:
            probs = self(images, training=True)
            loss = self.compute_loss(images, labels, probs, weights)
            scaled = loss
            if is_loss_scaled(self.optimizer):
                scaled = self.optimizer.scale_loss(loss) if keras_3() else self.optimizer.get_scaled_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        return (grads, probs, loss) if keras_3() else (grads, probs)


def clip_unscaled(grads: list, optim: OptimConfig, optimizer, scaled: bool, others_square=0.0):
    """Keras 3: ``optimizers.clip`` of loss-scaled ``grads`` on their unscaled values, scaled again for the
    optimizer's ``apply`` (which unscales them itself). The loss scale is a power of 2: dividing by it and
    multiplying again is exact."""
    scale = optimizer.dynamic_scale if scaled else None
    unscaled = grads if scale is None else [None if g is None else g / scale for g in grads]
    clipped, factor = optimizers.clip(unscaled, optim, others_square)
    return (clipped if scale is None else [None if g is None else g * scale for g in clipped]), factor


class Accumulation:
    """Keras 3's ``--grad-accum``: a local sum per variable and a count of the passes since the last update.

    Keras's own ``gradient_accumulation_steps`` would allreduce every pass (the traffic ``--grad-accum`` saves)
    and move ``--ema`` on every pass. Here every pass adds its gradients locally and counts in ``iterations``,
    as Horovod's accumulation does under tf-keras; the last of ``passes`` hands the sums to ``update`` (one
    allreduce, the mean, the update) and empties them. Every rank counts alike, so all take the same branch.
    """

    def __init__(self, variables, passes: int, optimizer):
        self.passes = passes
        self.optimizer = optimizer
        self.sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]
        self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def add(self, grads, update) -> None:
        for total, g in zip(self.sums, grads):
            if g is not None:
                total.assign_add(tf.convert_to_tensor(g))
        self.count.assign_add(1)

        def apply():
            update([total if g is not None else None for total, g in zip(self.sums, grads)])
            for total in self.sums:
                total.assign(tf.zeros_like(total))
            self.count.assign(0)
            return tf.constant(0)

        def count_pass():
            self.optimizer.iterations.assign_add(1)
            return tf.constant(0)

        tf.cond(self.count >= self.passes, apply, count_pass)
