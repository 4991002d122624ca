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
is in, in its leaf's 5 rows, by mu / 7 x (1 - leaf transmission) x the jaws' open share at each
sub-aperture; where it is the more closed of two neighbouring leaves, the tongue-and-groove strip's
share of the neighbour's boundary row follows it too, and where it is the more open, its own
boundary row loses that share (the class of the edge: four, from its two boundaries). Seen through
the response K, two such columns have as inner product C(dy, dx) summed over their rows, C the
autocorrelation of K (``ResponseCorrelation``: tabulated by leaf offset and the two classes). A jaw
changes the row its edge is in over that leaf's opening: C summed over two lines. The strip is not
a detail: left out, the curvature of an edge level with its neighbours was a third short, and
Gauss-Newton steps failed where neighbouring leaves move apart; with it, the misfit along a step of
up to 1 mm matched the quadratic model within 1 to 7 %. Each frame's 7 sub-aperture positions are
merged to ``SUB_SAMPLES`` for the curvature, leaves further apart than where C falls below
``CORRELATION_FLOOR`` of its peak are left uncoupled, and so are the jaws from the leaves.

Frame k couples control points k and k + 1 only, so the normal equations are block tridiagonal (106
unknowns per point) and are solved exactly in one sweep along the run (``solve_chain``). Levenberg-
Marquardt damping (``START_DAMPING`` x the diagonal, a third of it after a step that lowers the
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
from epid.synthesis.geometry import GRID_SIZE, LEAF_WIDTH_MM, MLC_Y_MIN_MM, NUM_LEAF_PAIRS, SUB_APERTURES

DESCENT_STEPS = 2
"""Gauss-Newton steps after the tracking under a broad response. On 40 frames of the tuning arcs 5,
85, 165, 325, 405 (realistic physics, seed 0), leaf MAE / share within 1 mm / jaw MAE: a 16 mm wide
response, tracking alone 0.754 mm / 82.1 % / 0.126 mm, 2 steps 0.688 / 86.0 / 0.076, 3 steps 0.665 /
86.6 / 0.068; a 12 mm wide one 0.371 / 96.4 / 0.089 -> 0.330 / 97.1 / 0.056 (2 steps); the
`elongated` one 0.397 / 95.6 / 0.080 -> 0.385 / 96.2 / 0.050. A step costs a rendering with its
gradient and the curvature, about 11 ms per frame on 2 CPU cores: on 300 frames of the held-out arcs
6, 86, 166, 326, 406, 486 (16 mm wide response) 2 steps ran at 12.2 frames/s (0.844 mm, 79.6 %), 3
at 10.1 (0.830 mm, 80.2 %), too near the 10 frames/s a whole arc must keep."""
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
EDGES = 2 * NUM_LEAF_PAIRS
"""Leaf edges per control point: bank A's leaves, then bank B's."""
UNKNOWNS = EDGES + 2
"""Per control point: the leaf edges, then jaw_1 and jaw_2."""


@dataclass(frozen=True)
class ResponseCorrelation:
    """Inner products of the images of fluence changes seen through a forward model's response.

    edges: (2 R + 1, 4, 4, W) for two leaf edges o = -R..R leaves apart (of classes c, c': bit 0 the
    edge is the more closed at its lower boundary, bit 1 at its upper one), dx = index - ``centre`` mm
    apart along x, per unit move of each; lines: (2 ``JAW_REACH_MM`` + 1, 257) for two lines of length
    L = 0..256 mm, dy = index - ``JAW_REACH_MM`` mm apart along y, aligned along x."""

    edges: Tensor
    lines: Tensor
    reach: int
    centre: int

    @classmethod
    def of(cls, forward_model: nn.Module, groove_share: float, device: torch.device | str) -> ResponseCorrelation:
        """The tables of an aperture forward model's response (its broad term at its mean weight)."""
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
            edges = _edge_table(auto, centre, groove_share)
            lengths = torch.arange(GRID_SIZE + 1, dtype=torch.float64)
            dx = torch.arange(-GRID_SIZE, GRID_SIZE + 1, dtype=torch.float64)
            overlap = (lengths[None, :] - dx[:, None].abs()).clamp_min(0)  # pairs of cells dx apart in two lines
            lines = auto[centre - JAW_REACH_MM:centre + JAW_REACH_MM + 1,
                         centre - GRID_SIZE:centre + GRID_SIZE + 1] @ overlap
        reach = (edges.shape[0] - 1) // 2
        return cls(edges.float().contiguous().to(device), lines.float().contiguous().to(device), reach, centre)

    def edge_products(self, index: Tensor, dx: Tensor) -> Tensor:
        """``edges`` at flat (offset, class, class) indices ``index`` and distances ``dx`` mm (same
        shape), linearly interpolated along x."""
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


def _edge_table(auto: Tensor, centre: int, groove_share: float) -> Tensor:
    """(2 R + 1, 4, 4, W): C summed over the rows two edges of each class move (rows -1..5 of their
    leaves), R the largest leaf offset whose products reach ``CORRELATION_FLOOR`` of the peak."""
    profiles = torch.zeros(4, 7, dtype=torch.float64)
    for edge_class in range(4):
        lower, upper = edge_class & 1, edge_class >> 1
        profiles[edge_class, 1:6] = 1.0
        profiles[edge_class, 1] = 1 - groove_share + groove_share * lower
        profiles[edge_class, 5] = 1 - groove_share + groove_share * upper
        profiles[edge_class, 0] = groove_share * lower
        profiles[edge_class, 6] = groove_share * upper
    pairs = torch.zeros(4, 4, 13, dtype=torch.float64)  # rows r' - r = -6..6
    for row in range(7):
        for other in range(7):
            pairs[:, :, other - row + 6] += profiles[:, None, row] * profiles[None, :, other]
    rows_per_leaf = round(LEAF_WIDTH_MM)
    tables = []
    for offset in range(NUM_LEAF_PAIRS):
        dy = torch.arange(-6, 7) + rows_per_leaf * offset + centre
        inside = dy < auto.shape[0]
        tables.append(torch.einsum("abk,kx->abx", pairs[:, :, inside], auto[dy[inside]]))
        if tables[-1].abs().max() < CORRELATION_FLOOR * tables[0][3, 3, centre]:
            tables.pop()
            break
    positive = torch.stack(tables)  # offsets 0..R; C(-dy, dx) = C(dy, -dx): offset -o is o, classes swapped, x flipped
    return torch.cat([positive[1:].flip(0).transpose(1, 2).flip(-1), positive])


def descend(forward_model: nn.Module, domain: RowDomain, signals: Tensor, points: ControlPointRun,
            steps: int = DESCENT_STEPS, batch_frames: int = BATCH_FRAMES) -> tuple[ControlPointRun, Rendering]:
    """``points`` (B runs of F + 1 control points) moved by ``steps`` Gauss-Newton steps on the misfit
    of the lag-free frames ``signals`` (B, F, 256, 256) (module docstring), and their ``Rendering``."""
    correlation = ResponseCorrelation.of(forward_model, domain.groove_share, signals.device)
    x = torch.cat([points.leaf_a, points.leaf_b, points.jaws], -1).float()
    rendering, gradient = _evaluate(forward_model, signals, x, batch_frames, with_gradient=steps > 0)
    damping = x.new_full((x.shape[0],), START_DAMPING)
    for step in range(steps):
        diagonal, upper = _curvature(domain, correlation, x, rendering.mu)
        curvature = diagonal.diagonal(dim1=-2, dim2=-1)
        shift = damping[:, None, None] * curvature + _prior(domain, correlation, rendering.mu, curvature)[:, None]
        move = -solve_chain(diagonal + torch.diag_embed(shift), upper, gradient / 2)
        trial = x + move.float().clamp(-STEP_LIMIT_MM, STEP_LIMIT_MM)
        last = step == steps - 1
        trial_rendering, trial_gradient = _evaluate(forward_model, signals, trial, batch_frames, with_gradient=not last)
        better = trial_rendering.misfits.sum((-2, -1)) < rendering.misfits.sum((-2, -1))  # (B,)
        x = torch.where(better[:, None, None], trial, x)
        rendering = Rendering(torch.where(better[:, None, None], trial_rendering.misfits, rendering.misfits),
                              torch.where(better[:, None], trial_rendering.mu, rendering.mu),
                              torch.where(better[:, None], trial_rendering.signal_mu, rendering.signal_mu))
        if not last:
            gradient = torch.where(better[:, None, None], trial_gradient, gradient)
        damping = torch.where(better, damping / 3, damping * 4)
    return (ControlPointRun(x[..., :NUM_LEAF_PAIRS].contiguous(), x[..., NUM_LEAF_PAIRS:EDGES].contiguous(),
                            x[..., EDGES:].contiguous()), rendering)


def _evaluate(forward_model: nn.Module, signals: Tensor, x: Tensor, batch_frames: int,
              with_gradient: bool) -> tuple[Rendering, Tensor | None]:
    """The ``Rendering`` of the control points x (B, F + 1, ``UNKNOWNS``) against ``signals`` (B, F,
    256, 256) and, when asked for, the gradient (B, F + 1, ``UNKNOWNS``) of the summed misfit."""
    runs, frames = signals.shape[:2]
    misfits = signals.new_zeros(runs, frames, NUM_LEAF_PAIRS)
    mu, signal_mu = signals.new_zeros(runs, frames), signals.new_zeros(runs, frames)
    gradient = torch.zeros_like(x) if with_gradient else None
    for begin in range(0, frames, batch_frames):
        chunk = slice(begin, min(begin + batch_frames, frames))
        with torch.inference_mode(False), torch.enable_grad():
            points = x[:, chunk.start:chunk.stop + 1].clone().requires_grad_(with_gradient)
            pairs = torch.stack([points[:, :-1], points[:, 1:]], 2).flatten(0, 1)  # (K, 2 [prev, curr], UNKNOWNS)
            scalars = torch.cat([pairs.new_ones(len(pairs), 1), pairs[:, :, EDGES], pairs[:, :, EDGES + 1]], 1)
            fluence = forward_model.fluence(pairs[:, :, :NUM_LEAF_PAIRS].flatten(1),
                                            pairs[:, :, NUM_LEAF_PAIRS:EDGES].flatten(1), scalars)
        with torch.no_grad():
            output = forward_model.beam.output(fluence.detach())[:, None, None]
            rendered = forward_model.response(fluence.detach()) * output
            per_leaf, frame_mu, frame_signal_mu, residuals = frame_misfits(rendered, signals[:, chunk].flatten(0, 1))
            misfits[:, chunk] = per_leaf.view(runs, -1, NUM_LEAF_PAIRS)
            mu[:, chunk], signal_mu[:, chunk] = frame_mu.view(runs, -1), frame_signal_mu.view(runs, -1)
            if with_gradient:
                towards = forward_model.response.adjoint(-2 * frame_mu[:, None, None] * output * residuals)
        if with_gradient:
            with torch.inference_mode(False):
                part, = torch.autograd.grad(fluence, points, towards.clone())
            gradient[:, chunk.start:chunk.stop + 1] += part
    return Rendering(misfits, mu, signal_mu), gradient


def _curvature(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, mu: Tensor) -> tuple[Tensor, Tensor]:
    """J^T J of the control points x (B, F + 1, ``UNKNOWNS``) with the frames' MU (B, F), as the
    diagonal blocks (B, F + 1, n, n) and the blocks above them (B, F, n, n) of a chain."""
    runs, count = x.shape[0], x.shape[1]
    edges = frame_sub_apertures(_edges(domain, x))  # (B, F, 7, 104) at the sub-apertures
    blocks = _leaf_blocks(domain, correlation, x, edges, mu)  # (B, F, 2, 2, 104, 104)
    lines = _jaw_blocks(domain, correlation, x, edges, mu)  # (B, F, 2, 2, 2)
    diagonal = x.new_zeros(runs, count, UNKNOWNS, UNKNOWNS, dtype=torch.float64)
    upper = x.new_zeros(runs, count - 1, UNKNOWNS, UNKNOWNS, dtype=torch.float64)
    diagonal[:, :-1, :EDGES, :EDGES] += blocks[:, :, 0, 0]
    diagonal[:, 1:, :EDGES, :EDGES] += blocks[:, :, 1, 1]
    upper[..., :EDGES, :EDGES] = blocks[:, :, 0, 1]
    diagonal[:, :-1, EDGES:, EDGES:] += torch.diag_embed(lines[:, :, 0, 0])
    diagonal[:, 1:, EDGES:, EDGES:] += torch.diag_embed(lines[:, :, 1, 1])
    upper[..., EDGES:, EDGES:] = torch.diag_embed(lines[:, :, 0, 1])
    return diagonal, upper


def _edges(domain: RowDomain, x: Tensor) -> Tensor:
    """The leaf edges (..., 104) of control points x (..., ``UNKNOWNS``), after each bank's leaf-end offset."""
    return torch.cat([x[..., :NUM_LEAF_PAIRS] - domain.offset_a, x[..., NUM_LEAF_PAIRS:EDGES] + domain.offset_b], -1)


def _sample_weights(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """The chain weights c (7, 2) of a frame's sub-apertures on its two control points, their split
    (7, M) between the ``SUB_SAMPLES`` positions, and the sub-aperture index of each position (M,)."""
    t = torch.arange(SUB_APERTURES, device=device) / (SUB_APERTURES - 1)
    samples = torch.linspace(0.0, 1.0, SUB_SAMPLES, device=device)
    split = (1 - (t[:, None] - samples[None, :]).abs() * (SUB_SAMPLES - 1)).clamp_min(0.0)
    return torch.stack([1 - t, t], 1), split, (samples * (SUB_APERTURES - 1)).round().long()


def _leaf_blocks(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, positions: Tensor,
                 mu: Tensor) -> Tensor:
    """(B, F, 2, 2, 104, 104): the leaves' J^T J of each frame over its [prev, curr] control points;
    ``positions`` (B, F, 7, 104) the edges at the sub-apertures."""
    runs, frames = mu.shape
    openings = domain.jaw_openings(x[..., EDGES:])  # (B, F, 7, 52, 5)
    passed = (domain.jaw_transmission + (1 - domain.jaw_transmission) * openings).mean(-1)
    bank_a, bank_b = positions[..., :NUM_LEAF_PAIRS], positions[..., NUM_LEAF_PAIRS:]
    seen = passed * (bank_b > bank_a)  # (B, F, 7, 52): the pair open
    sign = torch.cat([-torch.ones(NUM_LEAF_PAIRS, device=x.device), torch.ones(NUM_LEAF_PAIRS, device=x.device)])
    alpha = (sign * torch.cat([seen, seen], -1) * (positions.abs() < GRID_SIZE / 2)
             * (1 - domain.leaf_transmission) / SUB_APERTURES * mu[..., None, None])
    classes = torch.cat([_edge_classes(bank_a, torch.ge), _edge_classes(bank_b, torch.le)], -1)
    chain, split, sampled = _sample_weights(x.device)
    weight = torch.einsum("bfte,ta,tm->bfmae", alpha, chain, split)  # (B, F, M, 2, 104)
    positions, classes = positions[:, :, sampled], classes[:, :, sampled]  # (B, F, M, 104)
    reach = correlation.reach
    offsets = torch.arange(-reach, reach + 1, device=x.device)
    leaf = torch.arange(EDGES, device=x.device) % NUM_LEAF_PAIRS
    neighbour = leaf[:, None] + offsets  # (104, 2 R + 1)
    valid = (neighbour >= 0) & (neighbour < NUM_LEAF_PAIRS)
    blocks = x.new_zeros(runs, frames, 2, 2, EDGES, EDGES)
    for bank in (0, 1):
        partner = neighbour.clamp(0, NUM_LEAF_PAIRS - 1) + NUM_LEAF_PAIRS * bank
        dx = positions[:, :, :, None, :, None] - positions[..., partner][:, :, None]  # (B, F, M, M, 104, 2 R + 1)
        index = (offsets + reach) * 16 + 4 * classes[:, :, :, None, :, None] + classes[..., partner][:, :, None]
        products = correlation.edge_products(index, dx) * valid
        block = torch.einsum("bfmsek,bfmae,bfscek->bfacek", products, weight, weight[..., partner])
        blocks.scatter_add_(-1, partner.expand_as(block), block)
    return blocks


def _edge_classes(positions: Tensor, closer) -> Tensor:
    """Class (0..3) of each edge (..., 52) of a bank: bit 0 where it is at least as closed as the
    leaf below, bit 1 as the leaf above (``closer``: ``torch.ge`` for bank A, ``torch.le`` for B)."""
    none = torch.zeros_like(positions[..., :1], dtype=torch.bool)
    lower = torch.cat([none, closer(positions[..., 1:], positions[..., :-1])], -1)
    upper = torch.cat([closer(positions[..., :-1], positions[..., 1:]), none], -1)
    return lower.long() + 2 * upper.long()


def _jaw_blocks(domain: RowDomain, correlation: ResponseCorrelation, x: Tensor, edges: Tensor,
                mu: Tensor) -> Tensor:
    """(B, F, 2, 2, 2): each jaw's J^T J of each frame over its [prev, curr] control points, the
    leaves held: its edge's row over the opening of the leaf it lies in (``edges`` (B, F, 7, 104) at
    the sub-apertures)."""
    jaws = torch.stack([x[..., EDGES] - domain.jaw_offset, x[..., EDGES + 1] + domain.jaw_offset], -1)
    rows = frame_sub_apertures(jaws)  # (B, F, 7, 2)
    leaf = ((rows - MLC_Y_MIN_MM) / LEAF_WIDTH_MM).floor().long().clamp(0, NUM_LEAF_PAIRS - 1)
    half = GRID_SIZE / 2
    opening = (edges[..., NUM_LEAF_PAIRS:].gather(-1, leaf).clamp(-half, half)
               - edges[..., :NUM_LEAF_PAIRS].gather(-1, leaf).clamp(-half, half)).clamp_min(0.0)
    sign = torch.tensor([-1.0, 1.0], device=x.device)
    alpha = (sign * (rows.abs() < half) * (1 - domain.jaw_transmission) * (1 - domain.leaf_transmission)
             / SUB_APERTURES * mu[..., None, None])  # (B, F, 7, 2)
    dy = rows[:, :, :, None] - rows[:, :, None]  # (B, F, 7, 7, 2)
    length = 0.5 * (opening[:, :, :, None] + opening[:, :, None])
    products = correlation.line_products(dy, length) * alpha[:, :, :, None] * alpha[:, :, None]
    chain, _, _ = _sample_weights(x.device)
    return torch.einsum("bftsj,ta,sc->bfacj", products, chain, chain)


def _prior(domain: RowDomain, correlation: ResponseCorrelation, mu: Tensor, curvature: Tensor) -> Tensor:
    """(B, ``UNKNOWNS``): ``PRIOR_SHARE`` of a fully open edge's curvature at each run's mean MU for
    the leaves, of the jaws' mean curvature for the jaws."""
    chain, _, _ = _sample_weights(mu.device)
    open_edge = (mu.double().square().mean(-1) * (1 - domain.leaf_transmission) ** 2
                 * float(correlation.edges[correlation.reach, 3, 3, correlation.centre])
                 * chain.square().sum() * 2 / SUB_APERTURES ** 2)  # (B,)
    jaws = curvature[..., EDGES:]  # (B, F + 1, 2)
    seen = jaws > 0
    jaw_mean = torch.where(seen.any((-2, -1)), (jaws * seen).sum((-2, -1)) / seen.sum((-2, -1)).clamp_min(1),
                           open_edge)
    prior = open_edge[:, None].expand(-1, UNKNOWNS).clone()
    prior[:, EDGES:] = jaw_mean[:, None]
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
