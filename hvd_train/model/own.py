"""A backbone of your own: ``--model FILE.py:FUNCTION`` or ``--model PACKAGE.MODULE:FUNCTION``.

``FUNCTION(input_shape)`` returns a model of the run's Keras (``import keras`` gives it) from a batch
of preprocessed images to feature maps ``(batch, height, width, channels)``,
without a classification head: the run puts the same head on it as on a
Keras applications backbone. Its module's ``preprocess_input``, if it has one,
prepares the pixels (0-255, RGB); otherwise they are scaled to [-1, 1].
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from hvd_train.errors import UserError, first_line


def load(name: str) -> tuple[Callable, str, Callable | None]:
    """The builder ``name`` refers to, its module's name, and the module's ``preprocess_input`` (or None).

    Raises:
        UserError: the file, module or function cannot be found or imported.
    """
    where, _, function = name.rpartition(":")
    if not where or not function.isidentifier():
        raise UserError(
            f"--model {name!r}: a model of your own is FILE.py:FUNCTION or PACKAGE.MODULE:FUNCTION, "
            f"e.g. nets/small.py:backbone."
        )
    try:
        module = _module_of_file(where) if where.endswith(".py") else importlib.import_module(where)
    except UserError:
        raise
    except Exception as e:  # whatever the user's module raises as it is imported
        raise UserError(f"--model {name!r}: importing {where} failed: {first_line(e, named=True, limit=200)}") from None
    builder = getattr(module, function, None)
    if not callable(builder):
        raise UserError(f"--model {name!r}: {where} has no function {function}; name one it defines.")
    preprocess = getattr(module, "preprocess_input", None)
    return builder, module.__name__, preprocess if callable(preprocess) else None


def _module_of_file(path: str):
    if not os.path.isfile(path):
        raise UserError(f"--model: the file {path} does not exist; give the path of a Python file.")
    path = os.path.abspath(path)
    # One module per file, under a name no package of the user's can hold.
    name = f"hvd_train_own_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def constructor(name: str, builder: Callable) -> Callable:
    """``builder`` called as a Keras applications constructor is (``include_top``, ``weights``, ``input_shape``)."""
    from hvd_train.compat import KERAS_MAJOR, keras

    def build(include_top: bool = False, weights=None, input_shape=None):
        if weights == "imagenet":
            raise UserError(
                f"--model {name} is a model of your own: it has no ImageNet weights; pass --weights none, "
                f"or --weights PATH of a weights file saved from it."
            )
        try:
            model = builder(input_shape=input_shape)
        except UserError:
            raise
        except Exception as e:
            raise UserError(
                f"--model {name} failed to build at input {input_shape}: {first_line(e, named=True, limit=200)}"
            ) from None
        if not isinstance(model, keras.Model) or len(model.output_shape) != 4:
            got = f"output {model.output_shape}" if isinstance(model, keras.Model) else type(model).__name__
            raise UserError(
                f"--model {name} must return a Keras {KERAS_MAJOR} Model (HVD_TRAIN_KERAS={KERAS_MAJOR}: "
                f"`import keras` in its file gives that Keras) whose output is feature maps "
                f"(batch, height, width, channels); it returned {got}."
            )
        if weights:
            model.load_weights(weights)
        return model

    return build
