"""Multi-label held-out scores: the same on any number of ranks as on the images all together, and as defined."""

import threading

import numpy as np
import pytest

from hvd_train.results import multilabel


def reference_ap(scores, truth):
    """Average precision as scikit-learn defines it, from every distinct score (not only the positives'):
    the sum over thresholds, descending, of (recall gained) * precision."""
    scores = np.nan_to_num(np.asarray(scores, np.float64), nan=-np.inf)
    truth = np.asarray(truth, bool)
    if not truth.any():
        return float("nan")
    ap, recall_before = 0.0, 0.0
    for t in np.unique(scores)[::-1]:
        chosen = scores >= t
        recall = truth[chosen].sum() / truth.sum()
        ap += (recall - recall_before) * truth[chosen].sum() / chosen.sum()
        recall_before = recall
    return ap


class World:
    """``size`` ranks as threads, with an all-gather and an all-reduce that meet at a barrier."""

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots = [None] * size

    def collectives(self, rank):
        def gather(obj):
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            found = list(self.slots)
            self.barrier.wait()
            return found

        def reduce_sum(array):
            return np.sum(gather(np.asarray(array)), axis=0)

        return gather, reduce_sum

    def run(self, fn, parts):
        results = [None] * self.size

        def one(rank):
            results[rank] = fn(*parts[rank], *self.collectives(rank))

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        return results


def test_a_documented_case():
    """scikit-learn's own example of average_precision_score: 0.83 (to two places)."""
    ap = multilabel.average_precisions(
        np.array([[0.1], [0.4], [0.35], [0.8]]), np.array([[0], [0], [1], [1]]), *multilabel.one_rank()
    )
    assert round(float(ap[0]), 2) == 0.83 and ap[0] == pytest.approx(reference_ap([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_rank_gets_the_scores_of_all_images_together(size):
    """Scores with ties and a NaN, classes with no positive, a rank with no image: per-class average precision and
    the counts at 0.5 equal those of all images at once, on every rank."""
    rng = np.random.default_rng(size)
    n, classes = 200, 6
    logits = np.round(rng.normal(size=(n, classes)), 1).astype(np.float32)  # one decimal: many ties
    labels = (rng.random((n, classes)) < [0.3, 0.05, 0.5, 0.0, 0.9, 0.2]).astype(np.int8)
    labels[:, 0] |= (logits[:, 0] > 0.8).astype(np.int8)  # a class the scores tell apart
    logits[7, 2] = np.nan
    cuts = [0, 0, 120, n][: size + 1] if size == 3 else np.linspace(0, n, size + 1).astype(int)
    parts = [(logits[a:b], labels[a:b]) for a, b in zip(cuts, cuts[1:])]
    world = World(size)
    aps = world.run(multilabel.average_precisions, parts)
    expected = [reference_ap(logits[:, c], labels[:, c]) for c in range(classes)]
    for ap in aps:
        np.testing.assert_allclose(ap, expected, rtol=0, atol=1e-12)
        assert np.isnan(ap[3]) and not np.isnan(ap).all()
    found = world.run(lambda x, y, gather, reduce_sum: multilabel.counts(x, y, 0.5, reduce_sum), parts)
    predicted = np.nan_to_num(logits, nan=-np.inf) >= 0
    truth = labels > 0
    for got in found:
        np.testing.assert_array_equal(got.tp, (predicted & truth).sum(0))
        np.testing.assert_array_equal(got.fp, (predicted & ~truth).sum(0))
        np.testing.assert_array_equal(got.fn, (~predicted & truth).sum(0))
    assert np.isnan(found[0].recall()[3]) and found[0].micro_f1() == pytest.approx(
        2 * (predicted & truth).sum() / (2 * (predicted & truth).sum() + (predicted ^ truth).sum())
    )


def test_the_threshold_is_a_probability_compared_on_the_logits():
    logits = np.array([[np.log(0.7 / 0.3)], [np.log(0.69 / 0.31)], [-3.0]], np.float32)
    got = multilabel.counts(logits, np.array([[1], [1], [0]]), 0.7, multilabel.one_rank()[1])
    assert (got.tp.tolist(), got.fp.tolist(), got.fn.tolist()) == ([1], [0], [1])
