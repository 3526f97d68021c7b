"""One training run, on every rank: the Horovod recipe from data to outputs.

``run`` goes through the stages in order (``stages``): the output folder,
the data (rank 0 lists, every rank checks its share, all agree), the base
learning rate, the model (rank 0 loads the weights; Horovod's
``DistributedOptimizer``), the state (fresh, or rank 0's latest intact
checkpoint, broadcast). Then ``Loop`` trains until the last epoch, inside
Horovod's elastic retry loop for an elastic job (``elastic``), and
``finish`` evaluates and writes the saved model and ``summary.json``.
"""

from __future__ import annotations

from hvd_train.config import TrainConfig
from hvd_train.distributed import elastic
from hvd_train.distributed.context import Context
from hvd_train.log import get_logger
from hvd_train.model.network import Net
from hvd_train.training import early_stop, tracking
from hvd_train.training.elastic import ElasticTraining
from hvd_train.training.finish import Outcome, finish
from hvd_train.training.job import History, Job
from hvd_train.training.loop import Loop
from hvd_train.training.preemption import Preempted, StopRequests, stop_requests
from hvd_train.training.stages import build_net, load_data, prepare_output, resolve_base_lr, start_state
from hvd_train.training.state import TrainState

log = get_logger("train")


def run(cfg: TrainConfig, ctx: Context) -> Outcome:
    """Trains, evaluates and writes the outputs of ``cfg`` on this rank.

    Every rank of the job calls this with the same configuration.

    Raises:
        UserError: on every rank, for bad data, weights or options.
        Preempted: on every rank, after a signal, with a checkpoint written.
    """
    stop = stop_requests()
    stopped = False
    history = None
    try:
        if cfg.horovod.elastic:
            training = ElasticTraining(cfg, ctx, stop)
            elastic.run_elastic(training, ctx, on_lost=training.on_lost)
            job, net, state, history = training.job, training.net, training.state, training.history
        else:
            prepare_output(cfg, ctx)
            job = resolve_base_lr(load_data(cfg, ctx), ctx)
            net = build_net(job, ctx)
            state, history = start_state(job, ctx, net)
            history.tracker = start_tracking(cfg, ctx, resumed=history.resumed_from is not None)
            fit(job, ctx, net, state, stop, history)
        return finish(job, ctx, net, state, history)
    except Preempted:
        # The handlers stay until the process ends: the same stop may reach this rank
        # again on its way out (from its launcher), and must not kill it there.
        stopped = True
        if history is not None and history.tracker is not None:
            history.tracker.stopped()
        raise
    except BaseException as e:
        if history is not None and history.tracker is not None:
            history.tracker.failed(e)
        raise
    finally:
        if not stopped:
            stop.uninstall()


def start_tracking(cfg: TrainConfig, ctx: Context, resumed: bool):
    """Rank 0's tracker (``--track``), or None; a tracker that cannot be used (a tracking server that does not
    answer) stops every rank."""
    if cfg.run.track == "none":
        return None
    started = []
    ctx.on_root(lambda: started.append(tracking.start(cfg, resumed)), name="tracking")
    return started[0] if started else None


def fit(job: Job, ctx: Context, net: Net, state: TrainState, stop: StopRequests, history: History) -> None:
    """Trains from ``state`` until every epoch is done (``loop.Loop``)."""
    if state.epoch >= job.cfg.run.epochs:
        log.info(
            "all %d epochs are done already (checkpoint in %s); evaluating", job.cfg.run.epochs, job.cfg.run.output
        )
        return
    if early_stop.exhausted(job.cfg.run, state):
        log.info(
            "the run stopped early after epoch %d already (no better %s in %d epochs); evaluating",
            state.epoch,
            job.cfg.run.early_stop_metric,
            job.cfg.run.early_stop,
        )
        return
    Loop(job, ctx, net, state, stop, history).run()
