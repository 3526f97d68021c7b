"""``hvd-train models``: the keras.applications models available by name."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the models --model accepts")
    parser.set_defaults(run=run)


def run(args) -> int:
    from hvd_train.model.catalogue import available_models

    for name, spec in sorted(available_models().items()):
        print(f"{name:<20} default input {spec.default_size}x{spec.default_size}")
    print("Names are matched ignoring case, '_' and '-' (resnet50, mobilenet_v2, efficientnet-b0).")
    print("A backbone of your own: --model FILE.py:FUNCTION or MODULE:FUNCTION (docs/training.md).")
    return 0
