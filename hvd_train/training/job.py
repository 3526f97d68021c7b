"""What a run trains on and the numbers it derives: ``Job``, ``Plan``, the state it starts from, ``History``.

Everything here is plain data, the same on every rank. ``make_plan`` is the
one place where the world size turns into batch sizes, steps per epoch and
the peak learning rate; the rule itself (Goyal et al.'s linear scaling) and
the schedule that turns the peak into each step's rate are in ``schedules``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from hvd_train.config import TrainConfig
from hvd_train.data.blocks import BlockLayout
from hvd_train.data.folder import ImageSet
from hvd_train.data.packed import ShardSet
from hvd_train.data.pipeline import STRIDED
from hvd_train.data.sharding import Layout
from hvd_train.model import schedules
from hvd_train.model.catalogue import ModelSpec
from hvd_train.results.evaluation import EvalResult
from hvd_train.training.state import TrainState


@dataclass(frozen=True)
class Plan:
    """Numbers derived from the configuration and the job, computed in one place.

    Attributes:
        world_size: number of Horovod processes.
        batch_size: images per worker per step.
        global_batch: images per optimizer update: batch x workers x accumulation.
        steps_per_epoch: batches each rank runs per epoch (the same on every rank).
        scaled_lr: peak learning rate, ``base_lr`` scaled linearly to the global batch.
    """

    world_size: int
    batch_size: int
    global_batch: int
    steps_per_epoch: int
    scaled_lr: float


def make_plan(cfg: TrainConfig, world_size: int, num_train: int, global_batch: int | None = None) -> Plan:
    """Derives batch sizes, steps and learning rates for ``world_size`` workers.

    Steps count batches (backward passes). Steps per epoch cover every
    training image at least once and are rounded up to a multiple of
    ``grad_accum`` so each epoch ends on a full update.

    Args:
        global_batch: keep this global batch (an elastic job with
            ``--elastic-batch keep-global-batch``): each worker's batch is
            the nearest whole share of it. None: ``--batch-size`` per worker.
    """
    accum = cfg.horovod.grad_accum
    batch = cfg.data.batch_size
    if global_batch is not None:
        batch = max(1, round(global_batch / (world_size * accum)))
    per_pass = batch * world_size
    steps = max(1, math.ceil(num_train / per_pass))
    steps = math.ceil(steps / accum) * accum
    return Plan(
        world_size=world_size,
        batch_size=batch,
        global_batch=per_pass * accum,
        steps_per_epoch=steps,
        scaled_lr=schedules.linear_scaling(cfg.optim.base_lr, per_pass * accum, cfg.data.batch_size),
    )


@dataclass(frozen=True)
class Job:
    """What a run trains on: the same on every rank (an elastic job gives it to new workers).

    Attributes:
        cfg: the configuration.
        train: the training images or shard set.
        val: the held-out images or shard set, if any.
        image_size: side of the model input.
        precision: the numeric precision every rank uses (``--precision`` resolved by rank 0).
        spec: the Keras application ``--model`` names, resolved once.
    """

    cfg: TrainConfig
    train: ImageSet | ShardSet
    val: ImageSet | ShardSet | None
    image_size: int
    precision: str
    spec: ModelSpec

    @property
    def classes(self) -> list[str]:
        return self.train.classes

    def plan(self, world_size: int, state: TrainState | None = None) -> Plan:
        """Batch, steps and learning rate for ``world_size`` workers.

        With ``--elastic-batch keep-global-batch`` and a ``state`` to keep it
        from, each worker's batch is the share of the state's global batch.
        """
        keep = state is not None and self.cfg.horovod.elastic_batch == "keep-global-batch"
        return make_plan(self.cfg, world_size, len(self.train), state.global_batch if keep else None)

    def data_identity(self) -> dict:
        """Digests and sizes of the training and held-out lists, as checkpoints record them."""
        return {
            "train": self.train.digest,
            "train_images": len(self.train),
            "val": self.val.digest if self.val is not None else None,
            "val_images": len(self.val) if self.val is not None else 0,
        }

    def layout(self, epoch: int) -> Layout:
        """How epoch ``epoch`` is dealt to ranks."""
        if isinstance(self.train, ShardSet):
            return BlockLayout(self.train, self.cfg.run.seed, epoch)
        return STRIDED


def fresh_state(job: Job, plan: Plan) -> TrainState:
    return TrainState(
        seed=job.cfg.run.seed,
        world_size=plan.world_size,
        batch_size=plan.batch_size,
        global_batch=plan.global_batch,
        total=len(job.train),
        accum=job.cfg.horovod.grad_accum,
    )


@dataclass
class History:
    """What the run measured, epoch by epoch (kept across elastic resets).

    Attributes:
        epochs: the logs of each finished epoch, by epoch (0-based).
        last_eval: the latest held-out evaluation.
        world_sizes: the number of workers each time training (re)started.
        resets: elastic resets: workers before and after, steps and images
            redone, seconds from the failure to training again.
        checkpoint_seconds: time spent writing checkpoints (not in throughput).
        resumed_from: the checkpoint the run started from, if any.
        resumed_metrics: ``(epoch, logs)`` of the last finished epoch, as
            the checkpoint resumed from recorded them (so metrics.csv gets
            its row back if the process died after the checkpoint but
            before writing it).
        input_stats: this rank's storage reader counters, if it used one.
        undecodable: indices of training images this rank met that could not
            be decoded (trained on with no weight), not yet reported.
        skipped: every image skipped so far, on every rank alike:
            ``{path: (reason, when)}``, ``when`` being ``check`` (before
            training), ``training`` or ``evaluation``.
        tracker: rank 0's ``training.tracking.Tracker`` (``--track``), if any.
    """

    epochs: dict[int, dict] = field(default_factory=dict)
    last_eval: EvalResult | None = None
    world_sizes: list[int] = field(default_factory=list)
    resets: list[dict] = field(default_factory=list)
    checkpoint_seconds: float = 0.0
    resumed_from: str | None = None
    resumed_metrics: tuple[int, dict] | None = None
    input_stats: dict | None = None
    undecodable: set[int] = field(default_factory=set)
    skipped: dict[str, tuple[str, str]] = field(default_factory=dict)
    tracker: Any = None  # rank 0's tracker (--track), not kept in checkpoints

    def metrics_of(self, epoch: int) -> dict:
        """The logs of finished epoch ``epoch`` (0-based), this process's or the resumed checkpoint's."""
        if epoch in self.epochs:
            return self.epochs[epoch]
        if self.resumed_metrics is not None and self.resumed_metrics[0] == epoch:
            return self.resumed_metrics[1]
        return {}

    def rates(self) -> list[float]:
        """images/s of each epoch trained in this process, in order."""
        return [float(logs["images_per_sec"]) for _, logs in sorted(self.epochs.items()) if logs.get("images_per_sec")]


def median_rate(history: History) -> tuple[float | None, float | None]:
    """Median images/s over the epochs after the first, and the first epoch's."""
    rates = history.rates()
    steady = rates[1:] if len(rates) > 1 else rates
    return (statistics.median(steady) if steady else None), (rates[0] if rates else None)
