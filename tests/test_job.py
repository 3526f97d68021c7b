"""The numbers a run derives from the configuration and the world size (``training.job.make_plan``)."""

import pytest

from hvd_train import config
from hvd_train.training.job import make_plan


def test_plan_scales_learning_rate_and_pads_steps():
    cfg = config.build(
        {
            "data": {"train": "d", "batch_size": 32},
            "optim": {"base_lr": 0.1, "warmup_epochs": 2},
            "run": {"output": "o", "epochs": 10},
            "horovod": {"grad_accum": 2},
        }
    )
    plan = make_plan(cfg, world_size=4, num_train=1000)
    assert plan.global_batch == 32 * 4 * 2
    assert plan.scaled_lr == pytest.approx(0.1 * 8)
    # ceil(1000 / 128) = 8 batches per rank, already a multiple of grad_accum
    assert plan.steps_per_epoch == 8
    assert plan.steps_per_epoch * 32 * 4 >= 1000
    assert plan.batch_size == 32
    odd = make_plan(cfg, world_size=4, num_train=1100)  # ceil(1100/128) = 9 -> 10
    assert odd.steps_per_epoch == 10


def test_plan_can_keep_the_global_batch_for_another_number_of_workers():
    cfg = config.build({"data": {"train": "d", "batch_size": 32}, "optim": {"base_lr": 0.1}, "run": {"output": "o"}})
    four = make_plan(cfg, world_size=4, num_train=1000)
    two = make_plan(cfg, world_size=2, num_train=1000, global_batch=four.global_batch)
    assert (two.batch_size, two.global_batch) == (64, 128)
    assert two.scaled_lr == pytest.approx(four.scaled_lr)
    # Keeping each worker's batch instead: the global batch and the rate follow the workers.
    assert make_plan(cfg, world_size=2, num_train=1000).scaled_lr == pytest.approx(four.scaled_lr / 2)
    three = make_plan(cfg, world_size=3, num_train=1000, global_batch=128)  # 128 / 3: nearest whole share
    assert three.batch_size == 43 and three.scaled_lr == pytest.approx(0.1 * 129 / 32)
