"""Leaves and jaws refined on the forward model's own misfit: Gauss-Newton steps after the tracking.

The tracking (``epid.reconstruction.leaves``) finds the leaves in the row domain, a reduction of the
forward model. Under a broad response the reduction's optimum is not the forward model's: started at
the truth, without noise, the tracking moved the leaves of a 16 mm wide response 0.4 to 0.7 mm, to
positions the forward model's own rendering fits worse. The steps here lower the forward model's
misfit itself, the sum over frames of |S_k - mu_k R_k(x)|^2 (R_k the rendering per MU of frame k
at the control points x, mu_k its least-squares MU), over every leaf and jaw of every control point
of a run at once.

The gradient is the rendering's own (the response applied transposed, ``DetectorResponse.adjoint``).
The curvature J^T J is built from the physics. An edge at p changes the fluence of the 1 mm cell it
is in, in its strip's 5 rows, by mu / 7 x (1 - leaf transmission) x the jaws' open share at each
sub-aperture; where it is the more closed of two neighbouring leaves, the tongue-and-groove strip's
share of the neighbour's boundary row follows it too, and where it is the more open, its own
boundary row loses that share (the class of the edge, from its two boundaries; no such share where the
boundary is inside a leaf). Seen through the response K, two such columns have as inner product C(dy,
dx) summed over their imager rows, C the autocorrelation of K (``ResponseCorrelation``: tabulated by
strip offset and the two classes). On HD120's fine strips (rows of 0.5 mm, an imager row the mean of
two) a strip's rows fall on the imager rows in one of two phases, and the tables hold both. A jaw
changes the row its edge is in over that leaf's opening: C summed over two lines. The strip is not
a detail: left out, the curvature of an edge level with its neighbours was a third short, and
Gauss-Newton steps failed where neighbouring leaves move apart; with it, the misfit along a step of
up to 1 mm matched the quadratic model within 1 to 7 %. Each frame's 7 sub-aperture positions are
merged to ``SUB_SAMPLES`` for the curvature, leaves further apart than where C falls below
``CORRELATION_FLOOR`` of its peak are left uncoupled, and so are the jaws from the leaves.

Frame k couples control points k and k + 1 only, so the normal equations are block tridiagonal (2 x
strips + 2 unknowns per point) and are solved exactly in one sweep along the run (``solve_chain``).
Levenberg-Marquardt damping (``START_DAMPING`` x the diagonal, a third of it after a step that lowers the
misfit, four times after one that does not) and a prior of ``PRIOR_SHARE`` of a fully open edge's
curvature hold the positions the frames hardly show (a leaf behind a jaw, a closed pair); no position
moves more than ``STEP_LIMIT_MM`` in a step, and a step is kept for a run only when it lowers that
run's misfit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.models.aperture import frame_sub_apertures
from epid.reconstruction.fallback import BATCH_FRAMES, ControlPointRun, Rendering, frame_misfits
from epid.reconstruction.rows import RowDomain
from epid.synthesis.geometry import GRID_SIZE, MLC_Y_MIN_MM, ROWS_PER_LEAF, SUB_APERTURES, StripGrid

DESCENT_STEPS = 2
"""Gauss-Newton steps after the tracking under a broad response. On 40 frames of the tuning arcs 5,
85, 165, 325, 405 (realistic physics, seed 0), leaf MAE / share within 1 mm / jaw MAE: a 16 mm wide
response, tracking alone 0.754 mm / 82.1 % / 0.126 mm, 2 steps 0.688 / 86.0 / 0.076, 3 steps 0.665 /
86.6 / 0.068; a 12 mm wide one 0.371 / 96.4 / 0.089 -> 0.330 / 97.1 / 0.056 (2 steps); the
`elongated` one 0.397 / 95.6 / 0.080 -> 0.385 / 96.2 / 0.050. A step costs a rendering with its
gradient and the curvature, about 11 ms per frame on 2 CPU cores: on 300 frames of the held-out arcs
6, 86, 166, 326, 406, 486 (16 mm wide response) 2 steps ran at 12.2 frames/s (0.844 mm, 79.6 %), 3
at 10.1 (0.830 mm, 80.2 %), too near the 10 frames/s a whole arc must keep. With the neighbour cost of
the tracking (``epid.reconstruction.leaves.NEIGHBOUR_COST``), on the same held-out frames, one run after
the other on an AVX-512 EPYC: 4 steps against 2 took the 16 mm response from 0.510 mm / 89.1 % to
0.487 / 90.1 % at 12.0 against 15.5 frames/s, the 12 mm one from 0.283 / 97.4 to 0.269 / 97.6 at 11.8
against 13.6, `elongated` from 0.190 / 98.9 to 0.176 / 99.0 at 13.6 against 16.0 (on the tuning arcs 6
steps: 16 mm 91.6 % at 11.2 frames/s): kept at 2 for the margin slower CPUs need.

What holds the 16 mm response back is where the steps start, not the frames. On 150 frames of the
tuning arcs 85, 165, 405 (realistic physics, noise, the 20-minute checkpoint): 10 steps alone from
the truth moved by 0.5 mm of Gaussian noise per position ended at 0.21-0.25 mm, 99.2-99.7 % within
1 mm (from 1 mm of noise 91-97 %), while the tracking started there took the leaves to 88-93 %, and
started at the truth itself to 86 % (94 % without its travel and neighbour costs); 20 steps after
the tracking from the network's estimate reached only 85.6-92.3 %, at a misfit 0.1 to 1.3 % above
the truth's: the row domain's reduction leaves the leaves where the frames tell them from the truth
little, and steps that are local do not find their way back. Nor is the curvature model what stops
them: L-BFGS on the exact gradient of the same misfit (200 iterations, 150 frames of arc 165) took the
fit from 1.080 to 1.005 times the truth's misfit but its leaves only from 0.833 mm / 81.6 % to 0.768 /
83.5 %, and the network's estimate from 14.0 to 1.11 times, 2.23 -> 1.45 mm / 36.5 -> 59.1 %: the
misfit falls along a long shallow valley whose floor lies about 0.8 mm from the truth."""
SUB_SAMPLES = 3
"""Positions per frame the curvature is built from (the 7 sub-apertures' weights split between the
nearest two): 3, 4 and 7 gave the same leaves within 0.002 mm (16 mm wide response, 3 steps), 7 at
four times the cost of 3."""
CORRELATION_FLOOR = 1e-2
"""Leaves are coupled in the curvature up to the offset where C, summed over their rows, falls below
this share of its peak (16 leaves under a 16 mm wide response, 10 under a 12 mm one). At 3e-2 the
truncated curvature was no longer positive definite."""
STEP_LIMIT_MM = 1.0
"""Largest move of a position in one step, mm."""
PRIOR_SHARE = 0.1
"""The pull of every position to where it is, as a share of the curvature of an edge fully open in
both of its frames (for the jaws: of the jaws' mean curvature)."""
START_DAMPING = 0.01
"""Levenberg-Marquardt damping of the first step, relative to the curvature's diagonal."""
JAW_REACH_MM = 16
"""Largest distance along y between two positions of a jaw within a frame that the jaw lines'
table covers, mm (a jaw moves a few mm per control point)."""
STATES = 3
"""States of an edge at one of its strip's two boundaries: 0 the less closed of the two leaves that meet
there, 1 the more closed (it shuts the tongue-and-groove strip), ``NO_GROOVE`` where no tongue and groove
meets (inside a leaf of several strips, at the end of the strips)."""
NO_GROOVE = 2
CLASSES = STATES * STATES
"""Classes of an edge: the state at its lower boundary + ``STATES`` x the state at its upper one."""
SHUT = 1 + STATES * 1
"""The class of an edge more closed than both neighbours (it moves its strip's rows whole)."""


@dataclass(frozen=True)
class ResponseCorrelation:
    """Inner products of the images of fluence changes seen through a forward model's response.

    edges: (phases, 2 R + 1, ``CLASSES``, ``CLASSES``, W) for the edges of strip j (of phase j mod
    phases: one on the 52 strips, two on the fine strips) and of strip j + o, o = -R..R, of classes c
    and c', dx = index - ``centre`` mm apart along x, per unit move of each; lines: (2 ``JAW_REACH_MM``
    + 1, 257) for two lines of length L = 0..256 mm, dy = index - ``JAW_REACH_MM`` mm apart along y,
    aligned along x."""

    edges: Tensor
    lines: Tensor
    reach: int
    centre: int

    @classmethod
    def of(cls, forward_model: nn.Module, domain: RowDomain, device: torch.device | str) -> ResponseCorrelation:
        """The tables of an aperture forward model's response (its broad term at its mean weight), on the
        strips and with the tongue-and-groove strip of ``domain``."""
        response = forward_model.response
        with torch.no_grad():
            kernel = (response.kernel() * response.log_gain.exp()).double().cpu()
            broad = response.broad_taps().double().cpu()
            mean_broad = float(response.broad_weight(response.broad_gain.device).double().mean())
            kernel = kernel + mean_broad * torch.outer(broad, broad)
            centre = max(kernel.shape[0] - 1, GRID_SIZE)  # C reaches 2 x the kernel's reach; the tables +-256 mm
            size = 2 * centre + 2
            padded = F.pad(kernel, (0, size - kernel.shape[1], 0, size - kernel.shape[0]))
            auto = torch.fft.irfft2(torch.fft.rfft2(padded).abs().square(), s=(size, size))
            auto = torch.roll(auto, (centre, centre), (0, 1))[:-1, :-1]  # C(dy, dx) at [centre + dy, centre + dx]
            edges = _edge_table(auto, centre, domain.groove_rows, domain.grid)
            lengths = torch.arange(GRID_SIZE + 1, dtype=torch.float64)
            dx = torch.arange(-GRID_SIZE, GRID_SIZE + 1, dtype=torch.float64)
            overlap = (lengths[None, :] - dx[:, None].abs()).clamp_min(0)  # pairs of cells dx apart in two lines
            lines = auto[centre - JAW_REACH_MM:centre + JAW_REACH_MM + 1,
                         centre - GRID_SIZE:centre + GRID_SIZE + 1] @ overlap
        reach = (edges.shape[1] - 1) // 2
        return cls(edges.float().contiguous().to(device), lines.float().contiguous().to(device), reach, centre)

    @property
    def open_edge(self) -> float:
        """The product of an edge ``SHUT`` with itself (a strip of phase 0)."""
        return float(self.edges[0, self.reach, SHUT, SHUT, self.centre])

    def edge_index(self, phase: Tensor, offset: Tensor, edge_class: Tensor, other_class: Tensor) -> Tensor:
        """Flat (phase, offset o + R, class, class) indices into ``edges`` for ``edge_products``."""
        return ((phase * self.edges.shape[1] + offset + self.reach) * CLASSES + edge_class) * CLASSES + other_class

    def edge_products(self, index: Tensor, dx: Tensor) -> Tensor:
        """``edges`` at flat indices ``index`` (``edge_index``) and distances ``dx`` mm (same shape),
        linearly interpolated along x."""
        width = self.edges.shape[-1]
        column = (dx + self.centre).clamp(0, width - 1.001)
        low = column.floor()
        fraction = column - low
        flat = self.edges.flatten()
        base = index * width + low.long()
        return flat[base] * (1 - fraction) + flat[base + 1] * fraction

    def line_products(self, dy: Tensor, length: Tensor) -> Tensor:
        """``lines`` at distances ``dy`` mm and lengths ``length`` mm (same shape), bilinear."""
        rows, columns = self.lines.shape
        row = (dy + JAW_REACH_MM).clamp(0, rows - 1.001)
        column = length.clamp(0, columns - 1.001)
        r0, c0 = row.floor(), column.floor()
        fr, fc = row - r0, column - c0
        flat = self.lines.flatten()
        base = r0.long() * columns + c0.long()
        return ((1 - fr) * ((1 - fc) * flat[base] + fc * flat[base + 1])
                + fr * ((1 - fc) * flat[base + columns] + fc * flat[base + columns + 1]))


def _edge_profiles(groove_rows: list[float]) -> Tensor:
    """(``CLASSES``, 5 + 2 band): the fluence change per unit move of an edge of each class in the rows
    of its strip and the ``band`` = len(``groove_rows``) rows beyond each boundary (rows -band..4 +
    band): 1 in its own rows, and in the rows within 1 mm of a boundary where tongue and groove
    meets, share s of the strip (``groove_rows``, nearest first) 1 - s + s x state in its own row
    and s x state in the neighbour's (state 1 where the edge is the more closed)."""
    band = len(groove_rows)
    profiles = torch.zeros(CLASSES, ROWS_PER_LEAF + 2 * band, dtype=torch.float64)
    profiles[:, band:band + ROWS_PER_LEAF] = 1.0
    for edge_class in range(CLASSES):
        for side, state in enumerate((edge_class % STATES, edge_class // STATES)):
            if state == NO_GROOVE:
                continue
            for k, share in enumerate(groove_rows):
                own, beyond = (band + k, band - 1 - k) if side == 0 else (band + ROWS_PER_LEAF - 1 - k,
                                                                           band + ROWS_PER_LEAF + k)
                profiles[edge_class, own] = 1 - share + share * state
                profiles[edge_class, beyond] = share * state
    return profiles


def _pixel_profiles(profiles: Tensor, grid: StripGrid, strip: int) -> tuple[Tensor, int]:
    """``_edge_profiles`` of strip ``strip`` -> the same on the imager's 1 mm rows (each the mean of the
    grid's rows in it) and the imager row of their first entry."""
    band = (profiles.shape[1] - ROWS_PER_LEAF) // 2
    rows = ROWS_PER_LEAF * strip - band + torch.arange(profiles.shape[1])
    pixel = torch.div(rows, grid.rows_per_pixel, rounding_mode="floor")
    first = int(pixel[0])
    binned = profiles.new_zeros(CLASSES, int(pixel[-1]) - first + 1)
    binned.index_add_(1, pixel - first, profiles / grid.rows_per_pixel)
    return binned, first


def _pair_table(auto: Tensor, centre: int, profiles: Tensor, grid: StripGrid, strip: int, other: int) -> Tensor:
    """(``CLASSES``, ``CLASSES``, W): C summed over the imager rows the edges of ``strip`` and ``other``
    move, by their classes."""
    own, first = _pixel_profiles(profiles, grid, strip)
    partner, partner_first = _pixel_profiles(profiles, grid, other)
    size, partner_size = own.shape[1], partner.shape[1]
    pairs = own.new_zeros(CLASSES, CLASSES, size + partner_size - 1)  # imager rows r' - r
    for row in range(size):
        pairs[:, :, size - 1 - row:size - 1 - row + partner_size] += own[:, None, row, None] * partner[None]
    dy = torch.arange(1 - size, partner_size) + partner_first - first + centre
    inside = (dy >= 0) & (dy < auto.shape[0])
    return torch.einsum("abk,kx->abx", pairs[:, :, inside], auto[dy[inside]])


def _edge_table(auto: Tensor, centre: int, groove_rows: list[float], grid: StripGrid) -> Tensor:
    """(phases, 2 R + 1, ``CLASSES``, ``CLASSES``, W): C summed over the imager rows that two edges of
    each class move (``_edge_profiles``), R the largest strip offset whose products reach
    ``CORRELATION_FLOOR`` of the peak."""
    profiles = _edge_profiles(groove_rows)
    count = grid.phases
    tables = []
    for offset in range(grid.count):
        table = torch.stack([_pair_table(auto, centre, profiles, grid, phase, phase + offset)
                             for phase in range(count)])
        if offset and table.abs().max() < CORRELATION_FLOOR * tables[0][0, SHUT, SHUT, centre]:
            break
        tables.append(table)
    positive = torch.stack(tables, 1)  # (phases, R + 1, ...)
    # strip j and j - o are strips j - o (phase (j - o) mod phases) and j: C(-dy, dx) = C(dy, -dx)
    reach = len(tables) - 1
    negative = [positive[(torch.arange(count) - o) % count, o].transpose(1, 2).flip(-1) for o in range(reach, 0, -1)]
    return torch.cat([torch.stack(negative, 1), positive], 1) if negative else positive


def descend(forward_model: nn.Module, domain: RowDomain, signals: Tensor, points: ControlPointRun,
            steps: int = DESCENT_STEPS, batch_frames: int = BATCH_FRAMES) -> tuple[ControlPointRun, Rendering]:
    """``points`` (B runs of F + 1 control points) moved by ``steps`` Gauss-Newton steps on the misfit
    of the lag-free frames ``signals`` (B, F, 256, 256) (module docstring), and their ``Rendering``."""
    correlation = ResponseCorrelation.of(forward_model, domain, signals.device)
    x = torch.cat([points.leaf_a, points.leaf_b, points.jaws], -1).float()
    rendering, gradient = _evaluate(forward_model, domain.grid, signals, x, batch_frames, with_gradient=steps > 0)
    damping = x.new_full((x.shape[0],), START_DAMPING)
    for step in range(steps):
        diagonal, upper = _curvature(domain, correlation, x, rendering.mu)
        curvature = diagonal.diagonal(dim1=-2, dim2=-1)
        shift = damping[:, None, None] * curvature + _prior(domain, correlation, rendering.mu, curvature)[:, None]
        move = -solve_chain(diagonal + torch.diag_embed(shift), upper, gradient / 2)
        trial = x + move.float().clamp(-STEP_LIMIT_MM, STEP_LIMIT_MM)
        last = step == steps - 1
        trial_rendering, trial_gradient = _evaluate(forward_model, domain.grid, signals, trial, batch_frames,
                                                    with_gradient=not last)
        better = trial_rendering.misfits.sum((-2, -1)) < rendering.misfits.sum((-2, -1))  # (B,)
        x = torch.where(better[:, None, None], trial, x)
        rendering = Rendering(torch.where(better[:, None, None], trial_rendering.misfits, rendering.misfits),
                              torch.where(better[:, None], trial_rendering.mu, rendering.mu),
                              torch.where(better[:, None], trial_rendering.signal_mu, rendering.signal_mu))
        if not last:
            gradient = torch.where(better[:, None, None], trial_gradient, gradient)
        damping = torch.where(better, damping / 3, damping * 4)
    count = domain.grid.count
    return (ControlPointRun(x[..., :count].contiguous(), x[..., count:2 * count].contiguous(),
                            x[..., 2 * count:].contiguous()), rendering)


def _evaluate(forward_model: nn.Module, grid: StripGrid, signals: Tensor, x: Tensor, batch_frames: int,
              with_gradient: bool) -> tuple[Rendering, Tensor | None]:
    """The ``Rendering`` of the control points x (B, F + 1, 2 x strips + 2: the leaf edges of banks A
    and B, then jaw_1 and jaw_2) against ``signals`` (B, F, 256, 256) and, when asked for, the
    gradient (B, F + 1, 2 x strips + 2) of the summed misfit."""
    runs, frames = signals.shape[:2]
    count = grid.count
    misfits = signals.new_zeros(runs, frames, count)
    mu, signal_mu = signals.new_zeros(runs, frames), signals.new_zeros(runs, frames)
    gradient = torch.zeros_like(x) if with_gradient else None
    for begin in range(0, frames, batch_frames):
        chunk = slice(begin, min(begin + batch_frames, frames))
        with torch.inference_mode(False), torch.enable_grad():
            points = x[:, chunk.start:chunk.stop + 1].clone().requires_grad_(with_gradient)
            pairs = torch.stack([points[:, :-1], points[:, 1:]], 2).flatten(0, 1)  # (K, 2 [prev, curr], unknowns)
            scalars = torch.cat([pairs.new_ones(len(pairs), 1), pairs[:, :, 2 * count], pairs[:, :, 2 * count + 1]], 1)
            fluence = forward_model.fluence(pairs[:, :, :count].flatten(1), pairs[:, :, count:2 * count].flatten(1),
                                            scalars)
        with torch.no_grad():
            output = forward_model.beam.output(fluence.detach())[:, None, None]
            rendered = forward_model.response(fluence.detach()) * output
            per_strip, frame_mu, frame_signal_mu, residuals = frame_misfits(rendered, signals[:, chunk].flatten(0, 1),
                                                                            grid)
            misfits[:, chunk] = per_strip.view(runs, -1, count)
            mu[:, chunk], signal_mu[:, chunk] = frame_mu.view(runs, -1), frame_signal_mu.view(runs, -1)
            if with_gradient:
                towards = forward_model.response.adjoint(-2 * frame_mu[:, None, None] * output * residuals)
        if with_gradient:
            with torch.inference_mode(False):
                part, = torch.autograd.grad(fluence, points, towards.clone())
            gradient[:, chunk.start:chunk.stop + 1] += part
    return Rendering(misfits, mu, signal_mu), gradient


def _curvature(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, mu: Tensor) -> tuple[Tensor, Tensor]:
    """J^T J of the control points x (B, F + 1, 2 x strips + 2) with the frames' MU (B, F), as the
    diagonal blocks (B, F + 1, n, n) and the blocks above them (B, F, n, n) of a chain."""
    runs, count = x.shape[0], x.shape[1]
    edges = 2 * domain.grid.count
    positions = frame_sub_apertures(_edges(domain, x))  # (B, F, 7, edges) at the sub-apertures
    blocks = _leaf_blocks(domain, correlation, x, positions, mu)  # (B, F, 2, 2, edges, edges)
    lines = _jaw_blocks(domain, correlation, x, positions, mu)  # (B, F, 2, 2, 2)
    diagonal = x.new_zeros(runs, count, edges + 2, edges + 2, dtype=torch.float64)
    upper = x.new_zeros(runs, count - 1, edges + 2, edges + 2, dtype=torch.float64)
    diagonal[:, :-1, :edges, :edges] += blocks[:, :, 0, 0]
    diagonal[:, 1:, :edges, :edges] += blocks[:, :, 1, 1]
    upper[..., :edges, :edges] = blocks[:, :, 0, 1]
    diagonal[:, :-1, edges:, edges:] += torch.diag_embed(lines[:, :, 0, 0])
    diagonal[:, 1:, edges:, edges:] += torch.diag_embed(lines[:, :, 1, 1])
    upper[..., edges:, edges:] = torch.diag_embed(lines[:, :, 0, 1])
    return diagonal, upper


def _edges(domain: RowDomain, x: Tensor) -> Tensor:
    """The leaf edges (..., 2 x strips) of control points x (..., 2 x strips + 2), after each bank's
    leaf-end offset."""
    count = domain.grid.count
    return torch.cat([x[..., :count] - domain.offset_a, x[..., count:2 * count] + domain.offset_b], -1)


def _sample_weights(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The chain weights c (7, 2) of a frame's sub-apertures on its two control points, their split
    (7, M) between the ``SUB_SAMPLES`` positions, and the sub-aperture index of each position (M,)."""
    t = torch.arange(SUB_APERTURES, device=device) / (SUB_APERTURES - 1)
    samples = torch.linspace(0.0, 1.0, SUB_SAMPLES, device=device)
    split = (1 - (t[:, None] - samples[None, :]).abs() * (SUB_SAMPLES - 1)).clamp_min(0.0)
    return torch.stack([1 - t, t], 1), split, (samples * (SUB_APERTURES - 1)).round().long()


def _leaf_blocks(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, positions: Tensor,
                 mu: Tensor) -> Tensor:
    """(B, F, 2, 2, E, E): the leaves' J^T J of each frame over its [prev, curr] control points;
    ``positions`` (B, F, 7, E) the E = 2 x strips edges at the sub-apertures."""
    runs, frames = mu.shape
    count = domain.grid.count
    openings = domain.jaw_openings(x[..., 2 * count:])  # (B, F, 7, strips, 5)
    passed = (domain.jaw_transmission + (1 - domain.jaw_transmission) * openings).mean(-1)
    bank_a, bank_b = positions[..., :count], positions[..., count:]
    seen = passed * (bank_b > bank_a)  # (B, F, 7, strips): the pair open
    sign = torch.cat([-torch.ones(count, device=x.device), torch.ones(count, device=x.device)])
    alpha = (sign * torch.cat([seen, seen], -1) * (positions.abs() < GRID_SIZE / 2)
             * (1 - domain.leaf_transmission) / SUB_APERTURES * mu[..., None, None])
    joined = domain.interleaf > 0.5
    classes = torch.cat([_edge_classes(bank_a, torch.ge, joined), _edge_classes(bank_b, torch.le, joined)], -1)
    chain, split, sampled = _sample_weights(x.device)
    weight = torch.einsum("bfte,ta,tm->bfmae", alpha, chain, split)  # (B, F, M, 2, E)
    positions, classes = positions[:, :, sampled], classes[:, :, sampled]  # (B, F, M, E)
    reach = correlation.reach
    offsets = torch.arange(-reach, reach + 1, device=x.device)
    strip = torch.arange(2 * count, device=x.device) % count
    neighbour = strip[:, None] + offsets  # (E, 2 R + 1)
    valid = (neighbour >= 0) & (neighbour < count)
    phase = (strip % correlation.edges.shape[0])[:, None]
    blocks = x.new_zeros(runs, frames, 2, 2, 2 * count, 2 * count)
    for bank in (0, 1):
        partner = neighbour.clamp(0, count - 1) + count * bank
        dx = positions[:, :, :, None, :, None] - positions[..., partner][:, :, None]  # (B, F, M, M, E, 2 R + 1)
        index = correlation.edge_index(phase, offsets, classes[:, :, :, None, :, None],
                                       classes[..., partner][:, :, None])
        products = correlation.edge_products(index, dx) * valid
        block = torch.einsum("bfmsek,bfmae,bfscek->bfacek", products, weight, weight[..., partner])
        blocks.scatter_add_(-1, partner.expand_as(block), block)
    return blocks


def _edge_classes(positions: Tensor, closer, joined: Tensor) -> Tensor:
    """Class (``CLASSES``) of each edge (..., strips) of a bank: at each of its two boundaries 1 where it is
    at least as closed as the neighbour (``closer``: ``torch.ge`` for bank A, ``torch.le`` for B), 0 where
    less, ``NO_GROOVE`` where ``joined`` (strips - 1,) does not mark the boundary as one between leaves
    and at the ends of the strips."""
    none = torch.full_like(positions[..., :1], NO_GROOVE, dtype=torch.long)
    lower = torch.where(joined, closer(positions[..., 1:], positions[..., :-1]).long(), NO_GROOVE)
    upper = torch.where(joined, closer(positions[..., :-1], positions[..., 1:]).long(), NO_GROOVE)
    return torch.cat([none, lower], -1) + STATES * torch.cat([upper, none], -1)


def _jaw_blocks(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, edges: Tensor,
                mu: Tensor) -> Tensor:
    """(B, F, 2, 2, 2): each jaw's J^T J of each frame over its [prev, curr] control points, the
    leaves held: its edge's row over the opening of the strip it lies in (``edges`` (B, F, 7, 2 x
    strips) at the sub-apertures)."""
    grid = domain.grid
    jaw_1, jaw_2 = x[..., 2 * grid.count], x[..., 2 * grid.count + 1]
    rows = frame_sub_apertures(torch.stack([jaw_1 - domain.jaw_offset, jaw_2 + domain.jaw_offset], -1))  # (B, F, 7, 2)
    strip = ((rows - MLC_Y_MIN_MM) / grid.strip_mm).floor().long().clamp(0, grid.count - 1)
    half = GRID_SIZE / 2
    opening = (edges[..., grid.count:].gather(-1, strip).clamp(-half, half)
               - edges[..., :grid.count].gather(-1, strip).clamp(-half, half)).clamp_min(0.0)
    sign = torch.tensor([-1.0, 1.0], device=x.device)
    alpha = (sign * (rows.abs() < half) * (1 - domain.jaw_transmission) * (1 - domain.leaf_transmission)
             / SUB_APERTURES * mu[..., None, None])  # (B, F, 7, 2)
    dy = rows[:, :, :, None] - rows[:, :, None]  # (B, F, 7, 7, 2)
    length = 0.5 * (opening[:, :, :, None] + opening[:, :, None])
    products = correlation.line_products(dy, length) * alpha[:, :, :, None] * alpha[:, :, None]
    chain, _, _ = _sample_weights(x.device)
    return torch.einsum("bftsj,ta,sc->bfacj", products, chain, chain)


def _prior(domain: RowDomain, correlation: ResponseCorrelation, mu: Tensor, curvature: Tensor) -> Tensor:
    """(B, 2 x strips + 2): ``PRIOR_SHARE`` of a fully open edge's curvature at each run's mean MU for
    the leaves, of the jaws' mean curvature for the jaws."""
    chain, _, _ = _sample_weights(mu.device)
    edges = 2 * domain.grid.count
    open_edge = (mu.double().square().mean(-1) * (1 - domain.leaf_transmission) ** 2 * correlation.open_edge
                 * chain.square().sum() * 2 / SUB_APERTURES ** 2)  # (B,)
    jaws = curvature[..., edges:]  # (B, F + 1, 2)
    seen = jaws > 0
    jaw_mean = torch.where(seen.any((-2, -1)), (jaws * seen).sum((-2, -1)) / seen.sum((-2, -1)).clamp_min(1),
                           open_edge)
    prior = open_edge[:, None].expand(-1, edges + 2).clone()
    prior[:, edges:] = jaw_mean[:, None]
    return PRIOR_SHARE * prior


def solve_chain(diagonal: Tensor, upper: Tensor, rhs: Tensor) -> Tensor:
    """Solve the symmetric block tridiagonal system of B chains: ``diagonal`` (B, P, n, n) blocks,
    ``upper`` (B, P - 1, n, n) the blocks (k, k + 1), ``rhs`` (B, P, n) -> (B, P, n) float64, by
    block elimination along the chain (Cholesky per block; a block that is not positive definite is
    shifted by 1e-6 of its mean diagonal until it is)."""
    diagonal, upper, rhs = diagonal.double(), upper.double(), rhs.double()
    count = diagonal.shape[1]
    factors, carried = [], []
    block, value = diagonal[:, 0], rhs[:, 0]
    for k in range(count):
        factor = _cholesky(block)
        factors.append(factor)
        carried.append(value)
        if k + 1 < count:
            solved = torch.cholesky_solve(torch.cat([upper[:, k], value[..., None]], -1), factor)
            block = diagonal[:, k + 1] - upper[:, k].transpose(-2, -1) @ solved[..., :-1]
            value = rhs[:, k + 1] - (upper[:, k].transpose(-2, -1) @ solved[..., -1:])[..., 0]
    result = [torch.cholesky_solve(carried[-1][..., None], factors[-1])[..., 0]]
    for k in range(count - 2, -1, -1):
        right = carried[k] - (upper[:, k] @ result[-1][..., None])[..., 0]
        result.append(torch.cholesky_solve(right[..., None], factors[k])[..., 0])
    return torch.stack(result[::-1], 1)


def _cholesky(block: Tensor) -> Tensor:
    """The Cholesky factor of ``block`` (B, n, n), its diagonal shifted where it is not positive definite."""
    factor, info = torch.linalg.cholesky_ex(block)
    shift = 1e-6
    while bool((info > 0).any()):
        scale = block.diagonal(dim1=-2, dim2=-1).abs().mean(-1).clamp_min(1e-12)
        eye = torch.eye(block.shape[-1], dtype=block.dtype, device=block.device)
        block = block + ((info > 0) * shift * scale)[:, None, None] * eye
        factor, info = torch.linalg.cholesky_ex(block)
        shift *= 10
    return factor
