"""``hvd-train plan``: the scaling model, its inputs, and the link measurement."""

import json

import pytest

from hvd_train.errors import UserError
from hvd_train.perf import planner

from conftest import HVD_TRAIN, cli, launch, output_of, read_json

GBIT = 1e9 / 8


def setup(**changes):
    values = dict(
        step_seconds=0.5,
        batch=32,
        gradient_bytes=100e6,
        intra=planner.Link(10e9, 10e-6),
        inter=planner.Link(25 * GBIT, 50e-6),
        workers_per_host=4,
        fusion_bytes=64 * 2**20,
        cycle_seconds=0.001,
        overlap=1.0,
    )
    values.update(changes)
    return planner.Setup(**values)


def test_ring_allreduce_time_follows_the_textbook_formula():
    link = planner.Link(1e9, 1e-4)
    # Two workers, one buffer: S/B + 2 alpha + one cycle.
    assert planner.ring_allreduce_seconds(50e6, 2, link, 64 * 2**20, 0.001) == pytest.approx(0.05 + 2e-4 + 0.001)
    # Eight workers, 100 MB in two 64 MB buffers: 2*7/8*S/B + 2 * (2*7*alpha + cycle).
    expected = 2 * 7 / 8 * 0.1 + 2 * (14e-4 + 0.001)
    assert planner.ring_allreduce_seconds(100e6, 8, link, 64 * 2**20, 0.001) == pytest.approx(expected)
    assert planner.ring_allreduce_seconds(100e6, 1, link, 64 * 2**20, 0.001) == 0


def test_predictions_one_host_then_many():
    s = setup()
    one, four, eight = (planner.predict(s, n) for n in (1, 4, 8))
    assert one.efficiency == 1 and one.bottleneck == "compute" and one.images_per_sec == pytest.approx(64)
    assert four.hosts == 1 and eight.hosts == 2
    # Between hosts the allreduce is on the slower link.
    assert eight.comm_seconds > four.comm_seconds
    assert (eight.global_batch, eight.lr) == (256, pytest.approx(0.08))


def test_network_bound_when_the_allreduce_outlasts_the_backward_pass():
    s = setup(inter=planner.Link(0.1 * GBIT, 1e-3), overlap=0.5)
    p = planner.predict(s, 8)
    hidden = 0.5 * 2 / 3 * 0.5
    assert p.bottleneck == "network"
    assert p.step_seconds == pytest.approx(0.5 + p.comm_seconds - hidden)
    assert p.efficiency == pytest.approx(0.5 / p.step_seconds)
    low, high = p.step_range
    assert low == pytest.approx(p.comm_seconds) and high == pytest.approx(0.5 + p.comm_seconds)
    # With no overlap at all (CPUs), the whole allreduce adds to the step.
    assert planner.predict(setup(overlap=0.0), 4).step_seconds == pytest.approx(
        0.5 + planner.predict(s, 4).comm_seconds
    )


def test_input_bound_when_the_pipeline_feeds_less_than_the_step_takes():
    p = planner.predict(setup(input_rate=40.0), 4)
    assert p.bottleneck == "input" and p.images_per_sec == pytest.approx(4 * 40)


def test_a_measured_link_is_recovered_from_its_allreduce_times():
    link = planner.Link(2e9, 2e-5)
    sizes = [4e3 * 4**k for k in range(8)]
    times = [planner.ring_allreduce_seconds(s, 4, link, 1e12, 0.001) for s in sizes]
    fitted = planner.fit_link(sizes, times, 4, cycle=0.001)
    assert fitted.bandwidth == pytest.approx(2e9, rel=1e-6) and fitted.latency == pytest.approx(2e-5, rel=1e-6)


@pytest.mark.parametrize(
    "text, value", [("25Gbit", 25 * GBIT), ("100Mbit/s", 100e6 / 8), ("12.5GB/s", 12.5e9), ("3e9", 3e9)]
)
def test_bandwidths(text, value):
    assert planner.parse_bandwidth(text, "--x") == pytest.approx(value)


def test_bad_values_are_clear_errors():
    with pytest.raises(UserError, match="--inter-bandwidth '0Gbit': a bandwidth must be > 0"):
        planner.parse_bandwidth("0Gbit", "--inter-bandwidth")
    with pytest.raises(UserError, match="not a bandwidth"):
        planner.parse_bandwidth("fast", "--intra-bandwidth")
    with pytest.raises(UserError, match="latency"):
        planner.parse_latency("-1ms", "--inter-latency")
    with pytest.raises(UserError, match="bandwidth must be > 0"):
        planner.predict(setup(inter=planner.Link(0, 1e-5)), 8)
    with pytest.raises(UserError, match="--batch-size must be a whole number >= 1"):
        planner.predict(setup(batch=0), 2)


def head_costs(classes, workers=2, parallel=2, batch=32, per_host=8):
    from hvd_train.perf import head_plan

    head = head_plan.Head(classes, 256, batch)
    intra, inter = planner.Link(1.1e9, 0.0), planner.Link(25 * GBIT, 50e-6)
    data_link, group_link, peer_link = head_plan.links(workers, parallel, per_host, intra, inter)
    data = head_plan.data_parallel(head, workers, data_link, 128 * 2**20, 0.001)
    split = head_plan.sharded(head, workers, parallel, group_link, peer_link, 128 * 2**20, 0.001)
    crossing = head_plan.crossover(head, workers, parallel, per_host, intra, inter, 128 * 2**20, 0.001)
    return data, split, crossing


def test_the_sharded_head_sends_what_its_group_needs_and_the_data_parallel_one_its_classes():
    (data_k, split_k, _), (data_m, split_m, _) = head_costs(1000), head_costs(1_000_000)
    assert split_k.wire_bytes == split_m.wire_bytes  # one group: features and partial sums, whatever the classes
    assert head_costs(1000, batch=64)[1].wire_bytes == pytest.approx(2 * split_k.wire_bytes)  # ... by the rows
    assert data_m.wire_bytes / data_k.wire_bytes == pytest.approx(1000, rel=0.01)
    # Per rank: half the head's weights, gradients and momentum; as many logits (twice the rows, half the classes).
    assert data_m.memory_bytes - split_m.memory_bytes == pytest.approx(4 * 257 * 500_000 * 3)
    # Two groups: each shard's gradients are also averaged over its peers.
    assert head_costs(1_000_000, workers=4)[1].wire_bytes > split_m.wire_bytes + 4 * 256 * 500_000


@pytest.mark.parametrize("workers, per_host", [(2, 8), (16, 8), (64, 8)])
def test_the_crossover_is_where_the_sharded_head_starts_to_communicate_less_time(workers, per_host):
    crossing = head_costs(1000, workers=workers, per_host=per_host)[2]
    below, at = (
        head_costs(int(crossing * 0.98), workers, per_host=per_host),
        head_costs(crossing, workers, per_host=per_host),
    )
    assert below[1].seconds >= below[0].seconds and at[1].seconds < at[0].seconds
    assert head_costs(1000, workers=workers, batch=256, per_host=per_host)[2] > crossing  # more rows to gather


def test_plan_command_prints_a_table_and_writes_json(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {"batch_size": 32}, "results": {"synthetic": {"per_worker": 80.0}}}))
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "MobileNetV2", "--classes", "10", "--bench", bench, "--batch-size", "32"]
    more = ["--head-parallel", "2"]  # the head's two layouts: every worker count groups of 2 divide, not 1
    proc = cli([*args, "--workers", "1,2,16", "--inter-bandwidth", "1Gbit", "--overlap", "0", "--json", out, *more])
    assert proc.returncode == 0, output_of(proc)
    heads = read_json(out)["head"]
    assert [h["workers"] for h in heads] == [2, 16] and all(h["use"] == "data" for h in heads)  # 10 classes
    assert all(h["crossover"] > 10 and h["sharded"]["memory_bytes"] < h["data"]["memory_bytes"] for h in heads)
    assert "x 1,280 features" in proc.stdout  # MobileNetV2's head, read from the model
    rows = read_json(out)["rows"]
    assert [r["workers"] for r in rows] == [1, 2, 16] and rows[0]["efficiency"] == 1
    assert (
        rows[2]["hosts"] == 2 and rows[2]["bottleneck"] == "network" and rows[2]["efficiency"] < rows[1]["efficiency"]
    )
    assert read_json(out)["params"] > 2_000_000  # MobileNetV2 without its top, a 10-class head
    assert "images/s" in proc.stdout and "network" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "ResNet5O", "--step-time", "1"], "unknown model 'ResNet5O'"),
        (["--step-time", "1", "--batch-size", "0"], "--batch-size"),
        (["--step-time", "1", "--inter-bandwidth", "0"], "a bandwidth must be > 0"),
        (["--step-time", "1", "--workers", "0,2"], "--workers '0,2'"),
        ([], "give one worker's speed"),
        (["--step-time", "1", "--head-parallel", "1"], "--head-parallel 1: give the workers of one group"),
    ],
)
def test_plan_refuses_what_it_cannot_plan(args, message):
    proc = cli(["plan", "--params", "1000", *args])
    assert proc.returncode == 2, output_of(proc)
    assert message in proc.stderr, output_of(proc)


@pytest.mark.multiprocess
def test_measure_link_under_horovodrun(tmp_path):
    out = tmp_path / "link.json"
    proc = launch("horovodrun-gloo", 2, [*HVD_TRAIN, "plan", "--measure-link", "--json", out], timeout=300)
    assert proc.returncode == 0, output_of(proc)
    link = read_json(out)
    assert link["workers"] == 2 and link["hosts"] == 1 and link["bandwidth"] > 1e6 and link["latency"] >= 0
    assert "--intra-bandwidth" in proc.stdout
    alone = cli(["plan", "--measure-link"])
    assert alone.returncode == 2 and "at least 2 ranks" in alone.stderr


def test_workers_of_one_host_cannot_step_faster_than_the_full_host_lets_them():
    s = setup(loaded_step_seconds=0.7, workers_per_host=2, intra=planner.Link(100e9, 0))
    one, two, four = (planner.predict(s, n) for n in (1, 2, 4))
    assert one.step_seconds == 0.5 and one.efficiency == 1
    assert two.step_seconds == pytest.approx(0.7) and two.bottleneck == "host"
    assert two.efficiency == pytest.approx(0.5 / 0.7)
    slow = planner.predict(setup(loaded_step_seconds=0.7, workers_per_host=1, inter=planner.Link(0.1 * GBIT, 0)), 2)
    # One worker per host: no sharing; the network sets the pace.
    assert slow.bottleneck == "network" and slow.step_seconds > 0.7
