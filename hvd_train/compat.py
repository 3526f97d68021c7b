"""Keras 2 everywhere: the one place that decides which Keras is imported.

TensorFlow >= 2.16 ships Keras 3 as ``keras`` and ``tf.keras``. Horovod
0.28.1 (its last release) only knows Keras 2: ``horovod.tensorflow.keras``
imports ``keras`` and fails under Keras 3 with ``module 'keras.backend' has
no attribute 'constant'``. Keras 2 lives on as the ``tf_keras`` package, so
before TensorFlow or Horovod is imported we

* set ``TF_USE_LEGACY_KERAS=1`` so ``tf.keras`` is ``tf_keras``, and
* make ``import keras`` resolve to ``tf_keras`` for Horovod.

Every module of hvd_train gets Keras and TensorFlow from here (``from
hvd_train.compat import keras, tf``): so the whole process agrees on one
Keras, and TensorFlow is first imported here, with its import noise sieved
out, whichever module needs it first.
"""

import os
import shutil
import subprocess
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

VERBOSE = os.environ.get("HVD_TRAIN_VERBOSE", "") not in ("", "0")
"""``HVD_TRAIN_VERBOSE=1`` (or ``--verbose``, which sets it for the ranks a command starts): TensorFlow's lines too."""

# TensorFlow's C++ log lines (CPU feature guards, CUDA plugin registration,
# "failed call to cuInit" and "Could not find cuda drivers" on machines
# without GPUs, tf.data's "Local rendezvous is aborting with status:
# OUT_OF_RANGE" at each end of input) bury the trainer's own log on every
# rank and read like failures. Real failures still reach the user as Python
# exceptions. Users may override; verbose shows all.
if VERBOSE:
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
else:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# What TensorFlow's import writes to file descriptor 2 on a machine without a
# GPU before any log level applies: CUDA plugin registration, absl's notice,
# and (2.19+, which logs through absl before reading TF_CPP_MIN_LOG_LEVEL) the
# oneDNN and missing-driver notices.
IMPORT_NOISE = (
    r"Unable to register (cuDNN|cuFFT|cuBLAS) factory",
    r"All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r"computation placer already registered",
    r"port\.cc:[0-9]+\] oneDNN custom operations are on",
    r"cudart_stub\.cc:[0-9]+\] Could not find cuda drivers on your machine",
)


def _import_tensorflow_quietly() -> None:
    """Imports TensorFlow with the known noise of its import taken out of file descriptor 2.

    The CUDA plugin registration lines ("Unable to register cuDNN factory")
    are written through absl before any log level applies, once per rank.
    Everything else TensorFlow writes meanwhile passes through at once: a
    small ``grep -v`` process stands between file descriptor 2 and the real
    stderr, so even an import that kills the process (an abort in C++)
    leaves its last words on the terminal: grep outlives it and prints what
    it read. The lines sieved come before any log level applies, so a level
    of the user's own (``TF_CPP_MIN_LOG_LEVEL=2``, a common setting) would
    show them all, on every rank: only ``HVD_TRAIN_VERBOSE`` shows everything.
    """
    if VERBOSE or "tensorflow" in sys.modules:
        return
    grep = shutil.which("grep")
    sieve = saved = None
    if grep is not None:
        sys.stderr.flush()
        try:
            saved = os.dup(2)
            sieve = subprocess.Popen(
                [grep, "--line-buffered", "-v", "-E", "|".join(IMPORT_NOISE)],
                stdin=subprocess.PIPE,
                stdout=saved,
                stderr=subprocess.DEVNULL,
            )
        except OSError:  # no stderr to begin with, or no process to spare: import as it comes
            if saved is not None:
                os.close(saved)
    if sieve is None:
        import tensorflow  # noqa: F401

        return
    try:
        os.dup2(sieve.stdin.fileno(), 2)
        import tensorflow  # noqa: F401
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        sieve.stdin.close()
        try:
            sieve.wait(timeout=10)
        except subprocess.TimeoutExpired:  # something still holds the pipe: grep ends when it lets go
            pass


_import_tensorflow_quietly()

import tensorflow as tf  # noqa: E402
import tf_keras as keras  # noqa: E402

sys.modules["keras"] = keras

__all__ = ["keras", "tf"]
