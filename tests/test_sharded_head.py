"""The classification head split by class over groups of ranks (``--head-parallel``): exactness, bad input."""

import sys
from pathlib import Path

import pytest

from hvd_train.distributed.groups import Layout, check, shard_range
from hvd_train.errors import UserError

from conftest import launch, output_of, read_json

LAUNCHED = Path(__file__).parent / "launched"
CLASSES = 11  # as in the launched check: shards of 5 and 6, or 2, 3, 3 and 3


def test_layout_groups_consecutive_ranks_and_peers_hold_the_same_shard():
    layout = Layout(size=8, parallel=4)
    assert layout.groups == 2 and [layout.group_ranks(g) for g in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.peer_ranks(1) == [1, 5] and (layout.group_of(6), layout.shard_of(6)) == (1, 2)


@pytest.mark.parametrize("classes, parallel", [(11, 2), (11, 4), (1_000_000, 3), (7, 7)])
def test_shards_cover_every_class_once_as_evenly_as_they_can(classes, parallel):
    ranges = [shard_range(classes, parallel, j) for j in range(parallel)]
    assert [first for first, _ in ranges] == [sum(c for _, c in ranges[:j]) for j in range(parallel)]
    assert sum(c for _, c in ranges) == classes and max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


@pytest.mark.parametrize(
    "parallel, size, classes, message",
    [
        (3, 4, 10, "--head-parallel 3 does not divide the 4 workers of this job into groups: use one of 1, 2, 4."),
        (8, 4, 10, "--head-parallel 8 is more than the 4 workers of this job: use at most 4, or start more workers."),
        (4, 4, 3, "--head-parallel 4 is more than the 3 classes of the data"),
        (0, 4, 10, "--head-parallel 0: use a whole number >= 1"),
    ],
)
def test_a_head_that_cannot_be_split_so_is_refused_in_one_line(parallel, size, classes, message):
    with pytest.raises(UserError) as refused:
        check(parallel, size, classes)
    assert str(refused.value).startswith(message) and "\n" not in str(refused.value)


def exact(results: dict, rank: int) -> None:
    for key, r in results.items():
        for name in ("loss", "backbone", "kernel", "bias", "trained_backbone", "trained_kernel", "trained_bias"):
            assert r[name] <= 1e-5, (rank, key, name, r[name])
        assert r["predicted"] == r["argmax"], (rank, key)
        assert r["head_gradient_nonzero"] > 1e-3 and r["moved"] > 1e-3, (rank, key)  # something was compared
        # Held-out scores over all classes: the loss, the best class and the top 5, merged from the shards.
        assert r["score_loss"] <= 1e-5 and r["top1"][0] == r["top1"][1] and r["top5"][0] == r["top5"][1], (rank, key)
        # The head written whole from the shards reads back exactly, and in another layout's shards.
        assert r["read_back"] == 0 and r["resplit"] <= 1e-5, (rank, key)


@pytest.mark.multiprocess
@pytest.mark.parametrize("np_, layouts", [(2, "2"), (4, "2,4")])
def test_the_sharded_head_equals_the_data_parallel_head(tmp_path, np_, layouts):
    """Loss, gradients, predictions and three SGD steps, to 1e-5 relative, one and two groups, with and without
    label smoothing; held-out scores; the trained head gathered into one file and split again."""
    program = [sys.executable, LAUNCHED / "sharded_head_check.py", tmp_path, layouts, "0,0.1"]
    proc = launch("horovodrun-gloo", np_, program)
    assert proc.returncode == 0, output_of(proc)
    ranks = [read_json(tmp_path / f"rank{r}.json") for r in range(np_)]
    for rank, results in enumerate(ranks):
        assert sorted(results) == sorted(f"G={g},s={s}" for g in layouts.split(",") for s in ("0", "0.1"))
        exact(results, rank)
    for g in map(int, layouts.split(",")):  # each group's shards are the whole head
        for group in range(np_ // g):
            shards = [ranks[r][f"G={g},s=0"]["shard"] for r in Layout(np_, g).group_ranks(group)]
            assert shards == [list(shard_range(CLASSES, g, j)) for j in range(g)]


def test_a_head_file_of_other_classes_or_none_is_refused_in_one_line(tmp_path):
    import numpy as np

    from hvd_train.training import head_files

    np.save(head_files.path_of(str(tmp_path), "kernel"), np.zeros((4, 10), np.float32))
    assert head_files.read_columns(str(tmp_path), "kernel", 3, 4, 10).shape == (4, 4)
    for name, classes, message in (("kernel", 12, "holds a head of 10 classes, this run has 12"), ("bias", 10, "")):
        with pytest.raises(UserError) as refused:
            head_files.read_columns(str(tmp_path), name, 0, 5, classes)
        assert message in str(refused.value) and "\n" not in str(refused.value)
