"""The sharded head in an elastic job: the G a new world can have, what a commit keeps, the re-split after a reset.

The elastic job itself, with workers killed and added for real, is in test_elastic.py.
"""

import sys
from pathlib import Path

import pytest

from hvd_train.distributed.groups import nearest_parallel, shard_range
from hvd_train.errors import UserError
from hvd_train.training.elastic_head import Held, Plan, plan

from conftest import launch, output_of, read_json

LAUNCHED = Path(__file__).parent / "launched"


@pytest.mark.parametrize(
    "asked, size, classes, chosen",
    [
        (2, 4, 10, 2),  # it fits
        (2, 3, 10, 3),  # 1 would put the whole head on every worker: the next that divides, up
        (4, 6, 10, 6),
        (3, 4, 10, 4),
        (4, 2, 10, 2),  # fewer workers than G: one group of them all
        (2, 1, 10, 1),  # one worker left: the whole head
        (8, 8, 5, 4),  # no more than the classes
        (2, 5, 3, 1),  # 5 workers, 3 classes: groups of one
    ],
)
def test_a_new_world_gets_the_nearest_g_that_divides_it_with_shards_no_larger(asked, size, classes, chosen):
    assert nearest_parallel(asked, size, classes) == chosen


def held(progress, shards, size=4, parallel=4, whole=True):
    return Held(progress, size, parallel, tuple(shards), whole)


def test_the_plan_takes_the_latest_commit_held_whole_and_the_first_holder_of_each_shard():
    # Rank 0 is new; ranks 1-2 committed at 200 images (rank 3 did not get that far: its commit is at 100).
    holders = [(), (held(200, [1, 2]),), (held(200, [2, 3]),), (held(100, [3, 0]),)]
    # 200 lacks shard 0 (its holders, old ranks 0 and 3, are the new worker and one behind): the job would go on
    # from 100, which rank 3 holds... only in part: shards 3 and 0. Neither is whole.
    with pytest.raises(UserError) as refused:
        plan(holders)
    assert "shard(s) 0 of the head" in str(refused.value) and "\n" not in str(refused.value)
    holders[0] = (held(200, [0, 1]),)
    assert plan(holders) == Plan(0, (200, 4, 4), {0: 0, 1: 0, 2: 1, 3: 2})
    # An older commit held whole wins over a newer one that is not.
    older = [(held(300, [0, 1]),), (held(100, [0, 1], parallel=2),), (held(100, [0, 1], parallel=2),), ()]
    assert plan(older) == Plan(1, (100, 4, 2), {0: 1, 1: 1})


def test_a_commit_some_ranks_made_and_others_only_exchanged_goes_on_from_those_that_made_it():
    # Rank 3 was lost during the commit at 200: ranks 0 and 1 agreed on it, rank 2 only got its part (it failed
    # the agreement), and still offers it beside its commit at 100. The commit at 200 is whole with rank 2's part.
    holders = [
        (held(200, [0, 1]),),
        (held(200, [1, 2]),),
        (held(100, [0, 1], parallel=2), held(200, [2, 3], whole=False)),
    ]
    assert plan(holders) == Plan(0, (200, 4, 4), {0: 0, 1: 0, 2: 1, 3: 2})
    # A commit no rank holds whole (only its head's parts) is no commit to go on from.
    assert plan([(held(100, [0, 1], parallel=2), held(200, [0, 1, 2, 3], whole=False))]).key == (100, 4, 2)
    # A reset's own commit (3 workers now) that failed at its agreement on every rank: its head's parts are whole
    # together, and the rest of it is every commit's at those images (rank 0's, in the old layout).
    after = [(held(200, [0, 1]),), (held(200, [0, 1], 3, 3, whole=False),), (held(200, [1, 2], 3, 3, whole=False),)]
    assert plan(after) == Plan(0, (200, 3, 3), {0: 1, 1: 1, 2: 2})
    # One rank holds both the last commit and the one it was making, of the same images and layout, as another
    # rank of it (a worker replaced): it sends the shards of both.
    assert plan([(held(10, [0, 1]), held(10, [2, 3], whole=False)), (), (), ()]).sources == {0: 0, 1: 0, 2: 0, 3: 0}
    # The same images in two layouts (a reset's own commit, made in some groups only): never mixed.
    mixed = [(held(200, [0, 1]),), (held(200, [1, 2], size=3, parallel=3),), (held(200, [3, 0]),)]
    with pytest.raises(UserError) as refused:
        plan(mixed)
    assert "shard(s) 2 of the head" in str(refused.value)


@pytest.mark.multiprocess
def test_a_commit_keeps_the_next_shard_and_the_head_is_re_split_from_any_survivors(tmp_path):
    """Four ranks: a head of 11 classes committed in groups of 2 and of 4, re-split into groups of 1, 2 and 4
    after losses of one, two and three workers (as new, empty workers), to the bit, and after a commit a lost
    worker cut short; two neighbours lost from the group of 4 leave a shard no one holds, refused in one line."""
    proc = launch("horovodrun-gloo", 4, [sys.executable, LAUNCHED / "elastic_head_check.py", tmp_path])
    assert proc.returncode == 0, output_of(proc)
    for rank in range(4):
        results = read_json(tmp_path / f"rank{rank}.json")
        for old in (2, 4):
            shard = rank % old
            assert results[f"G={old}"] == {"next": 0.0, "held": sorted({shard, (shard + 1) % old})}
        splits = {key: r for key, r in results.items() if "G'=" in key}
        assert len(splits) == 3 * (4 + 2 + 1 + 1), sorted(results)
        for key, r in splits.items():
            assert r["difference"] == 0.0, (rank, key, r)
        # Shard 0 of the group of 4, its own holder lost, comes from rank 3's copy.
        assert splits["G=4,lost=[0],G'=2"]["sources"] == {"0": 3, "1": 1, "2": 1, "3": 2}
        # Rank 3 lost during the commit of the group of 4: the commit two ranks made, with rank 2's part of it.
        for g in (1, 2, 4):
            assert splits[f"partial,G'={g}"]["key"] == [200, 4, 4] and splits[f"partial,G'={g}"]["root"] == 0
        assert splits["two of one rank,G'=2"]["sources"] == {"0": 0, "1": 0, "2": 0, "3": 0}
        refused = results["G=4,lost=[0, 1]"]["refused"]
        assert refused.startswith("elastic: every worker that held shard(s) 1 of the head") and "\n" not in refused
    assert [shard_range(11, 2, j) for j in range(2)] == [(0, 5), (5, 6)]  # the uneven shards the check relies on
