"""Keras 2 everywhere: the one place that decides which Keras is imported.

TensorFlow >= 2.16 ships Keras 3 as ``keras`` and ``tf.keras``. Horovod
0.28.1 (its last release) only knows Keras 2: ``horovod.tensorflow.keras``
imports ``keras`` and fails under Keras 3 with ``module 'keras.backend' has
no attribute 'constant'``. Keras 2 lives on as the ``tf_keras`` package, so
before TensorFlow or Horovod is imported we

* set ``TF_USE_LEGACY_KERAS=1`` so ``tf.keras`` is ``tf_keras``, and
* make ``import keras`` resolve to ``tf_keras`` for Horovod.

Every module of hvd_train gets Keras from here (``from hvd_train.compat import
keras``) so the whole process agrees on one Keras.
"""

import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# TensorFlow's C++ log lines (CPU feature guards, CUDA plugin registration
# noise on machines without GPUs) bury the trainer's own log on every rank.
# Real failures still reach the user as Python exceptions. Users may override.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow with file descriptor 2 muted, unless asked to be verbose.

    The CUDA plugin registration lines ("Unable to register cuDNN factory")
    are written through absl before any log level applies, once per rank.
    Import errors still surface as Python exceptions after stderr is back.
    """
    if os.environ["TF_CPP_MIN_LOG_LEVEL"] != "3" or "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_import_tensorflow_quietly()

import tf_keras as keras  # noqa: E402

sys.modules["keras"] = keras

__all__ = ["keras"]
