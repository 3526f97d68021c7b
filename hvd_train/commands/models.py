"""``hvd-train models``: the keras.applications models available by name, and which Keras offers each."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list the models --model accepts")
    parser.set_defaults(run=run)


def run(args) -> int:
    from hvd_train.compat import KERAS_MAJOR
    from hvd_train.model.catalogue import KERAS_2_ONLY, available_models

    print(f"Keras {KERAS_MAJOR} (HVD_TRAIN_KERAS={KERAS_MAJOR}):")
    for name, spec in sorted(available_models().items()):
        only = "  (Keras 2 only)" if name in KERAS_2_ONLY else ""
        print(f"{name:<20} default input {spec.default_size}x{spec.default_size}{only}")
    if KERAS_MAJOR == 3:
        print(f"Keras 2 only (HVD_TRAIN_KERAS=2): {', '.join(KERAS_2_ONLY)}.")
    print("Names are matched ignoring case, '_' and '-' (resnet50, mobilenet_v2, efficientnet-b0).")
    print("A backbone of your own: --model FILE.py:FUNCTION or MODULE:FUNCTION (docs/training.md).")
    return 0
