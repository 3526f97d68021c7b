"""The network being trained: model, optimizer, and one training step.

``Net`` holds what a rank trains with: the Keras model (a keras.applications
backbone with a new head, see ``models``), Horovod's ``DistributedOptimizer``
around SGD or Adam, and the compiled step. Three things make a step a pure
function of the training state, so that a resumed run continues exactly:

* the learning rate is a variable the loop sets before every step from the
  schedule (keyed on images seen, see ``schedules``);
* dropout masks are drawn from ``(seed, rank, step)``, not from a generator
  whose state would be lost with the process;
* the values that differ from rank to rank (BatchNorm moving statistics,
  the running sums of the epoch's metrics) can be read and written as plain
  arrays, for checkpoints.

Every step also sums three flags over the ranks (stop requested, checkpoint
due, the last step's time) in the step's own Horovod cycles: the ranks agree
on when to stop without a collective of their own.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from hvd_train import distributed
from hvd_train.compat import keras
from hvd_train.config import TrainConfig
from hvd_train.models import HEAD_LAYER


class Classifier(keras.Model):
    """A functional model whose train step can scale the new head's gradients.

    With SGD, multiplying a variable's gradient by m is the same as
    multiplying its learning rate by m (MATLAB's WeightLearnRateFactor).
    """

    head_lr_mult: float = 1.0

    def train_step(self, data):
        images, labels = data
        with tf.GradientTape() as tape:
            probs = self(images, training=True)
            loss = self.compute_loss(images, labels, probs)
        # Horovod: DistributedOptimizer.compute_gradients allreduces the gradients.
        grads_and_vars = self.optimizer.compute_gradients(loss, self.trainable_variables, tape=tape)
        if self.head_lr_mult != 1.0:
            head = {v.ref() for v in self.get_layer(HEAD_LAYER).trainable_variables}
            grads_and_vars = [
                (g * self.head_lr_mult if g is not None and v.ref() in head else g, v) for g, v in grads_and_vars
            ]
        self.optimizer.apply_gradients(grads_and_vars)
        return self.compute_metrics(images, labels, probs, None)


def use_step_seeded_dropout() -> None:
    """Makes Keras layers draw random numbers from ``tf.random.Generator`` objects.

    Must be called before the model is built. ``Net`` resets those generators
    from ``(seed, rank, step)`` at every step.
    """
    keras.backend.experimental.enable_tf_random_generator()


class Net:
    """A rank's model, optimizer and compiled training step.

    Args:
        base: the functional model from ``models.build_model``.
        cfg: the configuration (optimizer, momentum, Horovod options).
        seed: the run's seed.
        rank: this process's rank (dropout masks differ per rank).
    """

    def __init__(self, base: keras.Model, cfg: TrainConfig, seed: int, rank: int):
        self.model = Classifier(base.inputs, base.outputs, name=base.name)
        self.model.head_lr_mult = cfg.optim.head_lr_mult
        self.optimizer = make_optimizer(cfg)
        self.model.compile(
            optimizer=self.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"]
        )
        # Optimizer state and metric sums must exist before they can be restored and broadcast.
        self.optimizer.build(self.model.trainable_variables)
        self._build_metrics()
        self.seed = seed
        self._rank = tf.Variable(rank, dtype=tf.int64, trainable=False, name="rank")
        self._flags = tf.Variable(tf.zeros(3), trainable=False, name="boundary_flags")
        self._generators = [
            layer._random_generator._generator
            for layer in self.model.submodules
            if isinstance(getattr(getattr(layer, "_random_generator", None), "_generator", None), tf.random.Generator)
        ]
        self._step = tf.function(self._train_step)

    @property
    def variables(self) -> list[tf.Variable]:
        """Model and optimizer variables: what rank 0 broadcasts and checkpoints hold."""
        return list(self.model.variables) + list(self.optimizer.variables)

    def set_rank(self, rank: int) -> None:
        self._rank.assign(rank)

    def set_learning_rate(self, lr: float) -> None:
        self.optimizer.learning_rate.assign(lr)

    def set_flags(self, stop: bool, checkpoint: bool, step_seconds: float) -> None:
        """This rank's flags for the next step: asked to stop; a timed checkpoint is due; its last step's time."""
        self._flags.assign([float(stop), float(checkpoint), float(step_seconds)])

    def _train_step(self, iterator):
        images, labels, ids = next(iterator)
        step = tf.cast(self.optimizer.iterations, tf.int64)
        key = self.seed * 1_000_003 + self._rank
        for i, generator in enumerate(self._generators):
            # Dropout masks from (seed, rank, step, layer): the same after a resume.
            generator.reset_from_key_counter(key, tf.stack([step, tf.constant(i, tf.int64)]))
        logs = self.model.train_step((images, labels))
        # Horovod: every rank's flags, summed in the same cycles as the gradients.
        agreed = distributed.allreduce_sum_op(self._flags.read_value(), name="boundary_flags")
        return logs, ids, agreed

    def step(self, iterator) -> tuple[dict, tf.Tensor, tf.Tensor]:
        """Runs one batch from ``iterator``.

        Returns:
            The epoch's metrics so far, the batch's image ids, and the flags
            of ``set_flags`` summed over all ranks.
        """
        return self._step(iterator)

    # --- values that differ between ranks --------------------------------------

    def local_variables(self) -> list[tf.Variable]:
        """BatchNorm moving statistics and the epoch's metric sums: each rank has its own."""
        return self.batchnorm_statistics() + self.metric_variables()

    def metric_variables(self) -> list[tf.Variable]:
        """The running sums of the epoch's loss and accuracy."""
        return [v for m in self.model.metrics for v in m.variables]

    def batchnorm_statistics(self) -> list[tf.Variable]:
        """Every BatchNorm layer's moving mean and variance."""
        return [
            v
            for layer in self.model.submodules
            if isinstance(layer, keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)
        ]

    def read_local(self) -> np.ndarray:
        """This rank's local values, flattened."""
        values = [np.ravel(v.numpy()).astype(np.float64) for v in self.local_variables()]
        return np.concatenate(values) if values else np.zeros(0)

    def write_local(self, flat: np.ndarray) -> None:
        """Sets the local values from ``read_local``'s layout."""
        pos = 0
        for v in self.local_variables():
            size = int(np.prod(v.shape))
            v.assign(np.reshape(flat[pos : pos + size], v.shape).astype(v.dtype.as_numpy_dtype))
            pos += size

    def _build_metrics(self) -> None:
        # Compiled metrics get their variables on first use; a resumed rank
        # writes them before any step has run.
        if not self.model.metrics or not all(m.variables for m in self.model.metrics):
            shape = self.model.input_shape[1:]
            zeros = tf.zeros((1, *shape))
            probs = self.model(zeros, training=False)
            self.model.compute_loss(zeros, tf.zeros((1,), tf.int32), probs)
            self.model.compute_metrics(zeros, tf.zeros((1,), tf.int32), probs, None)
            self.model.reset_metrics()

    def metric_results(self) -> dict[str, float]:
        """The epoch's running metrics of this rank (loss, accuracy)."""
        return {m.name: float(m.result()) for m in self.model.metrics}

    def reset_metrics(self) -> None:
        self.model.reset_metrics()


def make_optimizer(cfg: TrainConfig):
    """SGD (with momentum) or Adam, wrapped by Horovod's ``DistributedOptimizer``.

    The learning rate is a plain variable: the training loop sets it before
    every step from the schedule (see ``schedules``).
    """
    if cfg.optim.optimizer == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=cfg.optim.base_lr, momentum=cfg.optim.momentum)
    else:
        optimizer = keras.optimizers.Adam(learning_rate=cfg.optim.base_lr)
    return distributed.distributed_optimizer(
        optimizer, fp16_allreduce=cfg.horovod.fp16_allreduce, grad_accum=cfg.horovod.grad_accum
    )
