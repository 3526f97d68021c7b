"""What every rank does together after an optimizer update: an agreed stop, a timed checkpoint, a commit.

Every call of the compiled steps also sums, over ranks, flags each rank
gives it: whether it was asked to stop (a signal), whether rank 0's clock
says a checkpoint is due, how long its previous call took per step, and
whether its loss has turned non-finite (see ``network.Net.run_steps`` and
``divergence``). Horovod negotiates the sum while the steps run,
so it costs next to nothing, and the loop reads it one call late, when the
next call has run (where steps are long the ranks also agree at once).
Calls end at optimizer-update boundaries, and after each all ranks act on
the same sums: they stop, checkpoint and commit after the same step.
"""

from __future__ import annotations

import time

import numpy as np

from hvd_train.compat import KERAS_MAJOR
from hvd_train.config import parse_every
from hvd_train.distributed.context import Context
from hvd_train.log import get_logger
from hvd_train.model.compute import is_loss_scaled
from hvd_train.model.network import Net
from hvd_train.model.sharded_net import stage_head
from hvd_train.training import checkpoints, divergence, s3_mirror
from hvd_train.training.job import History, Job
from hvd_train.training.preemption import Preempted, StopRequests
from hvd_train.training.state import TrainState

log = get_logger("train")

# Steps longer than this (seconds) also get an agreement of their own right
# after them: a 2-number allreduce (about 2 ms here) is then under 1% of a step.
SLOW_STEP = 0.25

# Beyond this many workers a checkpoint keeps the mean of the per-rank values
# (BatchNorm statistics, metric sums) instead of one row per rank.
MAX_LOCAL_ROWS = 32


class Boundary:
    """Stops, checkpoints and commits of one ``Loop``, at the same step on every rank.

    Args:
        job, ctx, net, state, stop, history: those of the loop.
        commit: an elastic job's commit (save in memory, then check for new
            or lost hosts); None otherwise.
    """

    def __init__(
        self, job: Job, ctx: Context, net: Net, state: TrainState, stop: StopRequests, history: History, commit=None
    ):
        self.job, self.cfg, self.ctx, self.net = job, job.cfg, ctx, net
        self.state, self.stop, self.history, self.commit = state, stop, history, commit
        self.every_steps, self.every_seconds = parse_every(self.cfg.run.checkpoint_every)
        self._written: str | None = None  # the last checkpoint this run wrote
        self.restart()

    def restart(self) -> None:
        """Counts the checkpoint and commit cadence from now (training starts or starts again)."""
        self._last_checkpoint = (self.state.step, time.monotonic())
        self._since_commit = 0

    def timed_checkpoint_due(self) -> bool:
        """Rank 0's clock says a ``--checkpoint-every DURATION`` checkpoint is due."""
        return (
            self.ctx.is_root
            and self.every_seconds > 0
            and time.monotonic() - self._last_checkpoint[1] >= self.every_seconds
        )

    def steps_to_checkpoint(self) -> int:
        """Steps until a ``--checkpoint-every N`` (steps) checkpoint is due; 0 without one."""
        if not self.every_steps:
            return 0
        return max(1, self.every_steps - (self.state.step - self._last_checkpoint[0]))

    def steps_to_commit(self) -> int:
        """Steps until an elastic job's next ``--commit-every`` commit; 0 without one."""
        if self.commit is None:
            return 0
        return max(1, self.cfg.horovod.commit_every - self._since_commit) * self.state.accum

    def after_update(self, stop: float, timed: float, step_seconds: float, diverged: float, updates: int = 1) -> None:
        """Acts on what every rank agreed: stop, checkpoint, commit after this same step.

        The first four arguments are the sums over ranks of what each rank
        gave a call of the steps (see ``Net.run_steps``), the call before the
        one just run; every rank got the same sums. A signal that arrived
        during a call shows in the next one, and is read when the one after
        has run, which is free for short steps; where steps are long
        (more than ``SLOW_STEP`` seconds) the ranks also agree right now,
        with a small allreduce that costs under 1% of such a step, so a stop
        does not wait for more long steps.

        Args:
            updates: optimizer updates run since the last call (the elastic commit's cadence).

        Raises:
            Diverged: on every rank, when a rank's loss turned non-finite (no checkpoint written).
            Preempted: on every rank, after the stop's checkpoint.
        """
        if diverged > 0:
            raise self.diverged(f"the loss of {int(diverged)} of {self.ctx.size} rank(s)")
        if stop == 0 and step_seconds / self.ctx.size > SLOW_STEP:
            # Horovod: every rank takes this branch, from the same sums.
            stop, timed = self.ctx.allreduce_sum(
                np.array([self.stop.requested, self.timed_checkpoint_due()], np.float64), name="boundary"
            )
        if stop > 0:
            self._stop()
        if self.state.epoch_done:
            return  # the end of the epoch checkpoints and commits
        by_steps = self.every_steps and self.state.step - self._last_checkpoint[0] >= self.every_steps
        if timed > 0 or by_steps:
            self.save_checkpoint("--checkpoint-every")
        if self.commit is not None:
            self._since_commit += updates
            if self._since_commit >= self.cfg.horovod.commit_every:
                self.commit_now()

    def commit_now(self) -> None:
        """An elastic job's commit (nothing otherwise)."""
        if self.commit is not None:
            self.collect_stand_ins()
            self._since_commit = 0
            self.commit()

    def collect_stand_ins(self) -> None:
        """Moves the undecodable training images the steps met into ``history`` (read from the device)."""
        self.history.undecodable.update(self.net.take_stand_ins())

    def diverged(self, what: str) -> Exception:
        """The error that ends a diverged run (``divergence``), naming its last finite checkpoint: the one it
        wrote last, or resumed from."""
        last = self._written or self.history.resumed_from
        where = s3_mirror.location(self.cfg.run.output, last) if last else None
        lr = float(self.net.optimizer.learning_rate.numpy())
        return divergence.error(self.cfg, self.state, lr, what, where, is_loss_scaled(self.net.optimizer))

    def _stop(self) -> None:
        state = self.state
        by = f"{self.stop.name}" if self.stop.requested else "a signal to another rank"
        path = self.save_checkpoint(f"stopped by {by}")
        raise Preempted(
            f"stopped by {by} in epoch {state.epoch + 1}/{self.cfg.run.epochs} after step {state.epoch_steps} "
            f"({state.samples} of {state.total} images of the epoch); "
            f"checkpoint {s3_mirror.location(self.cfg.run.output, path)}; "
            f"rerun the same command to continue."
        )

    def save_checkpoint(self, reason: str = "end of epoch") -> str:
        """Rank 0 writes a checkpoint of the current state; every rank takes part and gets its path.

        Args:
            reason: why it is written, kept in it (``reason``): ``end of epoch``,
                ``--checkpoint-every``, or ``stopped by SIGTERM`` (rank 0's words).

        Raises:
            UserError: on every rank, when the checkpoint cannot be written.
        """
        started = time.perf_counter()
        state, ctx = self.state, self.ctx
        self.collect_stand_ins()
        # Horovod: the values that differ between ranks go into the checkpoint too, with the
        # training images each rank met undecodable and has not reported yet (at the epoch's end).
        # A checkpoint of non-finite values would be the resume point: the run ends with its last finite one.
        gathered = ctx.allgather_object(
            (self.net.read_local().astype(np.float32), sorted(self.history.undecodable), self.net.non_finite()),
            name="local_values",
        )
        broken = [groups for _, _, groups in gathered if groups]
        if broken:
            what = " and ".join(sorted({g for groups in broken for g in groups}))
            raise self.diverged(f"the {what} of {len(broken)} of {ctx.size} rank(s)")
        rows = [row for row, _, _ in gathered]
        local = np.stack(rows) if ctx.size <= MAX_LOCAL_ROWS else np.mean(rows, axis=0, keepdims=True)
        info = {
            "model": self.job.spec.name,
            "world_size": ctx.size,
            "global_batch": state.global_batch,
            "metrics": self.history.metrics_of(state.epoch - 1),
            "data": self.job.data_identity(),
            "reason": reason,
            # The Keras that wrote it (HVD_TRAIN_KERAS): the other names the variables otherwise.
            "keras": KERAS_MAJOR,
            # --multi-label: a sigmoid head, its metric's variables not the accuracy's.
            "multi_label": self.cfg.data.multi_label,
            # --ema: whether the optimizer's state holds moving averages of the weights.
            "ema": self.cfg.optim.ema,
            # What summary.json lists as skipped, so that a resumed run lists it too.
            "skipped": [[path, why, when] for path, (why, when) in self.history.skipped.items()],
            "undecodable": sorted({i for _, ids, _ in gathered for i in ids}),
        }

        # --head-parallel: the head, whole, gathered by rank 0 from the first group before it writes.
        head = stage_head(self.net, ctx, self.cfg.run.output)

        def write() -> str:
            path = checkpoints.save(
                self.cfg.run.output,
                checkpoints.name_for(state),
                self.net.model,
                self.net.optimizer,
                state,
                {"rows": local},
                info,
                self.cfg.run.keep_checkpoints,
                extra=head,
            )
            mirror = s3_mirror.of(self.cfg.run.output)
            if mirror is not None:  # an S3 --output: the checkpoint goes up before the run goes on
                mirror.push_checkpoint(path)
            return path

        path = ctx.on_root(write, name="checkpoint")
        self._written = path
        self._last_checkpoint = (state.step, time.monotonic())
        seconds = time.perf_counter() - started
        self.history.checkpoint_seconds += seconds
        log.info("checkpoint %s (%.2f s)", path, seconds)
        return path
