"""The network being trained: model, optimizer, and one training step.

``Net`` holds what a rank trains with: the Keras model (a keras.applications
backbone with a new head, see ``models``), Horovod's ``DistributedOptimizer``
around SGD, Adam or AdamW, and the compiled steps. One call of ``run_steps`` runs
several steps (``--steps-per-call``) in a loop inside one ``tf.function``,
as Keras's ``steps_per_execution`` does: the host neither assigns nor reads
anything between them. Three things make a step a pure function of the
training state, so that a resumed run continues exactly:

* each step computes its learning rate from the schedule (keyed on images
  seen, see ``schedules``) in the graph, from the step's place in the call;
* dropout masks are drawn from ``(seed, rank, step)``, not from a generator
  whose state would be lost with the process;
* the values that differ from rank to rank (BatchNorm moving statistics,
  the running sums of the epoch's metrics) can be read and written as plain
  arrays, for checkpoints.

Every call also sums three numbers over the ranks (stop requested,
checkpoint due, the previous call's seconds per step): the allreduce needs
nothing the steps compute, so Horovod negotiates it while they run, and the
ranks agree on when to stop without a wait of their own. Images that could
not be decoded (negative stand-in ids) are kept on the device until the loop
asks for them (``take_stand_ins``).

The recipe options that change the step live here too: ``--mixup`` and
``--cutmix`` mix each batch in the step (``mixing``), from ``(seed, rank,
images seen)``; ``--ema`` is Keras's moving average of the weights, kept by
the optimizer, with the BatchNorm statistics' averages beside it
(``averages``, ``averaged``); ``--weight-decay`` and ``--class-weights``.

Under ``--precision mixed_float16`` the optimizer is
``LossScaleOptimizer(DistributedOptimizer(...))`` (see ``precision``). With
``--xla jit`` the forward and backward pass are compiled by XLA and the
allreduce and the update run outside the compiled function: Horovod's
allreduce has no XLA kernel on CPUs, and on GPUs only with
``HOROVOD_ENABLE_XLA_OPS`` (horovod#2590).
"""

from __future__ import annotations

import contextlib

import numpy as np

from hvd_train.compat import keras, keras_3, tf
from hvd_train.config import TrainConfig
from hvd_train.distributed import context, gradients
from hvd_train.model import kerases, optimizers
from hvd_train.model.classifier import Classifier
from hvd_train.model.compute import is_loss_scaled, loss_scale_variables, wrap_optimizer
from hvd_train.model.mixing import Mixer, training_loss
from hvd_train.model.schedules import graph_rate

# The sums a call of the steps reports (``Net.run_steps``): asked to stop, a timed checkpoint due,
# seconds per step, and ranks whose loss is not finite.
REPORT_FLAGS = 4


def use_step_seeded_dropout() -> None:
    """Makes Keras layers draw random numbers from generators ``Net`` resets from ``(seed, rank, step)`` at
    every step (``kerases.use_step_seeded_dropout``). Must be called before the model is built."""
    kerases.use_step_seeded_dropout()


class Net:
    """A rank's model, optimizer and compiled training step.

    Args:
        base: the functional model from ``catalogue.build_model`` (built under
            the precision's policy).
        cfg: the configuration (optimizer, momentum, Horovod options, XLA).
        seed: the run's seed.
        rank: this process's rank (dropout masks differ per rank).
        precision: the resolved precision (``fp32``, ``mixed_float16``, ``mixed_bfloat16``).
    """

    def __init__(
        self,
        base: keras.Model,
        cfg: TrainConfig,
        seed: int,
        rank: int,
        precision: str = "fp32",
        class_counts: list[int] | None = None,
    ):
        self.model = Classifier(base.inputs, kerases.outputs_of(base), name=base.name)
        kerases.fuse_batch_norm(self.model)
        self.model.head_lr_mult = cfg.optim.head_lr_mult
        self.model.xla_jit = cfg.compute.xla == "jit"
        self.model.fp16_allreduce = cfg.horovod.fp16_allreduce
        self.model.optim = cfg.optim
        self.precision = precision
        optimizer = make_optimizer(cfg, base.trainable_variables)
        self.optimizer = wrap_optimizer(optimizer, precision)
        classes = int(base.outputs[0].shape[-1])
        # --mixup / --cutmix: the step mixes each batch, and the loss takes the mixed targets.
        self._mixer = Mixer(cfg.data.mixup, cfg.data.cutmix, classes) if cfg.data.mixup or cfg.data.cutmix else None
        self._multi_label = cfg.data.multi_label
        if self._multi_label:  # each image's classes as a multi-hot row: a sigmoid per class, its own cross-entropy
            loss = keras.losses.BinaryCrossentropy(label_smoothing=cfg.optim.label_smoothing)
            metrics = [keras.metrics.F1Score(average="micro", threshold=cfg.data.threshold, name="f1")]
        else:
            loss = training_loss(cfg.optim.label_smoothing, classes, soft_targets=self._mixer is not None)
            metrics = ["accuracy"]
        self.model.compile(optimizer=self.optimizer, loss=loss, metrics=metrics)
        if keras_3():  # --grad-accum: the step's own (tf-keras: Horovod's DistributedOptimizer)
            self._accumulate(cfg.horovod.grad_accum)
        # --class-weights auto: images / (classes x images of the class), the same for every rank.
        self._class_weights = None
        if cfg.optim.class_weights == "auto" and class_counts:
            counts = np.asarray(class_counts, np.float64)
            weights = np.where(counts > 0, counts.sum() / (len(counts) * np.maximum(counts, 1)), 0.0)
            self._class_weights = tf.constant(weights, tf.float32)
        # --ema: Keras averages the trainable variables after each update; the BatchNorm moving
        # statistics are averaged here, after each step (they change with every forward pass), as
        # timm's and TF Model Garden's averages do: averaged weights with the statistics of the
        # raw ones would normalise by the wrong numbers.
        self._ema = cfg.optim.ema
        self._statistic_averages = (
            [tf.Variable(v, trainable=False, name=f"average_{i}") for i, v in enumerate(self.batchnorm_statistics())]
            if self._ema
            else []
        )
        # The decay of each step, min(ema, (1 + n) / (10 + n)) after n updates (TensorFlow's
        # ExponentialMovingAverage with num_updates, timm's warm-up): an early average forgets the
        # random or pretrained start quickly, a late one is the --ema asked for. Keras's optimizer
        # reads it from its ``ema_momentum``, made this variable.
        self._ema_decay = tf.Variable(0.0, trainable=False, name="ema_decay")
        if self._ema:
            self._inner_optimizer().ema_momentum = self._ema_decay
        # Optimizer state and metric sums must exist before they can be restored and broadcast.
        self.optimizer.build(self.model.trainable_variables)
        if self._ema:
            start_averages(self._inner_optimizer(), self.model.trainable_variables)
        self._build_metrics()
        self.seed = seed
        self._decay = cfg.optim.lr_schedule
        self._looped = cfg.compute.steps_per_call > 1
        self._rank = tf.Variable(rank, dtype=tf.int64, trainable=False, name="rank")
        # Stand-in ids met since ``take_stand_ins`` last emptied it.
        self._stand_ins = tf.Variable(
            tf.zeros([0], tf.int64), shape=tf.TensorShape([None]), trainable=False, name="stand_ins"
        )
        self._generators = kerases.step_generators(self.model)
        # Called with each batch's image ids before they reach the allreduce (--sample-log).
        self.audit = None
        # Each call also reports when it started and ended (``tf.timestamp``, which
        # TensorFlow refuses under op determinism): ``bench`` measures the host's share.
        self.timestamps = False
        # No AutoGraph: the steps' control flow on tensors is one explicit
        # while loop, and converting Keras's and Horovod's code on the way in
        # took much of the first call on every rank, at every start and elastic
        # reset (with Horovod's below: 19 s -> 11 s, MobileNetV2 on a CPU).
        self._run = tf.function(self._run_steps, autograph=False)
        self._finite_check = None  # ``non_finite``'s compiled check, made at its first call

    @property
    def variables(self) -> list[tf.Variable]:
        """Model and optimizer variables (the loss scale included): what rank 0 broadcasts and commits hold."""
        return list(self.model.variables) + list(self.optimizer.variables) + loss_scale_variables(self.optimizer)

    def averages(self) -> list[tuple[tf.Variable, tf.Variable]]:
        """``(variable, its moving average)`` pairs under ``--ema``: the trainable variables, then the
        BatchNorm moving statistics. Empty without ``--ema``."""
        inner = self._inner_optimizer()
        if not getattr(inner, "use_ema", False):
            return []
        # Keras made one average per variable, in the order ``build`` was given them.
        averages = inner._model_variables_moving_average
        pairs = list(zip(self.model.trainable_variables, averages, strict=True))
        return pairs + list(zip(self.batchnorm_statistics(), self._statistic_averages, strict=True))

    def _inner_optimizer(self):
        """The Keras optimizer inside the loss scale (``mixed_float16``), or the optimizer itself."""
        return self.optimizer.inner_optimizer if is_loss_scaled(self.optimizer) else self.optimizer

    @contextlib.contextmanager
    def averaged(self):
        """Inside: the weights and statistics hold their moving averages (``--ema``); after: their own values."""
        pairs = self.averages()
        own = [tf.identity(v) for v, _ in pairs]
        for variable, average in pairs:
            variable.assign(average)
        try:
            yield
        finally:
            for (variable, _), value in zip(pairs, own):
                variable.assign(value)

    def use_averages(self) -> None:
        """The weights and statistics take their moving averages for good (the end of a run with ``--ema``)."""
        for variable, average in self.averages():
            variable.assign(average)

    def set_rank(self, rank: int) -> None:
        self._rank.assign(rank)

    def run_steps(self, iterator, steps: int, flags, progress, rates) -> tuple[dict, tf.Tensor]:
        """Runs ``steps`` batches from ``iterator``, each at the rate the schedule gives it.

        Args:
            steps: batches to run (``--steps-per-call``, fewer at the end of a segment).
            flags: this rank's ``[asked to stop, timed checkpoint due, seconds
                per step of its previous call]``.
            progress: ``[images seen, steps of the segment run, images per step
                (all ranks), images of the segment, images per epoch]``, as
                the ``TrainState`` has them before the first of these steps.
            rates: the schedule's ``parameters()``.

        Returns:
            The epoch's metrics so far, and a float64 report: the flags
            summed over all ranks, then the ranks whose loss of the epoch was
            not finite before these steps (``REPORT_FLAGS`` numbers in all),
            then (with ``timestamps``) the call's start and end in seconds.
        """
        if steps > 1 and not self._looped:
            raise ValueError(f"{steps} steps in one call of a Net made for --steps-per-call 1")
        return self._run(
            iterator,
            np.asarray(steps, np.int32),
            np.asarray(flags, np.float32),
            np.asarray(progress, np.float64),
            np.asarray(rates, np.float64),
        )

    def _run_steps(self, iterator, steps, flags, progress, rates):
        started = tf.timestamp() if self.timestamps else None
        # Whether this rank's loss of the epoch turned non-finite before these steps (a sum over
        # steps: one nan or inf stays): with the flags, every rank learns of it one call later. Under a
        # loss scale a step whose loss is not finite is skipped, the weights as they were: no divergence.
        diverged = tf.constant(0.0)
        if not is_loss_scaled(self.optimizer):
            diverged = tf.cast(tf.logical_not(tf.math.is_finite(self._loss_metric().result())), tf.float32)
        # Horovod: the agreement needs nothing the steps compute, so it is negotiated
        # while they run; every rank gets the same sums.
        agreed = context.allreduce_sum_op(tf.concat([flags, [diverged]], 0), name="boundary_flags")
        seen, first, per_step, pending, total = tf.unstack(progress)

        def one_step(i):
            # The images seen before this step, as ``TrainState.advance`` counts them.
            done = tf.cast(i, tf.float64) + first
            images = seen + tf.minimum(done * per_step, pending) - tf.minimum(first * per_step, pending)
            for rate in self._rates():
                rate.assign(tf.cast(graph_rate(self._decay, rates, images / tf.maximum(total, 1.0)), rate.dtype))
            if self._ema:
                updates = tf.cast(self.optimizer.iterations, tf.float32)
                self._ema_decay.assign(tf.minimum(self._ema, (1.0 + updates) / (10.0 + updates)))
            self._train_step(iterator, tf.cast(images, tf.int64))
            return (i + 1,)

        if self._looped:
            # One step after the other: each reads the weights the one before updated.
            done = tf.while_loop(lambda i: i < steps, one_step, (tf.constant(0),), parallel_iterations=1)
        elif self.timestamps:
            # A function's outputs come after all it does, the update included: the end's timestamp too.
            done = tf.function(one_step, autograph=False)(tf.constant(0))
        else:
            # --steps-per-call 1: the step alone, without a loop's frame around it.
            done = one_step(tf.constant(0))
        logs = kerases.metric_results(self.model)
        report = tf.cast(agreed, tf.float64)
        if self.timestamps:
            # A timestamp touches no variable: only these dependencies order it after the steps.
            with tf.control_dependencies([*done, *logs.values()]):
                report = tf.concat([report, tf.stack([started, tf.timestamp()])], 0)
        return logs, report

    def _train_step(self, iterator, seen):
        """One batch of ``iterator``; ``seen``: the images of the run before it (the key of its mixing)."""
        images, labels, ids = next(iterator)
        if self.audit is not None:
            # The record comes before this rank's gradients can join an
            # allreduce: a step every rank completed has every rank's record,
            # even when a process is killed right after it.
            written = tf.py_function(self._write_audit, [ids], Tout=tf.bool)
            with tf.control_dependencies([written]):
                images = tf.identity(images)
        step = tf.cast(self.optimizer.iterations, tf.int64)
        key = self.seed * 1_000_003 + self._rank
        # Dropout masks from (seed, rank, step, layer): the same after a resume.
        kerases.reseed(self._generators, key, step)
        # An image that could not be decoded came as a black stand-in with a negative
        # id (``pipeline``): it weighs nothing, and the loss is still summed over the
        # whole batch, so every other image counts as much as in any other step.
        with tf.xla.experimental.jit_scope(compile_ops=False):  # a variable that grows: XLA cannot
            self._stand_ins.assign(tf.concat([self._stand_ins, tf.boolean_mask(ids, ids < 0)], 0))
        weights = tf.cast(ids >= 0, tf.float32)
        if self._class_weights is not None:
            weights *= tf.gather(self._class_weights, tf.cast(labels, tf.int32))
        mixed = None
        if self._mixer is not None:
            # From (seed, rank, images seen): the same mixing after a resume, another on each rank.
            images, mixed, weights, labels = self._mixer.mix(images, labels, weights, tf.stack([key, seen]))
        self._update(images, labels, weights, mixed)
        for average, statistic in zip(self._statistic_averages, self.batchnorm_statistics()):
            average.assign(self._ema_decay * average + (1.0 - self._ema_decay) * statistic)

    def _update(self, images, labels, weights, mixed) -> None:
        """The forward and backward pass and the update (``ShardedNet``: with its head sharded); ``mixed``: a
        mixed batch's targets (``mixing.Mixed``), else None."""
        targets = None if mixed is None else self._mixer.targets(mixed)
        self.model.train_step((images, labels, weights), targets)

    def _rates(self) -> list[tf.Variable]:
        """The learning rates each step sets from the schedule."""
        return [self.optimizer.learning_rate]

    def _write_audit(self, ids) -> bool:
        self.audit(ids.numpy())
        return True

    def take_stand_ins(self) -> list[int]:
        """The training images met undecodable since the last call (their indices), forgotten here."""
        ids = self._stand_ins.numpy()
        if not len(ids):
            return []
        self._stand_ins.assign(tf.zeros([0], tf.int64))
        return (-1 - ids).tolist()

    # --- values that differ between ranks --------------------------------------

    def local_variables(self) -> list[tf.Variable]:
        """BatchNorm moving statistics, the epoch's metric sums and (``--ema``) the statistics'
        averages: each rank has its own."""
        return self.batchnorm_statistics() + self.metric_variables() + self._statistic_averages

    def statistics(self) -> list[tf.Variable]:
        """The BatchNorm moving statistics and their averages: what the ranks average at an epoch's end."""
        return self.batchnorm_statistics() + self._statistic_averages

    def metric_variables(self) -> list[tf.Variable]:
        """The running sums of the epoch's loss and accuracy."""
        return [v for m in self.model.metrics for v in m.variables]

    def batchnorm_statistics(self) -> list[tf.Variable]:
        """Every BatchNorm layer's moving mean and variance."""
        return [
            v
            for layer in kerases.layers(self.model)
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
            v.assign(np.reshape(flat[pos : pos + size], v.shape).astype(kerases.numpy_dtype(v)))
            pos += size

    def _accumulate(self, passes: int) -> None:
        """Keras 3, ``--grad-accum``: the model's step adds up the gradients of its trainable variables
        (``Classifier.accumulate``). A subclass whose step updates more than the model overrides it."""
        self.model.accumulate(passes)

    def _build_metrics(self) -> None:
        # Compiled metrics get their variables on first use; a resumed rank
        # writes them before any step has run.
        if not self.model.metrics or not all(m.variables for m in self.model.metrics):
            shape = self.model.input_shape[1:]
            zeros = tf.zeros((1, *shape))
            probs = self.model(zeros, training=False)
            rows = self._mixer is not None or self._multi_label  # targets as rows of classes
            targets = tf.zeros((1, probs.shape[-1])) if rows else tf.zeros((1,), tf.int32)
            self.model.compute_loss(zeros, targets, probs)
            self.model.compute_metrics(zeros, targets if self._multi_label else tf.zeros((1,), tf.int32), probs, None)
            self.model.reset_metrics()

    def _loss_metric(self):
        return next(m for m in self.model.metrics if m.name == "loss")

    def value_groups(self) -> dict[str, list[tf.Variable]]:
        """What a checkpoint holds of this rank, by what a user calls it (``non_finite``); the epoch's loss
        sums only where the loss is watched (under a loss scale a step's loss may be nan, its update skipped)."""
        statistics = self.batchnorm_statistics() + self._statistic_averages
        theirs = {kerases.key(v) for v in statistics}
        groups = {
            "weights": [v for v in self.model.variables if kerases.key(v) not in theirs],
            "BatchNorm statistics": statistics,
            "optimizer values": list(self.optimizer.variables) + loss_scale_variables(self.optimizer),
        }
        if not is_loss_scaled(self.optimizer):
            groups["epoch's loss sums"] = self.metric_variables()
        return {name: [v for v in group if tf.as_dtype(v.dtype).is_floating] for name, group in groups.items()}

    def non_finite(self) -> list[str]:
        """The groups of ``value_groups`` that hold a value that is not finite (one compiled check)."""
        if self._finite_check is None:
            groups = self.value_groups()

            def check():
                return tf.stack(
                    [
                        tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in group] or [True])
                        for group in groups.values()
                    ]
                )

            self._finite_check = list(groups), tf.function(check, autograph=False)
        names, check = self._finite_check
        return [name for name, finite in zip(names, check().numpy()) if not finite]

    def loss_diverged(self, loss) -> bool:
        """Whether the epoch's ``loss`` (averaged over ranks) says the run diverged: not finite, where each
        step applies its update (under a loss scale a step with a non-finite loss is skipped)."""
        return not is_loss_scaled(self.optimizer) and not np.isfinite(loss)

    def metric_results(self) -> dict[str, float]:
        """The epoch's running metrics of this rank (loss, accuracy)."""
        return {name: float(value) for name, value in kerases.metric_results(self.model).items()}

    def reset_metrics(self) -> None:
        self.model.reset_metrics()


def start_averages(optimizer, variables) -> None:
    """``--ema``: each of ``optimizer``'s averages starts as its variable, as tf-keras starts them. Keras 3 starts
    them at zero, replaced by the variable only at an update with ``iterations`` 0, which a skipped or accumulated
    step has counted past."""
    if keras_3():
        for variable, average in zip(variables, optimizer._model_variables_moving_average, strict=True):
            average.assign(variable)


def make_optimizer(cfg: TrainConfig, variables=()):
    """The run's optimizer (``optimizers.make``) in Horovod's ``DistributedOptimizer``: gradients averaged over
    every rank (``--fp16-allreduce`` compressed; ``--grad-accum``: added up locally, averaged at each update)."""
    wrapped = gradients.distributed_optimizer(
        optimizers.make(cfg.optim), fp16_allreduce=cfg.horovod.fp16_allreduce, grad_accum=cfg.horovod.grad_accum
    )
    return optimizers.leave_undecayed(wrapped, cfg.optim, variables)
