"""``hvd-train``: the command line.

Errors a user can fix print as one line (``error: ...``) and exit with 2;
anything else prints its traceback and exits with 1. Under a launcher, a
rank that fails alone ends the whole job (``distributed.exits.abort``) rather than
leave the other ranks waiting in a collective. A run stopped by a signal
(SIGTERM, SIGINT, SIGUSR1) after its checkpoint prints one line on every
rank and exits with 75 (``preemption.EXIT_PREEMPTED``).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading

from hvd_train import __version__, log
from hvd_train.distributed import hostname, launchers
from hvd_train.errors import UserError


def build_parser() -> argparse.ArgumentParser:
    from hvd_train.commands import (
        bench,
        demo,
        doctor,
        evaluate,
        export,
        lr_find,
        models,
        pack,
        plan,
        predict,
        report,
        sweep,
        train,
    )

    parser = argparse.ArgumentParser(
        prog="hvd-train",
        description="Fine-tune Keras applications image classifiers on one to hundreds of GPUs with Horovod.",
    )
    parser.add_argument("--version", action="version", version=f"hvd_train {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (train, sweep, lr_find, evaluate, predict, export, report, pack, bench, plan, models, doctor, demo):
        module.add_parser(subparsers)
    # Run by main() before parsing; here for the list of commands only.
    subparsers.add_parser(
        "launch",
        help="horovodrun with its arguments (hvd-train launch -np 4 hvd-train train ...), ending a stop "
        "with the ranks' 75 instead of a traceback",
    )
    for sub in subparsers.choices.values():
        sub.add_argument(
            "--verbose",
            action="store_true",
            help="also TensorFlow's and Horovod's own log lines, quiet by default "
            "(HVD_TRAIN_VERBOSE=1 does the same, on every rank of a launcher)",
        )
        _show_choices(sub)
    return parser


def _show_choices(parser: argparse.ArgumentParser) -> None:
    """Puts the allowed values of every option with choices into its help.

    argparse shows choices only where an option has no metavar; here every
    option's help says them, before its default.
    """
    for action in parser._actions:
        if not action.choices or not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        allowed = f"one of: {' | '.join(str(c) for c in action.choices)}"
        if allowed in action.help:
            continue
        text, sep, default = action.help.rpartition(" (default: ")
        if sep:
            action.help = f"{text} ({allowed}; default: {default}"
        else:
            action.help = f"{action.help} ({allowed})"


def main(argv: list[str] | None = None) -> int:
    """Runs the command of ``argv`` (this process's own arguments if None) and returns its exit status.

    A process started as ``hvd-train`` (``argv`` None) that loaded TensorFlow
    ends here instead, without the interpreter's teardown (``end_process``).
    """
    code = _main(argv)
    if argv is None and "tensorflow" in sys.modules:
        from hvd_train.distributed.exits import end_process

        end_process(code)
    return code


def _main(argv: list[str] | None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["launch"]:  # the launcher, not a rank: no TensorFlow, no rank set-up
        from hvd_train.commands import launch

        return launch.main(given[1:])
    rank, size = launchers.launcher_rank()
    log.setup(rank, size)
    logger = log.get_logger()
    try:
        # Before TensorFlow and Horovod load: may re-execute this process.
        notice = hostname.prepare_rank(argv_given=argv is not None)
    except UserError as e:
        logger.error("error: %s", e)
        return e.exit_code
    if notice and rank == 0:
        logger.info("%s", notice)
    if given[:1] == ["train"] and threading.current_thread() is threading.main_thread():
        # From here on a stop signal is the first step's stop, not the end of a starting rank.
        from hvd_train.training.preemption import note_from_start

        note_from_start()
    args = build_parser().parse_args(argv)
    if args.verbose:  # before TensorFlow loads (hvd_train.compat), here and in what this command starts
        os.environ["HVD_TRAIN_VERBOSE"] = "1"
    from hvd_train.training.preemption import STOP_SIGNALS, Preempted

    try:
        return int(args.run(args) or 0)
    except Preempted as e:
        # Every rank stopped after the same step and rank 0's checkpoint is written.
        logger.warning("%s", e)
        if argv is None:  # this process is the rank (not a caller of main())
            from hvd_train.distributed.exits import end_after_stop

            end_after_stop(e.exit_code, STOP_SIGNALS)
        return e.exit_code
    except UserError as e:
        if not e.agreed or rank == 0:
            logger.error("error: %s", e)
        code, agreed = e.exit_code, e.agreed
    except KeyboardInterrupt:
        code, agreed = 130, False
    except Exception as e:
        if isinstance(e, BrokenPipeError) and _stdout_gone():
            # `hvd-train predict ... | head`: the reader has what it wanted; end quietly, as Unix tools do.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code, agreed = 128 + signal.SIGPIPE, False
        else:
            logger.exception("unexpected error")
            code, agreed = 1, False
    if size > 1 and not agreed:
        from hvd_train.distributed.exits import abort

        abort(code)
    return code


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    sys.exit(main())
