import pytest

from hvd_train.model.schedules import WarmupSchedule


def test_warmup_goes_linearly_from_one_worker_rate_to_scaled_rate():
    s = WarmupSchedule(initial_lr=0.1, peak_lr=0.8, warmup_epochs=2, total_epochs=10, decay="constant")
    assert s(0) == pytest.approx(0.1)
    assert s(1) == pytest.approx(0.45)
    assert s(2) == pytest.approx(0.8)
    assert s(9.9) == pytest.approx(0.8)


def test_the_rate_is_a_function_of_images_seen_not_of_steps():
    # An epoch of 1000 images: 10 steps of 100 images, or 20 of 50, reach the same rates.
    s = WarmupSchedule(0.1, 0.8, warmup_epochs=1, total_epochs=4, decay="cosine")
    big = [s(k * 100 / 1000) for k in range(0, 11)]
    small = [s(k * 50 / 1000) for k in range(0, 21, 2)]
    assert big == pytest.approx(small)


def test_cosine_reaches_zero_at_the_end():
    s = WarmupSchedule(0.1, 0.8, warmup_epochs=1, total_epochs=11, decay="cosine")
    assert s(1) == pytest.approx(0.8)
    assert s(6) == pytest.approx(0.4, rel=1e-9)
    assert s(11) == pytest.approx(0.0, abs=1e-12)


def test_step_drops_every_period():
    s = WarmupSchedule(0.1, 1.0, warmup_epochs=0, total_epochs=10, decay="step", drop_factor=0.5, drop_period_epochs=2)
    assert [s(t) for t in (0, 1.99, 2, 3.9, 4)] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25])
    # Sums of fractional epochs that land on a period drop exactly there.
    assert s(sum([0.2] * 10)) == pytest.approx(0.5)


def test_config_roundtrip():
    s = WarmupSchedule(0.1, 0.8, 1.5, 10, decay="step", drop_factor=0.3, drop_period_epochs=3)
    again = WarmupSchedule.from_config(s.get_config())
    assert [again(t) for t in (0, 0.7, 5)] == [s(t) for t in (0, 0.7, 5)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"total_epochs": 0}, "`total_epochs` must be > 0. Received: total_epochs=0"),
        ({"warmup_epochs": -1}, "`warmup_epochs` must be >= 0"),
        ({"decay": "linear"}, "`decay` must be cosine, step or constant"),
        ({"drop_period_epochs": 0}, "`drop_period_epochs` must be > 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = {"initial_lr": 0.1, "peak_lr": 0.2, "warmup_epochs": 1, "total_epochs": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        WarmupSchedule(**args)
