"""``hvd-train bench`` as one process and under horovodrun / mpirun."""

import pytest

from conftest import HVD_TRAIN, TINY, cli, launch, output_of, read_json

SMALL = [*TINY[:2], "--image-size", "32", "--batch-size", "4", "--warmup-batches", "2"]
SMALL += ["--batches-per-iter", "3", "--iters", "2", "--threads-per-rank", "1"]


def check_result(result, mode, world_size, variants):
    assert result["world_size"] == world_size and result["config"]["mode"] == mode
    assert set(result["results"]) == set(variants)
    for entry in result["results"].values():
        ranks = entry["per_rank"]
        assert [r["rank"] for r in ranks] == list(range(world_size))
        for r in ranks:
            assert 0 < r["min"] <= r["median"] <= r["max"]
        assert entry["total"] == pytest.approx(sum(r["overall"] for r in ranks))


@pytest.mark.multiprocess
def test_synthetic_under_horovodrun_with_a_baseline(tmp_path):
    out = tmp_path / "bench.json"
    program = [*HVD_TRAIN, "bench", "--mode", "synthetic", "--classes", "10", *SMALL, "--baseline", "100"]
    proc = launch("horovodrun-gloo", 2, [*program, "--json", out])
    assert proc.returncode == 0, output_of(proc)
    result = read_json(out)
    check_result(result, "synthetic", 2, ["synthetic"])
    entry = result["results"]["synthetic"]
    assert entry["efficiency"] == pytest.approx(entry["total"] / 200)
    assert "step 6/6" in proc.stdout + proc.stderr, "progress is shown"
    assert "scaling efficiency" in proc.stdout


@pytest.mark.multiprocess
def test_io_under_mpirun_measures_both_decodes(demo_small, tmp_path):
    out = tmp_path / "io.json"
    proc = launch("mpirun", 2, [*HVD_TRAIN, "bench", "--mode", "io", "--data", demo_small, *SMALL, "--json", out])
    assert proc.returncode == 0, output_of(proc)
    result = read_json(out)
    check_result(result, "io", 2, ["fused", "full"])
    assert result["fused_over_full"] > 0 and "fused crop decode / whole decode" in proc.stdout


def test_full_mode_as_one_process(demo_small, tmp_path):
    out = tmp_path / "full.json"
    proc = cli(["bench", "--mode", "full", "--data", demo_small, *SMALL, "--json", out, "--baseline", str(out)])
    assert proc.returncode == 2 and "--baseline" in proc.stderr, "the JSON does not exist yet"
    proc = cli(["bench", "--mode", "full", "--data", demo_small, *SMALL, "--json", out])
    assert proc.returncode == 0, output_of(proc)
    check_result(read_json(out), "full", 1, ["full"])
    again = cli(["bench", "--mode", "full", "--data", demo_small, *SMALL, "--baseline", out])
    assert again.returncode == 0 and "scaling efficiency" in again.stdout, output_of(again)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mode", "io"], "--mode io reads real images: give --data"),
        (["--model", "ResNet5O"], "unknown model 'ResNet5O'"),
        (["--baseline", "fast"], "--baseline 'fast' is neither images/s nor the JSON"),
    ],
)
def test_bad_options_are_one_line_errors(args, message):
    proc = cli(["bench", *args])
    assert proc.returncode == 2, output_of(proc)
    errors = [line for line in proc.stderr.splitlines() if "ERROR error:" in line]
    assert len(errors) == 1 and message in errors[0], output_of(proc)
