"""The training loop of one rank: steps, agreed stops, checkpoints, commits, epoch ends.

``Loop.run`` is re-entrant: everything it needs to go on is in the
``TrainState`` and the variables of the ``Net``, so an elastic job that rolled
back to a commit, or a run resumed from a checkpoint, calls it again and it
continues where the state says: the rest of the current epoch (consumed
images skipped), then whole epochs.

Every step also sums, over ranks, flags each rank sets before it: whether
it was asked to stop (a signal), whether rank 0's clock says a checkpoint is
due, and how long its previous step took. The sum travels in the step's own
allreduce cycle, so it costs next to nothing; where steps are long the ranks
also agree right after the step (``_at_update_boundary``). At every
optimizer-update boundary all ranks stop, checkpoint and commit after the
same step. At the end of every epoch: metrics averaged over
ranks, BatchNorm statistics averaged, every held-out image scored once,
rank 0 writes metrics.csv, TensorBoard and the checkpoint.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from hvd_train import checkpoints, distributed
from hvd_train.classifier import Net
from hvd_train.compat import tf
from hvd_train.config import Plan, TrainConfig, make_plan, parse_every
from hvd_train.data.blocks import ShardLayout
from hvd_train.data.folder import ImageSet
from hvd_train.data.pipeline import STRIDED, eval_dataset, input_failure, train_input
from hvd_train.data.sharding import Layout, Segment
from hvd_train.data.shards import ShardSet
from hvd_train.distributed import Context
from hvd_train.errors import UserError
from hvd_train.evaluation import EvalResult, evaluate
from hvd_train.log import get_logger, launcher_rank
from hvd_train.models import get_spec
from hvd_train.preemption import Preempted, StopRequests
from hvd_train.reporting import Reporters
from hvd_train.schedules import WarmupSchedule
from hvd_train.state import TrainState

log = get_logger("train")

# Steps longer than this (seconds) also get an agreement of their own right
# after them: a 2-number allreduce (about 2 ms here) is then under 1% of a step.
SLOW_STEP = 0.25

# Beyond this many workers a checkpoint keeps the mean of the per-rank values
# (BatchNorm statistics, metric sums) instead of one row per rank.
MAX_LOCAL_ROWS = 32


@dataclass(frozen=True)
class Job:
    """What a run trains on: the same on every rank (an elastic job gives it to new workers).

    Attributes:
        cfg: the configuration.
        train: the training images or shard set.
        val: the held-out images or shard set, if any.
        image_size: side of the model input.
        precision: the numeric precision every rank uses (``--precision`` resolved by rank 0).
    """

    cfg: TrainConfig
    train: ImageSet | ShardSet
    val: ImageSet | ShardSet | None
    image_size: int
    precision: str = "fp32"

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
            return ShardLayout(self.train, self.cfg.run.seed, epoch)
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
    """

    epochs: dict[int, dict] = field(default_factory=dict)
    last_eval: EvalResult | None = None
    world_sizes: list[int] = field(default_factory=list)
    resets: list[dict] = field(default_factory=list)
    checkpoint_seconds: float = 0.0
    resumed_from: str | None = None
    resumed_metrics: tuple[int, dict] | None = None
    input_stats: dict | None = None

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
        self.commit = commit
        self.spec = get_spec(self.cfg.model.name)
        self.threads = distributed.cpu_threads(ctx, self.cfg.horovod.threads_per_rank)
        self.every_steps, self.every_seconds = parse_every(self.cfg.run.checkpoint_every)
        self.reader = None
        self.reporters: Reporters | None = None
        self._last_checkpoint = (state.step, time.monotonic())
        self._since_commit = 0
        self._sample_log = None
        if self.cfg.run.sample_log:
            net.audit = self._log_samples

    # --- the run ---------------------------------------------------------------

    def run(self) -> None:
        """Trains until every epoch is done.

        Raises:
            Preempted: on every rank, after an agreed stop and its checkpoint.
            UserError: bad data met during training, or a checkpoint that cannot be written.
        """
        plan = self.configure()
        self.history.world_sizes.append(self.ctx.size)
        try:
            while self.state.epoch < self.cfg.run.epochs:
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
        self.schedule = WarmupSchedule(
            initial_lr=self.cfg.optim.base_lr,
            peak_lr=plan.scaled_lr,
            warmup_epochs=self.cfg.optim.warmup_epochs,
            total_epochs=self.cfg.run.epochs,
            decay=self.cfg.optim.lr_schedule,
            drop_factor=self.cfg.optim.lr_drop_factor,
            drop_period_epochs=self.cfg.optim.lr_drop_period,
        )
        self.net.set_rank(ctx.rank)
        self._last_checkpoint = (state.step, time.monotonic())
        self._since_commit = 0
        if ctx.is_root:
            # Horovod: only rank 0 writes files and prints progress (rank 0 may be
            # another process than before an elastic reset).
            title = f"{self.spec.name}: {ctx.size} worker(s) x batch {plan.batch_size}"
            self.reporters = Reporters(self.cfg.run.output, self.cfg.run.epochs, self.cfg.run.tensorboard, title)
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
            preprocess=self.spec.preprocess_input(),
            seed=cfg.run.seed,
            threads=self.threads,
            s3=cfg.data.s3_options(),
            alpha_background=cfg.data.alpha_background,
        )
        self.reader = data.reader
        iterator = iter(data.dataset)
        with _input_errors(self.ctx.rank, data.reader):
            for segment, first in data.segments:
                steps, seconds = self._run_epoch_steps(segment, first, iterator)
                self._end_epoch(steps, seconds)
        if self.reader is not None:
            self.history.input_stats = self.reader.stats()

    def _run_epoch_steps(self, segment: Segment, first: int, iterator) -> tuple[int, float]:
        """Runs the steps of ``segment`` from ``first`` on; returns the steps run and their seconds."""
        state = self.state
        reporters = self.reporters
        if reporters:
            reporters.progress.begin(state.epoch, segment.steps, first)
        wait_before = self.reader.stats()["wait_seconds"] if self.reader else 0.0
        self._wait_before = wait_before
        seconds = 0.0
        logs = {}
        last_step = 0.0
        for _ in range(first, segment.steps):
            started = time.perf_counter()
            self.net.set_learning_rate(self.schedule(state.epoch_progress))
            self.net.set_flags(self.stop.requested, self._timed_checkpoint_due(), last_step)
            logs, _, agreed = self.net.step(iterator)
            last_step = time.perf_counter() - started
            state.advance()
            if self.history.resets and "seconds" not in self.history.resets[-1]:
                self._training_again()
            seconds += time.perf_counter() - started
            if reporters:
                reporters.progress.step(state.segment_steps, logs)
            if state.segment_steps % state.accum == 0:
                self._at_update_boundary(*np.asarray(agreed))
        return segment.steps - first, seconds

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

    # --- step boundaries -----------------------------------------------------------

    def _timed_checkpoint_due(self) -> bool:
        """Rank 0's clock says a ``--checkpoint-every DURATION`` checkpoint is due."""
        return (
            self.ctx.is_root
            and self.every_seconds > 0
            and time.monotonic() - self._last_checkpoint[1] >= self.every_seconds
        )

    def _at_update_boundary(self, stop: float, timed: float, step_seconds: float) -> None:
        """Acts on what every rank agreed: stop, checkpoint, commit after this same step.

        The arguments are the sums over ranks of the flags each rank set
        before the step just run (see ``Net.step``); every rank got the same
        sums. A signal that arrived during that step shows in the next one,
        which is free for short steps; where steps are long (more than
        ``SLOW_STEP`` seconds) the ranks also agree right now, with a small
        allreduce that costs under 1% of such a step, so a stop does not wait
        for one more long step.
        """
        if stop == 0 and step_seconds / self.ctx.size > SLOW_STEP:
            # Horovod: every rank takes this branch, from the same sums.
            stop, timed = self.ctx.allreduce_sum(
                np.array([self.stop.requested, self._timed_checkpoint_due()], np.float64), name="boundary"
            )
        if stop > 0:
            self._stop()
        if self.state.epoch_done:
            return  # the end of the epoch checkpoints and commits
        by_steps = self.every_steps and self.state.step - self._last_checkpoint[0] >= self.every_steps
        if timed > 0 or by_steps:
            self.save_checkpoint()
        if self.commit is not None:
            self._since_commit += 1
            if self._since_commit >= self.cfg.horovod.commit_every:
                self._commit()

    def _commit(self) -> None:
        self._since_commit = 0
        self.commit()

    def _stop(self) -> None:
        state = self.state
        path = self.save_checkpoint()
        by = f"{self.stop.name}" if self.stop.requested else "a signal to another rank"
        raise Preempted(
            f"stopped by {by} in epoch {state.epoch + 1}/{self.cfg.run.epochs} after step {state.epoch_steps} "
            f"({state.samples} of {state.total} images of the epoch); checkpoint {path}; "
            f"rerun the same command to continue."
        )

    # --- checkpoints ------------------------------------------------------------

    def save_checkpoint(self) -> str:
        """Rank 0 writes a checkpoint of the current state; every rank takes part and gets its path.

        Raises:
            UserError: on every rank, when the checkpoint cannot be written.
        """
        started = time.perf_counter()
        state, ctx = self.state, self.ctx
        # Horovod: the values that differ between ranks go into the checkpoint too.
        rows = ctx.allgather_object(self.net.read_local().astype(np.float32), name="local_values")
        local = np.stack(rows) if ctx.size <= MAX_LOCAL_ROWS else np.mean(rows, axis=0, keepdims=True)
        info = {
            "model": self.spec.name,
            "world_size": ctx.size,
            "global_batch": state.global_batch,
            "metrics": self.history.metrics_of(state.epoch - 1),
            "data": self.job.data_identity(),
        }

        def write() -> str:
            return checkpoints.save(
                self.cfg.run.output,
                checkpoints.name_for(state),
                self.net.model,
                self.net.optimizer,
                state,
                {"rows": local},
                info,
                self.cfg.run.keep_checkpoints,
            )

        path = ctx.on_root(write, name="checkpoint")
        self._last_checkpoint = (state.step, time.monotonic())
        seconds = time.perf_counter() - started
        self.history.checkpoint_seconds += seconds
        log.info("checkpoint %s (%.2f s)", path, seconds)
        return path

    # --- epoch end --------------------------------------------------------------

    def _end_epoch(self, steps: int, seconds: float) -> None:
        ctx, state, net = self.ctx, self.state, self.net
        epoch = state.epoch
        logs = self._averaged_metrics()
        logs["lr"] = float(net.optimizer.learning_rate.numpy())
        images = steps * state.batch_size * ctx.size
        logs["epoch_seconds"] = seconds
        logs["images_per_sec"] = images / seconds if seconds > 0 else None
        if self.reader is not None:
            self._report_input_wait(epoch, logs)
        # Horovod: BatchNorm statistics agree on all ranks before evaluation and saving.
        distributed.average_variables(net.batchnorm_statistics(), ctx, name=f"model_statistics.{epoch}")
        if self.job.val is not None:
            result = self.evaluate(f"val.{epoch}")
            logs.update(val_loss=result.loss, val_accuracy=result.accuracy, val_top5=result.top5)
        self.history.epochs[epoch] = logs
        if self.reporters:
            if steps:
                self.reporters.progress.end(steps, logs)
            self.reporters.draw_soon(epoch, logs)
        state.next_epoch()
        net.reset_metrics()
        # The checkpoint first: a full disk must not cost the epoch because a CSV row did not fit.
        path = self.save_checkpoint()
        self.ctx.on_root(lambda: self.reporters.epoch_end(epoch, logs, path), name=f"report.{epoch}")
        if self.commit is not None:
            self._commit()

    def _averaged_metrics(self) -> dict:
        mine = self.net.metric_results()
        names = sorted(mine)
        # Horovod: the epoch's loss and accuracy averaged over ranks.
        total = self.ctx.allreduce_sum(np.array([mine[k] for k in names], np.float64), name="metrics")
        return {k: float(v) / self.ctx.size for k, v in zip(names, total)}

    def _report_input_wait(self, epoch: int, logs: dict) -> None:
        waited = self.reader.stats()["wait_seconds"] - self._wait_before
        worst = max(self.ctx.allgather_object(waited, name=f"wait.{epoch}"))
        logs["input_wait_seconds"] = worst
        seconds = float(logs.get("epoch_seconds") or 0.0)
        if self.ctx.is_root:
            log.info(
                "epoch %d: input waited %.2f s on storage (slowest rank; %.0f%% of the epoch's %.1f s)",
                epoch + 1,
                worst,
                100.0 * worst / seconds if seconds else 0.0,
                seconds,
            )

    def evaluate(self, name: str) -> EvalResult:
        """Scores every held-out image once (all ranks take part)."""
        cfg = self.cfg
        held_out = eval_dataset(
            self.job.val,
            rank=self.ctx.rank,
            size=self.ctx.size,
            batch_size=self.state.batch_size,
            image_size=self.job.image_size,
            crop_fraction=cfg.data.crop_fraction,
            preprocess=self.spec.preprocess_input(),
            threads=self.threads,
            s3=cfg.data.s3_options(),
            alpha_background=cfg.data.alpha_background,
        )
        with _input_errors(self.ctx.rank, held_out.reader):
            result = evaluate(self.net.model, held_out.dataset, len(self.job.classes), self.ctx, name=name)
        self.history.last_eval = result
        return result

    # --- auditing -----------------------------------------------------------------

    def _log_samples(self, ids) -> None:
        """Appends the images of the step about to run (called inside the step, before its allreduce)."""
        if self._sample_log is None:
            self._sample_log = open(sample_log_path(self.cfg.run.sample_log), "a", encoding="utf-8")
        state = self.state
        record = {
            "time": round(time.time(), 3),
            "epoch": state.epoch,
            "step": state.epoch_steps + 1,
            "rank": self.ctx.rank,
            "size": self.ctx.size,
            "ids": np.asarray(ids).tolist(),
        }
        self._sample_log.write(json.dumps(record) + "\n")
        self._sample_log.flush()


def sample_log_path(folder: str) -> str:
    """This process's ``--sample-log`` file, named by the launch rank (it stays with the process) and the pid."""
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, f"rank-{launcher_rank()[0]}-{os.getpid()}.jsonl")


def log_sample_event(folder: str, event: str, state: TrainState) -> None:
    """Appends an elastic ``commit`` or ``rollback`` line to this process's ``--sample-log``.

    An audit counts a step as trained only if a commit follows it before any
    rollback: the steps after the last commit of a lost worker, and of the
    survivors before they rolled back, were undone.
    """
    if not folder:
        return
    with open(sample_log_path(folder), "a", encoding="utf-8") as f:
        f.write(json.dumps({"time": round(time.time(), 3), "event": event, "epoch": state.epoch, "step": state.step}))
        f.write("\n")


class _input_errors:
    """Turns an input pipeline failure into a UserError naming the cause (this rank only knows it)."""

    def __init__(self, rank: int, reader=None):
        self.rank = rank
        self.reader = reader

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or not isinstance(e, tf.errors.OpError):
            return False
        if distributed.is_horovod_failure(e):
            return False  # a lost worker: the elastic wrapper handles it
        failure = input_failure(self.reader)
        if failure is not None:
            # S3 gave up after its retries, or a shard is corrupt.
            if isinstance(failure, UserError):
                raise UserError(f"rank {self.rank}: {failure}") from None
            raise failure from None
        if not isinstance(
            e, (tf.errors.NotFoundError, tf.errors.InvalidArgumentError, tf.errors.PermissionDeniedError)
        ):
            return False
        # Images were checked at the start; failing now means one changed during the run.
        reason = e.message.strip().splitlines()[0].split(" [[", 1)[0]
        raise UserError(
            f"rank {self.rank} could not read its input during training ({reason}); "
            f"was an image deleted or changed while training? Fix the data and rerun (the run resumes)."
        ) from None


def median_rate(history: History) -> tuple[float | None, float | None]:
    """Median images/s over the epochs after the first, and the first epoch's."""
    rates = history.rates()
    steady = rates[1:] if len(rates) > 1 else rates
    return (statistics.median(steady) if steady else None), (rates[0] if rates else None)
