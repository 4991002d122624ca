"""Leaf edges tracked through consecutive frames, one leaf row at a time.

The frame a forward model renders is its detector response K applied to the aperture's fluence
on 1 mm cells. A Wiener filter turns each lag-free frame S into D = T * (mu F): the fluence seen
through a small sampled Gaussian T (taps t) instead of K, the sharpest that the filter can
reproduce for this response (``epid.reconstruction.rows``). In D, a leaf row's profile
along x (its pixel rows averaged, the central ones and those the jaws leave open weighing most,
``ROW_WEIGHTS``) depends on that leaf's edges, a little on its neighbours' (through T along y)
and on the jaws' open share of each pixel row at each sub-aperture.
Differenced along x, a profile is a sum of blurred steps: each of the 7 sub-aperture positions p
of a bank A edge adds a lin_t(boundary - p), bank B's subtract, a = MU x (1 - leaf transmission)
x the row's open share / 7. In the 1 mm rows beside a boundary between two leaves, the share the
tongue-and-groove strip covers is open only where both leaves are: its steps sit at the more
closed of the two edges (and closed leaves leak a little more there). lin_t, the taps linearly
interpolated, is exact for a cell covered in part: a step at p is t applied to the "splat" of p
onto the 1 mm lattice (weight 1 - f at floor(p), f at floor(p) + 1, f = p - floor(p)).

For one edge, with every other edge held, the misfit of frame k moving the edge from u to v is,
up to a constant,

    cost(u, v) = -2 sum_t a_t Y(p_t) + sum_(t,t') a_t a_t' A(p_t, p_t'),  p_t = u + (t / 6)(v - u),

where Y, the correlation of the row's differenced residual (the edge's own steps added back)
with t on the integer lattice, linearly interpolated, is exact, and A(p, p') the inner product of
two steps. A depends on p - p' and, by a few %, on where p falls in its cell (a step on a cell
boundary is sharper than one inside a cell): ``step_products`` tabulates the second part for
equal weights a_t, so costs are exact where the jaws leave the row's open share constant during
the frame and nearly so elsewhere. An edge's own weight includes the strips beside its leaf
where, at its current position, it is the more closed of the two; the stages settle that.

An edge's control points form a chain (frame k joins points k - 1 and k), so the positions of
least total misfit over the whole run of frames, each within a range of its start on a grid,
follow exactly by dynamic programming (the Viterbi recursion): a leaf that goes out and comes
back is settled by the frames on either side, as far along the arc as they reach. Each stage
(range, grid step) updates bank A, then bank B, each frame's MU refitted (least squares on the
differenced profiles of the leaves that move) as their residual is recomputed.

A frame fixes the mean of its edge's sub-aperture positions sharply but their spread, the motion
within the frame, only weakly: a chain that zig-zags about the true positions (each point in
turn too far out and too far in) changes each frame's misfit little, and noise, a partly open
row or a synthesis that rounds edges to the 1 mm grid can favour it. Each mm an edge travels in
a frame therefore costs ``TRAVEL_COST`` of one open-row step's energy: among motions the frames
cannot tell apart, the one of least travel.

The row domain is a reduction of the forward model: T is reproduced only within a few %, the
response's broad term is left out, the tongue-and-groove and partly open rows are approximated.
Under a sharp response that is below what the tracking can see; under a 12 mm wide one it is not
(a leaf's motion within a frame is read from the shape of its blurred edges, and a shape a few %
off reads as motion). So the rows are read relative to the start: the forward model renders the
start's frames, the residuals (measured less rendered) are filtered, and the start's own rows (the
row model at the start, per MU) are added: D = mu_s M(start) + W (S - mu_s R(start)). Whatever the
row domain leaves out of R cancels at the start and enters only as it changes between start and
fit. On the forward model's own noise-free frames of a 12 mm wide response (40 frames of arcs 5,
85, 165), tracked from the truth without the travel cost, the leaves stayed 0.12 mm from it;
reading W S itself they moved 0.8 and 1.6 mm (arcs 85, 165).

The two leaves of a pair meet and never cross (``CROSSING_COST``): each position of an edge beyond
the other bank's edge of its leaf, where it stands, is ruled out, so a closed pair stays closed
where the banks first meet (a pair closed at the wrong place does not slide; it would have to
open first).

Each edge is moved with every other edge held; under a broad response T couples neighbouring
leaves strongly (at 4.6 mm a leaf 5 mm away sees 55 % of the centre tap), and leaves moved all at
once, each explaining its neighbours' misfit too, overshoot together. The leaves of a bank
therefore move in groups of every n-th leaf (``leaf_groups``, ``GROUP_COUPLING``): one group of all
52 under the built-in response, three under a 12 mm wide one.

What a broad response cannot show at all is how neighbouring leaves differ from each other on the
scale of a strip: leaves alternately a little out and a little in along y (a period of two 5 mm
strips, 0.1 per mm) reach the frames through the response's transfer along y at that frequency,
0.31 for the built-in kernel, 6.9e-3 for a 12 mm wide one (`broad.mat`) and 2.1e-3 for a 16 mm wide
one (`broadest.mat`), below the noise. Leaves fitted one at a time then stray in opposite directions
(fitted errors of neighbouring leaves correlated -0.19 to -0.44 under the 16 mm response on the
tuning arcs 85, 165, 405). HD120's 2.5 mm leaves alternate at 0.2 per mm, which even the built-in
kernel passes at 1.8e-2. So, under a response broad to the strips (``RowDomain.broad``), each mm a
leaf stands apart from each neighbouring leaf of its bank that the frame shows costs
``NEIGHBOUR_COST`` of its step energy (a total-variation prior along y: the same cost for one large
step as for many small ones of the same sum, so a shape's steps stay where the frames show them).

The jaws decide how much of a leaf row each frame shows, and in a row the jaws have only begun
to uncover, a few tenths of a mm of jaw error change that several times over: after the first
stage, with the leaves roughly in place, the jaws are refined from the frames' row sums
(``epid.reconstruction.jaws``) and the rows re-weighed for the stages after it. Leaves that no jaw
opens keep their start (a small pull to it breaks ties). Everything runs batched over
independent runs of frames (a batch of frame pairs, or one arc), on the CPU or a GPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from epid.models.aperture import frame_sub_apertures
from epid.reconstruction.jaws import JAW_STAGES, start_row_sums, track_jaws
from epid.reconstruction.rows import (
    FIRST_BOUNDARY_MM,
    MAX_MOTION_MM,
    PHASES,
    PRODUCT_STEP_MM,
    TABLE_STEP_MM,
    RowDomain,
    mean_products,
)
from epid.synthesis.geometry import (
    GRID_SIZE,
    SUB_APERTURES,
)

PULL_PER_MM2 = 1e-6
"""Pull of each control point to its start (misfit per mm squared), for leaves no frame shows."""
TRAVEL_COST = 5e-4
"""Cost of each mm an edge travels within a frame, relative to the energy of one edge's step in a
fully open row: among motions the frames can hardly tell apart, the one of least travel."""
POLISH_STAGES = ((2.0, 0.2), (0.5, 0.05))
"""Stages after the given ones when the frames are seen through a Gaussian wider than
``MIN_TARGET_SIGMA_MM`` (a broad response), with the travel cost scaled by (``POLISH_SIGMA_MM`` /
width)^2. The travel cost biases each motion towards less travel by about width^2 (with its
curvature falling as width^-3 and the step energy as width^-1): started from the truth, without
noise, the leaves moved 0.2 mm at a 2 mm width and 0.5 mm at 4 mm (0.03 and 0.05 mm without
the cost). The first stages need the full cost to settle zig-zags; these take the bias out.
Chosen on arcs 5, 85, 165 (24 frames of a 12 mm wide response): leaf MAE 0.69 -> 0.54 mm."""
POLISH_SIGMA_MM = 1.25
"""The polishing stages' travel cost is the full cost x (this / T's width)^2. Started 1.5 mm inside
the truth, the fit ended 0.42 mm from it, as from the network's estimate, though the frames
fit the truth better (the fallback kept it wherever it was the start): the polishing cost still
pulled. On 40 frames of the tuning arcs 5, 85, 165, 325, 405 (realistic physics, the 12 mm wide
response), leaf MAE and share within 1 mm by this value: 2.0 mm 0.439 mm / 94.0 %, 1.5 mm 0.395 /
95.9, 1.25 mm 0.389 / 95.5, 1.0 mm 0.386 / 95.5, 0.75 mm 0.398 / 95.3, 0.5 mm 0.413 / 94.4, 0 (no
cost) 0.433 / 93.6; the `elongated` response 0.407 / 94.9 -> 0.392 / 95.7 and the 16 mm one 0.770
/ 81.2 -> 0.760 / 82.1 (2.0 -> 1.25 mm)."""
NEIGHBOUR_COST = 1e-4
"""Under a response broad to the strips, cost of each mm by which a leaf stands apart from each
neighbouring leaf of its bank that a frame shows, relative to one edge's step energy in a fully open
row (module docstring: what a broad response cannot show). On 150 frames of each tuning arc 5, 85, 165,
325, 405 (realistic physics, 20-minute checkpoints, seed 0), leaf MAE and share within 1 mm without
it and at 5e-5, 1e-4, 2e-4, 4e-4, 1e-3: the 16 mm wide response (`broadest.mat`) 0.629 mm / 86.9 %,
0.549 / 89.8, 0.533 / 90.3, 0.535 / 89.2, 0.577 / 86.5, 0.679 / 82.0 (the irregular arc 165 80.2,
81.8, 81.1, 78.2, 69.3, 55.6 %); the 12 mm wide one (`broad.mat`) 0.353 / 96.0 -> 0.309 / 97.0 at
1e-4, every arc as good or better (the values other than 1e-4 measured with the neighbours' visibility
read from their weight in the rows, 1e-4 there 0.533 / 90.2 %). Cut off at 3 mm (no pull beyond; at
1e-3), the semi-regular arcs 85 and 405 lost 3.5 and 4.7 points against the cost without the cut:
their neighbouring leaves differ by 1.4 mm (median), which is what the frames cannot show. HD120's 2.5 mm
strips under the built-in response (20-minute checkpoint, 17,760 samples), 150 frames of the same arcs:
0.248 mm / 97.83 % (the 2.5 mm leaves 96.83 %) without it, 0.215 / 98.61 % (97.97 %) with it."""
CROSSING_COST = 1e9
"""Cost per mm by which a position of an edge lies beyond the other bank's edge of its leaf (held
where it is): the leaves of a pair meet and never cross. Unbounded, the stages crossed closed pairs
started a little open: bank A, moved first, took the whole excess slit and more, since the row
model renders a crossed pair as a negative slit that explains any excess light (on frames the
model rendered itself, from a start 0.8 mm open, 1.7-1.9 mm crossed; Halcyon, whose parked strips
are closed at x = 0, 24 % of the strips' control points of the tuning arcs 5, 85, 165)."""
GROUP_COUPLING = 0.05
"""Largest tap of T along y between leaves that move in the same step, relative to its centre tap.
The leaves of a bank moved all at once, each with its neighbours held, overshoot together where
T couples them strongly: on the forward model's own frames of a 12 mm wide response (T 4.6 mm),
tracked from the network's estimate, 0.70 mm from the truth all at once, 0.55 mm in three groups."""
SHOWN_ONLY = ("cpu",)
"""Device types on which each chunk of frames computes the pair costs of only the leaves some frame
of it shows (``_track_bank``). On the CPU, which spends its time computing the costs: HD120's
20-minute built-in checkpoint, 300 frames of the tuning arcs 5, 85, 165, 7.07 -> 11.47 frames/s,
and a 12 mm wide response's (52 strips), 300 frames of six held-out arcs, 11.2 -> 14.3 frames/s
(2-core AMD EPYC, AVX2). On a GPU, whose time goes to launching the recursion's small kernels, the
mask's reads and scatter cost more than they save (one H200, HD120's whole arcs 2, 82, 162: 301
frames/s computing every leaf's costs, 225 only the shown ones'), so there every leaf's are computed."""
PAIR_ELEMENTS = {"cpu": 2**19}
"""Pair costs evaluated at once (frames x runs x leaves x states^2) per device type, 2**23 on others
(a GPU). On the CPU the smaller chunks stay in cache: 300 frames of an arc, 2 cores of an AMD
EPYC, 2**19 against 2**23: 24.1 and 27.6 against 18.2 and 19.7 frames/s (built-in response),
12.6 and 13.7 against 9.9 and 9.3 (a 12 mm wide one), the same control points."""


@dataclass(frozen=True)
class Tracked:
    """Leaf edges tracked through B runs of N frames: leaf_a, leaf_b (B, N + 1, strips) and jaws (B, N +
    1, 2) mm at the control points and mu (B, N) of each frame (least squares on the differenced
    profiles)."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor


def track_leaves(domain: RowDomain, signals: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor,
                 stages: tuple[tuple[float, float], ...], chunk_frames: int = 64,
                 jaw_stages: tuple[tuple[float, float], ...] = JAW_STAGES, start_mu: Tensor | None = None) -> Tracked:
    """Track the leaf edges of B runs of N lag-free frames ``signals`` (B, N, 256, 256) from their
    start (leaf_a, leaf_b (B, N + 1, strips), jaws (B, N + 1, 2) mm) through ``stages`` ((range, grid
    step) mm each); see the module docstring. After the first stage the jaws are refined with the
    leaves found (``epid.reconstruction.jaws``, ``jaw_stages``; none: the jaws as given). ``chunk_frames``
    bounds the frames filtered at once. With ``start_mu`` (B, N), ``signals`` are the residuals of the
    forward model's rendering of the start at those MU, and the rows read are the filtered
    residuals plus the start's rows (module docstring)."""
    jaws = jaws.float()
    start = None if start_mu is None else _Start([leaf_a.float(), leaf_b.float()], jaws, start_mu.float())
    observed = _Observed.of(domain, signals, jaws, chunk_frames, row_sums=bool(jaw_stages), start=start)
    banks = [leaf_a.float().clone(), leaf_b.float().clone()]
    schedule = [(range_mm, step_mm, 1.0) for range_mm, step_mm in stages]
    if domain.broad:
        scale = (POLISH_SIGMA_MM / domain.target_sigma_mm) ** 2
        schedule += [(range_mm, step_mm, scale) for range_mm, step_mm in POLISH_STAGES]
    groups = leaf_groups(domain, signals.device)
    for number, (range_mm, step_mm, travel_scale) in enumerate(schedule):
        states = round(2 * range_mm / step_mm) + 1
        offsets = torch.linspace(-range_mm, range_mm, states, device=signals.device)
        for bank in (0, 1):
            for moving in groups:
                banks[bank] = _track_bank(domain, observed.profiles, observed.coupling, observed.seen, banks, bank,
                                          offsets, travel_scale, moving)
        if number == 0 and jaw_stages:
            mu = _best_mu(observed.profiles, _model(domain, observed.coupling, banks))
            jaws = track_jaws(domain, observed.row_sums, banks[0], banks[1], jaws, mu, jaw_stages)
            # the frames are filtered again rather than kept: a whole arc's would hold (N, 260, 256) floats
            observed = _Observed.of(domain, signals, jaws, chunk_frames, row_sums=False, start=start)
    mu = _best_mu(observed.profiles, _model(domain, observed.coupling, banks))
    return Tracked(banks[0], banks[1], jaws, mu)


@dataclass(frozen=True)
class _Start:
    """Where residual frames were rendered: both banks (B, N + 1, strips) and jaws (B, N + 1, 2) mm at
    the control points, and each frame's MU (B, N)."""

    banks: list[Tensor]
    jaws: Tensor
    mu: Tensor


@dataclass(frozen=True)
class _Observed:
    """What tracking reads of B runs of N frames under given jaws: the differenced leaf-row profiles
    (B, N, strips, 255), the ``RowDomain.coupling`` pair, ``seen`` (B, N, strips) (the leaf's rows open in
    the frame) and, when asked for, the filtered frames' row sums (B, N, 260)."""

    profiles: Tensor
    coupling: tuple[Tensor, Tensor]
    seen: Tensor
    row_sums: Tensor | None

    @classmethod
    def of(cls, domain: RowDomain, signals: Tensor, jaws: Tensor, chunk_frames: int, row_sums: bool,
           start: _Start | None = None) -> _Observed:
        openings = domain.jaw_openings(jaws)  # (B, N, 7, strips, 5)
        row_weights = domain.row_weights(openings)
        profiles, sums = [], []
        for k in range(0, signals.shape[1], chunk_frames):
            rows = domain.filtered_rows(signals[:, k:k + chunk_frames])
            profiles.append(domain.leaf_profiles(rows, row_weights[:, k:k + chunk_frames]))
            if row_sums:
                sums.append(rows.sum(-1))
        profiles = torch.cat(profiles, 1)
        sums = torch.cat(sums, 1) if row_sums else None
        if start is not None:
            start_openings = domain.jaw_openings(start.jaws) if start.jaws is not jaws else openings
            start_coupling = domain.coupling(start_openings, row_weights)
            profiles = profiles + start.mu[..., None, None] * _model(domain, start_coupling, start.banks)
            if row_sums:
                sums = sums + start.mu[..., None] * start_row_sums(domain, start.banks, start.jaws)
        return cls(profiles, domain.coupling(openings, row_weights), row_weights.sum(-1) > 0, sums)


def _edges(domain: RowDomain, positions: Tensor, bank: int) -> Tensor:
    """Edge positions of a bank's leaves at ``positions``, after the bank's leaf-end offset."""
    return positions - domain.offset_a if bank == 0 else positions + domain.offset_b


def _model(domain: RowDomain, coupling: tuple[Tensor, Tensor], banks: list[Tensor],
           rows: Tensor | None = None) -> Tensor:
    """Differenced profiles per MU (B, F, strips, 255) of both banks' control points (B, F + 1, strips),
    ``coupling`` as ``RowDomain.coupling``: every leaf's edges and, where both leaves beside a
    boundary are open, the tongue-and-groove strip's (bank A's at the larger of the two, bank
    B's at the smaller). With ``rows`` (L,), the profiles of those leaves only (B, F, L, 255)."""
    own, groove = coupling
    edges = [_edges(domain, frame_sub_apertures(banks[bank]), bank) for bank in (0, 1)]  # (B, F, 7, strips)
    strip_a = torch.maximum(edges[0][..., :-1], edges[0][..., 1:])  # (B, F, 7, 51): boundaries 0..50
    strip_b = torch.maximum(strip_a, torch.minimum(edges[1][..., :-1], edges[1][..., 1:]))
    parts = [(edges[0], own, 1.0), (edges[1], own, -1.0)]
    if domain.groove_share > 0:
        parts += [(strip_a, groove, 1.0), (strip_b, groove, -1.0)]
    chosen = slice(None) if rows is None else rows
    count = domain.grid.count
    positions, weights = [], []
    for edge, coupling_of, sign in parts:
        sources = coupling_of.shape[-1]
        first = (sources - 1 - (edge.shape[-1] - count)) // 2  # sources before leaf / boundary 0
        padded = F.pad(edge, (first, sources - 1 - first + count - edge.shape[-1]))
        # (B, F, L, 7 x sources): the edges of leaf (or boundary) j + source seen in leaf j's profile
        positions.append(padded.unfold(-1, count, 1).permute(0, 1, 4, 2, 3)[:, :, chosen].flatten(-2))
        weights.append(sign * coupling_of.permute(0, 1, 3, 2, 4)[:, :, chosen].flatten(-2))
    return domain.blur(domain.splat(torch.cat(positions, -1), torch.cat(weights, -1))) / SUB_APERTURES


def _best_mu(profiles: Tensor, model: Tensor) -> Tensor:
    """Least-squares MU (B, F) of profiles ~ mu x model."""
    return (profiles * model).sum((-2, -1)) / model.square().sum((-2, -1)).clamp_min(1e-12)


def leaf_groups(domain: RowDomain, device: torch.device | str) -> list[Tensor]:
    """The leaves (indices) moved together in each step of a stage: every ``n``-th leaf, ``n`` the
    fewest whose strips, ``n`` strip widths apart, see each other's edges through T along y at no more
    than ``GROUP_COUPLING`` of the centre tap (one group, all 52 leaves, through a Gaussian of
    2 mm; three groups through one of 4-6 mm)."""
    spacing = 1
    while math.exp(-0.5 * (spacing * domain.grid.strip_mm / domain.target_sigma_mm) ** 2) > GROUP_COUPLING:
        spacing += 1
    leaves = torch.arange(domain.grid.count, device=device)
    return [leaves[first::spacing] for first in range(spacing)]


def _track_bank(domain: RowDomain, profiles: Tensor, coupling: tuple[Tensor, Tensor], seen: Tensor,
                banks: list[Tensor], bank: int, offsets: Tensor, travel_scale: float, moving: Tensor) -> Tensor:
    """One bank's control points (B, N + 1, strips) with those of the leaves ``moving`` (L,) moved to
    the positions of least misfit plus travel (``TRAVEL_COST`` x ``travel_scale``, in the frames
    where ``seen`` (B, N, strips), the leaf's rows open) within ``offsets`` (S,) of where they are,
    every other edge held, never beyond the other bank's edge of its leaf (``CROSSING_COST``), and each
    frame's MU refitted (the Viterbi recursion).

    Only the moving leaves' profiles enter: their residual and each frame's MU (least squares on
    them alone). Refitting the MU on all 52 profiles would render every leaf's profile at each
    group step (150 frames of arc 6, 12 mm wide response: the row model 3.5 s against 2.2 s of a
    22-23 s reconstruction, profiled) for no measurable gain:
    300 frames of each tuning arc 5, 85, 165, 325, 405 (realistic physics, 20-minute checkpoint),
    0.391 mm / 94.43 % within 1 mm with all profiles and 0.392 mm / 94.43 % with the moving
    leaves' (per arc -0.24 to +0.20 points, as float rounding alone moves them: -0.17 to +0.01);
    the 16 mm wide response (150 frames of the same arcs, their mean) 0.824 mm / 79.9 % and 0.826 mm
    / 80.1 %. With one group (a sharp response) the two are the same.

    A leaf that no frame of a chunk of frames shows (the jaws close its rows: its profile has no
    weight) has costs of exactly 0 there, which on the CPU are not computed (``SHOWN_ONLY``): the jaws
    show about a quarter of the strips in a frame, half of them in a chunk."""
    batch, frames = profiles.shape[:2]
    start = banks[bank]
    states, count = len(offsets), len(moving)
    pull = PULL_PER_MM2 * offsets.square()
    sign = 1.0 if bank == 0 else -1.0
    other = banks[1 - bank][..., moving, None]  # (B, N + 1, L, 1)
    crossing = CROSSING_COST * F.relu(sign * (start[..., moving, None] + offsets - other))  # (B, N + 1, L, S)
    point_costs = pull + crossing
    best = point_costs[:, 0]
    choices = torch.empty(frames, batch, count, states, dtype=torch.long, device=profiles.device)
    per_chunk = max(1, PAIR_ELEMENTS.get(profiles.device.type, 2**23) // (batch * count * states * states))
    for k in range(0, frames, per_chunk):
        part = slice(k, min(k + per_chunk, frames))
        points = [b[:, part.start:part.stop + 1] for b in banks]
        shown = seen[:, part][..., moving]  # (B, F, L)
        costs_of = functools.partial(_chunk_costs, domain, profiles[:, part], tuple(c[:, part] for c in coupling),
                                     points, bank, offsets, travel_scale, seen[:, part])
        costs = _shown_costs(costs_of, moving, shown, offsets)
        for frame in range(costs.shape[1]):
            total = best[..., :, None] + costs[:, frame]
            best, choices[k + frame] = total.min(-2)
            best = best + point_costs[:, k + frame + 1]
            best = best - best.amin(-1, keepdim=True)
    index = best.argmin(-1)  # (B, L) at the last control point
    chosen = [index]
    for frame in range(frames - 1, -1, -1):
        index = choices[frame].gather(-1, index[..., None])[..., 0]
        chosen.append(index)
    result = start.clone()
    result[..., moving] = start[..., moving] + offsets[torch.stack(chosen[::-1], 1)]
    return result


def _shown_costs(costs_of: Callable[[Tensor], Tensor], moving: Tensor, shown: Tensor, offsets: Tensor) -> Tensor:
    """The costs (B, F, L, S, S) of the leaves ``moving`` (L,) over a chunk of frames, ``costs_of(leaves)``
    (``_chunk_costs`` of the chunk), computed on a ``SHOWN_ONLY`` device for only the leaves some
    frame of it shows (``shown`` (B, F, L)): the others' are exactly 0. ``offsets`` (S,) the search's."""
    if offsets.device.type not in SHOWN_ONLY:
        return costs_of(moving)
    active = shown.flatten(0, -2).any(0)  # (L,)
    if bool(active.all()):
        return costs_of(moving)
    costs = offsets.new_zeros(*shown.shape, len(offsets), len(offsets))
    if bool(active.any()):
        costs[:, :, active] = costs_of(moving[active])
    return costs


def _chunk_costs(domain: RowDomain, profiles: Tensor, coupling: tuple[Tensor, Tensor], points: list[Tensor], bank: int,
                 offsets: Tensor, travel_scale: float, seen: Tensor, rows: Tensor) -> Tensor:
    """The misfit plus travel (B, F, L, S, S) of each of F frames moving each edge of the leaves ``rows``
    (L,) of ``bank`` from points[k] + offsets[i] to points[k + 1] + offsets[i'] (``_track_bank``), every
    other edge held, each frame's MU refitted on those leaves' profiles; under a response broad to the
    strips, plus the pull to the neighbouring edges (``_neighbour_distances``). profiles (B, F, strips, 255) and
    ``coupling`` of the F frames, both banks' points (B, F + 1, strips), ``seen`` (B, F, strips) the
    leaves each frame shows (where their travel costs)."""
    shown = seen[..., rows]  # (B, F, L)
    sign = 1.0 if bank == 0 else -1.0
    model = _model(domain, coupling, points, rows=rows)
    frame_mu = _best_mu(profiles[:, :, rows], model)
    weights = (_own_weights(domain, coupling, points[bank], bank)[..., rows]
               * frame_mu[..., None, None] / SUB_APERTURES).transpose(-2, -1)  # (B, F, L, 7)
    moved = points[bank][..., rows]
    edges = _edges(domain, frame_sub_apertures(moved), bank).transpose(-2, -1)
    own = domain.blur(domain.splat(edges, weights))
    residual = profiles[:, :, rows] - frame_mu[..., None, None] * model
    correlation = domain.correlate(sign * residual + own)  # (B, F, L, lattice)
    costs = _pair_costs(domain, correlation, weights, moved, offsets, bank)
    motion = (moved[:, 1:] - moved[:, :-1])[..., None, None] + offsets - offsets[:, None]
    step_energy = (frame_mu * (1 - domain.leaf_transmission)).square() * domain.gram[2 * domain.reach]
    travel = TRAVEL_COST * travel_scale * step_energy[..., None] * shown  # (B, F, L) per mm
    costs = costs + travel[..., None, None] * motion.abs()  # motion [i, i']: v - u
    if domain.broad:
        weight = (NEIGHBOUR_COST * step_energy[..., None] * shown)[..., None]  # (B, F, L, 1)
        first, last = _neighbour_distances(points[bank], seen, rows, offsets)
        costs += (weight * first)[..., :, None]
        costs += (weight * last)[..., None, :]
    return costs


def _neighbour_distances(bank_points: Tensor, seen: Tensor, rows: Tensor, offsets: Tensor) -> tuple[Tensor, Tensor]:
    """Per frame, half the distance (B, F, L, S) mm of the leaves ``rows`` (L,) of a bank (control points
    (B, F + 1, strips)) moved by each offset at the frame's first point, and the same at its last, from the
    neighbouring leaves of the bank that the frame shows (``seen`` (B, F, strips)): each control point is
    shared by two frames. A frame's pull for moves offsets[i] -> offsets[i'] is first[i] + last[i']."""
    count = bank_points.shape[-1]
    moved = bank_points[..., rows, None] + offsets  # (B, F + 1, L, S)
    first, last = torch.zeros_like(moved[:, :-1]), torch.zeros_like(moved[:, 1:])
    for step in (-1, 1):
        neighbour = (rows + step).clamp(0, count - 1)
        weight = (seen[..., neighbour] & ((rows + step >= 0) & (rows + step < count))).to(moved.dtype)[..., None]
        apart = (moved - bank_points[..., neighbour, None]).abs()  # (B, F + 1, L, S)
        first += weight * apart[:, :-1]
        last += weight * apart[:, 1:]
    return 0.5 * first, 0.5 * last


def _own_weights(domain: RowDomain, coupling: tuple[Tensor, Tensor], points: Tensor, bank: int) -> Tensor:
    """Per MU, the weight (B, F, 7, strips) of each edge of ``bank`` (control points (B, F + 1, strips)) in
    its own leaf's profile at each sub-aperture: its own coupling, plus the tongue-and-groove
    strip's on each side where the edge is the strip's (bank A's the larger of the two leaves',
    bank B's the smaller) at its current position."""
    own, groove = coupling
    reach = (own.shape[-1] - 1) // 2
    weights = own[..., reach]
    if domain.groove_share > 0:
        positions = frame_sub_apertures(points)
        previous = torch.cat([positions[..., :1], positions[..., :-1]], -1)  # leaf j - 1 (no strip before leaf 0)
        following = torch.cat([positions[..., 1:], positions[..., -1:]], -1)  # leaf j + 1
        leads = torch.ge if bank == 0 else torch.le
        weights = (weights + groove[..., reach] * leads(positions, previous)
                   + groove[..., reach + 1] * leads(positions, following))
    return weights


def _pair_costs(domain: RowDomain, correlation: Tensor, weights: Tensor, points: Tensor, offsets: Tensor,
                bank: int) -> Tensor:
    """cost(u, v) (B, F, strips, S, S) of each frame moving each edge from points[k] + offsets[i] to
    points[k + 1] + offsets[i'] (module docstring). correlation: (B, F, strips, lattice) Y; weights:
    (B, F, strips, 7) the a_t; points (B, F + 1, strips); offsets (S,) evenly spaced."""
    states = len(offsets)
    step = float(offsets[1] - offsets[0]) if states > 1 else 1.0
    last = SUB_APERTURES - 1
    prev = _edges(domain, points[:, :-1] + offsets[0], bank)  # (B, F, strips): state 0
    curr = _edges(domain, points[:, 1:] + offsets[0], bank)
    t = torch.arange(SUB_APERTURES, device=points.device) / last
    # the positions of sub-aperture t over all (i, i') lie on base_t + (step / 6) m, m = (6 - t) i + t i'
    steps = last * (states - 1) + 1
    base = prev[..., None] + (curr - prev)[..., None] * t  # (B, F, strips, 7)
    positions = base[..., None] + step / last * torch.arange(steps, device=points.device)
    values = _interpolate(correlation, positions.flatten(-2)).view(positions.shape)  # (B, F, strips, 7, steps)
    linear = 0.0
    for sub in range(SUB_APERTURES):
        column = values[..., sub, :].contiguous()
        lattice = column.as_strided((*column.shape[:-1], states, states),
                                    (*column.stride()[:-1], last - sub, sub))
        linear = linear + weights[..., sub, None, None] * lattice
    # the motion d = curr - prev + step (i' - i): 2 S - 1 values
    motion = (curr - prev)[..., None] + step * torch.arange(1 - states, states, device=points.device)
    quadratic = _motion_products(domain, weights, motion)  # (B, F, strips, 2 S - 1)
    quadratic = quadratic.unfold(-1, states, 1).flip(-2)  # [i, i'] -> motion index S - 1 - i + i'
    mean_weight = weights.mean(-1)
    if step == round(step):  # every state in the same cell phase: one lookup per motion
        phase = (prev % 1.0)[..., None].expand(motion.shape)
        correction = _phase_lookup(domain, phase, motion).unfold(-1, states, 1).flip(-2)
    else:
        phase = (prev[..., None] + step * torch.arange(states, device=points.device)) % 1.0  # (B, F, strips, S)
        correction = _phase_lookup(domain, phase[..., :, None].expand(*phase.shape, states),
                                   motion.unfold(-1, states, 1).flip(-2))
    return quadratic + mean_weight[..., None, None].square() * correction - 2 * linear


def _interpolate(values: Tensor, positions: Tensor) -> Tensor:
    """``values`` (..., lattice) on the lattice of ``RowDomain.splat``, linearly interpolated at
    ``positions`` (..., M) mm (0 off the lattice)."""
    lattice = values.shape[-1]
    reach = (lattice - GRID_SIZE + 1) // 2
    grid = positions - FIRST_BOUNDARY_MM + reach
    index = grid.floor()
    fraction = grid - index
    index = index.long()
    padded = F.pad(values, (1, 2))
    low = padded.gather(-1, (index + 1).clamp(0, lattice + 2))
    high = padded.gather(-1, (index + 2).clamp(0, lattice + 2))
    return low + (high - low) * fraction


def _motion_products(domain: RowDomain, weights: Tensor, motion: Tensor) -> Tensor:
    """sum over t != t' of a_t a_t' A(p_t, p_t') for edges moving by ``motion`` (..., D) mm within a
    frame, A averaged over the cell phase: (..., D). weights: (..., 7) the a_t."""
    last = SUB_APERTURES - 1
    lags = range(1, SUB_APERTURES)
    pairs = torch.stack([(weights[..., lag:] * weights[..., :-lag]).sum(-1, keepdim=True) for lag in lags])
    fractions = torch.arange(1, SUB_APERTURES, device=motion.device) / last
    separations = motion.abs() * fractions.view(-1, *[1] * motion.dim())  # (6, ..., D)
    return 2 * (pairs * _mean_product(domain, separations)).sum(0)


def _mean_product(domain: RowDomain, separation: Tensor) -> Tensor:
    """A(p, p + s) averaged over the cell phase of p, at separations ``s`` >= 0 mm: ``mean_products``
    linearly interpolated on its ``PRODUCT_STEP_MM`` grid."""
    table = mean_products(domain.target_sigma_mm, str(separation.device))
    index = (separation / PRODUCT_STEP_MM).clamp(0.0, len(table) - 1.001)
    low = index.floor()
    fraction = index - low
    low = low.long()
    return table[low] + (table[low + 1] - table[low]) * fraction


def _phase_lookup(domain: RowDomain, phase: Tensor, motion: Tensor) -> Tensor:
    """The cell-phase part of the step products of equally weighted sub-aperture steps from a
    position of cell phase ``phase`` moving by ``motion`` mm (same shape), bilinear in the table."""
    columns = len(domain.phase_corners) // PHASES  # table cells per row
    row = phase * PHASES
    column = ((motion + MAX_MOTION_MM) / TABLE_STEP_MM).clamp(0.0, columns - 0.001)
    r0, c0 = row.floor().clamp(0, PHASES - 1), column.floor()
    corners = domain.phase_corners[r0.long() * columns + c0.long()]  # (..., 4)
    low = torch.lerp(corners[..., 0], corners[..., 1], column - c0)
    high = torch.lerp(corners[..., 2], corners[..., 3], column - c0)
    return torch.lerp(low, high, row - r0)
