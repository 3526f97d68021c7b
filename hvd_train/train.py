"""One training run, on every rank: the Horovod recipe from data to outputs.

``run`` goes through five stages, each one function below:

1. ``load_data``: rank 0 lists the images, every rank checks its share, all agree.
2. ``build_net``: rank 0 loads the weights; Horovod's ``DistributedOptimizer``.
3. ``start_state``: a fresh ``TrainState``, or rank 0 restores the latest
   intact checkpoint; weights and optimizer state are broadcast from rank 0.
4. ``fit``: the training loop (``loop.Loop``) until the last epoch; in an
   elastic job, inside Horovod's elastic retry loop (``ElasticTraining``).
5. ``finish``: final evaluation, the saved model and ``summary.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from hvd_train import checkpoints, compute, distributed, files, lr_find, plots
from hvd_train.classifier import Net, use_step_seeded_dropout
from hvd_train.compat import keras
from hvd_train.config import TrainConfig
from hvd_train.data.sources import training_sets
from hvd_train.distributed import Context
from hvd_train.errors import UserError
from hvd_train.evaluation import EvalResult
from hvd_train.log import get_logger
from hvd_train.loop import History, Job, Loop, fresh_state, log_sample_event, median_rate
from hvd_train.models import build_model, get_spec, resolve_bn
from hvd_train.preemption import Preempted, StopRequests
from hvd_train.reporting import draw
from hvd_train.state import TrainState

log = get_logger("train")


@dataclass(frozen=True)
class Outcome:
    """What a run leaves on each rank.

    Attributes:
        summary: the numbers of ``summary.json``.
        model: the trained model of this rank.
    """

    summary: dict
    model: keras.Model


def run(cfg: TrainConfig, ctx: Context) -> Outcome:
    """Trains, evaluates and writes the outputs of ``cfg`` on this rank.

    Every rank of the job calls this with the same configuration.

    Raises:
        UserError: on every rank, for bad data, weights or options.
        Preempted: on every rank, after a signal, with a checkpoint written.
    """
    stop = StopRequests().install()
    stopped = False
    try:
        if cfg.horovod.elastic:
            training = ElasticTraining(cfg, ctx, stop)
            distributed.run_elastic(training, ctx, on_lost=training.on_lost)
            job, net, state, history = training.job, training.net, training.state, training.history
        else:
            prepare_output(cfg, ctx)
            job = resolve_base_lr(load_data(cfg, ctx), ctx)
            net = build_net(job, ctx)
            state, history = start_state(job, ctx, net)
            fit(job, ctx, net, state, stop, history)
        return finish(job, ctx, net, state, history)
    except Preempted:
        # The handlers stay until the process ends: the same stop may reach this rank
        # again on its way out (from its launcher), and must not kill it there.
        stopped = True
        raise
    finally:
        if not stopped:
            stop.uninstall()


# --- 1. data -------------------------------------------------------------------


def prepare_output(cfg: TrainConfig, ctx: Context) -> None:
    """Rank 0 makes the output folder (or says why it cannot) and writes ``run_config.yaml``.

    Checkpoints of an earlier run stay until training starts (``start_state``):
    a mistyped ``--data`` with ``--no-resume`` must not cost them.
    """

    def prepare() -> None:
        out = cfg.run.output
        try:
            os.makedirs(out, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-")
            probe.close()
        except OSError as e:
            raise UserError(f"cannot write to output folder {out} ({e.strerror}); choose another --output.") from None
        with open(os.path.join(out, "run_config.yaml"), "w", encoding="utf-8") as f:
            f.write(cfg.to_yaml())

    ctx.on_root(prepare, name="prepare_output")


def load_data(cfg: TrainConfig, ctx: Context) -> Job:
    """The checked training and held-out images, the same on every rank."""
    threads = distributed.cpu_threads(ctx, cfg.horovod.threads_per_rank)
    train_set, val_set = training_sets(cfg.data, cfg.run.seed, ctx, threads)
    spec = get_spec(cfg.model.name)
    # Horovod: one precision for all ranks (rank 0 looks at its GPU for "auto").
    numerics = ctx.broadcast_object(
        compute.resolve(cfg.compute.precision, cfg.horovod.grad_accum) if ctx.is_root else None, name="precision"
    )
    job = Job(cfg, train_set, val_set, cfg.data.image_size or spec.default_size, numerics)
    bn_mode, bn_momentum = resolve_bn(cfg.model)
    log.info(
        "%d classes; %d training images, %d held-out; %s at %dx%d (weights %s, BatchNorm %s%s, %s%s)",
        len(train_set.classes),
        len(train_set),
        len(val_set) if val_set else 0,
        spec.name,
        job.image_size,
        job.image_size,
        cfg.model.weights,
        bn_mode,
        f", momentum {bn_momentum}" if bn_mode == "train" and bn_momentum else "",
        numerics,
        f", XLA {cfg.compute.xla}" if cfg.compute.xla != "off" else "",
    )
    if ctx.is_root:
        files.write_json(os.path.join(cfg.run.output, "labels.json"), train_set.classes)
    return job


def resolve_base_lr(job: Job, ctx: Context) -> Job:
    """``--base-lr auto``: rank 0 runs the learning-rate range test; every rank gets its suggestion.

    A resumed run keeps the rate its first attempt found (``lr_find.json``),
    so the schedule it resumes is the one its checkpoint was made with.
    """
    cfg = job.cfg
    if cfg.optim.base_lr != "auto":
        return job

    def find() -> float:
        out = cfg.run.output
        if cfg.run.resume and checkpoints.latest(out) is not None:
            saved = lr_find.saved_suggestion(out)
            if saved:
                log.info("--base-lr auto: %.4g, as found by this run's range test (%s)", saved, lr_find.RESULT)
                return saved
        log.info("--base-lr auto: the learning-rate range test runs on rank 0 first (up to %d steps)", lr_find.STEPS)
        sweep = lr_find.run(job, threads=distributed.cpu_threads(ctx, cfg.horovod.threads_per_rank))
        lr_find.write(sweep, out)
        if sweep.suggestion is None:
            raise UserError(
                f"--base-lr auto: the range test found no rate: from {lr_find.START:g} to {lr_find.END:g} the "
                f"training loss neither fell nor rose, or still fell at the end ({sweep.stopped}; see "
                f"{os.path.join(out, 'lr_find.png')}); check the data and labels, or pass --base-lr with a number."
            )
        log.info(
            "--base-lr auto: %.4g per worker (range test: %d steps in %.0f s, %s; a tenth of %.3g)",
            sweep.suggestion,
            len(sweep.lrs),
            sweep.seconds,
            sweep.stopped,
            sweep.suggestion * 10,
        )
        return sweep.suggestion

    found = ctx.on_root(find, name="lr_find")
    optim = dataclasses.replace(cfg.optim, base_lr=found)
    return dataclasses.replace(job, cfg=dataclasses.replace(cfg, optim=optim))


# --- 2. model --------------------------------------------------------------------


def build_net(job: Job, ctx: Context, collective: bool = True) -> Net:
    """The model (rank 0 loads the weights), Horovod's optimizer and the compiled step.

    Args:
        collective: all ranks build together and agree on errors; False for a
            worker joining an elastic job, which receives everything by
            broadcast and must not start a collective of its own.
    """
    cfg = job.cfg
    if cfg.run.deterministic:
        keras.utils.set_random_seed(cfg.run.seed)
    use_step_seeded_dropout()
    compute.set_policy(job.precision)

    def build():
        # Rank 0 alone loads (maybe downloads) the weights; the others get them by
        # broadcast, so a download failure must stop every rank, not just rank 0.
        load = ctx.is_root and collective
        return build_model(cfg.model, len(job.classes), job.image_size, load_weights=load)

    base = ctx.agree(build, name="build_model") if collective else build()
    return Net(base, cfg, cfg.run.seed, ctx.rank, job.precision)


# --- 3. state --------------------------------------------------------------------


def start_state(job: Job, ctx: Context, net: Net) -> tuple[TrainState, History]:
    """A fresh state, or the one of the latest intact checkpoint; every rank gets rank 0's.

    Returns:
        The state and an empty history.
    """
    cfg = job.cfg
    plan = job.plan(ctx.size)
    log.info(
        "%d worker(s) x batch %d x accumulation %d = global batch %d; %d steps/epoch; "
        "lr %.4g -> %.4g over %g warmup epoch(s), then %s",
        ctx.size,
        plan.batch_size,
        cfg.horovod.grad_accum,
        plan.global_batch,
        plan.steps_per_epoch,
        cfg.optim.base_lr,
        plan.scaled_lr,
        cfg.optim.warmup_epochs,
        cfg.optim.lr_schedule,
    )

    def restore():
        out = cfg.run.output
        if not cfg.run.resume:
            removed = checkpoints.remove_all(out)
            if removed:
                log.info("--no-resume: removed %d checkpoint(s) of an earlier run from %s", removed, out)
            return None
        found = checkpoints.latest(out, set_aside=True)
        if found is None:
            return None
        changed = _check_same_data(job, found)
        rows = checkpoints.restore(found, net.model, net.optimizer)["rows"]
        return found.path, found.state.to_dict(), rows, changed, found.info.get("metrics") or {}

    restored = ctx.on_root(restore, name="restore")
    # Horovod: every rank starts from rank 0's weights and optimizer state.
    distributed.broadcast_variables(net.variables, ctx)
    if restored is None:
        return fresh_state(job, plan), History()
    path, values, rows, changed, metrics = restored
    state = TrainState.from_dict(values)
    # Each rank takes back its own BatchNorm statistics and metric sums, or
    # their mean when the workers are not the same ones.
    same_workers = rows.shape[0] == ctx.size == state.world_size
    net.write_local(rows[ctx.rank] if same_workers else rows.mean(axis=0))
    if changed:
        # --allow-data-change: the positions of the interrupted epoch mean other files now.
        state.restart_epoch(len(job.train))
    log.info(
        "resuming from %s: %d epoch(s) done, %d of %d images of epoch %d consumed, step %d",
        path,
        state.epoch,
        state.samples,
        state.total,
        state.epoch + 1,
        state.step,
    )
    if state.global_batch != plan.global_batch:
        log.warning(
            "the global batch was %d and is %d now; the learning rate follows the new one",
            state.global_batch,
            plan.global_batch,
        )
    history = History()
    history.resumed_from = path
    if metrics and state.epoch > 0:
        history.resumed_metrics = (state.epoch - 1, metrics)
    return state, history


def _check_same_data(job: Job, found: checkpoints.Found) -> bool:
    """Compares the image lists with the ones ``found`` was made with (rank 0).

    Returns:
        Whether the training images changed (resumed with ``--allow-data-change``).

    Raises:
        UserError: the images differ and ``--allow-data-change`` is not given.
    """
    saved, now = found.info.get("data"), job.data_identity()
    if not saved:
        log.warning(
            "checkpoint %s holds no digest of its image list (written by an older hvd_train): "
            "the images cannot be checked against it",
            found.path,
        )
        return found.state.total != now["train_images"]
    differ = [
        f"{what}: {saved[key + '_images']} images, digest {saved[key]} then; "
        f"{now[key + '_images']} images, digest {now[key]} now"
        for key, what in (("train", "training images"), ("val", "held-out images"))
        if saved.get(key) != now[key]
    ]
    if not differ:
        return False
    if not job.cfg.run.allow_data_change:
        raise UserError(
            f"the images differ from those checkpoint {found.path} was made with ({'; '.join(differ)}): resuming "
            f"would map the rest of the run onto other files (and could hold out images already trained on). "
            f"Give the same images (--data, --val-data, --val-split, --seed), pass --allow-data-change to resume "
            f"anyway (the interrupted epoch starts over), or --no-resume to start over."
        )
    log.warning(
        "--allow-data-change: the images differ from those of checkpoint %s (%s)%s",
        found.path,
        "; ".join(differ),
        "; the interrupted epoch starts over" if saved.get("train") != now["train"] else "",
    )
    return saved.get("train") != now["train"]


# --- 4. fit ------------------------------------------------------------------------


def fit(job: Job, ctx: Context, net: Net, state: TrainState, stop: StopRequests, history: History) -> None:
    """Trains from ``state`` until every epoch is done (``loop.Loop``)."""
    if state.epoch >= job.cfg.run.epochs:
        log.info(
            "all %d epochs are done already (checkpoint in %s); evaluating", job.cfg.run.epochs, job.cfg.run.output
        )
        return
    Loop(job, ctx, net, state, stop, history).run()


class ElasticTraining(distributed.ElasticSession):
    """An elastic job (``--elastic``): stages 1-4 inside Horovod's elastic retry loop.

    The first workers set the run up together (stages 1-3), then commit. A
    worker lost mid-run makes the survivors roll back to the last commit
    (``restore``), the rest of the epoch is dealt anew to the workers left
    (``Loop.configure``), and training goes on. A worker that joins later
    receives the job description, the state and the weights from the most
    advanced rank (``sync``) without a collective of its own.
    """

    def __init__(self, cfg: TrainConfig, ctx: Context, stop: StopRequests):
        self.cfg, self.ctx, self.stop = cfg, ctx, stop
        self.job: Job | None = None
        self.net: Net | None = None
        self.state: TrainState | None = None
        self.history = History()
        self._saved = None
        self._lost_at = 0.0

    def body(self) -> None:
        if self.state is None:
            prepare_output(self.cfg, self.ctx)
            self.job = resolve_base_lr(load_data(self.cfg, self.ctx), self.ctx)
            self.net = build_net(self.job, self.ctx)
            self.state, history = start_state(self.job, self.ctx, self.net)
            self.history = history
            self.commit()
        if self.state.epoch >= self.cfg.run.epochs:
            return
        Loop(self.job, self.ctx, self.net, self.state, self.stop, self.history, commit=self.commit).run()

    def save(self) -> None:
        net = self.net
        self._saved = (
            [v.numpy() for v in net.variables],
            net.read_local(),
            self.state.copy(),
            copy.deepcopy(self.history),
        )
        log_sample_event(self.cfg.run.sample_log, "commit", self.state)

    def restore(self) -> None:
        self._lost_at = time.time()
        log.warning("elastic: a collective failed (a worker was lost); rolling back to the last commit")
        if self._saved is None:  # lost a worker while setting up: set up again
            self.job = self.net = self.state = None
            return
        values, local, state, history = self._saved
        lost = self.state.step - state.step if self.state else 0
        log_sample_event(self.cfg.run.sample_log, "rollback", state)
        for variable, value in zip(self.net.variables, values):
            variable.assign(value)
        self.net.write_local(local)
        self.state = state.copy()
        self.history = copy.deepcopy(history)
        self.history.resets.append(
            {"from": self.ctx.size, "lost_steps": lost, "lost_images": lost * self.state.global_batch}
        )

    def on_lost(self) -> None:
        self._lost_at = self._lost_at or time.time()
        log.warning(
            "elastic: the workers changed; waiting for the new set (at least --min-np, up to the elastic timeout)"
        )

    def reset(self) -> None:
        from hvd_train import log as logs

        logs.setup(self.ctx.rank, self.ctx.size, all_ranks=self.cfg.run.log_all_ranks)
        if self.history.resets and "to" not in self.history.resets[-1]:
            self.history.resets[-1].update(to=self.ctx.size, since=self._lost_at)
        else:
            self.history.resets.append({"to": self.ctx.size, "lost_steps": 0, "lost_images": 0, "since": self._lost_at})
        log.info("elastic: %d worker(s) now; this is rank %d", self.ctx.size, self.ctx.rank)

    def sync(self) -> None:
        ctx = self.ctx
        # Horovod: the most advanced rank, an old worker, is the source of truth.
        progress = ctx.allgather_object(self.state.images_seen if self.state is not None else -1, name="progress")
        root = int(np.argmax(progress))
        if progress[root] < 0:
            return  # nobody has started: the body sets the run up together
        shared = ctx.broadcast_object(
            (self.job, self.state.to_dict() if ctx.rank == root else None, self.history if ctx.rank == root else None),
            name="job",
            root=root,
        )
        job, values, history = shared
        if self.net is None:  # a new worker
            self.job = job
            self.net = build_net(job, ctx, collective=False)
        self.state = TrainState.from_dict(values)
        self.history = history
        # Horovod: weights, optimizer state (BatchNorm statistics among the
        # weights) and the epoch's metric sums from the source rank.
        distributed.broadcast_variables(self.net.variables + self.net.metric_variables(), ctx, root=root)
        self.save()


# --- 5. finish ---------------------------------------------------------------------


def finish(job: Job, ctx: Context, net: Net, state: TrainState, history: History) -> Outcome:
    """Final evaluation, identical-weights check, ``model.keras`` and ``summary.json``."""
    cfg = job.cfg
    final = history.last_eval
    if final is None and job.val is not None:
        final = Loop(job, ctx, net, state, StopRequests(), history).evaluate("val.final")
    digests = ctx.allgather_object(_weights_digest(net.model), name="weights_digest")
    identical = len(set(digests)) == 1
    if not identical:
        log.error("ranks ended with different weights: %s", digests)
    summary = _summary(job, ctx, state, final, history, digests, identical)
    if ctx.is_root:
        if job.precision == "fp32":
            export = keras.Model(net.model.inputs, net.model.outputs, name=net.model.name)
        else:
            # The saved model computes in float32: inference never meets float16.
            export = compute.float32_copy(
                net.model, lambda: build_model(cfg.model, len(job.classes), job.image_size, load_weights=False)
            )
        _save_model_atomically(export, os.path.join(cfg.run.output, "model.keras"))
        files.write_json(os.path.join(cfg.run.output, "summary.json"), summary)
        if final is not None:
            path = os.path.join(cfg.run.output, plots.CONFUSION)
            draw(path, lambda: plots.confusion(final.confusion, job.classes, path, f"held-out ({final.count} images)"))
        if final is not None:
            log.info(
                "held-out accuracy %.4f (top-%d %.4f) on %d images; %.1f images/s on %d worker(s)",
                final.accuracy,
                final.k,
                final.top5,
                final.count,
                summary["images_per_sec"] or 0,
                ctx.size,
            )
        log.info("outputs in %s", cfg.run.output)
    return Outcome(summary, net.model)


def _summary(job, ctx, state, final: EvalResult | None, history: History, digests, identical) -> dict:
    cfg = job.cfg
    rate, first = median_rate(history)
    return {
        "val_accuracy": final.accuracy if final else None,
        "base_lr": cfg.optim.base_lr,
        "val_top5": final.top5 if final else None,
        "val_top_k": final.k if final else None,
        "val_loss": final.loss if final else None,
        "val_images": final.count if final else 0,
        "val_per_class_accuracy": dict(zip(job.classes, final.per_class_accuracy())) if final else None,
        "val_confusion_matrix": final.confusion.tolist() if final else None,
        "world_size": ctx.size,
        "batch_size": state.batch_size,
        "global_batch": state.global_batch,
        "steps_per_epoch": job.plan(ctx.size, state).steps_per_epoch,
        "epochs": cfg.run.epochs,
        "image_size": job.image_size,
        "model": get_spec(cfg.model.name).name,
        # The first epoch includes graph tracing and pipeline warm-up; report the
        # steady state when there is one, and the first epoch separately.
        "images_per_sec": rate,
        "images_per_sec_first_epoch": first,
        "weights_identical_across_ranks": identical,
        "weights_digest": digests[0],
        "deterministic": cfg.run.deterministic,
        "precision": job.precision,
        "xla": cfg.compute.xla,
        "horovod_environment": {k: os.environ.get(k) for k in sorted(_HOROVOD_TUNING)},
        "resumed_from": history.resumed_from,
        "world_sizes": history.world_sizes,
        "elastic_resets": history.resets,
        "checkpoint_seconds": round(history.checkpoint_seconds, 3),
        **_input_stats(ctx, history),
        **distributed.versions(),
    }


# The Horovod settings that shape its speed, as the workers saw them.
_HOROVOD_TUNING = (
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_AUTOTUNE",
    "HOROVOD_AUTOTUNE_LOG",
    "HOROVOD_TIMELINE",
    "HOROVOD_HIERARCHICAL_ALLREDUCE",
    "HOROVOD_GLOO_TIMEOUT_SECONDS",
)


def _input_stats(ctx: Context, history: History) -> dict:
    stats = ctx.allgather_object(history.input_stats, name="input_stats")
    # Per rank: seconds the input pipeline waited for S3 objects or shard
    # blocks that were not fetched yet (an upper bound on the training stall
    # they caused), objects fetched, and bytes read.
    return {
        "input_wait_seconds": [round(s["wait_seconds"], 3) if s else None for s in stats],
        "input_objects": [s["objects"] if s else None for s in stats],
        "input_bytes": [s["bytes"] if s else None for s in stats],
    }


def _weights_digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()[:16]


def _save_model_atomically(model, path: str) -> None:
    folder = os.path.dirname(path)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".model-") as tmp:
        tmp_path = os.path.join(tmp, os.path.basename(path))
        model.save(tmp_path)
        os.replace(tmp_path, path)
