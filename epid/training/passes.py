"""One rank's training pass of an epoch: its sums and counters, where it stops, where it resumes.

``TrainPass`` holds what a pass leaves (loss sums on the device, host counters). ``StopRules``
says, at each step boundary and agreed over every rank, whether a loss was non-finite, a stop
signal arrived or EPID_TIME_LIMIT was reached. A pass stopped that way is saved in the
checkpoint (``interrupted_record``: every rank's loss sums so far) and a resumed run continues
it (``resumed_pass``) when its batch plan is the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from epid.models.losses import LOSS_TERMS
from epid.training import distributed
from epid.training.distributed import StopSignal

NUM_TERMS = len(LOSS_TERMS)


@dataclass
class TrainPass:
    """What one rank's training pass of an epoch leaves: device sums and host counters."""

    sums: Tensor
    samples: Tensor
    seconds: float = 0.0
    steps: int = 0
    nonfinite_steps: int = 0
    batches_done: int = 0
    interrupted: bool = False
    aborted: bool = False

    @classmethod
    def fresh(cls, device: torch.device) -> TrainPass:
        """A pass before its first batch: zero sums (``NUM_TERMS``,) and zero samples on ``device``."""
        return cls(sums=torch.zeros(NUM_TERMS, device=device), samples=torch.zeros((), device=device))


class StopRules:
    """Whether a run stops at a step boundary: a stop signal (``StopSignal``) or the time limit
    (``time_limit`` minutes from now; 0 = none) on any rank."""

    def __init__(self, signal: StopSignal, time_limit: float, device: torch.device) -> None:
        self.signal, self.time_limit, self.device = signal, time_limit, device
        self.deadline = time.perf_counter() + 60.0 * time_limit if time_limit else None

    def time_up(self) -> bool:
        """Whether this rank has run for the time limit."""
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def agree(self, step_total: Tensor) -> tuple[bool, bool, bool]:
        """Whether any rank saw a non-finite loss this step (``step_total``: its loss sum), whether
        any rank received a stop signal, and whether any rank reached the time limit."""
        flags = torch.stack([(~torch.isfinite(step_total)).float(),
                             torch.full((), float(self.signal.requested), device=self.device),
                             torch.full((), float(self.time_up()), device=self.device)])
        distributed.all_reduce(flags, dist.ReduceOp.MAX)
        nonfinite, signalled, time_up = flags.tolist()
        return nonfinite > 0, signalled > 0, time_up > 0

    def stopped_by(self, signalled: bool) -> str:
        """What stopped the run, for the stop line: this rank's signal, another rank's, or the time limit."""
        if self.signal.requested:
            return f"Stopped by {self.signal.name}"
        if signalled:
            return "Stopped by a signal on another rank"
        return f"Stopped: time limit of {self.time_limit:g} min reached"


def resumed_pass(saved: dict[str, Any] | None, epoch: int, plan: Any, rank: int, grad_accum: int, batches: int,
                 device: torch.device) -> tuple[TrainPass, str]:
    """The pass of ``epoch``: the one an interrupted run ``saved`` (``interrupted_record``) with this
    rank's sums when it was stopped in ``epoch`` under the same batch ``plan``, else a fresh one;
    and what to tell the user ("" when there is nothing to say)."""
    result = TrainPass.fresh(device)
    if not saved or saved.get("epoch") != epoch:
        return result, ""
    if saved.get("plan") != plan:
        return result, f"Epoch {epoch} was interrupted under another batch plan; it restarts from its first batch"
    result.sums += torch.tensor(saved["rank_train_sums"][rank], device=device)
    result.samples += float(saved["rank_train_samples"][rank])
    result.seconds = float(saved.get("train_seconds", 0.0))
    result.batches_done = int(saved["batches_done"])
    result.steps = result.batches_done // grad_accum
    result.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
    return result, f"Epoch {epoch} continues after batch {saved['batches_done']}/{batches}"


def interrupted_record(epoch: int, train: TrainPass, rank_values: list[list[float]], plan: Any) -> dict[str, Any]:
    """The checkpoint's record of a pass stopped in ``epoch``; ``rank_values``: every rank's
    ``pass_values`` in rank order."""
    return {
        "epoch": epoch, "batches_done": train.batches_done,
        "rank_train_sums": [values[:NUM_TERMS] for values in rank_values],
        "rank_train_samples": [values[NUM_TERMS] for values in rank_values], "train_seconds": train.seconds,
        "nonfinite_steps": train.nonfinite_steps, "plan": plan,
    }


def pass_values(train: TrainPass) -> list[float]:
    """A rank's loss sums and sample count as one list (``NUM_TERMS`` sums, then the samples)."""
    return torch.cat([train.sums, train.samples.view(1)]).tolist()
