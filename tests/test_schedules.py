import pytest

from hvd_train.compat import keras
from hvd_train.schedules import WarmupSchedule


def lr(schedule, step):
    return float(schedule(step))


def test_warmup_goes_linearly_from_one_worker_rate_to_scaled_rate():
    s = WarmupSchedule(initial_lr=0.1, peak_lr=0.8, warmup_steps=10, total_steps=100, decay="constant")
    assert lr(s, 0) == pytest.approx(0.1)
    assert lr(s, 5) == pytest.approx(0.45)
    assert lr(s, 10) == pytest.approx(0.8)
    assert lr(s, 99) == pytest.approx(0.8)


def test_cosine_reaches_zero_at_the_end():
    s = WarmupSchedule(0.1, 0.8, warmup_steps=10, total_steps=110, decay="cosine")
    assert lr(s, 10) == pytest.approx(0.8)
    assert lr(s, 60) == pytest.approx(0.4, rel=1e-5)
    assert lr(s, 110) == pytest.approx(0.0, abs=1e-7)


def test_step_drops_every_period():
    s = WarmupSchedule(0.1, 1.0, warmup_steps=0, total_steps=100, decay="step", drop_factor=0.5, drop_period_steps=20)
    assert [lr(s, t) for t in (0, 19, 20, 39, 40)] == pytest.approx([1.0, 1.0, 0.5, 0.5, 0.25])


def test_config_roundtrip_and_optimizer_rebuild():
    s = WarmupSchedule(0.1, 0.8, 10, 100, decay="step", drop_factor=0.3, drop_period_steps=7)
    again = WarmupSchedule.from_config(s.get_config())
    assert [lr(again, t) for t in (0, 5, 50)] == [lr(s, t) for t in (0, 5, 50)]
    # Horovod's DistributedOptimizer rebuilds the optimizer from its config.
    opt = keras.optimizers.SGD(learning_rate=s, momentum=0.9)
    rebuilt = keras.optimizers.SGD.from_config(opt.get_config())
    assert isinstance(rebuilt._learning_rate, WarmupSchedule)
    assert float(rebuilt._learning_rate(5)) == pytest.approx(lr(s, 5))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"total_steps": 0}, "`total_steps` must be > 0. Received: total_steps=0"),
        ({"warmup_steps": -1}, "`warmup_steps` must be >= 0"),
        ({"decay": "linear"}, "`decay` must be cosine, step or constant"),
    ],
)
def test_bad_arguments(kwargs, message):
    args = {"initial_lr": 0.1, "peak_lr": 0.2, "warmup_steps": 1, "total_steps": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        WarmupSchedule(**args)
