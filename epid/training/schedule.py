"""The learning-rate schedule: a linear warm-up, then a decay, as a function of where training is.

The schedule keeps no state. Its position follows from the epochs done and, inside the running
epoch, the optimizer steps done, so a resumed run continues where its checkpoint's epoch (and,
inside an interrupted epoch, its step) puts it; a changed EPID_LR takes effect from there.

Positions (EPID_LR_UPDATE): with ``epoch`` (legacy) the rate changes at the start of each
epoch and the position is the epoch, counted from 0; with ``step`` it changes before every
optimizer step and the position is the optimizer steps since the start of the run (epochs
done x steps per epoch + steps done in this epoch). Lengths count positions.

Shapes, for base rate ``b`` (EPID_LR after EPID_LR_SCALING), floor ``m`` (EPID_LR_MIN),
``W`` warm-up positions and position ``p``:

* warm-up, ``p < W``: ``b (p + 1) / (W + 1)``;
* after it, at ``q = p - W``, by EPID_LR_SCHEDULE:

  * ``cosine-restarts`` (legacy; torch's ``CosineAnnealingWarmRestarts(T_0, T_mult, eta_min)``):
    periods of ``T_0`` (EPID_LR_RESTART_EPOCHS), ``T_0 T_mult``, ``T_0 T_mult^2``, ...
    (EPID_LR_RESTART_FACTOR), in each ``m + (b - m)(1 + cos(pi t / T)) / 2`` at ``t`` positions
    into a period of length ``T``;
  * ``cosine``: one such half cosine over the ``L`` positions left after the warm-up;
  * ``linear``: ``b - (b - m) q / L``, a straight line down to ``m`` (after a warm-up: one cycle).

The legacy default, ``cosine-restarts`` per epoch with T_0 = 10, T_mult = 2, m = 1e-6 and no
warm-up, reproduces the rates of the earlier per-epoch LambdaLR bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from epid.config.load import Config

DECAYS = ("cosine-restarts", "cosine", "linear")
UPDATES = ("epoch", "step")


@dataclass(frozen=True)
class ScheduleConfig:
    """The schedule's shape; every length counts positions (epochs or optimizer steps, ``update``).

    ``length``: the positions of the whole run (the ``cosine`` and ``linear`` decays reach
    ``min_lr`` there).
    """

    decay: str = "cosine-restarts"
    update: str = "epoch"
    warmup: int = 0
    restart_period: int = 10
    restart_factor: int = 2
    min_lr: float = 1e-6
    length: int = 2000

    def __post_init__(self) -> None:
        if self.decay not in DECAYS or self.update not in UPDATES:
            raise ValueError(f"decay {self.decay!r} / update {self.update!r}: expected one of {DECAYS} / {UPDATES}")

    @classmethod
    def from_config(cls, config: Config, steps_per_epoch: int) -> ScheduleConfig:
        """The schedule of a run whose epochs take ``steps_per_epoch`` optimizer steps."""
        per_epoch = steps_per_epoch if config.lr_update == "step" else 1
        return cls(
            decay=config.lr_schedule, update=config.lr_update,
            warmup=config.warmup_steps or config.warmup_epochs * per_epoch,
            restart_period=config.lr_restart_epochs * per_epoch, restart_factor=config.lr_restart_factor,
            min_lr=config.lr_min, length=config.epochs * per_epoch,
        )


class Schedule:
    """The learning rate of every position of a run, and its setting in an optimizer."""

    def __init__(self, config: ScheduleConfig, base_lr: float, steps_per_epoch: int) -> None:
        self.config = config
        self.base_lr = base_lr
        self.steps_per_epoch = steps_per_epoch

    def position(self, epoch_index: int, step: int) -> int:
        """The position of optimizer step ``step`` (0-based) of the 0-based epoch ``epoch_index``."""
        if self.config.update == "epoch":
            return epoch_index
        return epoch_index * self.steps_per_epoch + step

    def rate(self, position: int) -> float:
        """The learning rate at ``position``.

        Computed as the base rate times a factor, the form torch's LambdaLR gave the legacy
        schedule, so that a run repeats the updates of the same run of earlier versions.
        """
        return self.base_lr * (self._shape(position) / self.base_lr)

    def set(self, optimizer: torch.optim.Optimizer, epoch_index: int, step: int) -> float:
        """Give every parameter group the rate of that step times the group's ``lr_factor`` (1 when
        it has none, ``epid.training.optimizer``); the rate."""
        rate = self.rate(self.position(epoch_index, step))
        for group in optimizer.param_groups:
            group["lr"] = rate * group.get("lr_factor", 1.0)
        return rate

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of the schedule: its base rate and shape (nothing to restore)."""
        return {"base_lr": self.base_lr, **dataclasses.asdict(self.config)}

    def _shape(self, position: int) -> float:
        config, base = self.config, self.base_lr
        if position < config.warmup:
            return base * (position + 1) / (config.warmup + 1)
        period = max(config.length - config.warmup, 1)
        into = min(position - config.warmup, period)
        if config.decay == "linear":
            return base - (base - config.min_lr) * into / period
        if config.decay == "cosine-restarts":
            into, period = position - config.warmup, config.restart_period
            while into >= period:
                into -= period
                period *= config.restart_factor
        return config.min_lr + (base - config.min_lr) * (1 + math.cos(math.pi * into / period)) / 2
