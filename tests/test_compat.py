"""TensorFlow's import: its known noise kept out of stderr, everything else let through, even when it crashes.

A stand-in ``tensorflow`` package, first on the path, writes to file
descriptor 2 as TensorFlow's C++ does (noise and real words), then fails the
way a broken install fails: a Python ImportError, or an abort in native code
(as TensorFlow's CPU feature check does on a machine without AVX).
"""

import json
import os
import re
import subprocess
import sys

import pytest

from hvd_train.compat import IMPORT_NOISE

from conftest import BIN, run

NOISY = re.compile("|".join(IMPORT_NOISE))

NOISE = (
    "E0000 00:00:1795449604.630003   12257 cuda_dnn.cc:8310] Unable to register cuDNN factory: Attempting to "
    "register factory for plugin cuDNN when one has already been registered"
)
ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
REAL = "F tensorflow/core/platform/cpu_feature_guard.cc:11] The TensorFlow library was compiled to use AVX"

STAND_IN = f"""
import os
os.write(2, {ABSL!r}.encode() + b"\\n" + {NOISE!r}.encode() + b"\\n" + {REAL!r}.encode() + b"\\n")
if os.environ.get("HOW") == "abort":
    os.abort()
raise ImportError("libtensorflow_framework.so.2: cannot open shared object file")
"""


@pytest.mark.parametrize("how", ["abort", "import error"])
def test_a_failing_tensorflow_import_leaves_its_words_on_stderr(tmp_path, how):
    (tmp_path / "tensorflow").mkdir()
    (tmp_path / "tensorflow" / "__init__.py").write_text(STAND_IN)
    proc = subprocess.run(
        [sys.executable, "-c", "import hvd_train.compat"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOW": how.split()[0]},
        timeout=120,
    )
    assert proc.returncode != 0
    assert REAL in proc.stderr, proc.stderr
    assert "Unable to register cuDNN factory" not in proc.stderr and ABSL not in proc.stderr, proc.stderr
    if how == "import error":
        assert "ImportError: libtensorflow_framework.so.2" in proc.stderr


def test_the_real_import_is_quiet():
    proc = subprocess.run(
        [sys.executable, "-c", "import hvd_train.compat, tensorflow as tf; tf.constant(1)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


LEFT_OUT = """
import importlib.util, json, sys
import numpy as np
from hvd_train.compat import LEFT_OUT_OF_KERAS, keras
loaded = [name for name in LEFT_OUT_OF_KERAS if name in sys.modules]
# Keras still trains on arrays (its array adapter is where it would have looked for pandas).
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
loss = model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=1, verbose=0).history["loss"][0]
installed = [name for name in LEFT_OUT_OF_KERAS if importlib.util.find_spec(name) is not None]
import matplotlib.pyplot, pandas, sklearn.base  # importable afterwards, as usual
print(json.dumps({"loaded": loaded, "installed": installed, "loss": loss}))
"""


@pytest.mark.both_kerases
def test_keras_loads_without_scikit_learn_pandas_and_matplotlib_which_are_imported_later_as_usual():
    # Keras 3 imports them when installed (about 2 s of every process's start), for features hvd_train
    # does not use from Keras.
    proc = subprocess.run([sys.executable, "-c", LEFT_OUT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["installed"] == ["sklearn", "pandas", "matplotlib"], "installed here, so the test can fail"
    assert result["loaded"] == [] and result["loss"] > 0, result


def test_the_command_line_is_built_without_loading_tensorflow():
    # `hvd-train --help` and every subcommand's parser: TensorFlow loads only where a command needs it,
    # after hvd_train.compat (the Keras chosen, the import's noise sieved).
    code = "import sys; from hvd_train import cli; cli.build_parser(); print('tensorflow' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


@pytest.mark.parametrize("level", [None, "2"], ids=["no level", "a level of the user's own"])
def test_a_command_that_loads_tensorflow_is_quiet_too(level):
    # TF_CPP_MIN_LOG_LEVEL=2, a common setting, hid nothing of the import's noise, which comes before any level
    # applies: every rank of a job printed absl's notice twice.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update({"TF_CPP_MIN_LOG_LEVEL": level} if level else {})
    args = [sys.executable, "-m", "hvd_train", "models"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "MobileNetV2" in proc.stdout, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr


@pytest.mark.parametrize("how", ["--verbose", "HVD_TRAIN_VERBOSE=1"])
def test_verbose_brings_tensorflows_lines_back(how):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")  # verbose wins over a level set beforehand
    args = [sys.executable, "-m", "hvd_train", "models"]
    if how == "--verbose":
        args.append("--verbose")
    else:
        env["HVD_TRAIN_VERBOSE"] = "1"
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "MobileNetV2" in proc.stdout, proc.stderr
    assert NOISY.search(proc.stderr), proc.stderr


@pytest.mark.parametrize(
    "args",
    [["-np", "1", "--gloo", "true"], ["--check-build"], ["--check-build", "--verbose"]],
    ids=["job", "check-build", "check-build verbose"],
)
def test_horovodrun_itself_is_quiet_unless_asked(args):
    # horovodrun checks Horovod's TensorFlow extension in a forked child that imports TensorFlow;
    # Horovod as we build it mutes that child's descriptors, not only Python's streams.
    proc = run([BIN / "horovodrun", *args], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert bool(NOISY.search(proc.stdout + proc.stderr)) == ("--verbose" in args), proc.stdout + proc.stderr


ASK_WHAT_WAS_BUILT = """
import os, sys
from horovod.common import util
if sys.argv[1] == "answers":
    print(util.extension_available("tensorflow", verbose=True), util.gloo_built(True), util.mpi_built(True))
else:  # one question: each import of TensorFlow takes seconds
    util._op_library = (lambda name: 1 / 0) if sys.argv[1] == "raises" else (lambda name: os.abort())
    print(util.gloo_built(verbose=True))
"""


def imported(stderr: str) -> set[str]:
    """The modules ``python -X importtime`` says were imported, in this process and its forked children."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("op_library", ["answers", "raises", "dies"])
def test_horovodrun_asks_the_op_library_what_was_built_and_imports_tensorflow_only_where_it_cannot(op_library):
    # horovodrun asks this before every job (and --check-build for each line it prints). Horovod as
    # we build it asks the TensorFlow extension's op library alone, in a forked child, not an import
    # of TensorFlow (seconds); where that child cannot answer, the import answers as it always did.
    proc = run([sys.executable, "-X", "importtime", "-c", ASK_WHAT_WAS_BUILT, op_library], timeout=120)
    assert proc.returncode == 0, proc.stderr
    answers = [line for line in proc.stdout.splitlines() if not line.startswith(("Checking", "Extension", "Its"))]
    assert answers == (["True True True"] if op_library == "answers" else ["True"]), proc.stdout + proc.stderr
    modules = imported(proc.stderr)
    assert "horovod.common.basics" in modules, proc.stderr
    assert ("tensorflow" in modules) == (op_library != "answers"), sorted(modules)
