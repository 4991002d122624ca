"""Leaf edges tracked through consecutive frames, one leaf row at a time.

The frame a forward model renders is its detector response K applied to the aperture's fluence
on 1 mm cells. A Wiener filter turns each lag-free frame S into D = T * (mu F): the fluence seen
through a small sampled Gaussian T (``TARGET_SIGMA_MM``, taps t) instead of K, wide enough that
the filter amplifies no noise (T's spectrum falls faster than K's). In D, a leaf row's profile
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
(range, grid step) updates bank A, then bank B, each frame's MU refitted (least
squares on the differenced profiles) as the residual is recomputed.

A frame fixes the mean of its edge's sub-aperture positions sharply but their spread, the motion
within the frame, only weakly: a chain that zig-zags about the true positions (each point in
turn too far out and too far in) changes each frame's misfit little, and noise, a partly open
row or a synthesis that rounds edges to the 1 mm grid can favour it. Each mm an edge travels in
a frame therefore costs ``TRAVEL_COST`` of one open-row step's energy: among motions the frames
cannot tell apart, the one of least travel.

The jaws decide how much of a leaf row each frame shows, and in a row the jaws have only begun
to uncover, a few tenths of a mm of jaw error change that several times over: after the first
stage, with the leaves roughly in place, the jaws are refined from the frames' row sums
(``epid.jaw_tracking``) and the rows re-weighed for the stages after it. Leaves that no jaw
opens keep their start (a small pull to it breaks ties). Everything runs batched over
independent runs of frames (a batch of frame pairs, or one arc), on the CPU or a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.aperture_models import (
    IMAGER_MARGIN,
    LEAF_GRID_ROWS,
    ROWS_PER_LEAF,
    frame_sub_apertures,
    leaf_grid_centres,
)
from epid.imaging import GRID_SIZE, SUB_APERTURES, cell_coverage
from epid.jaw_tracking import JAW_STAGES, track_jaws
from epid.sequences import NUM_LEAF_PAIRS

TARGET_SIGMA_MM = 2.0
"""Width of the Gaussian the frames are seen through after the Wiener filter, mm."""
EDGE_PAD = 32
"""Rows and columns each frame is extended by (its edges repeated) before the Wiener filter."""
WIENER_FLOOR = 1e-4
"""Regularisation of the Wiener filter, relative to the response spectrum's peak power."""
ROW_WEIGHTS = (0.1, 1.0, 1.0, 1.0, 0.1)
"""Weights of a leaf's 5 pixel rows in its profile where the jaws leave them open (the rows beside
the neighbours count little, unless the jaws close the others)."""
PULL_PER_MM2 = 1e-6
"""Pull of each control point to its start (misfit per mm squared), for leaves no frame shows."""
TRAVEL_COST = 5e-4
"""Cost of each mm an edge travels within a frame, relative to the energy of one edge's step in a
fully open row: among motions the frames can hardly tell apart, the one of least travel."""
PHASES = 20
"""Cell phases of the ``step_products`` table."""
TABLE_STEP_MM = 0.05
"""Motion grid of the ``step_products`` table, mm."""
MAX_MOTION_MM = 64.0
"""Largest motion of an edge within a frame that the ``step_products`` table covers, mm."""
PAIR_ELEMENTS = 2**23
"""Pair costs evaluated at once (frames x runs x leaves x states^2)."""
FIRST_BOUNDARY_MM = 1 - GRID_SIZE / 2
"""x of the first of the 255 boundaries between imager columns, where differenced profiles sit."""


@dataclass(frozen=True)
class RowDomain:
    """What tracking needs of a forward model, on one device.

    wiener: (H, W // 2 + 1) complex spectrum mapping a leaf-grid frame to D (padded FFT shape
    ``fft_shape``); taps: t on offsets -reach..reach (sum 1); gram: G(k) = sum_n t(n) t(n + k)
    for k = -2 reach..2 reach; row_taps: (2 R + 1, 5, 5) the taps between pixel row r of leaf j and
    pixel row r' of leaf j + o, M_o[r, r'] (o = -R..R); edge offsets of banks A and B and of the jaws (mm,
    positive widens); leaf, jaw and interleaf transmission (fractions); groove_share: the share
    of each 1 mm row beside a boundary between leaves that the tongue-and-groove strip covers;
    phase_error: (PHASES + 1, 2 M + 1) the cell-phase part of the step products
    (``step_products``).
    """

    wiener: Tensor
    fft_shape: tuple[int, int]
    taps: Tensor
    gram: Tensor
    row_taps: Tensor
    phase_error: Tensor
    offset_a: float
    offset_b: float
    jaw_offset: float
    leaf_transmission: float
    jaw_transmission: float
    interleaf_leakage: float
    groove_share: float

    @property
    def reach(self) -> int:
        return (len(self.taps) - 1) // 2

    @property
    def lattice(self) -> int:
        """Integer positions a splat may touch: boundaries extended by the reach on each side."""
        return GRID_SIZE - 1 + 2 * self.reach

    @classmethod
    def of(cls, forward_model: nn.Module, device: torch.device | str | None = None) -> RowDomain:
        """The domain of an aperture forward model (``response``, ``aperture``)."""
        response, aperture = forward_model.response, forward_model.aperture
        device = torch.device(device) if device is not None else next(forward_model.parameters()).device
        with torch.no_grad():
            kernel = (response.kernel() * response.log_gain.exp()).double()
            spectrum = response._spectrum(kernel)
            taps, gram = _target_taps(TARGET_SIGMA_MM)
            reach = (len(taps) - 1) // 2
            target = torch.zeros(response.fft_shape, dtype=torch.float64)
            target[:2 * reach + 1, :2 * reach + 1] = torch.outer(taps, taps)
            target_spectrum = torch.fft.rfft2(torch.roll(target, (-reach, -reach), (0, 1)))
            power = spectrum.abs().square()
            wiener = target_spectrum * spectrum.conj() / (power + WIENER_FLOOR * power.max())
            shift = float(aperture.edge_shift)
            offset_a, offset_b = (shift + float(v) for v in aperture.leaf_end_offset)
            return cls(
                wiener=wiener.to(device, torch.complex64), fft_shape=tuple(response.fft_shape),
                taps=taps.float().to(device), gram=gram.float().to(device),
                row_taps=_row_taps(taps).float().to(device),
                phase_error=_phase_error(TARGET_SIGMA_MM).to(device),
                offset_a=offset_a, offset_b=offset_b, jaw_offset=shift,
                leaf_transmission=float(aperture.leaf_transmission_percent) / 100.0,
                jaw_transmission=float(aperture.jaw_transmission_percent) / 100.0,
                interleaf_leakage=float(aperture.interleaf_leakage_percent) / 100.0,
                groove_share=min(max(float(aperture.tongue_groove_mm) / 2.0, 0.0), 1.0),
            )

    def filtered_rows(self, signals: Tensor) -> Tensor:
        """Lag-free frames (..., 256, 256) -> D on the leaf grid's rows (..., 260, 256), y ascending.
        The frames are extended by ``EDGE_PAD`` rows and columns repeating their edges, so that the
        filter sees no step where the imager ends."""
        frames = signals.float().flip(-2)  # rows y ascending, as the leaf grid
        shape = frames.shape
        padded = F.pad(frames.reshape(-1, 1, *shape[-2:]), (EDGE_PAD,) * 4, mode="replicate").view(
            *shape[:-2], *(size + 2 * EDGE_PAD for size in shape[-2:]))
        seen = torch.fft.irfft2(torch.fft.rfft2(padded, s=self.fft_shape) * self.wiener, s=self.fft_shape)
        first = EDGE_PAD - IMAGER_MARGIN
        return seen[..., first:first + LEAF_GRID_ROWS, EDGE_PAD:EDGE_PAD + GRID_SIZE]

    @staticmethod
    def leaf_profiles(rows: Tensor, row_weights: Tensor) -> Tensor:
        """``filtered_rows`` (..., 260, 256) -> differenced leaf-row profiles (..., 52, 255), each
        leaf's pixel rows weighted by ``row_weights`` (..., 52, 5): entry c is profile(c + 1) -
        profile(c), at the boundary x = c - 127 mm."""
        rows = rows.unflatten(-2, (NUM_LEAF_PAIRS, ROWS_PER_LEAF))
        return torch.diff((rows * row_weights[..., None]).sum(-2), dim=-1)

    def profiles(self, signals: Tensor, row_weights: Tensor) -> Tensor:
        """Lag-free frames (..., 256, 256) -> differenced leaf-row profiles (..., 52, 255) of D
        (``filtered_rows``, ``leaf_profiles``)."""
        return self.leaf_profiles(self.filtered_rows(signals), row_weights)

    def jaw_openings(self, jaws: Tensor) -> Tensor:
        """Jaws (..., P, 2) at P control points -> (..., P - 1, 7, 52, 5): the open share of each
        pixel row of each leaf at each sub-aperture of each frame (learned jaw offset applied)."""
        moving = frame_sub_apertures(jaws)
        rows = leaf_grid_centres(jaws.device)
        opening = cell_coverage(moving[..., 0] - self.jaw_offset, moving[..., 1] + self.jaw_offset, rows)
        return opening.unflatten(-1, (NUM_LEAF_PAIRS, ROWS_PER_LEAF))

    @staticmethod
    def row_weights(openings: Tensor) -> Tensor:
        """``jaw_openings`` (..., F, 7, 52, 5) -> the weights (..., F, 52, 5) of each leaf's pixel
        rows in its profile in each frame: ``ROW_WEIGHTS`` x the row's mean open share, summing to
        1 (all 0 where the jaws close the leaf)."""
        weights = openings.mean(-3) * torch.tensor(ROW_WEIGHTS, device=openings.device)
        return weights / weights.sum(-1, keepdim=True).clamp_min(1e-6)

    def coupling(self, openings: Tensor, row_weights: Tensor) -> tuple[Tensor, Tensor]:
        """``jaw_openings`` (..., F, 7, 52, 5) and ``row_weights`` (..., F, 52, 5) -> the weights
        in leaf j's profile at each sub-aperture of each frame of the edges of leaf j + o, (...,
        F, 7, 52, 2 R + 1) for o = -R..R, and of the tongue-and-groove edges of the boundary
        between leaves j + q and j + q + 1, (..., F, 7, 52, 2 R + 2) for q = -R - 1..R: the jaws'
        and the leaves' transmission of each source row seen through t along y, the rows beside
        a boundary shared between the leaf's own edge and the strip's."""
        passed = self.jaw_transmission + (1 - self.jaw_transmission) * openings
        strip = torch.zeros(NUM_LEAF_PAIRS, ROWS_PER_LEAF, device=openings.device)
        strip[:-1, -1] = 1.0  # the last row of every leaf but the last, the first of every leaf but the first
        strip[1:, 0] = 1.0
        source = passed * (1 - self.leaf_transmission - self.interleaf_leakage * strip)
        reach = (self.row_taps.shape[0] - 1) // 2
        padded = F.pad(source, (0, 0, reach, reach))  # leaves -R..51+R
        strips = F.pad(strip, (0, 0, reach, reach))
        own, groove = [], [0.0] * (2 * reach + 2)
        for o in range(2 * reach + 1):
            through = torch.einsum("...jr,rs->...js", row_weights, self.row_taps[o])
            seen = through[..., None, :, :] * padded[..., o:o + NUM_LEAF_PAIRS, :]  # (..., F, 7, 52, 5)
            rows = strips[o:o + NUM_LEAF_PAIRS]
            own.append((seen * (1 - self.groove_share * rows)).sum(-1))
            groove[o + 1] = groove[o + 1] + self.groove_share * seen[..., -1] * rows[:, -1]  # boundary below j + o
            groove[o] = groove[o] + self.groove_share * seen[..., 0] * rows[:, 0]  # boundary above j + o
        return torch.stack(own, -1), torch.stack(groove, -1)

    def splat(self, positions: Tensor, weights: Tensor) -> Tensor:
        """Edges at ``positions`` (..., K) mm with ``weights`` (..., K) -> their splat on the
        lattice (..., ``lattice``): entry i is the integer position i + FIRST_BOUNDARY_MM - reach mm."""
        lattice = positions - FIRST_BOUNDARY_MM + self.reach
        index = lattice.floor()
        fraction = lattice - index
        index = index.long()
        out = positions.new_zeros(*positions.shape[:-1], self.lattice + 2)
        for offset, share in ((0, 1 - fraction), (1, fraction)):
            where = (index + offset + 1).clamp(0, self.lattice + 1)  # slots 0 and lattice + 1 collect the outside
            out.scatter_add_(-1, where, weights * share)
        return out[..., 1:-1]

    def blur(self, splats: Tensor) -> Tensor:
        """Splats (..., lattice) -> differenced profiles (..., 255): the taps applied."""
        flat = splats.reshape(-1, 1, splats.shape[-1])
        return F.conv1d(flat, self.taps[None, None]).view(*splats.shape[:-1], GRID_SIZE - 1)

    def correlate(self, rows: Tensor) -> Tensor:
        """Differenced rows (..., 255) -> their correlation Y with the taps on the lattice (..., lattice)."""
        reach = self.reach
        flat = F.pad(rows.reshape(-1, 1, rows.shape[-1]), (2 * reach, 2 * reach))
        return F.conv1d(flat, self.taps[None, None]).view(*rows.shape[:-1], self.lattice)


def _row_taps(taps: Tensor) -> Tensor:
    """M_o[r, r'] (2 R + 1, 5, 5): the vertical taps between pixel row r of a leaf and pixel row
    r' of the leaf o rows on (offsets -reach..reach; R leaves the taps reach)."""
    reach = (len(taps) - 1) // 2
    leaves = math.ceil((reach + ROWS_PER_LEAF - 1) / ROWS_PER_LEAF)
    rows = torch.arange(ROWS_PER_LEAF)
    matrices = []
    for o in range(-leaves, leaves + 1):
        offset = rows[:, None] - rows[None, :] - ROWS_PER_LEAF * o
        matrices.append(torch.where(offset.abs() <= reach, taps[(offset + reach).clamp(0, 2 * reach)], 0.0))
    return torch.stack(matrices)


def step_products(gram: Tensor, reach: int, first: Tensor, second: Tensor) -> Tensor:
    """Inner products of the unit steps at ``first`` and ``second`` (same shape) mm, exact on an
    unbounded row: the splat weights of both against G."""
    def split(p: Tensor) -> tuple[Tensor, Tensor]:
        index = p.floor()
        return index, p - index

    i, f = split(first)
    j, g = split(second)
    lag = (j - i).long()

    def g_at(k: Tensor) -> Tensor:
        return _gram_at(gram, reach, k)

    return ((1 - f) * (1 - g) + f * g) * g_at(lag) + (1 - f) * g * g_at(lag + 1) + f * (1 - g) * g_at(lag - 1)


def _gram_at(gram: Tensor, reach: int, lag: Tensor) -> Tensor:
    """G at integer lags (any shape), 0 beyond +-2 reach."""
    return torch.where(lag.abs() <= 2 * reach, gram[(lag + 2 * reach).clamp(0, 4 * reach)], 0.0)


@functools.cache
def _phase_error(sigma_mm: float) -> Tensor:
    """(PHASES + 1, 2 M + 1): for 7 equally weighted sub-aperture steps from u (its cell phase on
    the rows, the last row repeating the first) moving by d (columns, -M..M of ``TABLE_STEP_MM``),
    sum_(t,t') A(p_t, p_t') less its mean over the phase; T of width ``sigma_mm``."""
    taps, gram = _target_taps(sigma_mm)
    reach = (len(taps) - 1) // 2
    phase = torch.arange(PHASES + 1, dtype=torch.float64) / PHASES
    motion = torch.arange(-MAX_MOTION_MM, MAX_MOTION_MM + TABLE_STEP_MM / 2, TABLE_STEP_MM, dtype=torch.float64)
    t = torch.linspace(0.0, 1.0, SUB_APERTURES, dtype=torch.float64)
    positions = phase[:, None, None] + motion[None, :, None] * t  # (phases, motions, 7)
    products = step_products(gram, reach, positions[..., :, None], positions[..., None, :]).sum((-2, -1))
    return (products - products[:-1].mean(0, keepdim=True)).float()


def _target_taps(sigma_mm: float) -> tuple[Tensor, Tensor]:
    """T's taps (float64, offsets -reach..reach, sum 1, reach = ceil(4 sigma)) and their gram G(k),
    k = -2 reach..2 reach."""
    reach = math.ceil(4 * sigma_mm)
    offsets = torch.arange(-reach, reach + 1, dtype=torch.float64)
    taps = torch.exp(-0.5 * (offsets / sigma_mm) ** 2)
    taps = taps / taps.sum()
    gram = torch.nn.functional.conv1d(F.pad(taps, (2 * reach, 2 * reach))[None, None], taps[None, None])[0, 0]
    return taps, gram


@dataclass(frozen=True)
class Tracked:
    """Leaf edges tracked through B runs of N frames: leaf_a, leaf_b (B, N + 1, 52) and jaws (B, N +
    1, 2) mm at the control points and mu (B, N) of each frame (least squares on the differenced
    profiles)."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor


def track_leaves(domain: RowDomain, signals: Tensor, leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor,
                 stages: tuple[tuple[float, float], ...], chunk_frames: int = 64,
                 jaw_stages: tuple[tuple[float, float], ...] = JAW_STAGES) -> Tracked:
    """Track the leaf edges of B runs of N lag-free frames ``signals`` (B, N, 256, 256) from their
    start (leaf_a, leaf_b (B, N + 1, 52), jaws (B, N + 1, 2) mm) through ``stages`` ((range, grid
    step) mm each); see the module docstring. After the first stage the jaws are refined with the
    leaves found (``epid.jaw_tracking``, ``jaw_stages``; none: the jaws as given). ``chunk_frames``
    bounds the frames filtered at once."""
    jaws = jaws.float()
    observed = _Observed.of(domain, signals, jaws, chunk_frames, row_sums=bool(jaw_stages))
    banks = [leaf_a.float().clone(), leaf_b.float().clone()]
    for number, (range_mm, step_mm) in enumerate(stages):
        states = round(2 * range_mm / step_mm) + 1
        offsets = torch.linspace(-range_mm, range_mm, states, device=signals.device)
        for bank in (0, 1):
            banks[bank] = _track_bank(domain, observed.profiles, observed.coupling, observed.seen, banks, bank, offsets)
        if number == 0 and jaw_stages:
            mu = _best_mu(observed.profiles, _model(domain, observed.coupling, banks))
            jaws = track_jaws(domain, observed.row_sums, banks[0], banks[1], jaws, mu, jaw_stages)
            # the frames are filtered again rather than kept: a whole arc's would hold (N, 260, 256) floats
            observed = _Observed.of(domain, signals, jaws, chunk_frames, row_sums=False)
    mu = _best_mu(observed.profiles, _model(domain, observed.coupling, banks))
    return Tracked(banks[0], banks[1], jaws, mu)


@dataclass(frozen=True)
class _Observed:
    """What tracking reads of B runs of N frames under given jaws: the differenced leaf-row profiles
    (B, N, 52, 255), the ``RowDomain.coupling`` pair, ``seen`` (B, N, 52) (the leaf's rows open in
    the frame) and, when asked for, the filtered frames' row sums (B, N, 260)."""

    profiles: Tensor
    coupling: tuple[Tensor, Tensor]
    seen: Tensor
    row_sums: Tensor | None

    @classmethod
    def of(cls, domain: RowDomain, signals: Tensor, jaws: Tensor, chunk_frames: int, row_sums: bool) -> _Observed:
        openings = domain.jaw_openings(jaws)  # (B, N, 7, 52, 5)
        row_weights = domain.row_weights(openings)
        profiles, sums = [], []
        for k in range(0, signals.shape[1], chunk_frames):
            rows = domain.filtered_rows(signals[:, k:k + chunk_frames])
            profiles.append(domain.leaf_profiles(rows, row_weights[:, k:k + chunk_frames]))
            if row_sums:
                sums.append(rows.sum(-1))
        return cls(torch.cat(profiles, 1), domain.coupling(openings, row_weights), row_weights.sum(-1) > 0,
                   torch.cat(sums, 1) if row_sums else None)


def _edges(domain: RowDomain, positions: Tensor, bank: int) -> Tensor:
    """Edge positions of a bank's leaves at ``positions``, after the bank's leaf-end offset."""
    return positions - domain.offset_a if bank == 0 else positions + domain.offset_b


def _model(domain: RowDomain, coupling: tuple[Tensor, Tensor], banks: list[Tensor]) -> Tensor:
    """Differenced profiles per MU (B, F, 52, 255) of both banks' control points (B, F + 1, 52),
    ``coupling`` as ``RowDomain.coupling``: every leaf's edges and, where both leaves beside a
    boundary are open, the tongue-and-groove strip's (bank A's at the larger of the two, bank
    B's at the smaller)."""
    own, groove = coupling
    edges = [_edges(domain, frame_sub_apertures(banks[bank]), bank) for bank in (0, 1)]  # (B, F, 7, 52)
    strip_a = torch.maximum(edges[0][..., :-1], edges[0][..., 1:])  # (B, F, 7, 51): boundaries 0..50
    strip_b = torch.maximum(strip_a, torch.minimum(edges[1][..., :-1], edges[1][..., 1:]))
    parts = [(edges[0], own, 1.0), (edges[1], own, -1.0)]
    if domain.groove_share > 0:
        parts += [(strip_a, groove, 1.0), (strip_b, groove, -1.0)]
    positions, weights = [], []
    for edge, coupling_of, sign in parts:
        sources = coupling_of.shape[-1]
        first = (sources - 1 - (edge.shape[-1] - NUM_LEAF_PAIRS)) // 2  # sources before leaf / boundary 0
        padded = F.pad(edge, (first, sources - 1 - first + NUM_LEAF_PAIRS - edge.shape[-1]))
        # (B, F, 52, 7 x sources): the edges of leaf (or boundary) j + source seen in leaf j's profile
        positions.append(padded.unfold(-1, NUM_LEAF_PAIRS, 1).permute(0, 1, 4, 2, 3).flatten(-2))
        weights.append(sign * coupling_of.permute(0, 1, 3, 2, 4).flatten(-2))
    return domain.blur(domain.splat(torch.cat(positions, -1), torch.cat(weights, -1))) / SUB_APERTURES


def _best_mu(profiles: Tensor, model: Tensor) -> Tensor:
    """Least-squares MU (B, F) of profiles ~ mu x model."""
    return (profiles * model).sum((-2, -1)) / model.square().sum((-2, -1)).clamp_min(1e-12)


def _track_bank(domain: RowDomain, profiles: Tensor, coupling: tuple[Tensor, Tensor], seen: Tensor,
                banks: list[Tensor], bank: int, offsets: Tensor) -> Tensor:
    """One bank's control points (B, N + 1, 52) of least misfit plus travel (in the frames where
    ``seen`` (B, N, 52), the leaf's rows open) within ``offsets`` (S,) of their current positions,
    the other bank held and each frame's MU refitted (the Viterbi recursion)."""
    batch, frames = profiles.shape[:2]
    start = banks[bank]
    states = len(offsets)
    pull = PULL_PER_MM2 * offsets.square()
    best = pull.expand(batch, NUM_LEAF_PAIRS, states).clone()
    choices = torch.empty(frames, batch, NUM_LEAF_PAIRS, states, dtype=torch.long, device=profiles.device)
    per_chunk = max(1, PAIR_ELEMENTS // (batch * NUM_LEAF_PAIRS * states * states))
    sign = 1.0 if bank == 0 else -1.0
    for k in range(0, frames, per_chunk):
        part = slice(k, min(k + per_chunk, frames))
        points = [b[:, part.start:part.stop + 1] for b in banks]
        chunk_coupling = tuple(c[:, part] for c in coupling)
        model = _model(domain, chunk_coupling, points)
        frame_mu = _best_mu(profiles[:, part], model)
        weights = _own_weights(domain, chunk_coupling, points[bank], bank) * frame_mu[..., None, None] / SUB_APERTURES
        edges = _edges(domain, frame_sub_apertures(points[bank]), bank).transpose(-2, -1)
        own = domain.blur(domain.splat(edges, weights.transpose(-2, -1)))
        residual = profiles[:, part] - frame_mu[..., None, None] * model
        correlation = domain.correlate(sign * residual + own)  # (B, F, 52, lattice)
        costs = _pair_costs(domain, correlation, weights.transpose(-2, -1), points[bank], offsets, bank)
        motion = (points[bank][:, 1:] - points[bank][:, :-1])[..., None, None] + offsets - offsets[:, None]
        step_energy = (frame_mu * (1 - domain.leaf_transmission)).square() * domain.gram[2 * domain.reach]
        travel = TRAVEL_COST * step_energy[..., None] * seen[:, part]  # (B, F, 52) per mm
        costs = costs + travel[..., None, None] * motion.abs()  # motion [i, i']: v - u
        for frame in range(costs.shape[1]):
            total = best[..., :, None] + costs[:, frame]
            best, choices[k + frame] = total.min(-2)
            best = best + pull
            best = best - best.amin(-1, keepdim=True)
    index = best.argmin(-1)  # (B, 52) at the last control point
    chosen = [index]
    for frame in range(frames - 1, -1, -1):
        index = choices[frame].gather(-1, index[..., None])[..., 0]
        chosen.append(index)
    return start + offsets[torch.stack(chosen[::-1], 1)]


def _own_weights(domain: RowDomain, coupling: tuple[Tensor, Tensor], points: Tensor, bank: int) -> Tensor:
    """Per MU, the weight (B, F, 7, 52) of each edge of ``bank`` (control points (B, F + 1, 52)) in
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
    """cost(u, v) (B, F, 52, S, S) of each frame moving each edge from points[k] + offsets[i] to
    points[k + 1] + offsets[i'] (module docstring). correlation: (B, F, 52, lattice) Y; weights:
    (B, F, 52, 7) the a_t; points (B, F + 1, 52); offsets (S,) evenly spaced."""
    states = len(offsets)
    step = float(offsets[1] - offsets[0]) if states > 1 else 1.0
    last = SUB_APERTURES - 1
    prev = _edges(domain, points[:, :-1] + offsets[0], bank)  # (B, F, 52): state 0
    curr = _edges(domain, points[:, 1:] + offsets[0], bank)
    t = torch.arange(SUB_APERTURES, device=points.device) / last
    # the positions of sub-aperture t over all (i, i') lie on base_t + (step / 6) m, m = (6 - t) i + t i'
    steps = last * (states - 1) + 1
    base = prev[..., None] + (curr - prev)[..., None] * t  # (B, F, 52, 7)
    positions = base[..., None] + step / last * torch.arange(steps, device=points.device)
    values = _interpolate(correlation, positions.flatten(-2)).view(positions.shape)  # (B, F, 52, 7, steps)
    linear = 0.0
    for sub in range(SUB_APERTURES):
        column = values[..., sub, :].contiguous()
        lattice = column.as_strided((*column.shape[:-1], states, states),
                                    (*column.stride()[:-1], last - sub, sub))
        linear = linear + weights[..., sub, None, None] * lattice
    # the motion d = curr - prev + step (i' - i): 2 S - 1 values
    motion = (curr - prev)[..., None] + step * torch.arange(1 - states, states, device=points.device)
    quadratic = _motion_products(domain, weights, motion)  # (B, F, 52, 2 S - 1)
    quadratic = quadratic.unfold(-1, states, 1).flip(-2)  # [i, i'] -> motion index S - 1 - i + i'
    mean_weight = weights.mean(-1)
    if step == round(step):  # every state in the same cell phase: one lookup per motion
        phase = (prev % 1.0)[..., None].expand(motion.shape)
        correction = _phase_lookup(domain, phase, motion).unfold(-1, states, 1).flip(-2)
    else:
        phase = (prev[..., None] + step * torch.arange(states, device=points.device)) % 1.0  # (B, F, 52, S)
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
    total = 0.0
    for lag in range(1, SUB_APERTURES):
        pairs = (weights[..., lag:] * weights[..., :-lag]).sum(-1, keepdim=True)
        separation = (motion * (lag / last)).abs()
        total = total + 2 * pairs * _mean_product(domain, separation)
    return total


def _mean_product(domain: RowDomain, separation: Tensor) -> Tensor:
    """A(p, p + s) averaged over the cell phase of p, at separations ``s`` >= 0 mm: the splat of s
    against the gram, each lag weighted by the overlap of two unit cells."""
    reach = domain.reach
    lag = separation.floor()
    f = separation - lag
    lag = lag.long()

    def g_at(k: Tensor) -> Tensor:
        return _gram_at(domain.gram, reach, k)

    # lag k of the gram weighs B(k - s), B the overlap of two unit triangles (the cubic B-spline)
    return ((2 / 3 - f * f + f * f * f / 2) * g_at(lag) + (1 / 6 + f / 2 + f * f / 2 - f * f * f / 2) * g_at(lag + 1)
            + ((1 - f) ** 3 / 6) * g_at(lag - 1) + (f * f * f / 6) * g_at(lag + 2))


def _phase_lookup(domain: RowDomain, phase: Tensor, motion: Tensor) -> Tensor:
    """The cell-phase part of the step products of equally weighted sub-aperture steps from a
    position of cell phase ``phase`` moving by ``motion`` mm (same shape), bilinear in the table."""
    table = domain.phase_error
    columns = table.shape[1]
    row = phase * PHASES
    column = ((motion + MAX_MOTION_MM) / TABLE_STEP_MM).clamp(0.0, columns - 1.001)
    r0, c0 = row.floor().clamp(0, PHASES - 1), column.floor()
    fr, fc = row - r0, column - c0
    flat = table.flatten()
    base = (r0.long() * columns + c0.long())

    def at(index: Tensor) -> Tensor:
        return flat[index]

    return ((1 - fr) * ((1 - fc) * at(base) + fc * at(base + 1))
            + fr * ((1 - fc) * at(base + columns) + fc * at(base + columns + 1)))
