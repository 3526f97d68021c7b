"""TensorFlow's import: its known noise kept out of stderr, everything else let through, even when it crashes.

A stand-in ``tensorflow`` package, first on the path, writes to file
descriptor 2 as TensorFlow's C++ does (noise and real words), then fails the
way a broken install fails: a Python ImportError, or an abort in native code
(as TensorFlow's CPU feature check does on a machine without AVX).
"""

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


def test_the_command_line_is_built_without_loading_tensorflow():
    # `hvd-train --help` and every subcommand's parser: TensorFlow loads only where a command needs it,
    # after hvd_train.compat (Keras 2 in place, the import's noise sieved).
    code = "import sys; from hvd_train import cli; cli.build_parser(); print('tensorflow' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr


def test_a_command_that_loads_tensorflow_is_quiet_too():
    proc = subprocess.run([sys.executable, "-m", "hvd_train", "models"], capture_output=True, text=True, timeout=120)
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
