"""The one place that decides which Keras is imported: ``HVD_TRAIN_KERAS=2`` or ``3``.

TensorFlow >= 2.16 ships Keras 3 as ``keras`` and ``tf.keras``; Keras 2 lives
on as the ``tf_keras`` package. Horovod 0.28.1 (its last release) only knows
Keras 2: ``horovod.tensorflow.keras`` imports ``keras`` and fails under Keras
3, and its optimizer hooks are never called by a Keras 3 optimizer.

* ``HVD_TRAIN_KERAS=2`` (tf-keras): before TensorFlow or Horovod is imported,
  ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` ``tf_keras``, and ``import
  keras`` resolves to ``tf_keras`` for Horovod's Keras layer.
* ``HVD_TRAIN_KERAS=3`` (Keras 3, TensorFlow backend): nothing of Horovod's
  Keras layer is used, only ``horovod.tensorflow``'s collectives
  (``distributed.gradients``), with our own step and averaging.

Every module of hvd_train gets Keras and TensorFlow from here (``from
hvd_train.compat import keras, tf``): so the whole process agrees on one
Keras, and TensorFlow is first imported here, with its import noise sieved
out, whichever module needs it first. ``KERAS_MAJOR`` says which.
"""

import contextlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys

from hvd_train.errors import UserError

KERAS_3_SINCE = (2, 21)
"""The TensorFlow from which Keras 3 is the default: the stack it is tested on. Before it (the 2.18
stack), tf-keras (docs/keras3.md, "Which is the default")."""


def default_keras(tensorflow_version: str | None) -> str:
    """The Keras a run uses when ``HVD_TRAIN_KERAS`` is not set, for the installed TensorFlow's version
    (``None``: not found, Keras 3)."""
    if tensorflow_version is None:
        return "3"
    release = re.match(r"(\d+)\.(\d+)", tensorflow_version)
    if release is None:
        return "3"
    return "3" if (int(release[1]), int(release[2])) >= KERAS_3_SINCE else "2"


def _installed_tensorflow() -> str | None:
    """The version of the TensorFlow distribution installed (read from its metadata: nothing imported)."""
    for name in ("tensorflow", "tensorflow-cpu", "tf-nightly"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _chosen_major() -> int:
    """``HVD_TRAIN_KERAS`` checked (a backend other than TensorFlow is refused in one line), and
    ``TF_USE_LEGACY_KERAS`` set to agree with it, so that ``tf.keras`` is the same Keras."""
    chosen = os.environ.get("HVD_TRAIN_KERAS", "").strip() or default_keras(_installed_tensorflow())
    if chosen not in ("2", "3"):
        raise UserError(f"HVD_TRAIN_KERAS={chosen!r}: use 2 (tf-keras) or 3 (Keras 3 on TensorFlow)")
    if chosen == "3":
        backend = os.environ.get("KERAS_BACKEND", "tensorflow").strip()
        if backend != "tensorflow":
            raise UserError(
                f"KERAS_BACKEND={backend}: hvd_train trains with TensorFlow and Horovod; "
                "unset KERAS_BACKEND or set it to tensorflow"
            )
        os.environ["KERAS_BACKEND"] = "tensorflow"
        # HVD_TRAIN_KERAS decides, whatever a parent process of Keras 2 left here: tf.keras is Keras 3 too.
        os.environ["TF_USE_LEGACY_KERAS"] = "0"
        return 3
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    return 2


KERAS_MAJOR = _chosen_major()
"""2 (tf-keras) or 3 (Keras 3), from ``HVD_TRAIN_KERAS``."""

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


LEFT_OUT_OF_KERAS = ("sklearn", "pandas", "matplotlib")
"""What Keras 3's import loads when it is installed and hvd_train never uses from Keras: scikit-learn (its
estimator wrappers, with SciPy), pandas (DataFrames given to ``fit``) and matplotlib (its plotting
helpers). Installed beside hvd_train (MLflow brings them), they cost every process about 2.7 CPU-s of its start;
Keras takes each as not installed, and the process can import them later as usual (benchmarks/RESULTS.md,
"A process's start")."""


@contextlib.contextmanager
def _left_out(names: tuple[str, ...]):
    """``import NAME`` (and of its submodules) fails inside, for those of ``names`` not imported yet."""
    held = [name for name in names if name not in sys.modules]
    for name in held:
        sys.modules[name] = None  # the import system's own "not importable" mark
    try:
        yield
    finally:
        for name in held:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


with _left_out(LEFT_OUT_OF_KERAS):
    _import_tensorflow_quietly()

    import tensorflow as tf  # noqa: E402

    if KERAS_MAJOR == 3:
        import keras  # noqa: E402

        if not keras.__version__.startswith("3."):
            raise UserError(
                f"HVD_TRAIN_KERAS=3, but `import keras` gives Keras {keras.__version__}: "
                "pip install 'keras>=3.12,<4' (make install does), or use HVD_TRAIN_KERAS=2"
            )
    else:
        import tf_keras as keras  # noqa: E402

        sys.modules["keras"] = keras


def keras_3() -> bool:
    """Whether this process runs Keras 3."""
    return KERAS_MAJOR == 3


__all__ = ["KERAS_MAJOR", "keras", "keras_3", "tf"]
