"""The training state: where a run stands, in one object.

Checkpoints, preemption stops and elastic commits all save and restore this
object next to the model and optimizer variables; with them it is all a run
needs to go on as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hvd_train.data.sharding import Intervals, Layout, Segment


@dataclass
class TrainState:
    """Progress of a run, identical on every rank.

    Attributes:
        seed: the run's seed (data order, augmentation, dropout).
        world_size: workers of the current segment.
        batch_size: images per worker per step in the current segment.
        global_batch: images per optimizer update (batch x workers x accumulation).
        total: training images per epoch.
        epoch: epochs finished.
        step: batches each rank has run since the start of the run.
        epoch_steps: batches each rank has run in the current epoch.
        samples: images of the current epoch consumed so far (all ranks).
        images_seen: images consumed since the start of the run (all
            ranks); the learning rate is keyed on it, so a change of the
            number of workers does not make it jump.
        pending: positions of the current epoch not consumed when the
            current segment began (``None``: the whole epoch).
        segment_steps: steps run in the current segment.
        accum: batches per optimizer update.
        best_epoch: ``--early-stop``: the epoch (0-based) of the best
            held-out score so far; -1 before the first.
        best_score: that score.
    """

    seed: int
    world_size: int
    batch_size: int
    global_batch: int
    total: int
    epoch: int = 0
    step: int = 0
    epoch_steps: int = 0
    samples: int = 0
    images_seen: int = 0
    pending: Intervals | None = None
    segment_steps: int = 0
    accum: int = 1
    best_epoch: int = -1
    best_score: float | None = None
    _segment: Segment | None = field(default=None, compare=False, repr=False)

    def segment(self) -> Segment:
        """The current segment of the current epoch."""
        seg = self._segment
        if seg is None or seg.epoch != self.epoch:
            if self.pending is None:
                seg = Segment.whole(self.epoch, self.total, self.world_size, self.batch_size, self.accum, self.seed)
            else:
                seg = Segment(
                    self.epoch, self.total, self.pending, self.world_size, self.batch_size, self.accum, self.seed
                )
            self._segment = seg
        return seg

    @property
    def epoch_done(self) -> bool:
        """Every step of the current epoch has run (its end-of-epoch work may not have)."""
        return self.segment_steps >= self.segment().steps

    def advance(self, steps: int = 1) -> None:
        """Counts ``steps`` more steps of the current segment."""
        seg = self.segment()
        before = seg.consumed(self.segment_steps)
        self.segment_steps += steps
        self.step += steps
        self.epoch_steps += steps
        self.samples = seg.consumed(self.segment_steps)
        self.images_seen += self.samples - before

    def next_epoch(self) -> None:
        """Moves to the start of the next epoch."""
        self.epoch += 1
        self.epoch_steps = 0
        self.samples = 0
        self.pending = None
        self.segment_steps = 0
        self._segment = None

    def restart_epoch(self, total: int) -> None:
        """Starts the current epoch over with ``total`` images (the training set changed)."""
        self.images_seen = self.epoch * total
        self.total, self.pending, self.segment_steps, self.samples, self.epoch_steps = total, None, 0, 0, 0
        self._segment = None

    def resize(self, layout: Layout, world_size: int, batch_size: int, global_batch: int) -> None:
        """Re-deals what is left of the epoch to ``world_size`` workers of ``batch_size`` images.

        The images consumed stay consumed; the rest becomes the pending
        positions of a new segment, with equal steps on every rank.
        """
        if (world_size, batch_size) == (self.world_size, self.batch_size):
            return
        seg = self.segment()
        self.pending = seg.remaining(layout, self.segment_steps) if self.segment_steps else seg.pending
        self.world_size = world_size
        self.batch_size = batch_size
        self.global_batch = global_batch
        self.segment_steps = 0
        self._segment = None

    @property
    def epoch_progress(self) -> float:
        """Epochs of training so far, fractional: what the learning-rate schedule reads."""
        return self.images_seen / max(1, self.total)

    def to_dict(self) -> dict:
        """Plain JSON-able values."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        out["pending"] = None if self.pending is None else [list(r) for r in self.pending]
        return out

    @classmethod
    def from_dict(cls, values: dict) -> TrainState:
        known = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        kwargs = {k: v for k, v in values.items() if k in known}
        if kwargs.get("pending") is not None:
            kwargs["pending"] = tuple((int(lo), int(hi)) for lo, hi in kwargs["pending"])
        return cls(**kwargs)

    def copy(self) -> TrainState:
        return TrainState.from_dict(self.to_dict())
