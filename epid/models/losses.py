"""Cross-training loss of the forward and inverse models.

All terms are computed in float32 (inputs are cast up, also under autocast) and returned as
0-dim tensors without host synchronisation. Positions are compared normalised by
``LEAF_SCALE_MM`` (130 mm), scalars by ``SCALAR_SCALE`` ([40 MU, 130, 130, 130, 130 mm]).

Weighted mean squared error, as in the legacy scripts, is ``mean(w * d**2)`` over all elements
(the sum of weighted squares divided by the element count, not by the sum of the weights).

Terms (unweighted; ``total`` applies the weights):

* ``forward``: per sample, mean over pixels of (epid_pred - epid_curr)**2, divided by the
  sample's MU (``scalars[:, 0]`` of the batch, clamped at 1e-6); mean over samples.
* ``leaf_a``, ``leaf_b``: weighted MSE of the normalised leaves with ``leaf_weight_a/b``, against the
  edges the frames show (``shown_leaves``: cut at a batch's X jaws).
* ``scalars``: MSE of the normalised scalars the inverse model estimates (the first 5: a batch's X
  jaws, on an MLC with them, are the forward model's inputs only).
* ``ordering``: mean of relu(a.detach() - b)**2 on the normalised predicted leaves; bank A is
  detached, so the penalty only pushes bank B open.
* ``consistency``: predicted leaves, curr half of sample i against the prev half of sample
  i + 1 (the same control point), weighted MSE with sample i's curr leaf weights, bank A plus
  bank B; zero for a batch of one sample.
* ``latent``: MSE between the forward and inverse latent images.

``total = forward + leaf_a + leaf_b + scalars + 10 * ordering + consistency + 0.1 * latent``.

``batch_losses`` runs both models on a batch and computes its terms, as training and
validation do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from epid.core.devices import autocast
from epid.models.legacy import LEAF_SCALE_MM, SCALAR_SCALE
from epid.synthesis.sequences import fold_into_x_jaws

LOSS_TERMS = ("total", "forward", "leaf_a", "leaf_b", "scalars", "ordering", "consistency", "latent")
LOSS_WEIGHTS = {
    "forward": 1.0,
    "leaf_a": 1.0,
    "leaf_b": 1.0,
    "scalars": 1.0,
    "ordering": 10.0,
    "consistency": 1.0,
    "latent": 0.1,
}
MU_FLOOR = 1e-6


class LossTargets(Protocol):
    """The batch fields the loss reads (``epid.data.dataset.Batch`` provides them)."""

    leaf_a: Tensor
    leaf_b: Tensor
    scalars: Tensor
    leaf_weight_a: Tensor
    leaf_weight_b: Tensor
    epid_curr: Tensor


class LossBatch(LossTargets, Protocol):
    """A batch the models can run on and the loss can score (``epid.data.dataset.Batch``)."""

    epid_prev: Tensor


def weighted_mse(prediction: Tensor, target: Tensor, weight: Tensor) -> Tensor:
    """``mean(weight * (prediction - target)**2)`` over all elements."""
    return (weight * (prediction - target).square()).mean()


def forward_loss(epid_pred: Tensor, epid_curr: Tensor, mu_curr: Tensor) -> Tensor:
    """Mean over samples of the per-sample pixel MSE divided by the sample's MU (clamped at 1e-6).

    ``epid_pred``, ``epid_curr``: (B, ...) frames; ``mu_curr``: (B,) MU.
    """
    batch = epid_curr.shape[0]
    per_sample = (epid_pred.reshape(batch, -1) - epid_curr.reshape(batch, -1)).square().mean(dim=1)
    return (per_sample / mu_curr.clamp_min(MU_FLOOR)).mean()


def ordering_loss(leaf_a: Tensor, leaf_b: Tensor) -> Tensor:
    """``mean(relu(leaf_a.detach() - leaf_b)**2)``: penalises bank B closing past bank A."""
    return torch.relu(leaf_a.detach() - leaf_b).square().mean()


def consistency_loss(leaf_banks: Sequence[Tensor], weight_banks: Sequence[Tensor]) -> Tensor:
    """Sum over banks of the weighted MSE of curr of sample i against prev of sample i + 1.

    ``leaf_banks``: predicted (B, 104) leaves ``[prev 52, curr 52]`` per bank; ``weight_banks``:
    the matching (B, 104) leaf weights, of which sample i's curr half weights the pair (i, i+1).
    """
    total = leaf_banks[0].new_zeros(())
    if leaf_banks[0].shape[0] < 2:
        return total
    for leaves, weights in zip(leaf_banks, weight_banks, strict=True):
        strips = leaves.shape[-1] // 2
        curr = leaves[:-1, strips:]
        next_prev = leaves[1:, :strips]
        total = total + weighted_mse(curr, next_prev, weights[:-1, strips:])
    return total


def point_x_jaws(scalars: Tensor) -> list[Tensor] | None:
    """[X1, X2] (B, 2) mm at the prev and at the curr control point, from scalars with a beam's X jaws
    appended ((B, 9): [X1 prev, X1 curr, X2 prev, X2 curr] after the 5); None for scalars without (B, 5)."""
    first = len(SCALAR_SCALE)
    return None if scalars.shape[1] <= first else [scalars[:, [first + k, first + 2 + k]] for k in (0, 1)]


def shown_leaves(leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> tuple[Tensor, Tensor]:
    """The leaf edges (B, 2 x strips) [prev, curr] frames show for a batch's leaves and scalars: cut at
    the X jaws (``fold_into_x_jaws``) where the scalars carry them (``point_x_jaws``), else the leaves.
    What the inverse model estimates."""
    x_jaws = point_x_jaws(scalars)
    if x_jaws is None:
        return leaf_a, leaf_b
    half = leaf_a.shape[1] // 2
    parts = [fold_into_x_jaws(leaf_a[:, part], leaf_b[:, part], jaws)
             for jaws, part in zip(x_jaws, (slice(None, half), slice(half, None)), strict=True)]
    return torch.cat([parts[0][0], parts[1][0]], 1), torch.cat([parts[0][1], parts[1][1]], 1)


def cross_training_loss(
    forward_out: tuple[Tensor, Tensor],
    inverse_out: tuple[Tensor, Tensor, Tensor, Tensor],
    batch: LossTargets,
) -> dict[str, Tensor]:
    """All loss terms of one batch, keyed by ``LOSS_TERMS``, as float32 0-dim tensors.

    ``forward_out`` = ``(epid (B,1,256,256), latent (B,1,64,64))`` of the forward model;
    ``inverse_out`` = ``(leaf_a (B,104), leaf_b (B,104), scalars (B,5), latent (B,1,64,64))``
    of the inverse model; ``batch`` holds the targets in mm / MU (see ``LossTargets``).
    """
    epid_pred, forward_latent = (t.float() for t in forward_out)
    leaf_a_pred, leaf_b_pred, scalars_pred, inverse_latent = (t.float() for t in inverse_out)
    target_a, target_b = shown_leaves(batch.leaf_a.float(), batch.leaf_b.float(), batch.scalars.float())
    scalars = batch.scalars.float()[:, :len(SCALAR_SCALE)]
    scalar_scale = scalars.new_tensor(SCALAR_SCALE)
    leaf_a_norm = leaf_a_pred / LEAF_SCALE_MM
    leaf_b_norm = leaf_b_pred / LEAF_SCALE_MM
    weight_a = batch.leaf_weight_a.float()
    weight_b = batch.leaf_weight_b.float()
    terms = {
        "forward": forward_loss(epid_pred, batch.epid_curr.float(), scalars[:, 0]),
        "leaf_a": weighted_mse(leaf_a_norm, target_a / LEAF_SCALE_MM, weight_a),
        "leaf_b": weighted_mse(leaf_b_norm, target_b / LEAF_SCALE_MM, weight_b),
        "scalars": (scalars_pred / scalar_scale - scalars / scalar_scale).square().mean(),
        "ordering": ordering_loss(leaf_a_norm, leaf_b_norm),
        "consistency": consistency_loss((leaf_a_norm, leaf_b_norm), (weight_a, weight_b)),
        "latent": (forward_latent - inverse_latent).square().mean(),
    }
    total = sum(LOSS_WEIGHTS[name] * value for name, value in terms.items())
    return {"total": total, **terms}


def batch_losses(
    model: Callable[..., Any], batch: LossBatch, device: torch.device, amp_dtype: torch.dtype
) -> dict[str, Tensor]:
    """Every loss term of ``batch`` through ``model`` (a ``CrossModel``, or a runner called like
    one), the models under autocast to ``amp_dtype`` on ``device``."""
    with autocast(device, amp_dtype):
        forward_out, inverse_out = model(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
    return cross_training_loss(forward_out, inverse_out, batch)
