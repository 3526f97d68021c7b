"""The training loop of one rank: the steps of each epoch, in order.

``Loop.run`` is re-entrant: everything it needs to go on is in the
``TrainState`` and the variables of the ``Net``, so an elastic job that rolled
back to a commit, or a run resumed from a checkpoint, calls it again and it
continues where the state says: the rest of the current epoch (consumed
images skipped), then whole epochs.

The steps run ``--steps-per-call`` at a time, in one call of the compiled
step each (``Net.run_steps``), at the learning rate the schedule gives each
of them. The host reads nothing of a call before the next has run: what the
ranks agreed in call N (a stop, a timed checkpoint) is acted on after call
N+1, the same call on every rank (the agreement of a segment's first call
at once). What the ranks do together after a call (stop, checkpoint,
commit) is in ``boundary``; the end of an epoch (metrics, BatchNorm sync,
evaluation) in ``epoch_end``; rank 0 writes metrics.csv, TensorBoard and the
curves (``writers``) after the epoch's checkpoint.
"""

from __future__ import annotations

import gc
import time

from hvd_train.data.pipeline import release, train_input
from hvd_train.data.sharding import Segment
from hvd_train.data.streams import input_errors
from hvd_train.distributed import start
from hvd_train.distributed.context import Context
from hvd_train.log import Ticker, get_logger
from hvd_train.model import schedules
from hvd_train.model.network import REPORT_FLAGS, Net
from hvd_train.training import early_stop, epoch_end
from hvd_train.training.audit import SampleLog
from hvd_train.training.boundary import Boundary
from hvd_train.training.job import History, Job, Plan
from hvd_train.training.preemption import StopRequests
from hvd_train.training.state import TrainState
from hvd_train.training.writers import Reporters

log = get_logger("train")


class Loop:
    """Trains ``net`` from ``state`` to the last epoch (see the module docstring).

    Args:
        job: what to train on.
        ctx: this rank's place in the job (updated in place by an elastic reset).
        net: the model, optimizer and compiled step.
        state: where the run stands; advanced in place.
        stop: the signals received.
        history: measurements so far.
        commit: an elastic job's commit (save in memory, then check for new
            or lost hosts); None otherwise.
    """

    def __init__(
        self,
        job: Job,
        ctx: Context,
        net: Net,
        state: TrainState,
        stop: StopRequests,
        history: History,
        commit=None,
    ):
        self.job = job
        self.cfg = job.cfg
        self.ctx = ctx
        self.net = net
        self.state = state
        self.stop = stop
        self.history = history
        self.boundary = Boundary(job, ctx, net, state, stop, history, commit)
        self.reader = None
        self._wait_before = 0.0
        self.reporters: Reporters | None = None
        self.held_out = epoch_end.HeldOut(job)  # built at the first epoch's end that evaluates
        self._traced = False
        if self.cfg.run.sample_log:
            net.audit = SampleLog(self.cfg.run.sample_log, state, ctx)

    def run(self) -> None:
        """Trains until every epoch is done.

        Raises:
            Preempted: on every rank, after an agreed stop and its checkpoint.
            UserError: bad data met during training, or a checkpoint that cannot be written.
        """
        plan = self.configure()
        self.history.world_sizes.append(self.ctx.size)
        try:
            while self.state.epoch < self.cfg.run.epochs and not early_stop.exhausted(self.cfg.run, self.state):
                if self.state.epoch_done:
                    self._end_epoch(steps=0, seconds=0.0)
                else:
                    self._train(plan)
        finally:
            if self.reporters:
                # curves.png shows the last epoch drawn, and its painter ends (an elastic reset
                # makes new writers). After a stop the checkpoint is written already.
                self.reporters.close()

    def configure(self) -> Plan:
        """Fits the state to the current workers: batch, learning rate, what is left of the epoch."""
        ctx, state = self.ctx, self.state
        plan = self.job.plan(ctx.size, state)
        if (state.world_size, state.batch_size) != (plan.world_size, plan.batch_size):
            before = state.world_size, state.batch_size
            state.resize(self.job.layout(state.epoch), plan.world_size, plan.batch_size, plan.global_batch)
            log.info(
                "%d worker(s) x batch %d now (was %d x %d): the rest of epoch %d (%d images) is dealt anew",
                plan.world_size,
                plan.batch_size,
                *before,
                state.epoch + 1,
                state.segment().pending_count,
            )
        state.global_batch = plan.global_batch
        self.schedule = schedules.of_run(self.cfg.optim, self.cfg.run.epochs, plan.scaled_lr)
        self.net.set_rank(ctx.rank)
        self.boundary.restart()
        if ctx.is_root:
            # Horovod: only rank 0 writes files and prints progress (rank 0 may be
            # another process than before an elastic reset).
            title = f"{self.job.spec.name}: {ctx.size} worker(s) x batch {plan.batch_size}"
            self.reporters = Reporters(
                self.cfg.run.output, self.cfg.run.epochs, self.cfg.run.tensorboard, title, self.cfg.run.log_every
            )
        else:
            self.reporters = None
        last = self.history.metrics_of(state.epoch - 1)
        ctx.on_root(lambda: self.reporters.truncate(state.epoch, last), name="reporters")
        return plan

    def _train(self, plan: Plan) -> None:
        state, cfg = self.state, self.cfg
        segments = [(state.segment(), state.segment_steps)]
        segments += [
            (Segment.whole(e, state.total, plan.world_size, plan.batch_size, state.accum, state.seed), 0)
            for e in range(state.epoch + 1, cfg.run.epochs)
        ]
        data = train_input(
            self.job.train,
            segments,
            rank=self.ctx.rank,
            image_size=self.job.image_size,
            augment=cfg.data.augment,
            magnitude=cfg.data.augment_magnitude,
            preprocess=self.job.spec.preprocess_input(),
            seed=cfg.run.seed,
            threads=start.cpu_threads(self.ctx, cfg.horovod.threads_per_rank),
            s3=cfg.data.s3_options(),
            alpha_background=cfg.data.alpha_background,
        )
        self.reader = data.reader
        held = [iter(data.dataset)]  # its one reference, for ``release``
        try:
            with input_errors(self.ctx.rank, data.reader):
                for segment, first in data.segments:
                    steps, seconds = self._run_epoch_steps(segment, first, held[0])
                    self._end_epoch(steps, seconds)
                    if early_stop.exhausted(cfg.run, state):
                        self._stopped_early()
                        break
        finally:
            release(held)  # training goes on at once (an elastic reset too), not after up to a minute
        if self.reader is not None:
            self.history.input_stats = self.reader.stats()

    def _run_epoch_steps(self, segment: Segment, first: int, iterator) -> tuple[int, float]:
        """Runs the steps of ``segment`` from ``first`` on; returns the steps run and their seconds."""
        state, boundary, reporters, net = self.state, self.boundary, self.reporters, self.net
        if reporters:
            reporters.progress.begin(state.epoch, segment.steps, first, segment.batch * segment.size)
        self._wait_before = self._waited()
        rates = self.schedule.parameters()
        per_step = segment.batch * segment.size
        seconds = last = 0.0
        agreed = None  # the last call's report, read once the next call has run
        first_call = True
        while state.segment_steps < segment.steps:
            steps = self._steps_of_call(segment)
            started = time.perf_counter()
            # The last call's time per step: the host waits for each call's report once the next
            # has been dispatched, so in a steady run this loop goes at the device's pace.
            flags = (self.stop.requested, boundary.timed_checkpoint_due(), last)
            progress = (state.images_seen, state.segment_steps, per_step, segment.pending_count, state.total)
            if self._traced:
                logs, report = net.run_steps(iterator, steps, flags, progress, rates)
            else:  # the first call builds the graph and fills the input pipeline: say so while it lasts
                with Ticker(log, "first step: building the training graph, filling the input pipeline"):
                    logs, report = net.run_steps(iterator, steps, flags, progress, rates)
                self._traced = True
                # Python's collector of reference cycles goes through every object it tracks at its
                # oldest generation: with the graphs traced, hundreds of thousands, and a pause of
                # 250 ms (MobileNetV2) that stalls a step now and then. They live as long as the
                # run: moved out of its way (``gc.freeze``), a collection looks at new objects only.
                gc.freeze()
            state.advance(steps)
            if self.history.resets and "seconds" not in self.history.resets[-1]:
                self._training_again()
            if first_call:
                # The first call's agreement at once, the one wait of the segment: a stop that came
                # while the rank started (or the epoch ended) comes after the first call.
                values, first_call = report.numpy()[:REPORT_FLAGS], False
            else:
                values, agreed = (agreed.numpy()[:REPORT_FLAGS] if agreed is not None else (0,) * REPORT_FLAGS), report
            # The steps' time, waiting for a report included, not what the ranks do after them.
            last = (time.perf_counter() - started) / steps
            seconds += last * steps
            boundary.after_update(*values, updates=steps // state.accum)
            if reporters:
                reporters.progress.step(state.segment_steps, logs)
        if agreed is not None:  # the last call's agreement, at the segment's end
            boundary.after_update(*agreed.numpy()[:REPORT_FLAGS], updates=0)
        return segment.steps - first, seconds

    def _steps_of_call(self, segment: Segment) -> int:
        """Steps of the next call: ``--steps-per-call`` in whole updates, to the next boundary at most.

        A call ends at the segment's end, a ``--checkpoint-every N`` checkpoint
        and an elastic commit, where one is due.
        """
        state, accum = self.state, self.state.accum
        steps = min(self.cfg.compute.steps_per_call, segment.steps - state.segment_steps)
        for limit in (self.boundary.steps_to_checkpoint(), self.boundary.steps_to_commit()):
            if limit:
                steps = min(steps, limit)
        return max(accum, steps - steps % accum)

    def _stopped_early(self) -> None:
        run, state = self.cfg.run, self.state
        if self.ctx.is_root:
            log.info(
                "early stop: no better %s in %d epochs; training ends after epoch %d of %d (best: epoch %d, %.4f)",
                run.early_stop_metric,
                run.early_stop,
                state.epoch,
                run.epochs,
                state.best_epoch + 1,
                state.best_score,
            )

    def _waited(self) -> float:
        return self.reader.stats()["wait_seconds"] if self.reader else 0.0

    def _training_again(self) -> None:
        reset = self.history.resets[-1]
        reset["seconds"] = round(time.time() - reset.get("since", time.time()), 3)
        log.info(
            "elastic: training again on %d worker(s), %.1f s after the change; %d step(s) (%d images) redone",
            self.ctx.size,
            reset["seconds"],
            reset.get("lost_steps", 0),
            reset.get("lost_images", 0),
        )

    def _end_epoch(self, steps: int, seconds: float) -> None:
        state, net = self.state, self.net
        epoch = state.epoch
        self.boundary.collect_stand_ins()
        waited = self._waited() - self._wait_before if self.reader is not None else None
        logs = epoch_end.close_epoch(
            self.job,
            self.ctx,
            net,
            epoch,
            state.batch_size,
            self.history,
            steps,
            seconds,
            waited,
            self.held_out,
            self.boundary.diverged,
        )
        if self.reporters and steps:
            self.reporters.progress.end(steps, logs)
        early_stop.note(self.cfg.run, state, epoch, logs, self.ctx.is_root)
        state.next_epoch()
        net.reset_metrics()
        # The checkpoint first: a full disk must not cost the epoch because a CSV row did not fit.
        path = self.boundary.save_checkpoint()
        self.ctx.on_root(lambda: self.reporters.epoch_end(epoch, logs, path), name=f"report.{epoch}")
        if self.history.tracker is not None:  # rank 0's; a failed call is a warning
            self.history.tracker.log_epoch(epoch + 1, logs)
        self.boundary.commit_now()
        if self.reporters:
            # The curves after the checkpoint and an elastic commit, not beside them: drawing
            # holds the GIL, and both read each variable with eager ops that each wait for it
            # (a checkpoint took 4x as long, every rank waiting for rank 0).
            self.reporters.draw_soon(epoch, logs)
