"""Epoch plans: equal steps per rank, every image per epoch, exact continuation, re-dealing."""

import collections

import numpy as np
import pytest

from hvd_train.data.sharding import Segment, Strided, count, epoch_order, from_intervals, to_intervals
from hvd_train.training.state import TrainState

STRIDED = Strided()


def streams(segment, layout=STRIDED, start=0):
    return [segment.stream(layout, r, start) for r in range(segment.size)]


@pytest.mark.parametrize("n, size, batch, accum", [(23, 1, 4, 1), (23, 2, 4, 1), (23, 3, 4, 2), (100, 4, 8, 1)])
def test_equal_steps_and_every_image_at_least_once(n, size, batch, accum):
    seg = Segment.whole(0, n, size, batch, accum)
    per_rank = streams(seg)
    assert seg.steps % accum == 0
    assert all(len(s) == seg.steps * batch for s in per_rank)
    seen = collections.Counter(int(p) for s in per_rank for p in s)
    assert set(seen) == set(range(n))
    assert max(seen.values()) - min(seen.values()) <= 1 + (seg.steps * batch * size) // n


def test_intervals_roundtrip():
    positions = np.array([7, 1, 2, 3, 9, 8, 20])
    assert to_intervals(positions) == ((1, 4), (7, 10), (20, 21))
    assert from_intervals(to_intervals(positions)).tolist() == [1, 2, 3, 7, 8, 9, 20]
    assert count(((1, 4), (7, 10))) == 6 and to_intervals(np.array([], np.int64)) == ()


def test_continuing_a_segment_gives_the_rest_of_each_rank_stream():
    seg = Segment.whole(3, 50, 2, 4)
    for k in range(seg.steps + 1):
        for r, whole in enumerate(streams(seg)):
            assert seg.stream(STRIDED, r, k).tolist() == whole[k * 4 :].tolist()


@pytest.mark.parametrize("sizes", [(2, 3), (3, 1), (2, 3, 1, 4)])
def test_redealing_after_a_change_of_workers_covers_exactly_the_images_left(sizes):
    n, batch = 61, 4
    seg = Segment.whole(0, n, sizes[0], batch)
    consumed = set()
    for new_size in [*sizes[1:], None]:
        steps = max(1, seg.steps // 2) if new_size is not None else seg.steps
        for s in streams(seg):
            consumed.update(int(p) for p in s[: steps * batch])
        left = set(from_intervals(seg.remaining(STRIDED, steps)).tolist())
        assert left == set(range(n)) - consumed, "remaining = exactly what no rank consumed"
        if new_size is None:
            break
        seg = seg.follow_on(STRIDED, steps, new_size, batch)
        assert seg.pending_count == len(left) and seg.done_before == n - len(left)
        assert all(len(s) == seg.steps * batch for s in streams(seg))
    assert consumed == set(range(n))


def test_epoch_orders_differ_and_repeat():
    assert epoch_order(10, 1, 0).tolist() != epoch_order(10, 1, 1).tolist()
    assert epoch_order(10, 1, 0).tolist() == epoch_order(10, 1, 0).tolist()
    assert sorted(epoch_order(10, 1, 5).tolist()) == list(range(10))


def test_state_counts_images_and_epochs():
    state = TrainState(seed=0, world_size=2, batch_size=4, global_batch=8, total=23)
    seg = state.segment()
    assert seg.steps == 3
    for _ in range(seg.steps):
        state.advance()
    assert state.epoch_done and state.samples == 23 and state.images_seen == 23
    assert state.epoch_progress == pytest.approx(1.0)
    state.next_epoch()
    assert (state.epoch, state.samples, state.epoch_steps, state.step) == (1, 0, 0, 3)


def test_state_resize_redeals_the_rest_and_survives_json():
    state = TrainState(seed=0, world_size=2, batch_size=4, global_batch=8, total=41)
    state.advance(2)  # 16 images consumed
    before = state.images_seen
    state.resize(STRIDED, world_size=3, batch_size=4, global_batch=12)
    assert state.segment().pending_count == 41 - 16 and state.segment_steps == 0
    again = TrainState.from_dict(state.to_dict())
    assert again.segment().pending == state.segment().pending and again.images_seen == before
    while not again.epoch_done:
        again.advance()
    assert again.images_seen == 41 and again.epoch_progress == pytest.approx(1.0)
