"""The state of a training run, saved into and restored from a checkpoint by one pair of functions.

``capture_run_state`` gathers everything a run needs to go on as if it had never stopped
(both models' weights and configs, the optimizer, the gradient scaler, the random generators,
where the run is and its history) into a checkpoint payload (``epid.models.checkpoint``);
``restore_run_state`` puts it back. The learning-rate schedule keeps no state of its own:
its position is the run's epoch and, inside an interrupted epoch, its step
(``epid.training.schedule``); the checkpoint records its base rate and shape.
"""

from __future__ import annotations

import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from epid.config.load import Config
from epid.models.checkpoint import FORMAT_VERSION
from epid.models.families import CrossModel
from epid.training import metrics_log
from epid.training.schedule import Schedule


@dataclass
class RunState:
    """Where a run is: its ID, the last completed epoch (1-based, 0 before the first), the
    history of every epoch, the best validation loss so far, the window cursor (each rank's
    position in its window stream, where the next capped epoch starts: ``epid.training.rank_data``), and
    ``interrupted``: None, or the
    record of an epoch stopped by a signal ({"epoch", "batches_done", "rank_train_sums",
    "rank_train_samples", "train_seconds", "nonfinite_steps", "plan"})."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    epoch: int = 0
    history: dict[str, Any] = field(default_factory=metrics_log.empty_history)
    best_val_loss: float = math.inf
    best_epoch: int = 0
    window_cursor: int = 0
    interrupted: dict[str, Any] | None = None


def capture_run_state(model: CrossModel, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                      schedule: Schedule, state: RunState, config: Config, world_size: int,
                      precision: dict[str, str]) -> dict[str, Any]:
    """The checkpoint payload of a run: plain containers, tensors copied to the CPU; ``precision``
    as ``epid.training.precision.precision_record`` gives it."""
    return {
        "format_version": FORMAT_VERSION,
        "run_id": state.run_id,
        "epoch": state.epoch,
        "forward_model": _to_cpu(model.forward_model.state_dict()),
        "inverse_model": _to_cpu(model.inverse_model.state_dict()),
        "model_config": model.config.to_dict(),
        "optimizer": _to_cpu(optimizer.state_dict()),
        "schedule": schedule.state_dict(),
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "rng": rng_state(),
        "history": state.history,
        "best_val_loss": state.best_val_loss,
        "best_epoch": state.best_epoch,
        "window_cursor": state.window_cursor,
        "config": config.to_dict(),
        "dataset_ids": list(config.dataset_ids),
        "world_size": world_size,
        "torch_version": str(torch.__version__),
        "precision": precision,
        "interrupted": state.interrupted,
    }


def restore_run_state(checkpoint: dict[str, Any], optimizer: torch.optim.Optimizer,
                      scaler: torch.amp.GradScaler) -> RunState:
    """Load the optimizer, scaler and generator states of ``checkpoint`` (from ``load_checkpoint``;
    its models are rebuilt from it beforehand, ``epid.models.checkpoint.build_models_from_checkpoint``)
    and return where its run is. The parameter groups keep the learning-rate factors the models
    give them now (``epid.training.optimizer``); their layout must match the checkpoint's (checked before
    the launch, ``epid.training.preflight``)."""
    factors = [group.get("lr_factor", 1.0) for group in optimizer.param_groups]
    optimizer.load_state_dict(checkpoint["optimizer"])
    for group, factor in zip(optimizer.param_groups, factors, strict=True):
        group["lr_factor"] = factor
    _match_optimizer_layout(optimizer)
    if scaler.is_enabled() and checkpoint.get("scaler"):
        scaler.load_state_dict(checkpoint["scaler"])
    if checkpoint.get("rng"):
        set_rng_state(checkpoint["rng"])
    history = metrics_log.restored_history(checkpoint.get("history") or {})
    return RunState(
        run_id=str(checkpoint.get("run_id") or uuid.uuid4().hex),
        epoch=int(checkpoint["epoch"]),
        history=history,
        best_val_loss=float(checkpoint.get("best_val_loss", math.inf)),
        best_epoch=int(checkpoint.get("best_epoch", 0)),
        window_cursor=int(checkpoint.get("window_cursor", 0)),
        interrupted=checkpoint.get("interrupted"),
    )


def _match_optimizer_layout(optimizer: torch.optim.Optimizer) -> None:
    """Give loaded moment tensors their parameter's memory format (checkpoints store them contiguous)."""
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key, value in state.items():
                if isinstance(value, Tensor) and value.shape == parameter.shape:
                    state[key] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)


def _to_cpu(value: Any) -> Any:
    """Tensors of a nested container as contiguous CPU copies (checkpoints load on any machine)."""
    if isinstance(value, Tensor):
        return value.detach().cpu().contiguous()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


# --------------------------------------------------------------------------- random generators


def seed_rngs(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators, so that a run and its resumed copy
    hold the same generator states (``rng_state``)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Random generator states as tensors and lists (weights_only-loadable)."""
    numpy_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states ``rng_state`` saved (CUDA only when the device count matches)."""
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
