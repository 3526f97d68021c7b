"""``hvd-train train``: fine-tune a model on a labelled image folder."""

from __future__ import annotations

import argparse

from hvd_train import config


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a keras.applications model on labelled images",
        description="Fine-tune a keras.applications model on a folder tree DIR/<class>/.../<image>. "
        "Run it directly for one process, or under horovodrun / mpirun for many. "
        "Options may come from --config FILE.yaml; flags win.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    config.add_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import gc

    # TensorFlow's, Keras's and Horovod's modules make hundreds of thousands of objects that live
    # as long as the process: the cycle collector's passes over them while they are made took
    # about 0.5 s of every rank's start. Off while they load, then moved out of its way.
    gc.disable()
    try:
        cfg, ctx = _start(args)
    finally:
        gc.freeze()
        gc.enable()
    from hvd_train.training.run import run as train

    train(cfg, ctx)
    return 0


def _start(args: argparse.Namespace):
    """The checked configuration and this rank's Horovod context, with TensorFlow and Horovod loaded."""
    # Validated before Horovod starts and before any rank reads data: every
    # rank rejects a bad option the same way, and none waits for another.
    import os

    from hvd_train.errors import UserError
    from hvd_train.training import s3_mirror

    try:
        # An S3 --output: the run writes its staging folder, which rank 0 mirrors to the prefix.
        cfg = s3_mirror.stage(config.from_sources(args))
    except UserError as e:
        # Every rank parsed the same flags and failed the same way: rank 0 says so.
        raise UserError(str(e), agreed=True) from None
    # Read by TensorFlow and by hvd.init(), so set before either starts.
    os.environ.update(cfg.horovod.environment(cfg.run.output))
    if cfg.horovod.timeline or cfg.horovod.autotune:
        os.makedirs(cfg.run.output, exist_ok=True)  # Horovod opens its files there at init
    from hvd_train.model import compute

    compute.xla_environment(cfg.compute.xla)

    from hvd_train import log
    from hvd_train.distributed import start
    from hvd_train.model.catalogue import get_spec

    try:
        get_spec(cfg.model.name)
        start.check_launch(elastic=cfg.horovod.elastic)
    except UserError as e:
        raise UserError(str(e), agreed=True) from None
    ctx = start.init(
        cfg.horovod.threads_per_rank, deterministic=cfg.run.deterministic, process_sets=bool(cfg.horovod.head_parallel)
    )
    compute.use_xla(cfg.compute.xla)
    start.warn_ineffective(cfg.horovod, ctx)
    if cfg.run.log_all_ranks:
        log.setup(ctx.rank, ctx.size, all_ranks=True)
    import hvd_train.training.run  # noqa: F401  (loaded with the collector off)

    return cfg, ctx
