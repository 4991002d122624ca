"""The optimizer of a run: AdamW over parameter groups with learning-rate factors, and its step.

A model may train some of its parameters at another rate than the rest: a method
``parameter_groups()`` returning ``[(parameters, lr_factor), ...]`` that names each of its
parameters once. The optimizer gets one AdamW group per factor (the parameters of both models
with that factor, in the order the factors first appear, forward model first); each group's
dict holds its ``lr_factor``, and the schedule sets the group's rate to the scheduled rate times
that factor (``epid.training.schedule.Schedule.set``). The parameters of a model without the method
have factor 1: the legacy pair gives one group of every parameter in module order, the
optimizer of earlier versions.

``optimizer_step`` takes the step: with EPID_GRAD_CLIP, the gradients are unscaled (fp16
gradient scaling) and their global norm is clipped first. Gradients are all-reduced before
the step, so every rank clips and steps alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from epid.models.families import CrossModel

ParameterGroups = list[tuple[list[nn.Parameter], float]]


def model_parameter_groups(model: nn.Module) -> ParameterGroups:
    """``(parameters, lr_factor)`` pairs of one model: its ``parameter_groups()``, checked to name
    every trainable parameter (``requires_grad``) once with a positive finite factor, or all
    trainable parameters at factor 1. Parameters a model holds (``epid.models.panel``) stay out of
    the optimizer, so that checkpoints written before they existed still resume."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not hasattr(model, "parameter_groups"):
        return [(trainable, 1.0)]
    groups = [(list(parameters), float(factor)) for parameters, factor in model.parameter_groups()]
    name = f"{type(model).__name__}.parameter_groups()"
    named = [id(parameter) for parameters, _ in groups for parameter in parameters]
    if len(named) != len(set(named)) or set(named) != {id(parameter) for parameter in trainable}:
        raise ValueError(f"{name} must name every trainable parameter of the model exactly once")
    for _, factor in groups:
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"{name}: learning-rate factor {factor}; expected a positive number")
    return groups


def parameter_groups(model: CrossModel) -> ParameterGroups:
    """One ``(parameters, lr_factor)`` pair per distinct factor of both models."""
    merged: dict[float, list[nn.Parameter]] = {}
    for module in (model.forward_model, model.inverse_model):
        for parameters, factor in model_parameter_groups(module):
            merged.setdefault(factor, []).extend(parameters)
    return [(parameters, factor) for factor, parameters in merged.items()]


def group_sizes(groups: Sequence[tuple[Sequence[nn.Parameter], float]]) -> list[int]:
    """Parameters per group: what an optimizer state must match to load."""
    return [len(parameters) for parameters, _ in groups]


def build_optimizer(model: CrossModel, base_lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW (fused) with one group per learning-rate factor, each at ``base_lr`` times its factor."""
    groups = [{"params": parameters, "lr": base_lr * factor, "lr_factor": factor}
              for parameters, factor in parameter_groups(model)]
    return torch.optim.AdamW(groups, lr=base_lr, weight_decay=weight_decay, fused=True)


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, grad_clip: float = 0.0) -> None:
    """One optimizer step through the gradient scaler; with ``grad_clip > 0`` the unscaled gradients'
    global L2 norm (over every parameter of every group) is clipped to ``grad_clip`` first."""
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    scaler.step(optimizer)
    scaler.update()
