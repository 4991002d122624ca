"""Reconstructing control points from consecutive EPID frames with the forward model's rendering.

A window of W consecutive frames spans W + 1 control points: frame k integrates the motion from
control point k - 1 to control point k, so every control point inside the window is shared by
two frames. Starting from the inverse network's estimates, the fit moves the leaves and jaws of
all W + 1 control points at once to minimise, per frame, the squared difference between the
measured signal and the forward model's rendering scaled by its best MU, relative to that MU
squared (so frames of any MU weigh alike):

    sum over frames of || mu R(geometry) - S ||^2 / mu^2,   mu = <R, S> / <R, R>

with Adam, the step size falling along a half cosine from ``START_STEP_MM`` to a tenth of it.
The signal S of a frame is the recorded frame with the detector's lag taken out:
S_k = (F_k - lag F_(k-1)) / (1 - lag), exact where the frame before is known.

A blurred frame shows where an edge was on average during the frame well, but the ends of its
motion poorly: the staircase of sub-apertures from u to v looks the same as from v to u. Every
frame's mean edge position is therefore fitted quickly, while the alternating direction that
keeps all the means (control point j moved by (-1)^(j+1) d: the zigzag) is shallow with several
local minima. After the first descent, each split round tries, for every leaf edge at once, each
zigzag amplitude d of ``SPLIT_OFFSETS_MM``; each edge keeps the amplitude of least misfit in its
own region of the window's frames (its leaf row, on its bank's side of the middle of the
opening). The edges are moved in four scans, one bank's even or odd leaves at a time, so that no
region's misfit mixes with the blur of another edge moving in its own row or in the rows beside
it. A shorter descent from ``REFINE_STEP_MM`` follows.

On a frame pair (W = 2: the control point before prev extrapolated at constant speed, prev and
curr), a leaf that comes back to where it was gives the same two frames as one that made the
opposite excursion: the pair cannot tell them apart. On a longer window the neighbouring frames
decide it, except at the window's ends; ``reconstruct_arc`` therefore fits overlapping windows
and keeps, of each control point, the estimate of the window in which it lies most inside.

Only the geometry moves: the forward model's parameters receive no gradient. Leaves that no
jaw opens in any frame of a window get no gradient, are not searched and keep their estimates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from epid.aperture_models import ROWS_PER_LEAF, column_centres, remove_lag, row_visibility, to_leaf_grid
from epid.sequences import NUM_LEAF_PAIRS

START_STEP_MM = 0.5
REFINE_STEP_MM = 0.2
FINAL_STEP_FRACTION = 0.1
SPLIT_OFFSETS_MM = (0.0, *(sign * 0.5 * k for k in range(1, 17) for sign in (-1.0, 1.0)))
"""Zigzag amplitudes tried in a split round, mm: 0 first (ties keep the current split), then
+-0.5 to +-8 mm."""
METHODS = ("network", "pair", "arc")
"""Reconstructions: the inverse network's estimate, refined per frame pair (``pair_estimate``),
refined jointly over consecutive frames (``reconstruct_arc``)."""
ARC_WINDOW_FRAMES = 8
"""Frames fitted jointly by ``reconstruct_arc``."""
ARC_WINDOW_OVERLAP = 4
"""Frames that consecutive windows of ``reconstruct_arc`` share."""
ARC_BATCH_FRAMES = 64
"""Frames rendered together in one step of ``reconstruct_arc`` (whole windows)."""


@dataclass(frozen=True)
class FitSettings:
    """How long the fit runs: descent ``steps`` (0 = no fit), ``split_rounds`` and the descent
    ``refine_steps`` after each round."""

    steps: int = 100
    split_rounds: int = 3
    refine_steps: int = 40

    @classmethod
    def of(cls, inverse_model: nn.Module) -> FitSettings:
        """The settings of an aperture inverse model's config (``fit_steps``, ``split_rounds``,
        ``refine_steps``)."""
        config = inverse_model.config
        return cls(config.fit_steps, config.split_rounds, config.refine_steps)


@dataclass(frozen=True)
class Window:
    """The geometry of B windows of W frames: leaf_a, leaf_b (B, W + 1, 52) and jaws (B, W + 1, 2)
    [jaw_1, jaw_2] at the W + 1 control points, mm; mu (B, W) of each frame's signal (None
    before a fit)."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor | None = None


@dataclass(frozen=True)
class ArcReconstruction:
    """Control points reconstructed from N consecutive frames: leaf_a, leaf_b (N + 1, 52) and jaws
    (N + 1, 2) [jaw_1, jaw_2] mm at control points 0..N (frame k integrates k - 1 -> k), mu (N,)
    of each frame, and ``method`` ("network" or "arc fit")."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor
    method: str


def fit_window(renderer: nn.Module, signals: Tensor, start: Window, settings: FitSettings) -> Window:
    """Refine ``start`` against ``signals`` (B, W, 256, 256), the lag-free frames of B windows,
    with ``renderer.render`` (an aperture forward model); see the module docstring."""
    batch, frames = signals.shape[:2]
    with torch.inference_mode(False), torch.enable_grad():
        measured = signals.detach().clone().transpose(0, 1).reshape(frames * batch, *signals.shape[2:])
        geometry = [t.detach().clone().requires_grad_() for t in (start.leaf_a, start.leaf_b, start.jaws)]
        if settings.steps > 0:
            _descend(renderer, measured, geometry, settings.steps, START_STEP_MM)
            for _ in range(settings.split_rounds):
                _search_splits(renderer, measured, geometry)
                _descend(renderer, measured, geometry, settings.refine_steps, REFINE_STEP_MM)
        with torch.no_grad():
            mu = _best_mu(_render(renderer, geometry), measured).view(frames, batch).T
    leaf_a, leaf_b, jaws = (t.detach() for t in geometry)
    return Window(leaf_a, leaf_b, jaws, mu)


def can_refine(forward_model: nn.Module, inverse_model: nn.Module) -> bool:
    """Whether the pair can refine the network's estimate: a forward model that renders
    (``render``, ``lag_fraction``) and an inverse model with fit settings of at least one step."""
    config = getattr(inverse_model, "config", None)
    return hasattr(forward_model, "render") and getattr(config, "fit_steps", 0) > 0


def method_used(forward_model: nn.Module, inverse_model: nn.Module, method: str) -> str:
    """The reconstruction that ``method`` (one of ``METHODS``) gives for this pair: "network"
    when it cannot refine."""
    if method not in METHODS:
        raise ValueError(f"unknown reconstruction {method!r}; expected one of {', '.join(METHODS)}")
    return method if can_refine(forward_model, inverse_model) else "network"


def pair_estimate(forward_model: nn.Module, inverse_model: nn.Module, epid_prev: Tensor, epid_curr: Tensor,
                  refine: bool = True, settings: FitSettings | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse network's estimate of frame pairs (B, 1, 256, 256) [prev, curr], refined (when
    ``refine`` and ``can_refine``) by ``fit_window`` on the pair with the forward model's lag
    taken out of the curr frame: (leaf_a, leaf_b (B, 104) [prev, curr] mm, scalars (B, 5) [MU
    curr, jaw_1 prev, curr, jaw_2 prev, curr]). ``settings`` default to the inverse model's own."""
    leaf_a, leaf_b, scalars, _ = inverse_model(epid_prev, epid_curr)
    if not (refine and can_refine(forward_model, inverse_model)):
        return leaf_a, leaf_b, scalars
    settings = settings or FitSettings.of(inverse_model)
    frames = torch.cat([epid_prev, epid_curr], 1).float()
    half = NUM_LEAF_PAIRS
    jaws = scalars[:, 1:].view(-1, 2, 2).transpose(1, 2)  # (B, 2 [prev, curr], 2 [jaw_1, jaw_2])

    def with_start(prev: Tensor, curr: Tensor) -> Tensor:
        return torch.stack([2 * prev - curr, prev, curr], 1)

    start = Window(with_start(leaf_a[:, :half], leaf_a[:, half:]), with_start(leaf_b[:, :half], leaf_b[:, half:]),
                   with_start(jaws[:, 0], jaws[:, 1]))
    fitted = fit_window(forward_model, remove_lag(frames, forward_model.lag_fraction.detach()), start, settings)
    flat_jaws = fitted.jaws[:, 1:].transpose(1, 2).reshape(-1, 4)
    return (fitted.leaf_a[:, 1:].flatten(1), fitted.leaf_b[:, 1:].flatten(1),
            torch.cat([fitted.mu[:, 1:], flat_jaws], 1))


def reconstruct_arc(forward_model: nn.Module, inverse_model: nn.Module, frames: Tensor, *,
                    frame_before: Tensor | None = None, settings: FitSettings | None = None,
                    window: int = ARC_WINDOW_FRAMES, overlap: int = ARC_WINDOW_OVERLAP,
                    batch_frames: int = ARC_BATCH_FRAMES,
                    progress: Callable[[int], None] | None = None) -> ArcReconstruction:
    """Control points 0..N of N >= 2 consecutive recorded frames (N, 256, 256) of one arc.

    ``frame_before`` (256, 256) is the recorded frame before the first (zeros at the start of an
    arc); without it the first frame's lag stays in and control point 0 comes from the first
    pair's estimate extrapolated. The inverse network estimates every consecutive pair; each
    control point starts at the mean of the (up to two) pair estimates that contain it; windows
    of ``window`` frames overlapping by ``overlap`` are then fitted (``fit_window``, settings
    default to the inverse model's own; no fit steps, or a pair that cannot refine: the network's
    estimate, the first frame's MU NaN without ``frame_before``). ``progress`` is
    called with the number of frames each batch of windows finished."""
    frames = frames.float()
    count = len(frames)
    if count < 2:
        raise ValueError(f"an arc reconstruction needs at least 2 frames, got {count}")
    settings = settings or FitSettings.of(inverse_model)
    if not can_refine(forward_model, inverse_model):
        settings = FitSettings(0, 0, 0)
    lag = forward_model.lag_fraction.detach() if settings.steps > 0 else _network_lag(inverse_model)
    before = frames[:1] if frame_before is None else frame_before.float().reshape(1, *frames.shape[1:])
    recorded = torch.cat([before, frames])  # (N + 1, 256, 256): the pairs (k - 1, k) for k = 1..N
    signals = (frames - lag * recorded[:-1]) / (1.0 - lag)
    if frame_before is None:
        signals[0] = frames[0]
    *start, network_mu = _pair_estimates(inverse_model, recorded, batch_frames, first_pair=frame_before is not None)
    if settings.steps == 0:
        return ArcReconstruction(*start, network_mu, method="network")
    window = min(window, count)
    overlap = min(overlap, window - 1)
    starts = _window_starts(count, window, overlap)
    leaf_a, leaf_b, jaws = (t.clone() for t in start)
    mu = signals.new_zeros(count)
    per_batch = max(1, batch_frames // window)
    owners = _owners(starts, window, count)
    for first in range(0, len(starts), per_batch):
        group = range(first, min(first + per_batch, len(starts)))
        spans = [torch.arange(starts[w], starts[w] + window + 1) for w in group]
        fitted = fit_window(forward_model, torch.stack([signals[span[0]:span[-1]] for span in spans]),
                            Window(*(torch.stack([t[span] for span in spans]) for t in start)), settings)
        for k, w in enumerate(group):
            keep = torch.nonzero(owners == w).flatten()
            local = keep - starts[w]
            leaf_a[keep], leaf_b[keep] = fitted.leaf_a[k, local], fitted.leaf_b[k, local]
            jaws[keep] = fitted.jaws[k, local]
            frames_kept = local[local > 0]
            mu[starts[w] + frames_kept - 1] = fitted.mu[k, frames_kept - 1]
        if progress is not None:
            progress(len(group) * window)
    return ArcReconstruction(leaf_a, leaf_b, jaws, mu, method="arc fit")


def _network_lag(inverse_model: nn.Module) -> Tensor | float:
    """The lag fraction the inverse network takes out of a curr frame (0 for a model without one)."""
    lag = getattr(inverse_model, "lag_percent", None)
    return 0.0 if lag is None else lag.detach() / 100.0


def _pair_estimates(inverse_model: nn.Module, recorded: Tensor, batch_frames: int,
                    first_pair: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Control points 0..N (leaf_a, leaf_b (N + 1, 52), jaws (N + 1, 2)) and each frame's MU (N,)
    from the network's estimates of the pairs of ``recorded`` (N + 1 frames, the first the frame
    before the arc's first): each point the mean of the estimates that contain it. Without the
    ``first_pair``, control point 0 is extrapolated and the first frame's MU is NaN."""
    count = len(recorded) - 1
    half = NUM_LEAF_PAIRS
    sums = recorded.new_zeros(count + 1, 2 * half + 2)
    weights = recorded.new_zeros(count + 1, 1)
    mu = recorded.new_full((count,), math.nan)
    first = 0 if first_pair else 1
    for begin in range(first, count, batch_frames):
        end = min(begin + batch_frames, count)
        leaf_a, leaf_b, scalars, _ = inverse_model(recorded[begin:end, None], recorded[begin + 1:end + 1, None])
        for point, columns in ((0, slice(None, half)), (1, slice(half, None))):
            jaws = scalars[:, [1 + point, 3 + point]]
            sums[begin + point:end + point] += torch.cat([leaf_a[:, columns], leaf_b[:, columns], jaws], 1).float()
            weights[begin + point:end + point] += 1
        mu[begin:end] = scalars[:, 0].float()
    points = sums / weights.clamp_min(1)
    if not first_pair:
        points[0] = 2 * points[1] - points[2]
    return points[:, :half], points[:, half:2 * half], points[:, 2 * half:], mu


def _window_starts(count: int, window: int, overlap: int) -> list[int]:
    """First frames of windows of ``window`` frames covering ``count`` frames, each overlapping the
    next by at least ``overlap`` (the last ends at the arc's end)."""
    stride = window - overlap
    starts = list(range(0, max(count - window, 0) + 1, stride))
    if starts[-1] + window < count:
        starts.append(count - window)
    return starts


def _owners(starts: list[int], window: int, count: int) -> Tensor:
    """For each control point 0..count, the index into ``starts`` of the window in which it lies
    most inside (farthest from the window's ends; the arc's own ends count as inside)."""
    point = torch.arange(count + 1)[:, None]
    first = torch.tensor(starts)[None, :]
    last = first + window
    inside = torch.minimum(torch.where(first == 0, count + 1, point - first),
                           torch.where(last == count, count + 1, last - point))
    inside = torch.where((point >= first) & (point <= last), inside, -1)
    return inside.argmax(1)


def _best_mu(rendered: Tensor, measured: Tensor) -> Tensor:
    """Least-squares MU (F,) of measured ~ mu * rendered (F, 256, 256)."""
    return (rendered * measured).sum((-2, -1)) / (rendered * rendered).sum((-2, -1)).clamp_min(1e-12)


def _render(renderer: nn.Module, geometry: list[Tensor]) -> Tensor:
    """Frames per MU (W B, 256, 256), frame-major (frame 1 of every window, then frame 2, ...), of
    the windows' geometry [leaf_a, leaf_b (B, W + 1, 52), jaws (B, W + 1, 2)]."""
    leaf_a, leaf_b, jaws = geometry

    def motions(points: Tensor) -> Tensor:  # (B, W + 1, n) -> (W B, 2 n) [start, end] of each frame
        return torch.cat([points[:, :-1], points[:, 1:]], -1).transpose(0, 1).flatten(0, 1)

    jaw_motion = motions(jaws)  # [jaw_1 start, jaw_2 start, jaw_1 end, jaw_2 end]
    scalars = torch.cat([jaw_motion.new_ones(len(jaw_motion), 1), jaw_motion[:, [0, 2, 1, 3]]], 1)
    return renderer.render(motions(leaf_a), motions(leaf_b), scalars)[0]


def _misfit(renderer: nn.Module, measured: Tensor, geometry: list[Tensor]) -> Tensor:
    """Sum over frames of || mu R - S ||^2 / mu^2 at each frame's best MU."""
    rendered = _render(renderer, geometry)
    mu = _best_mu(rendered, measured).detach().clamp_min(1e-6)
    residual = mu[:, None, None] * rendered - measured
    return (residual.square().sum((-2, -1)) / mu.square()).sum()


def _descend(renderer: nn.Module, measured: Tensor, geometry: list[Tensor], steps: int, start_step_mm: float) -> None:
    """``steps`` Adam steps on the misfit, the step size along a half cosine from ``start_step_mm``
    to ``FINAL_STEP_FRACTION`` of it; ``geometry`` is updated in place."""
    optimizer = torch.optim.Adam(geometry, lr=start_step_mm)
    for step in range(steps):
        fraction = FINAL_STEP_FRACTION + (1 - FINAL_STEP_FRACTION) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = start_step_mm * fraction
        gradients = torch.autograd.grad(_misfit(renderer, measured, geometry), geometry)
        for tensor, gradient in zip(geometry, gradients, strict=True):
            tensor.grad = gradient
        optimizer.step()


@torch.no_grad()
def _search_splits(renderer: nn.Module, measured: Tensor, geometry: list[Tensor]) -> None:
    """One split round (module docstring): every open leaf edge's zigzag amplitude chosen among
    ``SPLIT_OFFSETS_MM`` by the least misfit in its region; ``geometry`` is updated in place."""
    leaf_a, leaf_b, jaws = (t.detach().clone() for t in geometry)
    batch, points = leaf_a.shape[:2]
    zigzag = torch.tensor([(-1.0) ** (j + 1) for j in range(points)], device=leaf_a.device)[None, :, None]
    rendered = _render(renderer, geometry)
    mu = _best_mu(rendered, measured).clamp_min(1e-6)
    middle = (leaf_a[:, :-1] + leaf_a[:, 1:] + leaf_b[:, :-1] + leaf_b[:, 1:]) / 4  # (B, W, 52) per frame
    bank_a_side = column_centres(leaf_a.device) < middle.transpose(0, 1).flatten(0, 1)[..., None]  # (W B, 52, 256)
    best_cost = _edge_misfits(rendered, measured, mu, bank_a_side, batch)  # (2, B, 52) at amplitude 0
    best_offset = torch.zeros_like(best_cost)
    even = torch.arange(NUM_LEAF_PAIRS, device=leaf_a.device) % 2 == 0
    none = torch.zeros_like(even)
    for moved in (torch.stack(banks) for banks in ((even, none), (~even, none), (none, even), (none, ~even))):
        for offset in SPLIT_OFFSETS_MM[1:]:
            step_a, step_b = (offset * moved)[:, None, None, :] * zigzag  # (2, 1, W + 1, 52)
            cost = _edge_misfits(_render(renderer, [leaf_a + step_a, leaf_b + step_b, jaws]), measured, mu,
                                 bank_a_side, batch)
            better = (cost < best_cost) & moved[:, None, :]
            best_cost = torch.where(better, cost, best_cost)
            best_offset = torch.where(better, torch.full_like(cost, offset), best_offset)
    seen = torch.stack([row_visibility((jaws[:, k, 0], jaws[:, k + 1, 0]), (jaws[:, k, 1], jaws[:, k + 1, 1]))[0]
                        for k in range(points - 1)]).sum(0) > 0  # (B, 52)
    best_offset = best_offset * seen
    geometry[0].copy_(leaf_a + best_offset[0][:, None, :] * zigzag)
    geometry[1].copy_(leaf_b + best_offset[1][:, None, :] * zigzag)


def _edge_misfits(rendered: Tensor, measured: Tensor, mu: Tensor, bank_a_side: Tensor, batch: int) -> Tensor:
    """The misfit of each leaf edge's region, summed over a window's frames: (2, B, 52) [bank A,
    bank B]. ``rendered`` and ``measured`` (W B, 256, 256) frame-major, ``mu`` (W B,) the frames'
    MU; a region is the leaf's row of pixels on its bank's side of ``bank_a_side`` (W B, 52, 256)."""
    misfit = (mu[:, None, None] * rendered - measured).square() / mu.square()[:, None, None]
    rows = to_leaf_grid(misfit).unflatten(-2, (NUM_LEAF_PAIRS, ROWS_PER_LEAF)).sum(-2)  # (W B, 52, 256)
    cost_a = (rows * bank_a_side).sum(-1)
    cost_b = rows.sum(-1) - cost_a
    return torch.stack([cost_a.view(-1, batch, NUM_LEAF_PAIRS).sum(0), cost_b.view(-1, batch, NUM_LEAF_PAIRS).sum(0)])
