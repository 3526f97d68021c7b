"""An elastic job (``--elastic``): the run's stages inside Horovod's elastic retry loop.

What happens when a worker is lost, in order:

1. A collective fails on the survivors (``distributed.elastic.is_horovod_failure``);
   ``distributed.elastic.run_elastic`` calls ``restore``: weights, state and history
   roll back to the last commit (``save``, at every ``--commit-every``
   updates and every epoch end).
2. ``on_lost`` notes the time; Horovod forms the new world (at least
   ``--min-np`` workers) and ``reset`` adapts the logs to it.
3. ``sync``: the most advanced rank sends the job, the state, the history and
   the weights to every rank, new workers included (they build their model
   without a collective of their own).
   A sharded head (``--head-parallel``) is built again on every rank, in
   groups of the new world, and re-split from the commit (``elastic_head``).
4. ``body`` runs the loop again: ``Loop.configure`` deals the rest of the
   epoch anew to the workers left (``TrainState.resize``), and the loop notes
   when training goes on (``history.resets``).
"""

from __future__ import annotations

import copy
import time

import numpy as np

from hvd_train.compat import KERAS_MAJOR
from hvd_train.config import TrainConfig
from hvd_train.distributed import elastic, gradients, start
from hvd_train.distributed.context import Context
from hvd_train.log import get_logger
from hvd_train.model.network import Net
from hvd_train.model.sharded_net import ShardedNet
from hvd_train.training import early_stop, elastic_head
from hvd_train.training.audit import log_sample_event
from hvd_train.training.job import History, Job
from hvd_train.training.loop import Loop
from hvd_train.training.preemption import StopRequests
from hvd_train.training.stages import build_net, load_data, prepare_output, resolve_base_lr, start_state
from hvd_train.training.state import TrainState

log = get_logger("train")


class ElasticTraining(elastic.ElasticSession):
    """An elastic job (``--elastic``): the stages and the loop inside Horovod's elastic retry loop.

    The first workers set the run up together (``stages``), then commit. A
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
        self._pending = None  # the head of a commit under way (``elastic_head.agree``)
        self._lost_at = 0.0

    def body(self, commit) -> None:
        if self.state is None:
            prepare_output(self.cfg, self.ctx)
            self.job = resolve_base_lr(load_data(self.cfg, self.ctx), self.ctx)
            self.net = build_net(self.job, self.ctx)
            self.state, history = start_state(self.job, self.ctx, self.net)
            self.history = history
            commit()
        if self.state.epoch >= self.cfg.run.epochs or early_stop.exhausted(self.cfg.run, self.state):
            return
        Loop(self.job, self.ctx, self.net, self.state, self.stop, self.history, commit=commit).run()

    def save(self) -> None:
        net, head = self.net, None
        if isinstance(net, ShardedNet):  # exchanges, before the rest: a failure leaves the last commit as it was
            head = self._pending = elastic_head.commit(net, self.state.images_seen)
            elastic_head.agree(net)
        self._saved = (
            [v.numpy() for v in net.variables],
            net.read_local(),
            self.state.copy(),
            copy.deepcopy(self.history),
            head,
        )
        self._pending = None
        log_sample_event(self.cfg.run.sample_log, "commit", self.state)

    def restore(self) -> None:
        self._lost_at = time.time()
        log.warning("elastic: a collective failed (a worker was lost); rolling back to the last commit")
        if self._saved is None:  # lost a worker while setting up: set up again (or from those that committed)
            self.job = self.net = self.state = None
            return
        values, local, state, history, head = self._saved
        lost = self.state.step - state.step if self.state else 0
        log_sample_event(self.cfg.run.sample_log, "rollback", state)
        for variable, value in zip(self.net.variables, values):
            variable.assign(value)
        self.net.write_local(local)
        if head is not None:
            elastic_head.restore(self.net, head)
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
        self._lost_at = 0.0  # the next change is timed from its own start
        log.info("elastic: %d worker(s) now; this is rank %d", self.ctx.size, self.ctx.rank)

    def sync(self) -> None:
        ctx = self.ctx
        # Horovod: the most advanced rank, an old worker, is the source of truth.
        # With each rank's Keras: a worker that joined on another is refused on every rank.
        seen = self.state.images_seen if self.state is not None else -1
        committed = self._saved[4] if self._saved is not None and self.state is not None else None
        offers = elastic_head.offers(committed, self._pending)
        gathered = ctx.allgather_object((seen, KERAS_MAJOR, offers), name="progress")
        start.refuse_mixed_kerases([major for _, major, _ in gathered])
        progress = [images for images, _, _ in gathered]
        root = int(np.argmax(progress))
        if progress[root] < 0:
            return  # nobody has started: the body sets the run up together
        holders = [held for _, _, held in gathered]
        sharded = any(holders)
        if sharded:  # the latest commit of which every shard of the head is still held
            chosen = elastic_head.plan(holders)
            root = chosen.root
        shared = ctx.broadcast_object(
            (self.job, self.state.to_dict() if ctx.rank == root else None, self.history if ctx.rank == root else None),
            name="job",
            root=root,
        )
        job, values, history = shared
        if sharded:  # every rank: the head's groups are the new world's, and the step's exchanges with them
            self.job = job
            self.net = self._rebuilt(job)
        elif self.net is None:  # a new worker
            self.job = job
            self.net = build_net(job, ctx, collective=False)
        self.state = TrainState.from_dict(values)
        self.history = history
        # Horovod: weights, optimizer state (BatchNorm statistics among the
        # weights) and the epoch's metric sums from the source rank.
        gradients.broadcast_variables(self.net.variables + self.net.metric_variables(), ctx, root=root)
        if sharded:
            elastic_head.respread(self.net, [committed, self._pending], chosen)
            if self.history.resets:
                self.history.resets[-1]["head_parallel"] = self.net.head.parallel
        self.save()

    def _rebuilt(self, job: Job) -> Net:
        """The net built again for this world, from this rank's commit where it has one (its head: ``respread``)."""
        net = build_net(job, self.ctx, collective=False)
        if self._saved is not None:
            values, local = self._saved[:2]
            for variable, value in zip(net.variables, values, strict=True):
                variable.assign(value)
            net.write_local(local)
        return net
