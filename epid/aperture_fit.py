"""Refining an inverse estimate by fitting the forward model's rendering to the measured frames.

The frame pair of a sample spans three control points: the prev frame integrates the motion
from control point s (before prev) to prev, the curr frame from prev to curr. Starting from the
network's prev and curr leaves and jaws (the control point before prev extrapolated at constant
speed), the fit moves all three to minimise, per frame, the squared difference between the
measured frame and the forward model's rendering scaled by its best MU, relative to that MU
squared (so frames of any MU weigh alike):

    sum over frames of || mu R(geometry) - F ||^2 / mu^2,   mu = <R, F> / <R, R>

with Adam, the step size falling along a half cosine from ``START_STEP_MM`` to a tenth of it.
Only the geometry moves: the forward model's parameters receive no gradient. Leaves that no
jaw opens get no gradient and keep the network's values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from epid.sequences import NUM_LEAF_PAIRS

START_STEP_MM = 0.5
FINAL_STEP_FRACTION = 0.1


def _scalars(jaw_start: Tensor, jaw_end: Tensor) -> Tensor:
    """Jaws (B, 2) [jaw_1, jaw_2] at a frame's start and end -> renderer scalars (B, 5) at MU 1."""
    one = jaw_start.new_ones(len(jaw_start), 1)
    return torch.cat([one, jaw_start[:, :1], jaw_end[:, :1], jaw_start[:, 1:], jaw_end[:, 1:]], 1)


def _best_mu(rendered: Tensor, measured: Tensor) -> Tensor:
    """Least-squares MU (B,) of measured ~ mu * rendered (B, 256, 256)."""
    return (rendered * measured).sum((-2, -1)) / (rendered * rendered).sum((-2, -1)).clamp_min(1e-12)


def fit_to_frames(renderer: nn.Module, frames: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor,
                  steps: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Refine (leaf_a, leaf_b (B, 104) [prev, curr] mm, jaws (B, 4) [jaw_1 prev, curr, jaw_2 prev,
    curr]) against frames (B, 2, 256, 256) [prev, curr] with ``renderer.render`` (an aperture
    forward model). Returns the refined leaf_a, leaf_b, jaws and the curr frame's MU (B,)."""
    batch, half = len(frames), NUM_LEAF_PAIRS
    with torch.inference_mode(False), torch.enable_grad():
        frames, leaf_a, leaf_b, jaws = (t.clone() for t in (frames, leaf_a, leaf_b, jaws))
        prev_a, curr_a = leaf_a[:, :half].detach(), leaf_a[:, half:].detach()
        prev_b, curr_b = leaf_b[:, :half].detach(), leaf_b[:, half:].detach()
        prev_jaws, curr_jaws = jaws[:, 0::2].detach(), jaws[:, 1::2].detach()
        geometry = [t.clone().requires_grad_() for t in (
            2 * prev_a - curr_a, prev_a, curr_a, 2 * prev_b - curr_b, prev_b, curr_b,
            2 * prev_jaws - curr_jaws, prev_jaws, curr_jaws,
        )]
        optimizer = torch.optim.Adam(geometry, lr=START_STEP_MM)
        for step in range(steps):
            progress = step / max(steps, 1)
            fraction = FINAL_STEP_FRACTION + (1 - FINAL_STEP_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = START_STEP_MM * fraction
            loss = _misfit(renderer, frames, geometry)
            gradients = torch.autograd.grad(loss, geometry)
            for tensor, gradient in zip(geometry, gradients, strict=True):
                tensor.grad = gradient
            optimizer.step()
        with torch.no_grad():
            rendered = _render_pair(renderer, geometry)
            mu = _best_mu(rendered[batch:], frames[:, 1])
    _, a_1, a_2, _, b_1, b_2, _, j_1, j_2 = (t.detach() for t in geometry)
    jaws_out = torch.stack([j_1[:, 0], j_2[:, 0], j_1[:, 1], j_2[:, 1]], 1)
    return torch.cat([a_1, a_2], 1), torch.cat([b_1, b_2], 1), jaws_out, mu


def _render_pair(renderer: nn.Module, geometry: list[Tensor]) -> Tensor:
    """Frames per MU (2B, 256, 256): the prev frames (motion 0 -> 1), then the curr frames (1 -> 2)."""
    a_0, a_1, a_2, b_0, b_1, b_2, j_0, j_1, j_2 = geometry
    leaf_a = torch.cat([torch.cat([a_0, a_1], 1), torch.cat([a_1, a_2], 1)])
    leaf_b = torch.cat([torch.cat([b_0, b_1], 1), torch.cat([b_1, b_2], 1)])
    scalars = torch.cat([_scalars(j_0, j_1), _scalars(j_1, j_2)])
    return renderer.render(leaf_a, leaf_b, scalars)[0]


def _misfit(renderer: nn.Module, frames: Tensor, geometry: list[Tensor]) -> Tensor:
    """Sum over samples and frames of || mu R - F ||^2 / mu^2 at the best MU of each frame."""
    rendered = _render_pair(renderer, geometry)
    measured = torch.cat([frames[:, 0], frames[:, 1]])
    mu = _best_mu(rendered, measured).detach().clamp_min(1e-6)
    residual = mu[:, None, None] * rendered - measured
    return (residual.square().sum((-2, -1)) / mu.square()).sum()
