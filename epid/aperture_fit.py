"""Refining an inverse estimate by fitting the forward model's rendering to the measured frames.

The frame pair of a sample spans three control points: the prev frame integrates the motion
from control point s (before prev) to prev, the curr frame from prev to curr. Starting from the
network's prev and curr leaves and jaws (the control point before prev extrapolated at constant
speed), the fit moves all three to minimise, per frame, the squared difference between the
measured frame and the forward model's rendering scaled by its best MU, relative to that MU
squared (so frames of any MU weigh alike):

    sum over frames of || mu R(geometry) - F ||^2 / mu^2,   mu = <R, F> / <R, R>

with Adam, the step size falling along a half cosine from ``START_STEP_MM`` to a tenth of it.

A blurred frame shows where an edge was on average during the frame well, but the ends of its
motion poorly: the staircase of sub-apertures from u to v looks the same as from v to u, and
a few millimetres of motion only widen the blurred edge a little. Each frame's mean edge
position, (s + prev) / 2 and (prev + curr) / 2, is therefore fitted quickly, while how the
motion is split between the two frames (where prev lies) is a shallow direction of the misfit
with several local minima. After the first descent, each split round tries, for every leaf
edge at once, moving prev by each offset of ``SPLIT_OFFSETS_MM`` while both frames' mean
positions stay (s - d, prev + d, curr - d); each edge keeps the offset of least misfit in its
own region of the frames (its leaf row, on its bank's side of the middle of the opening). The
edges are moved in four scans, one bank's even or odd leaves at a time, so that no region's
misfit mixes with the blur of another edge moving in its own row or in the rows beside it. A
shorter descent from ``REFINE_STEP_MM`` follows. A leaf that comes back to where it was (s =
curr) gives the same two frames as one that made the opposite excursion: which of the two it was
stays undecided by the frames.

Only the geometry moves: the forward model's parameters receive no gradient. Leaves that no
jaw opens get no gradient, are not searched and keep the network's values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from epid.aperture_models import ROWS_PER_LEAF, column_centres, row_visibility, to_leaf_grid
from epid.sequences import NUM_LEAF_PAIRS

START_STEP_MM = 0.5
REFINE_STEP_MM = 0.2
FINAL_STEP_FRACTION = 0.1
SPLIT_OFFSETS_MM = (0.0, *(sign * 0.5 * k for k in range(1, 17) for sign in (-1.0, 1.0)))
"""Offsets of prev tried in a split round, mm: 0 first (ties keep the current split), then
+-0.5 to +-8 mm."""

Geometry = list[Tensor]
"""The nine fitted tensors: leaf_a at s, prev, curr (B, 52); leaf_b at s, prev, curr (B, 52);
jaws [jaw_1, jaw_2] at s, prev, curr (B, 2); mm."""


def _scalars(jaw_start: Tensor, jaw_end: Tensor) -> Tensor:
    """Jaws (B, 2) [jaw_1, jaw_2] at a frame's start and end -> renderer scalars (B, 5) at MU 1."""
    one = jaw_start.new_ones(len(jaw_start), 1)
    return torch.cat([one, jaw_start[:, :1], jaw_end[:, :1], jaw_start[:, 1:], jaw_end[:, 1:]], 1)


def _best_mu(rendered: Tensor, measured: Tensor) -> Tensor:
    """Least-squares MU (B,) of measured ~ mu * rendered (B, 256, 256)."""
    return (rendered * measured).sum((-2, -1)) / (rendered * rendered).sum((-2, -1)).clamp_min(1e-12)


def fit_to_frames(renderer: nn.Module, frames: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor,
                  steps: int, split_rounds: int = 0, refine_steps: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Refine (leaf_a, leaf_b (B, 104) [prev, curr] mm, jaws (B, 4) [jaw_1 prev, curr, jaw_2 prev,
    curr]) against frames (B, 2, 256, 256) [prev, curr] with ``renderer.render`` (an aperture
    forward model): ``steps`` steps of descent, then ``split_rounds`` rounds of split search and
    ``refine_steps`` steps of descent. Returns the refined leaf_a, leaf_b, jaws and the curr
    frame's MU (B,)."""
    batch, half = len(frames), NUM_LEAF_PAIRS
    with torch.inference_mode(False), torch.enable_grad():
        frames, leaf_a, leaf_b, jaws = (t.clone() for t in (frames, leaf_a, leaf_b, jaws))
        measured = torch.cat([frames[:, 0], frames[:, 1]])
        prev_a, curr_a = leaf_a[:, :half].detach(), leaf_a[:, half:].detach()
        prev_b, curr_b = leaf_b[:, :half].detach(), leaf_b[:, half:].detach()
        prev_jaws, curr_jaws = jaws[:, 0::2].detach(), jaws[:, 1::2].detach()
        geometry = [t.clone().requires_grad_() for t in (
            2 * prev_a - curr_a, prev_a, curr_a, 2 * prev_b - curr_b, prev_b, curr_b,
            2 * prev_jaws - curr_jaws, prev_jaws, curr_jaws,
        )]
        _descend(renderer, measured, geometry, steps, START_STEP_MM)
        for _ in range(split_rounds):
            _search_splits(renderer, measured, geometry)
            _descend(renderer, measured, geometry, refine_steps, REFINE_STEP_MM)
        with torch.no_grad():
            rendered = _render_pair(renderer, geometry)
            mu = _best_mu(rendered[batch:], frames[:, 1])
    _, a_1, a_2, _, b_1, b_2, _, j_1, j_2 = (t.detach() for t in geometry)
    jaws_out = torch.stack([j_1[:, 0], j_2[:, 0], j_1[:, 1], j_2[:, 1]], 1)
    return torch.cat([a_1, a_2], 1), torch.cat([b_1, b_2], 1), jaws_out, mu


def _descend(renderer: nn.Module, measured: Tensor, geometry: Geometry, steps: int, start_step_mm: float) -> None:
    """``steps`` Adam steps on the misfit, the step size along a half cosine from ``start_step_mm``
    to ``FINAL_STEP_FRACTION`` of it; ``geometry`` is updated in place."""
    optimizer = torch.optim.Adam(geometry, lr=start_step_mm)
    for step in range(steps):
        progress = step / steps
        fraction = FINAL_STEP_FRACTION + (1 - FINAL_STEP_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = start_step_mm * fraction
        loss = _misfit(renderer, measured, geometry)
        gradients = torch.autograd.grad(loss, geometry)
        for tensor, gradient in zip(geometry, gradients, strict=True):
            tensor.grad = gradient
        optimizer.step()


@torch.no_grad()
def _search_splits(renderer: nn.Module, measured: Tensor, geometry: Geometry) -> None:
    """One split round (module docstring): every open leaf edge's prev moved by the offset of
    ``SPLIT_OFFSETS_MM`` with the least misfit in its region, s and curr by its opposite;
    ``geometry`` is updated in place."""
    leaves = [t.detach().clone() for t in geometry[:6]]
    a_0, a_1, a_2, b_0, b_1, b_2 = leaves
    rendered = _render_pair(renderer, geometry)
    mu = _best_mu(rendered, measured).clamp_min(1e-6)
    middle = torch.cat([a_0 + a_1 + b_0 + b_1, a_1 + a_2 + b_1 + b_2]) / 4  # (2B, 52) per frame
    bank_a_side = column_centres(middle.device) < middle[..., None]  # (2B, 52, 256)
    best_cost = _edge_misfits(rendered, measured, mu, bank_a_side)  # (2, B, 52) at offset 0
    best_offset = torch.zeros_like(best_cost)
    even = torch.arange(NUM_LEAF_PAIRS, device=middle.device) % 2 == 0
    none = torch.zeros_like(even)
    for moved in (torch.stack(banks) for banks in ((even, none), (~even, none), (none, even), (none, ~even))):
        for offset in SPLIT_OFFSETS_MM[1:]:
            step_a, step_b = offset * moved
            shifted = [a_0 - step_a, a_1 + step_a, a_2 - step_a, b_0 - step_b, b_1 + step_b, b_2 - step_b,
                       *geometry[6:]]
            cost = _edge_misfits(_render_pair(renderer, shifted), measured, mu, bank_a_side)
            better = (cost < best_cost) & moved[:, None, :]
            best_cost = torch.where(better, cost, best_cost)
            best_offset = torch.where(better, torch.full_like(cost, offset), best_offset)
    jaw_0, jaw_1, jaw_2 = (t.detach() for t in geometry[6:])
    seen = (row_visibility((jaw_0[:, 0], jaw_1[:, 0]), (jaw_0[:, 1], jaw_1[:, 1]))[0]
            + row_visibility((jaw_1[:, 0], jaw_2[:, 0]), (jaw_1[:, 1], jaw_2[:, 1]))[0]) > 0
    best_offset = best_offset * seen
    for bank, offset in enumerate(best_offset):
        for point, sign in enumerate((-1.0, 1.0, -1.0)):
            geometry[3 * bank + point].copy_(leaves[3 * bank + point] + sign * offset)


def _edge_misfits(rendered: Tensor, measured: Tensor, mu: Tensor, bank_a_side: Tensor) -> Tensor:
    """The misfit of each leaf edge's region, both frames summed: (2, B, 52) [bank A, bank B].

    ``rendered`` (2B, 256, 256) is ``_render_pair``'s, scaled by the frames' MU ``mu`` (2B,); a
    region is the leaf's row of pixels on its bank's side of ``bank_a_side`` (2B, 52, 256)."""
    misfit = (mu[:, None, None] * rendered - measured).square() / mu.square()[:, None, None]
    rows = to_leaf_grid(misfit).unflatten(-2, (NUM_LEAF_PAIRS, ROWS_PER_LEAF)).sum(-2)  # (2B, 52, 256)
    cost_a = (rows * bank_a_side).sum(-1)
    cost_b = rows.sum(-1) - cost_a
    batch = len(rows) // 2
    return torch.stack([cost_a[:batch] + cost_a[batch:], cost_b[:batch] + cost_b[batch:]])


def _render_pair(renderer: nn.Module, geometry: Geometry) -> Tensor:
    """Frames per MU (2B, 256, 256): the prev frames (motion 0 -> 1), then the curr frames (1 -> 2)."""
    a_0, a_1, a_2, b_0, b_1, b_2, j_0, j_1, j_2 = geometry
    leaf_a = torch.cat([torch.cat([a_0, a_1], 1), torch.cat([a_1, a_2], 1)])
    leaf_b = torch.cat([torch.cat([b_0, b_1], 1), torch.cat([b_1, b_2], 1)])
    scalars = torch.cat([_scalars(j_0, j_1), _scalars(j_1, j_2)])
    return renderer.render(leaf_a, leaf_b, scalars)[0]


def _misfit(renderer: nn.Module, measured: Tensor, geometry: Geometry) -> Tensor:
    """Sum over samples and frames of || mu R - F ||^2 / mu^2 at the best MU of each frame;
    ``measured`` (2B, 256, 256) holds the prev frames, then the curr frames."""
    rendered = _render_pair(renderer, geometry)
    mu = _best_mu(rendered, measured).detach().clamp_min(1e-6)
    residual = mu[:, None, None] * rendered - measured
    return (residual.square().sum((-2, -1)) / mu.square()).sum()
