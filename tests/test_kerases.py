"""Both Kerases (HVD_TRAIN_KERAS=2, tf-keras; =3, Keras 3 with TensorFlow): the switch, Horovod's own Keras
test cases against our step on each, and what does not cross from one Keras to the other."""

import json
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import BIN, HVD_TRAIN, TINY, launch, launcher_command, output_of, read_json, run, write_images

LAUNCHED = Path(__file__).parent / "launched"
KERASES = ["2", "3"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("keras", KERASES)
def test_horovods_keras_cases_hold_for_our_step(keras, tmp_path):
    """Ported from Horovod's test_tensorflow2_keras.py: gradient aggregation exact (test_gradient_aggregation),
    sparse gradients as dense (test_sparse_as_dense), a broadcast that meets although the ranks' Keras named
    their variables otherwise."""
    proc = launch("horovodrun-gloo", 2, [sys.executable, LAUNCHED / "keras_cases.py", tmp_path], HVD_TRAIN_KERAS=keras)
    assert proc.returncode == 0, output_of(proc)
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in (0, 1)]
    assert [r["keras"] for r in ranks] == [int(keras)] * 2
    # Broadcast: rank 1 started from other weights, and holds rank 0's after it.
    assert ranks[0]["broadcast"] == ranks[1]["broadcast"]
    # Aggregation: every pass counts, the weights move on every 4th alone, to the mean of the cycle's
    # 2 ranks x 4 batches, alike on both ranks.
    for rank in ranks:
        passes = rank["aggregation"]
        assert [p["iterations"] for p in passes] == list(range(1, 11))
        assert [p["moved"] for p in passes] == [(i + 1) % 4 == 0 for i in range(10)]
        assert all(p["off"] < 1e-6 for i, p in enumerate(passes) if (i + 1) % 4 == 0), passes
        assert all(p["off"] > 1e-4 for i, p in enumerate(passes) if (i + 1) % 4), "the reference is not trivial"
    assert [p["digest"] for p in ranks[0]["aggregation"]] == [p["digest"] for p in ranks[1]["aggregation"]]
    # Sparse: gather's gradient rows [1, 0, 1] x (rank + 1), averaged as a dense tensor.
    assert ranks[0]["sparse"] == ranks[1]["sparse"] == [1.5, 0.0, 1.5]


def hvd_train(args, keras, **env):
    return run([*HVD_TRAIN, *args], timeout=300, HVD_TRAIN_KERAS=keras, **env)


def test_the_switch_refuses_what_it_cannot_run_in_one_line(tmp_path):
    bad = hvd_train(["models"], "4")
    assert bad.returncode == 2 and "HVD_TRAIN_KERAS='4': use 2 (tf-keras) or 3" in bad.stderr, output_of(bad)
    jax = hvd_train(["models"], "3", KERAS_BACKEND="jax")
    assert jax.returncode == 2 and "KERAS_BACKEND=jax" in jax.stderr and "Traceback" not in jax.stderr, output_of(jax)
    # A Keras 2 parent's TF_USE_LEGACY_KERAS=1 does not hold a Keras 3 child back (HVD_TRAIN_KERAS decides).
    listed = hvd_train(["models"], "3", TF_USE_LEGACY_KERAS="1")
    assert listed.returncode == 0 and listed.stdout.startswith("Keras 3 (HVD_TRAIN_KERAS=3)"), output_of(listed)
    assert "MobileNetV2" in listed.stdout and "Keras 2 only (HVD_TRAIN_KERAS=2): RegNetX002" in listed.stdout
    # Unset (or empty): Keras 3 on the TensorFlow it is tested on, tf-keras on an older stack (2.18).
    unset = hvd_train(["models"], "")
    assert unset.returncode == 0 and unset.stdout.startswith("Keras 3 (HVD_TRAIN_KERAS=3)"), output_of(unset)
    from hvd_train.compat import default_keras

    versions = ("2.21.0", "2.22.0rc1", "3.0.0", "2.18.1", "2.16.2", None)
    assert [default_keras(v) for v in versions] == ["3", "3", "3", "2", "2", "3"]
    dropped = hvd_train(["train", "--data", "x", "--output", "y", "--model", "resnet_rs50"], "3")
    assert dropped.returncode == 2, output_of(dropped)
    assert "--model ResNetRS50 is one of Keras 2's applications that Keras 3 dropped" in dropped.stderr


@pytest.mark.multiprocess
def test_ranks_on_two_kerases_are_refused_on_every_rank(tmp_path):
    data = write_images(tmp_path / "data", {"a": 4, "b": 4})
    # Rank 0 on Keras 2, rank 1 on Keras 3.
    program = ["sh", "-c", 'HVD_TRAIN_KERAS=$((2 + HOROVOD_RANK)) exec "$0" "$@"', *HVD_TRAIN, "train"]
    program += ["--data", data, "--output", tmp_path / "out", *TINY]
    proc = run([*launcher_command("horovodrun-gloo", 2), *program], timeout=300)
    assert proc.returncode != 0, output_of(proc)
    assert "the ranks of this job run different Kerases (Keras 2 on rank(s) 0; Keras 3 on rank(s) 1)" in proc.stderr
    assert "<stderr>:Traceback" not in proc.stderr, output_of(proc)  # no rank's (horovodrun prints its own)


@pytest.fixture(scope="module")
def keras3_run(tmp_path_factory):
    """One epoch of one process under Keras 3."""
    root = tmp_path_factory.mktemp("keras3")
    data = write_images(root / "data", {"a": 12, "b": 12, "c": 12})
    proc = hvd_train(["train", "--data", data, "--output", root / "run", *TINY, "--val-split", "0.25"], "3")
    assert proc.returncode == 0, output_of(proc)
    return data, root / "run"


def test_a_keras3_run_is_refused_by_keras2_in_one_line_and_loads_in_plain_keras3(keras3_run, tmp_path):
    data, out = keras3_run
    with zipfile.ZipFile(out / "model.keras") as archive:
        assert json.loads(archive.read("metadata.json"))["keras_version"].startswith("3.")
    resumed = hvd_train(["train", "--data", data, "--output", out, *TINY, "--val-split", "0.25", "--epochs", "2"], "2")
    assert resumed.returncode == 2, output_of(resumed)
    assert "was written under Keras 3, and this run is Keras 2" in resumed.stderr
    assert "resume with HVD_TRAIN_KERAS=3, or start over in another --output" in resumed.stderr
    # A checkpoint of before the Keras was recorded is tf-keras', the default then: Keras 3 says so.
    from hvd_train.training import checkpoints

    old = tmp_path / "old"
    shutil.copytree(out, old)
    for state in old.glob("checkpoints/*/state.json"):
        body = {k: v for k, v in read_json(state).items() if k != "keras"}
        state.write_text(json.dumps({**body, "checksum": checkpoints._body_checksum(body)}))
    resumed = hvd_train(["train", "--data", data, "--output", old, *TINY, "--val-split", "0.25", "--epochs", "2"], "3")
    assert resumed.returncode == 2, output_of(resumed)
    assert "written under tf-keras (Keras 2, hvd_train's default before Keras 3)" in resumed.stderr
    assert "resume with HVD_TRAIN_KERAS=2, or start over" in resumed.stderr
    scored = hvd_train(["evaluate", "--model-dir", out, "--data", data], "2")
    assert scored.returncode == 2 and "was saved by Keras 3, and this process runs Keras 2" in scored.stderr, output_of(
        scored
    )
    # The same run's model, in an environment of Keras 3 alone (no hvd_train): it loads and answers.
    plain = run(
        [
            BIN / "python",
            "-c",
            "import sys, numpy, keras; m = keras.models.load_model(sys.argv[1], compile=False); "
            "print(keras.__version__, m(numpy.zeros((1, 32, 32, 3), 'float32')).shape)",
            out / "model.keras",
        ],
        timeout=300,
        KERAS_BACKEND="tensorflow",
        TF_USE_LEGACY_KERAS="0",
        PYTHONPATH="",
    )
    assert plain.returncode == 0 and plain.stdout.startswith("3.") and "(1, 3)" in plain.stdout, output_of(plain)
