"""The optimizer: parameter groups with learning-rate factors, the schedule's rate per group, and
gradient clipping after the fp16 gradient scaler's unscaling."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from epid.models import legacy
from epid.models.families import CrossModel, build_models
from epid.training.optimizer import build_optimizer, model_parameter_groups, optimizer_step, parameter_groups
from epid.training.schedule import Schedule, ScheduleConfig


def tiny_pair() -> CrossModel:
    torch.manual_seed(0)
    return CrossModel(*build_models("tiny", "legacy"))


def first_four_slower(model: nn.Module) -> list[tuple[list[nn.Parameter], float]]:
    """A ``parameter_groups`` method: the model's first four parameters at half the rate."""
    parameters = list(model.parameters())
    return [(parameters[:4], 0.5), (parameters[4:], 1.0)]


def test_legacy_models_give_one_group_of_every_parameter_in_module_order():
    model = tiny_pair()
    optimizer = build_optimizer(model, 1e-4, 1e-4)
    assert len(optimizer.param_groups) == 1
    group = optimizer.param_groups[0]
    assert group["params"] == list(model.parameters()) and group["lr_factor"] == 1.0 and group["lr"] == 1e-4
    assert group["fused"] and group["weight_decay"] == 1e-4


def test_factors_of_both_models_make_one_group_each(monkeypatch):
    monkeypatch.setattr(legacy.ForwardModel, "parameter_groups", first_four_slower, raising=False)
    model = tiny_pair()
    forward, inverse = list(model.forward_model.parameters()), list(model.inverse_model.parameters())
    optimizer = build_optimizer(model, 2e-4, 0.0)
    assert [group["lr_factor"] for group in optimizer.param_groups] == [0.5, 1.0]
    assert optimizer.param_groups[0]["params"] == forward[:4]
    assert optimizer.param_groups[1]["params"] == forward[4:] + inverse
    assert [group["lr"] for group in optimizer.param_groups] == [1e-4, 2e-4]
    schedule = Schedule(ScheduleConfig(decay="linear", length=4, min_lr=0.0), 2e-4, steps_per_epoch=1)
    rate = schedule.set(optimizer, 1, 0)
    assert rate == pytest.approx(1.5e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [0.5 * rate, rate]


@pytest.mark.parametrize("groups, problem", [
    (lambda parameters: [(parameters[1:], 1.0)], "exactly once"),
    (lambda parameters: [(parameters, 1.0), (parameters[:1], 2.0)], "exactly once"),
    (lambda parameters: [(parameters, 0.0)], "positive"),
])
def test_parameter_groups_must_name_every_parameter_once_with_a_positive_factor(monkeypatch, groups, problem):
    monkeypatch.setattr(legacy.InverseModel, "parameter_groups", lambda self: groups(list(self.parameters())),
                        raising=False)
    model = tiny_pair()
    with pytest.raises(ValueError, match=problem):
        parameter_groups(model)
    assert model_parameter_groups(model.forward_model) == [(list(model.forward_model.parameters()), 1.0)]


@pytest.mark.parametrize("fp16", [False, True])
def test_gradient_clipping_acts_on_the_unscaled_global_norm(fp16):
    weights = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    gradients = [torch.tensor([3.0, 0.0, -4.0]), torch.tensor([[0.0, 12.0], [0.0, 0.0]])]  # global norm 13
    optimizer = torch.optim.SGD(weights, lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=fp16)
    loss = sum((weight * gradient).sum() for weight, gradient in zip(weights, gradients, strict=True))
    scaler.scale(loss).backward()  # fp16: gradients 1024 times the true ones until unscaled
    optimizer_step(optimizer, scaler, grad_clip=2.6)

    expected = [nn.Parameter(torch.zeros_like(g)) for g in gradients]
    for weight, gradient in zip(expected, gradients, strict=True):
        weight.grad = gradient.clone()
    norm = torch.nn.utils.clip_grad_norm_(expected, 2.6)
    assert norm.item() == pytest.approx(13.0)
    for weight, reference in zip(weights, expected, strict=True):
        torch.testing.assert_close(weight.detach(), -reference.grad)  # SGD at rate 1 steps by the clipped gradient
    assert torch.cat([w.detach().flatten() for w in weights]).norm().item() == pytest.approx(2.6)


def test_without_clipping_the_step_uses_the_gradients_as_they_are():
    weight = nn.Parameter(torch.zeros(2))
    weight.grad = torch.tensor([30.0, -40.0])
    optimizer_step(torch.optim.SGD([weight], lr=1.0), torch.amp.GradScaler("cpu", enabled=False))
    assert weight.detach().tolist() == [-30.0, 40.0]
