"""The learning-rate schedule: the legacy per-epoch cosine with warm restarts bit for bit, the
other shapes against their formulas, positions per epoch and per optimizer step."""

from __future__ import annotations

import math

import pytest
import torch

from epid.config.load import load_config
from epid.training.schedule import Schedule, ScheduleConfig


def cosine_restarts(position: int, base_lr: float, period: int = 10, factor: int = 2, floor: float = 1e-6) -> float:
    """Cosine annealing with warm restarts (periods 10, 20, 40, ... by default), written out."""
    start = 0
    while position >= start + period:
        start, period = start + period, factor * period
    return floor + (base_lr - floor) * (1 + math.cos(math.pi * (position - start) / period)) / 2


def test_the_default_is_torchs_cosine_annealing_with_warm_restarts_per_epoch():
    schedule = Schedule(ScheduleConfig(), 3e-4, steps_per_epoch=7)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=3e-4)
    reference = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=10, T_mult=2, eta_min=1e-6)
    for epoch in range(75):
        for step in (0, 6):  # every step of an epoch has the epoch's rate
            assert schedule.set(optimizer, epoch, step) == pytest.approx(reference.get_last_lr()[0], rel=1e-12)
        optimizer.step()
        reference.step()
    assert schedule.rate(10) == pytest.approx(3e-4) and schedule.rate(30) == pytest.approx(3e-4)  # the restarts


@pytest.mark.parametrize("base_lr, warmup", [(1e-4, 0), (3e-4, 0), (2e-4, 3), (4e-3 * math.sqrt(4 / 128), 2)])
def test_the_default_gives_the_rates_of_the_earlier_lambda_lr_bit_for_bit(base_lr, warmup):
    """Earlier versions stepped torch's LambdaLR once per epoch with the factor rate(epoch) / base."""

    def legacy(epoch: int) -> float:
        if epoch < warmup:
            return base_lr * (epoch + 1) / (warmup + 1)
        return cosine_restarts(epoch - warmup, base_lr)

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: legacy(epoch) / base_lr)
    schedule = Schedule(ScheduleConfig(warmup=warmup), base_lr, steps_per_epoch=5)
    for epoch in range(300):
        assert schedule.rate(epoch) == optimizer.param_groups[0]["lr"], epoch
        optimizer.step()
        lambda_lr.step()


def test_warm_up_is_linear_and_the_decay_starts_at_the_base_rate():
    schedule = Schedule(ScheduleConfig(warmup=3), 1e-3, steps_per_epoch=1)
    assert [schedule.rate(p) for p in range(5)] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3,
                                                                  cosine_restarts(1, 1e-3)])


def test_per_step_positions_count_the_steps_of_the_run():
    config = ScheduleConfig(update="step", warmup=4, restart_period=20, restart_factor=1, min_lr=1e-5, length=100)
    schedule = Schedule(config, 1e-3, steps_per_epoch=10)
    assert schedule.position(0, 3) == 3 and schedule.position(2, 5) == 25
    assert schedule.rate(schedule.position(0, 0)) == pytest.approx(1e-3 / 5)
    assert schedule.rate(schedule.position(0, 4)) == pytest.approx(1e-3)
    for position in range(4, 100):
        assert schedule.rate(position) == pytest.approx(cosine_restarts(position - 4, 1e-3, 20, 1, 1e-5), rel=1e-12)


def test_cosine_and_linear_decay_reach_the_floor_at_the_end_of_the_run():
    cosine = Schedule(ScheduleConfig(decay="cosine", warmup=2, min_lr=1e-5, length=12), 1e-3, 1)
    linear = Schedule(ScheduleConfig(decay="linear", warmup=2, min_lr=1e-5, length=12), 1e-3, 1)
    for position in range(2, 13):
        into = (position - 2) / 10
        assert cosine.rate(position) == pytest.approx(1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi * into)) / 2)
        assert linear.rate(position) == pytest.approx(1e-3 - (1e-3 - 1e-5) * into)
    assert cosine.rate(12) == pytest.approx(1e-5) and linear.rate(12) == pytest.approx(1e-5)
    assert linear.rate(1) == pytest.approx(2e-3 / 3)  # the warm-up first: one cycle


def test_the_variables_set_the_schedule_in_its_positions():
    config = load_config({"EPID_LR_SCHEDULE": "cosine", "EPID_LR_UPDATE": "step", "EPID_WARMUP_STEPS": "30",
                          "EPID_LR_MIN": "1e-5", "EPID_LR_RESTART_EPOCHS": "3", "EPID_LR_RESTART_FACTOR": "1",
                          "EPID_EPOCHS": "4"})
    assert ScheduleConfig.from_config(config, steps_per_epoch=50) == ScheduleConfig(
        decay="cosine", update="step", warmup=30, restart_period=150, restart_factor=1, min_lr=1e-5, length=200)
    by_epoch = load_config({"EPID_MODEL": "legacy", "EPID_WARMUP_EPOCHS": "2", "EPID_EPOCHS": "7"})
    assert ScheduleConfig.from_config(by_epoch, steps_per_epoch=50) == ScheduleConfig(warmup=2, length=7)
    in_steps = load_config({"EPID_WARMUP_EPOCHS": "2", "EPID_LR_UPDATE": "step", "EPID_EPOCHS": "7"})
    assert ScheduleConfig.from_config(in_steps, steps_per_epoch=50).warmup == 100
