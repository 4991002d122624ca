"""A fit is kept only where the measured frames agree with it better than with its start.

The tracking models the frames through the row domain (``epid.reconstruction.rows``), a
reduction of the forward model; where the reduction does not hold (a response the filter cannot
undo, physics the model lacks), a fit can land further from the truth than the network's estimate
it started from, and nothing in the row domain would show it. The judge here is the forward
model itself: each frame of each candidate (start, fit) is rendered, its MU fitted by least
squares, and the squared residual summed per leaf row (the imager rows each leaf covers) and per
frame. A control point's leaf row takes the fit's positions unless the two frames that control
point belongs to (the one ending there and the one starting there) fit that row clearly better
with the start's (``KEEP_START_BELOW``); its jaws likewise, from the two frames' whole misfit. Of
the fit, the start and that per-leaf merge, each run keeps the one of least total misfit, so the
result is never worse than the start on the frames. ``Kept.from_start`` reports how often the
start was kept. The start's rendering (``render_run``) also gives the frames' residuals, which
the tracking reads (``epid.reconstruction.leaves``, ``epid.reconstruction.estimate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from epid.models.families import model_strips
from epid.synthesis.geometry import GRID_SIZE, MLC_Y_MIN_MM, PIXEL_MM, STRIPS, StripGrid

BATCH_FRAMES = 64
"""Frames the network estimates, and the forward model renders, at once (here and in
``epid.reconstruction.estimate``)."""
KEEP_START_BELOW = 0.9
"""The start replaces the fit where its misfit is below this share of the fit's: a leaf the frames
hardly see (behind a jaw, parked) differs between the two by noise and keeps the fit."""


@dataclass(frozen=True)
class ControlPointRun:
    """Control points of B runs of F frames: leaf_a, leaf_b (B, F + 1, strips) mm and jaws (B, F + 1, 2)
    [jaw_1, jaw_2] mm; frame k of a run integrates point k -> k + 1."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor


@dataclass(frozen=True)
class Kept:
    """The control points returned (``ControlPointRun``), the (B, F + 1, strips) mask of the leaf
    positions taken from the start, ``from_start``: their share among the leaves the jaws leave
    open (0 when the whole fit is kept, 1 when the whole start is), and each frame's least-squares
    ``mu`` and ``signal_mu`` (B, F) at the returned points (``Rendering``)."""

    points: ControlPointRun
    leaves_from_start: Tensor
    from_start: float
    mu: Tensor
    signal_mu: Tensor


def uncrossed(run: ControlPointRun) -> ControlPointRun:
    """``run`` with every pair whose bank A edge lies beyond its bank B edge closed at their midpoint:
    the nearest positions (least squares) whose leaves do not cross, and so never further from
    positions that do not cross than ``run`` was (a projection onto a convex set)."""
    crossed = run.leaf_a > run.leaf_b
    if not bool(crossed.any()):
        return run
    middle = 0.5 * (run.leaf_a + run.leaf_b)
    return ControlPointRun(torch.where(crossed, middle, run.leaf_a), torch.where(crossed, middle, run.leaf_b),
                           run.jaws)


def imager_row_leaves(grid: StripGrid = STRIPS, device: torch.device | str | None = None) -> Tensor:
    """(256 x rows per pixel,) the strip of ``grid`` each row of the imager's rows lies in (row 0 =
    most positive y; on the fine strips each imager row's two rows, the upper first)."""
    rows = GRID_SIZE * grid.rows_per_pixel
    y_mm = (GRID_SIZE / 2 - (torch.arange(rows, device=device, dtype=torch.float64) + 0.5) * grid.row_mm) * PIXEL_MM
    return ((y_mm - MLC_Y_MIN_MM) / grid.strip_mm).floor().long().clamp(0, grid.count - 1)


def strip_misfits(rows: Tensor, grid: StripGrid) -> Tensor:
    """Misfits of the imager rows (K, 256) -> of the strips (K, strips): each row's to the strip it
    lies in (on the fine strips, half of it to each of its two rows' strips)."""
    per_pixel = grid.rows_per_pixel
    if per_pixel > 1:
        rows = rows.repeat_interleave(per_pixel, -1) / per_pixel
    return rows.new_zeros(len(rows), grid.count).index_add_(1, imager_row_leaves(grid, rows.device), rows)


@dataclass(frozen=True)
class Rendering:
    """What the forward model makes of B runs of F lag-free frames at given control points: the
    squared residual summed over each leaf's imager rows, ``misfits`` (B, F, strips), each frame's
    least-squares ``mu`` (B, F), its ``signal_mu`` (B, F): the frame's whole signal over the
    rendering's per MU (``frame_misfits``), and, when asked for, the frames less ``mu`` x the
    rendering, ``residuals`` (B, F, 256, 256)."""

    misfits: Tensor
    mu: Tensor
    signal_mu: Tensor
    residuals: Tensor | None = None


def render_run(forward_model: nn.Module, signals: Tensor, points: ControlPointRun, batch_frames: int = BATCH_FRAMES,
               residuals: bool = False) -> Rendering:
    """The ``Rendering`` of ``points`` against ``signals`` (B, F, 256, 256), ``batch_frames`` frames at
    a time, with the ``residuals`` when asked for."""
    runs, frames = signals.shape[:2]
    strips = model_strips(forward_model).count
    misfits = signals.new_zeros(runs, frames, strips)
    mu, signal_mu = signals.new_zeros(runs, frames), signals.new_zeros(runs, frames)
    left = torch.empty_like(signals) if residuals else None
    for begin in range(0, frames, batch_frames):
        chunk = slice(begin, min(begin + batch_frames, frames))
        pairs = [torch.stack([value[:, chunk], value[:, chunk.start + 1:chunk.stop + 1]], 2).flatten(0, 1)
                 for value in (points.leaf_a, points.leaf_b, points.jaws)]  # (B x chunk, 2, ...)
        measured = signals[:, chunk].flatten(0, 1)
        chunk_misfits, chunk_mu, chunk_signal_mu, chunk_left = _render_pairs(forward_model, *pairs, measured)
        misfits[:, chunk] = chunk_misfits.view(runs, -1, strips)
        mu[:, chunk], signal_mu[:, chunk] = chunk_mu.view(runs, -1), chunk_signal_mu.view(runs, -1)
        if residuals:
            left[:, chunk] = chunk_left.view(runs, -1, *chunk_left.shape[1:])
    return Rendering(misfits, mu, signal_mu, left)


def rerender(forward_model: nn.Module, signals: Tensor, points: ControlPointRun, rendering: Rendering,
             changed: Tensor, batch_frames: int = BATCH_FRAMES) -> Rendering:
    """``rendering`` with the frames of ``changed`` (B, F) rendered again at ``points``: the others
    are the same frames at the same control points."""
    runs, frames = signals.shape[:2]
    misfits, mu, signal_mu = rendering.misfits.clone(), rendering.mu.clone(), rendering.signal_mu.clone()
    where = changed.flatten().nonzero()[:, 0]
    for begin in range(0, len(where), batch_frames):
        index = where[begin:begin + batch_frames]
        run, frame = index // frames, index % frames
        pairs = [torch.stack([value[run, frame], value[run, frame + 1]], 1)
                 for value in (points.leaf_a, points.leaf_b, points.jaws)]
        misfits[run, frame], mu[run, frame], signal_mu[run, frame], _ = _render_pairs(forward_model, *pairs,
                                                                                       signals[run, frame])
    return Rendering(misfits, mu, signal_mu)


def _render_pairs(forward_model: nn.Module, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor,
                  measured: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Frames (K, 256, 256) against the motions leaf_a, leaf_b (K, 2, strips), jaws (K, 2, 2) [prev,
    curr]: ``frame_misfits``."""
    scalars = torch.cat([jaws.new_ones(len(jaws), 1), jaws[:, :, 0], jaws[:, :, 1]], 1).float()
    rendered = forward_model.render(leaf_a.flatten(1).float(), leaf_b.flatten(1).float(), scalars)[0]
    return frame_misfits(rendered, measured, model_strips(forward_model))


def frame_misfits(rendered: Tensor, measured: Tensor,
                  grid: StripGrid = STRIPS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Renderings per MU and frames (K, 256, 256): the per-strip misfits (K, strips of ``grid``,
    ``strip_misfits``) at the least-squares MU (K,), the signal MU (K,) and the residuals (K, 256, 256).

    The least-squares MU weighs each pixel by the rendering, so it rests on the field, where a
    model's response and output shape matter most; the signal MU, the frame's whole signal over the
    rendering's, rests on what a response conserves, the signal summed over the frame (and so on the
    leaf and jaw transmission, a third of a small field's signal). On the simulated clinic
    deliveries of ``bench_error_detection`` (commissioned sharp model, tuning arcs 5, 85, 165, 325,
    405) the first read the totals of error-free deliveries -0.2 / -1.0 / +0.7 / -1.8 / +0.8 % off,
    the second -0.4 / -1.8 / -1.3 / -1.4 / -1.2 %: mostly an offset common to the plans, which
    commissioning measures (``plan_qa.commissioned_mu_reference``); with it, the held-out arcs 6,
    86, 166 read +0.65 / +1.68 / +0.04 % (by least squares -0.92 / +0.22 / -1.75 %), and, once frames
    moved back by the sag continued their edges (``timeline.with_sag``), +0.68 / +0.75 / +0.30 % with
    another checkpoint that had read +0.72 / +1.83 / +0.35 % before."""
    measured = measured.float()
    mu = (rendered * measured).sum((-2, -1)) / (rendered * rendered).sum((-2, -1)).clamp_min(1e-12)
    signal_mu = measured.sum((-2, -1)) / rendered.sum((-2, -1)).clamp_min(1e-12)
    residuals = measured - mu[:, None, None] * rendered
    return strip_misfits(residuals.square().sum(-1), grid), mu, signal_mu, residuals


def keep_better(forward_model: nn.Module, signals: Tensor, start: ControlPointRun, fit: ControlPointRun,
                batch_frames: int = BATCH_FRAMES, start_rendering: Rendering | None = None,
                fit_rendering: Rendering | None = None) -> Kept:
    """The fit where the frames (lag-free, (B, F, 256, 256)) agree with it at least as well as with
    ``start``, else the start, per control point and leaf (module docstring); ``start_rendering``
    and ``fit_rendering``: theirs, when already made."""
    renderings = [start_rendering or render_run(forward_model, signals, start, batch_frames),
                  fit_rendering or render_run(forward_model, signals, fit, batch_frames)]
    start_misfit, fit_misfit = (rendering.misfits for rendering in renderings)
    start_rows, fit_rows = _point_costs(start_misfit), _point_costs(fit_misfit)
    leaves_from_start = start_rows < KEEP_START_BELOW * fit_rows  # (B, F + 1, strips)
    jaws_from_start = start_rows.sum(-1) < KEEP_START_BELOW * fit_rows.sum(-1)  # (B, F + 1)
    merged = ControlPointRun(torch.where(leaves_from_start, start.leaf_a, fit.leaf_a),
                             torch.where(leaves_from_start, start.leaf_b, fit.leaf_b),
                             torch.where(jaws_from_start[..., None], start.jaws, fit.jaws))
    points_changed = leaves_from_start.any(-1) | jaws_from_start  # (B, F + 1)
    renderings.append(rerender(forward_model, signals, merged, renderings[1],
                               points_changed[:, :-1] | points_changed[:, 1:], batch_frames))
    choice = torch.stack([rendering.misfits.sum((-2, -1)) for rendering in renderings]).argmin(0)  # 0 start, 1 fit
    runs = torch.arange(len(choice))
    masks = torch.stack([torch.ones_like(leaves_from_start), torch.zeros_like(leaves_from_start),
                         leaves_from_start])[choice, runs]
    candidates = (start, fit, merged)
    points = ControlPointRun(*(torch.stack([getattr(candidates[int(c)], name)[run] for run, c in enumerate(choice)])
                               for name in ("leaf_a", "leaf_b", "jaws")))
    mu, signal_mu = (torch.stack([getattr(rendering, name) for rendering in renderings])[choice, runs]
                     for name in ("mu", "signal_mu"))
    open_rows = open_leaves(points.jaws, model_strips(forward_model))
    share = float(masks[open_rows].float().mean()) if bool(open_rows.any()) else 0.0
    return Kept(points, masks, share, mu, signal_mu)


def open_leaves(jaws: Tensor, grid: StripGrid = STRIPS) -> Tensor:
    """(..., strips) mask of the strips of ``grid`` whose rows the jaws (..., 2) [jaw_1, jaw_2] mm leave open."""
    lower = MLC_Y_MIN_MM + grid.strip_mm * torch.arange(grid.count, device=jaws.device, dtype=jaws.dtype)
    return (lower + grid.strip_mm > jaws[..., :1]) & (lower < jaws[..., 1:])


def _point_costs(misfits: Tensor) -> Tensor:
    """(B, F, strips) per frame -> (B, F + 1, strips) per control point: the misfits of the frame ending at
    the point and of the frame starting there."""
    padded = torch.nn.functional.pad(misfits, (0, 0, 1, 1))
    return padded[:, :-1] + padded[:, 1:]
