"""The row domain the leaf and jaw tracking share: frames seen as leaf-row profiles and row sums.

The frame a forward model renders is its detector response K applied to the aperture's fluence
on 1 mm cells. A Wiener filter turns each lag-free frame S into D = T * (mu F): the fluence seen
through a small sampled Gaussian T (taps t) instead of K, K's long tails taken out. T must be one
the filter can reproduce: where T's spectrum falls more slowly than K's, the filter would need
more gain than its regularisation lets it have, the filtered frames are not T * (mu F) and every
edge the tracking reads from them is off. A response twice as broad as the built-in one made the
leaves 3 mm wrong that way with T fixed at 2 mm (no noise needed: the bias is the filter's). So T
is chosen per forward model (``epid.models.response.target_sigma``): the sharpest Gaussian, and none
sharper than ``MIN_TARGET_SIGMA_MM``, that the filter reproduces within ``TARGET_FIDELITY``
(``epid.models.response.ResponseFilter``). ``RowDomain`` holds the
forward model's physics in the form the tracking needs: the filter, each leaf row's profile
along x (its pixel rows averaged, weighted by ``ROW_WEIGHTS`` and the jaws' open share), the
coupling of neighbouring rows through T, and the products of blurred steps (``step_products``)
that the tracking's costs are made of.

On the fine strips of HD120 (``epid.synthesis.geometry.FINE_STRIPS``: 2.5 mm, five rows of 0.5 mm)
each row is read as the pixel row it lies in, and the coupling between a row of one strip and a row
of another is T along y between their pixel rows, halved (a pixel row's fluence is the mean of its
two rows): it depends on whether the strip starts on a whole millimetre, so the taps come in two
phases.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.models.aperture import frame_sub_apertures
from epid.models.response import ResponseFilter, target_taps
from epid.synthesis.fluence import cell_coverage, groove_shares
from epid.synthesis.geometry import (
    GRID_SIZE,
    ROWS_PER_LEAF,
    STRIPS,
    SUB_APERTURES,
    StripGrid,
)

ROW_WEIGHTS = (0.1, 1.0, 1.0, 1.0, 0.1)
"""Weights of a leaf's 5 pixel rows in its profile where the jaws leave them open (the rows beside
the neighbours count little, unless the jaws close the others)."""


PHASES = 20
"""Cell phases of the ``step_products`` table."""


TABLE_STEP_MM = 0.05
"""Motion grid of the ``step_products`` table, mm."""


MAX_MOTION_MM = 64.0
"""Largest motion of an edge within a frame that the ``step_products`` table covers, mm."""


PRODUCT_STEP_MM = 1 / 64
"""Separation grid of the ``mean_products`` table, mm (linear interpolation on it is within 1e-5 of
the exact products for T 2 mm wide)."""


FIRST_BOUNDARY_MM = 1 - GRID_SIZE / 2
"""x of the first of the 255 boundaries between imager columns, where differenced profiles sit."""


@dataclass(frozen=True)
class RowDomain:
    """What tracking needs of a forward model, on one device.

    response_filter: the Wiener filter mapping a frame to D (``ResponseFilter``); taps: t on offsets
    -reach..reach (sum 1); gram: G(k) = sum_n t(n) t(n + k) for k = -2 reach..2 reach; row_taps:
    (phases, 2 R + 1, 5, 5) the taps between row r of strip j
    and row r' of strip j + o, M_o[r, r'] (o = -R..R; one phase on the 52 strips, two on the fine
    strips, strip j taking phase j mod 2); edge offsets of banks A and B and of the jaws (mm,
    positive widens); leaf, jaw and interleaf transmission (fractions); interleaf: (strips - 1,) 1
    where the boundary between two strips is one between two leaves of a layer (where leakage passes
    and tongue and groove meet), 0 inside a leaf or beyond the leaves (``ApertureFluence``; a dual
    layer's leaves seen as one); groove_share: the share of each 1 mm row beside a boundary between
    leaves that the tongue-and-groove strip covers;
    phase_corners: (PHASES x 2 M, 4) the cell-phase part of the step products (``step_products``)
    by table cell, its four corners;
    blur_matrix: (lattice, 255) t applied along the lattice of ``splat`` (``blur``, ``correlate``);
    grid: the forward model's strips (``epid.synthesis.geometry.StripGrid``).
    """

    response_filter: ResponseFilter
    taps: Tensor
    gram: Tensor
    row_taps: Tensor
    phase_corners: Tensor
    offset_a: float
    offset_b: float
    jaw_offset: float
    leaf_transmission: float
    jaw_transmission: float
    interleaf_leakage: float
    interleaf: Tensor
    groove_share: float
    blur_matrix: Tensor
    grid: StripGrid = STRIPS

    @property
    def groove_rows(self) -> list[float]:
        """The share of each of the strip rows within 1 mm of a boundary between leaves (nearest
        first) that the tongue-and-groove strip covers: ``groove_share`` on rows of 1 mm."""
        return [float(share) for share in groove_shares(self.groove_share, self.grid)]

    @property
    def target_sigma_mm(self) -> float:
        """The width of T, mm (``epid.models.response.target_sigma``)."""
        return self.response_filter.target_sigma_mm

    @property
    def broad(self) -> bool:
        """Whether the frames are seen through a Gaussian wider, relative to the strips, than
        ``MIN_TARGET_SIGMA_MM`` is to strips of 5 mm (``ResponseFilter.broad``: a response broader
        than the tracking was tuned with; polishing stages, leaf groups, the passes read relative to the
        fit before them and the pull of each leaf towards its neighbours, ``leaves.NEIGHBOUR_COST``, apply).
        Every response is broad to HD120's 2.5 mm strips: on 300 frames of the tuning arcs 5, 85, 165 (20-minute HD120
        checkpoint, realistic physics, built-in kernel) the leaves came to 0.460 mm, 91.3 % within 1
        mm (the 2.5 mm leaves 84.5 %) without the broad stages and 0.311 mm, 96.3 % (93.6 %) with
        them, at 7.3 frames/s against 12.4; the polishing stages alone 0.394 mm, 92.8 %; the second
        pass alone 0.401 mm, 93.6 %."""
        return self.response_filter.broad(self.grid)

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
            kernel = (response.kernel() * response.log_gain.exp()).double().cpu()  # one filter, built on the CPU
            response_filter = ResponseFilter.of(response._spectrum(kernel), tuple(response.fft_shape), device)
            sigma_mm = response_filter.target_sigma_mm
            taps, gram = target_taps(sigma_mm)
            shift = float(aperture.edge_shift)
            offset_a, offset_b = (shift + float(v) for v in aperture.leaf_end_offset)
            grid = aperture.grid
            return cls(
                response_filter=response_filter,
                taps=taps.float().to(device), gram=gram.float().to(device),
                row_taps=_row_taps(taps, grid).float().to(device),
                phase_corners=_phase_corners(sigma_mm).to(device),
                offset_a=offset_a, offset_b=offset_b, jaw_offset=shift,
                leaf_transmission=float(aperture.leaf_transmission_percent) / 100.0,
                jaw_transmission=float(aperture.jaw_transmission_percent) / 100.0,
                interleaf_leakage=float(aperture.interleaf_leakage_percent) / 100.0,
                interleaf=(aperture.interleaf.amax(0) if aperture.layers
                           else torch.ones(grid.count - 1)).float().to(device),
                groove_share=min(float(aperture.tongue_groove_width) / 2.0, 1.0),
                blur_matrix=_blur_matrix(taps.float()).to(device), grid=grid,
            )

    def filtered_rows(self, signals: Tensor) -> Tensor:
        """Lag-free frames (..., 256, 256) -> D on the leaf grid's rows (..., 260, 256), y ascending
        (``ResponseFilter.filtered_rows``)."""
        return self.response_filter.filtered_rows(signals)

    def leaf_profiles(self, rows: Tensor, row_weights: Tensor) -> Tensor:
        """``filtered_rows`` (..., 260, 256) -> differenced strip-row profiles (..., strips, 255), each
        strip's rows (on the fine strips, the pixel row each lies in) weighted by ``row_weights``
        (..., strips, 5): entry c is profile(c + 1) - profile(c), at the boundary x = c - 127 mm."""
        rows = self.grid.strip_rows(rows).unflatten(-2, (self.grid.count, ROWS_PER_LEAF))
        return torch.diff((rows * row_weights[..., None]).sum(-2), dim=-1)

    def profiles(self, signals: Tensor, row_weights: Tensor) -> Tensor:
        """Lag-free frames (..., 256, 256) -> differenced strip-row profiles (..., strips, 255) of D
        (``filtered_rows``, ``leaf_profiles``)."""
        return self.leaf_profiles(self.filtered_rows(signals), row_weights)

    def jaw_openings(self, jaws: Tensor) -> Tensor:
        """Jaws (..., P, 2) at P control points -> (..., P - 1, 7, strips, 5): the open share of each
        row of each strip at each sub-aperture of each frame (learned jaw offset applied)."""
        moving = frame_sub_apertures(jaws)
        rows = self.grid.row_centres(jaws.device)
        opening = cell_coverage(moving[..., 0] - self.jaw_offset, moving[..., 1] + self.jaw_offset, rows,
                                self.grid.row_mm)
        return opening.unflatten(-1, (self.grid.count, ROWS_PER_LEAF))

    @staticmethod
    def row_weights(openings: Tensor) -> Tensor:
        """``jaw_openings`` (..., F, 7, strips, 5) -> the weights (..., F, strips, 5) of each strip's
        rows in its profile in each frame: ``ROW_WEIGHTS`` x the row's mean open share, summing to
        1 (all 0 where the jaws close the strip)."""
        weights = openings.mean(-3) * torch.tensor(ROW_WEIGHTS, device=openings.device)
        return weights / weights.sum(-1, keepdim=True).clamp_min(1e-6)

    def coupling(self, openings: Tensor, row_weights: Tensor) -> tuple[Tensor, Tensor]:
        """``jaw_openings`` (..., F, 7, strips, 5) and ``row_weights`` (..., F, strips, 5) -> the
        weights in strip j's profile at each sub-aperture of each frame of the edges of strip j + o,
        (..., F, 7, strips, 2 R + 1) for o = -R..R, and of the tongue-and-groove edges of the
        boundary between strips j + q and j + q + 1, (..., F, 7, strips, 2 R + 2) for q = -R - 1..R:
        the jaws' and the leaves' transmission of each source row seen through t along y, the rows
        beside a boundary between leaves (``interleaf``; none inside a leaf of several strips) shared
        between the strip's own edge and the groove's."""
        count, band = self.grid.count, self.grid.rows_per_pixel
        passed = self.jaw_transmission + (1 - self.jaw_transmission) * openings
        lower = torch.zeros(count, ROWS_PER_LEAF, device=openings.device)  # groove share of the boundary below
        upper = torch.zeros_like(lower)  # and of the boundary above each row
        for k, share in enumerate(self.groove_rows):
            lower[1:, k] = share * self.interleaf  # the k-th row of every strip but the first
            upper[:-1, -1 - k] = share * self.interleaf  # the k-th row from the top of every strip but the last
        leaking = torch.zeros_like(lower)  # the rows within 1 mm of a boundary between two leaves
        leaking[:-1, -band:] = self.interleaf[:, None]
        leaking[1:, :band] = self.interleaf[:, None]
        source = passed * (1 - self.leaf_transmission - self.interleaf_leakage * leaking)
        reach = (self.row_taps.shape[1] - 1) // 2
        padded = F.pad(source, (0, 0, reach, reach))  # strips -R..count - 1 + R
        lowers, uppers = (F.pad(shares, (0, 0, reach, reach)) for shares in (lower, upper))
        phase = torch.arange(count, device=openings.device) % self.row_taps.shape[0]
        own, groove = [], [0.0] * (2 * reach + 2)
        for o in range(2 * reach + 1):
            if self.row_taps.shape[0] == 1:
                through = torch.einsum("...jr,rs->...js", row_weights, self.row_taps[0, o])
            else:
                through = torch.einsum("...jr,jrs->...js", row_weights, self.row_taps[phase, o])
            seen = through[..., None, :, :] * padded[..., o:o + count, :]  # (..., F, 7, strips, 5)
            below, above = lowers[o:o + count], uppers[o:o + count]
            own.append((seen * (1 - below - above)).sum(-1))
            groove[o + 1] = groove[o + 1] + (seen * above).sum(-1)  # the boundary above j + o
            groove[o] = groove[o] + (seen * below).sum(-1)  # the boundary below j + o
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
        return splats @ self.blur_matrix

    def correlate(self, rows: Tensor) -> Tensor:
        """Differenced rows (..., 255) -> their correlation Y with the taps on the lattice (..., lattice)."""
        return rows @ self.blur_matrix.T


def _blur_matrix(taps: Tensor) -> Tensor:
    """(lattice, 255): the taps applied along a splat's lattice as one matrix product (a banded
    Toeplitz matrix: several times faster on a CPU than a one-channel convolution). Row i is lattice
    point i blurred."""
    reach = (len(taps) - 1) // 2
    identity = torch.eye(GRID_SIZE - 1 + 2 * reach, dtype=taps.dtype)
    return F.conv1d(identity[:, None], taps[None, None])[:, 0].contiguous()


def _row_taps(taps: Tensor, grid: StripGrid = STRIPS) -> Tensor:
    """M_o[r, r'] (phases, 2 R + 1, 5, 5): the vertical taps between row r of a strip and row r' of
    the strip o on (o = -R..R; R strips reach as far as the taps, ``reach`` pixel rows). On rows of
    1 mm, one phase: the taps at the rows' offset. On the fine strips, the rows read as the pixel
    rows they lie in and each source row is half a pixel row's fluence: t(p - p') / 2 between
    their pixel rows p, p', which depends on whether the strip starts on a whole millimetre (phase
    0, even strips) or half way (phase 1)."""
    reach = (len(taps) - 1) // 2
    per_pixel = grid.rows_per_pixel
    strips = math.ceil((per_pixel * (reach + 1) - 1 + ROWS_PER_LEAF - 1) / ROWS_PER_LEAF)
    rows = torch.arange(ROWS_PER_LEAF)
    phases = []
    for phase in range(grid.phases):
        matrices = []
        for o in range(-strips, strips + 1):
            first = phase * ROWS_PER_LEAF  # the strip's first row, counted from a whole millimetre
            offset = ((first + rows[:, None]) // per_pixel
                      - (first + ROWS_PER_LEAF * o + rows[None, :]).div(per_pixel, rounding_mode="floor"))
            matrices.append(torch.where(offset.abs() <= reach, taps[(offset + reach).clamp(0, 2 * reach)], 0.0)
                            / per_pixel)
        phases.append(torch.stack(matrices))
    return torch.stack(phases)


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
        return gram_at(gram, reach, k)

    return ((1 - f) * (1 - g) + f * g) * g_at(lag) + (1 - f) * g * g_at(lag + 1) + f * (1 - g) * g_at(lag - 1)


def gram_at(gram: Tensor, reach: int, lag: Tensor) -> Tensor:
    """G at integer lags (any shape), 0 beyond +-2 reach."""
    return torch.where(lag.abs() <= 2 * reach, gram[(lag + 2 * reach).clamp(0, 4 * reach)], 0.0)


@functools.cache
def _phase_corners(sigma_mm: float) -> Tensor:
    """(PHASES x 2 M, 4): for 7 equally weighted sub-aperture steps from u (its cell phase on the
    rows, the last row repeating the first) moving by d (columns, -M..M of ``TABLE_STEP_MM``),
    sum_(t,t') A(p_t, p_t') less its mean over the phase; T of width ``sigma_mm``. Laid out by
    table cell (row r, column c; flat index r x 2 M + c): its corners (r, c), (r, c + 1), (r + 1,
    c), (r + 1, c + 1), so that a bilinear lookup gathers once."""
    taps, gram = target_taps(sigma_mm)
    reach = (len(taps) - 1) // 2
    phase = torch.arange(PHASES + 1, dtype=torch.float64) / PHASES
    motion = torch.arange(-MAX_MOTION_MM, MAX_MOTION_MM + TABLE_STEP_MM / 2, TABLE_STEP_MM, dtype=torch.float64)
    t = torch.linspace(0.0, 1.0, SUB_APERTURES, dtype=torch.float64)
    positions = phase[:, None, None] + motion[None, :, None] * t  # (phases, motions, 7)
    products = step_products(gram, reach, positions[..., :, None], positions[..., None, :]).sum((-2, -1))
    table = (products - products[:-1].mean(0, keepdim=True)).float()
    return torch.stack([table[:-1, :-1], table[:-1, 1:], table[1:, :-1], table[1:, 1:]], -1).flatten(0, 1)


@functools.cache
def mean_products(sigma_mm: float, device: str) -> Tensor:
    """A(p, p + s) averaged over the cell phase of p, for T of width ``sigma_mm``, at s = 0,
    ``PRODUCT_STEP_MM``, ... up to where it vanishes (2 reach + 2 mm): the splat of s against the gram,
    each lag weighted by the overlap of two unit cells (B(k - s), the cubic B-spline)."""
    _, gram = target_taps(sigma_mm)
    reach = (len(gram) - 1) // 4
    separation = torch.arange(0.0, 2 * reach + 3, PRODUCT_STEP_MM, dtype=torch.float64)
    lag = separation.floor()
    f = separation - lag
    lag = lag.long()

    def g_at(k: Tensor) -> Tensor:
        return gram_at(gram, reach, k)

    values = ((2 / 3 - f * f + f * f * f / 2) * g_at(lag) + (1 / 6 + f / 2 + f * f / 2 - f * f * f / 2) * g_at(lag + 1)
              + ((1 - f) ** 3 / 6) * g_at(lag - 1) + (f * f * f / 6) * g_at(lag + 2))
    return values.float().to(device)
