"""Jaw edges refined from the frames' row sums, once the leaves are tracked.

Summed along x, a frame seen through the Wiener filter of ``epid.reconstruction.rows.RowDomain`` (its
detector response replaced by the small Gaussian T) is T along y applied to the row sums of the
aperture's fluence. Per MU, row y of sub-aperture t passes the jaws' share pass(y, t) (jaw
transmission + the rest x the row's open share between the jaws at t) of the leaves' row sum
R(y, t): the opening between the leaf pair of the row within the imager (in the 1 mm rows beside a
boundary between leaves, the tongue-and-groove strip's share only where both leaves are open),
less the leaf and interleaf transmission, plus that transmission over the whole row. So

    row_sums(y) = MU x T_y * (1/7) sum_t pass(y, t) R(y, t),

exact where the imager holds the blur along x. The leaves fix R; the jaws move only pass, and a
jaw's edge in a row partly open (a leaf row the jaw has just started to uncover) weighs that
row's opening: the network's jaw estimates, good to a few tenths of a mm, are not good enough there.

The profiles are differenced along y and compared with each frame's MU and a constant fitted by
least squares (a background that rises steadily along y, such as the arm's backscatter, drops
out). Each jaw's control points are refined in turn by coordinate descent: the control points of
one parity move over a grid of offsets while the others hold, so that each frame (joining control
points k - 1 and k) has one moving point and the costs of different points are independent. As
for the leaves, a frame fixes the mean of the jaw's sub-aperture positions sharply and the spread
weakly, so each mm a jaw travels within a frame costs ``JAW_TRAVEL_COST`` of that jaw's step energy:
among motions the frames cannot tell apart, the one of least travel. Moving one point at a time
cannot undo a zig-zag (each move alone shifts a frame's mean), and it makes one of a start off by
the same amount at neighbouring points (the points of one parity move twice that amount the other
way, and every frame's mean is right), so the chain's alternating part is taken out before every
stage, within ``ZIGZAG_MM``. Rows within ``EDGE_ROWS`` of the imager's ends, where the filter saw
the frame's repeated edges, are left out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from epid.models.aperture import frame_sub_apertures
from epid.synthesis.geometry import (
    GRID_SIZE,
    IMAGER_MARGIN,
    LEAF_GRID_ROWS,
    MLC_Y_MIN_MM,
    ROWS_PER_LEAF,
    SUB_APERTURES,
)

if TYPE_CHECKING:
    from epid.reconstruction.rows import RowDomain

JAW_STAGES = ((1.6, 0.2), (0.4, 0.05))
"""Coordinate-descent stages of the jaws: (range, grid step) mm around each control point."""
JAW_TRAVEL_COST = 5e-4
"""Cost of each mm a jaw travels within a frame, relative to the energy of its step (the row's
fluence per MU at the jaw, squared)."""
JAW_PULL_PER_MM2 = 1e-9
"""Pull of each control point to where it was (relative to the frame's energy, per mm squared),
for jaws the frames do not show."""
EDGE_ROWS = 3
"""Leaf-grid rows at each end of the imager left out of the misfit, mm. With 10, jaws within 10 mm
of the imager's ends kept the network's estimate, and the leaf rows they partly open were
tracked with a wrong opening: on 512 frames of held-out arc 2 (ideal physics) 98.1 % of the
leaves were within 1 mm with 10 rows left out, 99.5-99.6 % with 0 to 3; whole arcs 2, 82, 162:
98.9-99.0 % with 10, 99.4 % with 3. Nearer than ~3 mm the filter's repeated edges distort the rows."""
ZIGZAG_MM = 0.5
"""Largest change that taking a jaw chain's zig-zag out may make to a control point, mm (more is a
real change of speed, not the network's noise)."""
CHUNK_ELEMENTS = 2**24
"""Candidate rows evaluated at once (candidates x runs x frames x 7 x 260)."""
HALF_IMAGER_MM = GRID_SIZE / 2
"""Half the imager's width along x, mm: the leaves' openings are counted within +-this."""


def leaf_row_fluence(domain: RowDomain, leaf_a: Tensor, leaf_b: Tensor) -> Tensor:
    """Leaves (B, N + 1, strips) at the control points -> R (B, N, 7, rows): each row's fluence of
    the strips' grid summed along the imager's x at each sub-aperture of each frame, per MU, with
    the jaws open."""
    band = domain.grid.rows_per_pixel
    low = (frame_sub_apertures(leaf_a.float()) - domain.offset_a).clamp(-HALF_IMAGER_MM, HALF_IMAGER_MM)
    high = (frame_sub_apertures(leaf_b.float()) + domain.offset_b).clamp(-HALF_IMAGER_MM, HALF_IMAGER_MM)
    own = (high - low).clamp_min(0.0)  # (B, N, 7, strips)
    both = (torch.minimum(high[..., :-1], high[..., 1:]) - torch.maximum(low[..., :-1], low[..., 1:])).clamp_min(0.0)
    rows = own[..., None].repeat_interleave(ROWS_PER_LEAF, -1)  # (B, N, 7, strips, 5)
    for k, share in enumerate(domain.groove_rows):  # the k-th row from a boundary
        rows[..., :-1, -1 - k] = (1 - share) * own[..., :-1] + share * both  # of each strip but the last
        rows[..., 1:, k] = (1 - share) * own[..., 1:] + share * both  # of each strip but the first
    closed = torch.full((domain.grid.count, ROWS_PER_LEAF), domain.leaf_transmission, device=leaf_a.device)
    closed[:-1, -band:] += domain.interleaf_leakage
    closed[1:, :band] += domain.interleaf_leakage
    return (rows * (1 - closed) + GRID_SIZE * closed).flatten(-2)


def jaw_passes(domain: RowDomain, jaws: Tensor) -> Tensor:
    """Jaws (..., N + 1, 2) at the control points -> (..., N, 7, rows): the share of each row of
    the strips' grid the jaws pass at each sub-aperture of each frame (``RowDomain.jaw_openings``,
    with the learned jaw transmission)."""
    return domain.jaw_transmission + (1 - domain.jaw_transmission) * domain.jaw_openings(jaws).flatten(-2)


def _pixel_rows(domain: RowDomain, rows: Tensor) -> Tensor:
    """(..., rows) on the strips' grid -> (..., 260) on the 1 mm rows (the mean of each pixel's rows)."""
    per_pixel = domain.grid.rows_per_pixel
    return rows if per_pixel == 1 else rows.unflatten(-1, (LEAF_GRID_ROWS, per_pixel)).mean(-1)


def start_row_sums(domain: RowDomain, banks: list[Tensor], jaws: Tensor) -> Tensor:
    """Row sums per MU (B, N, 260) of frames seen through T at control points (leaf banks (B, N +
    1, strips), jaws (B, N + 1, 2) mm): what ``track_jaws`` models them as."""
    return _seen_row_sums(domain, jaw_passes(domain, jaws), leaf_row_fluence(domain, *banks))


def _seen_row_sums(domain: RowDomain, passes: Tensor, fluence: Tensor) -> Tensor:
    """Row sums per MU (..., F, 260) seen through T: the jaws' ``passes`` (..., F, 7, rows) of the
    leaves' row fluence (..., F, 7, rows), averaged over the sub-apertures and each pixel's rows,
    blurred along y."""
    return _blur_rows(domain, _pixel_rows(domain, (passes * fluence).mean(-2)))


def imager_rows(device: torch.device | str) -> Tensor:
    """(260,) 1 on the leaf-grid rows the misfit counts, 0 on the others (``EDGE_ROWS``)."""
    weights = torch.zeros(LEAF_GRID_ROWS, device=device)
    weights[IMAGER_MARGIN + EDGE_ROWS:IMAGER_MARGIN + GRID_SIZE - EDGE_ROWS] = 1.0
    return weights


def track_jaws(domain: RowDomain, row_sums: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor, mu: Tensor,
               stages: tuple[tuple[float, float], ...] = JAW_STAGES) -> Tensor:
    """Refined jaws (B, N + 1, 2) of B runs of N frames from their start ``jaws`` (B, N + 1, 2) mm:
    ``row_sums`` (B, N, 260) the frames' filtered row sums (``RowDomain.filtered_rows`` summed along
    x), leaves (B, N + 1, strips) mm at the control points, ``mu`` (B, N) each frame's MU (for the
    travel cost); see the module docstring."""
    fluence = leaf_row_fluence(domain, leaf_a, leaf_b)
    weights = imager_rows(row_sums.device)[1:]
    measured = torch.diff(row_sums.float(), dim=-1) * weights
    measured = measured - (measured.sum(-1, keepdim=True) / weights.sum()) * weights
    energy = measured.square().sum(-1)  # (B, N)
    jaws = jaws.float()
    points = jaws.shape[1]
    parity = torch.arange(points, device=jaws.device) % 2
    for range_mm, step_mm in stages:
        jaws = _without_zigzag(jaws)
        offsets = torch.linspace(-range_mm, range_mm, round(2 * range_mm / step_mm) + 1, device=jaws.device)
        pull = JAW_PULL_PER_MM2 * offsets.square()[:, None, None] * energy.mean(-1)[None, :, None]
        for jaw in (0, 1):
            for moving in (parity == 0, parity == 1):
                candidates = jaws.expand(len(offsets), *jaws.shape).clone()
                candidates[..., jaw] += offsets[:, None, None] * moving
                costs = _frame_costs(domain, measured, fluence, candidates, weights)  # (S, B, N)
                costs = costs + _travel(domain, fluence, candidates, jaw, mu)
                per_point = costs.new_zeros(*costs.shape[:-1], points)  # frame k joins points k and k + 1
                per_point[..., 1:] += costs
                per_point[..., :-1] += costs
                choice = offsets[(per_point + pull).argmin(0)]  # (B, N + 1)
                jaws[..., jaw] += choice * moving
    return jaws


def _without_zigzag(jaws: Tensor) -> Tensor:
    """Jaws (B, N + 1, 2) with the alternating part of the chain taken out ([1, 2, 1] / 4 along the
    control points, the ends extrapolated from the points beside them), each point changed by at
    most ``ZIGZAG_MM``: the one motion the frames hardly see, which coordinate descent cannot undo
    (it moves one control point at a time, and each move alone shifts a frame's mean). Runs of
    fewer than 4 control points are kept as they are."""
    if jaws.shape[1] < 4:
        return jaws.clone()
    smooth = jaws.clone()
    smooth[:, 1:-1] = (jaws[:, :-2] + 2 * jaws[:, 1:-1] + jaws[:, 2:]) / 4
    smooth[:, 0] = 2 * smooth[:, 1] - smooth[:, 2]
    smooth[:, -1] = 2 * smooth[:, -2] - smooth[:, -3]
    return jaws + (smooth - jaws).clamp(-ZIGZAG_MM, ZIGZAG_MM)


def _frame_costs(domain: RowDomain, measured: Tensor, fluence: Tensor, candidates: Tensor, weights: Tensor) -> Tensor:
    """Misfit (S, B, N) of each frame's differenced row sums (``measured``, (B, N, 259)) under each
    candidate's jaws (S, B, N + 1, 2), each frame's MU and a constant (a background that rises
    steadily along y) the least-squares ones, over the counted rows."""
    frames = measured.shape[1]
    per_chunk = max(1, CHUNK_ELEMENTS // (candidates.shape[0] * candidates.shape[1] * SUB_APERTURES
                                          * domain.grid.rows))
    costs = []
    for k in range(0, frames, per_chunk):
        stop = min(k + per_chunk, frames)
        passes = jaw_passes(domain, candidates[:, :, k:stop + 1])  # (S, B, F, 7, rows)
        seen = torch.diff(_seen_row_sums(domain, passes, fluence[:, k:stop]), dim=-1) * weights  # (S, B, F, 259)
        seen = seen - (seen.sum(-1, keepdim=True) / weights.sum()) * weights  # the constant projected out
        cross = (seen * measured[:, k:stop]).sum(-1)
        costs.append(-cross.square() / seen.square().sum(-1).clamp_min(1e-12))
    return torch.cat(costs, -1)


def _travel(domain: RowDomain, fluence: Tensor, candidates: Tensor, jaw: int, mu: Tensor) -> Tensor:
    """The travel cost (S, B, N) of each frame: ``JAW_TRAVEL_COST`` x the jaw's step energy (the
    frame's MU x the fluence per MU of the open row at the jaw at the frame's start, squared, seen
    through T) per mm the jaw moves within the frame."""
    motion = (candidates[..., 1:, jaw] - candidates[..., :-1, jaw]).abs()  # (S, B, N)
    start = candidates[0, :, :-1, jaw] - MLC_Y_MIN_MM  # (B, N): the first candidate's, mm above the leaf grid
    row = (start.floor().long() - jaw).clamp(0, LEAF_GRID_ROWS - 1)  # jaw_1: the row above it, jaw_2: below
    step = _pixel_rows(domain, fluence[..., 0, :]).gather(-1, row[..., None])[..., 0]  # (B, N)
    energy = (step * mu.float()).square() * domain.gram[2 * domain.reach]
    return JAW_TRAVEL_COST * energy * motion


def _blur_rows(domain: RowDomain, rows: Tensor) -> Tensor:
    """Row profiles (..., 260) seen through T along y ('same', zero beyond the leaf grid)."""
    flat = rows.reshape(-1, 1, rows.shape[-1])
    return F.conv1d(flat, domain.taps[None, None], padding=domain.reach).view(rows.shape)
