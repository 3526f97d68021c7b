"""The Keras model a data-parallel rank trains: its step, from the batch to the update.

The gradients are averaged over every rank (Horovod's ``DistributedOptimizer``,
or outside XLA with ``--xla jit``), unscaled under a loss scale, clipped
(``optimizers.clip``), the head's multiplied by ``--head-lr-mult``, then
applied by the outermost optimizer.
"""

from __future__ import annotations

from hvd_train.compat import keras, tf
from hvd_train.config import OptimConfig
from hvd_train.distributed import gradients
from hvd_train.model import optimizers
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

    def train_step(self, data, targets=None):
        """One update; the loss is against ``targets`` when given (mixed ones), the metrics against the labels."""
        images, labels, weights = keras.utils.unpack_x_y_sample_weight(data)
        targets = labels if targets is None else targets
        variables = self.trainable_variables
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
        if self.head_lr_mult != 1.0:
            head = {v.ref() for v in self.get_layer(HEAD_LAYER).trainable_variables}
            grads_and_vars = [
                (g * self.head_lr_mult if g is not None and v.ref() in head else g, v) for g, v in grads_and_vars
            ]
        # A LossScaleOptimizer skips the update (and halves its scale) when a gradient
        # is not finite: every rank sees the same allreduced gradients, so all skip.
        self.optimizer.apply_gradients(grads_and_vars)
        return self.compute_metrics(images, labels, probs, weights)

    @tf.function(jit_compile=True, autograph=False)
    def _compiled_gradients(self, images, labels, weights=None):
        """This rank's gradients (scaled by the loss scale under mixed_float16) and predictions."""
        with tf.GradientTape() as tape:
            probs = self(images, training=True)
            loss = self.compute_loss(images, labels, probs, weights)
            if is_loss_scaled(self.optimizer):
                loss = self.optimizer.get_scaled_loss(loss)
        return tape.gradient(loss, self.trainable_variables), probs
