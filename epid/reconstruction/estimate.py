"""Reconstructing control points from consecutive EPID frames with the forward model's physics.

N consecutive frames span N + 1 control points: frame k integrates the motion from control point
k - 1 to control point k, so every control point inside the run is shared by two frames. The
inverse network estimates every consecutive pair; each control point starts at the mean of the
(up to two) pair estimates that contain it. ``epid.reconstruction.leaves`` then moves the leaves of all
N + 1 control points to the positions of least misfit between the measured frames and the
forward model's aperture seen through its detector response, exactly per leaf edge over the
whole run (dynamic programming along the chain of control points); each frame's MU is the least
squares fit of the forward model's rendering. The signal of a frame is the recorded frame with
the detector's lag taken out: S_k = (F_k - lag F_(k-1)) / (1 - lag), exact where the frame
before is known.

On a frame pair (the control point before prev extrapolated at constant speed, prev and curr), a
leaf that comes back to where it was gives the same two frames as one that made the opposite
excursion: the pair cannot tell them apart. Over a whole arc the neighbouring frames decide it,
except at the arc's ends.

The jaws start from the network's estimate and are refined with the leaves
(``epid.reconstruction.jaws``); the forward model's parameters are read, never trained. A fit is
kept only where the frames, rendered by the forward model, agree with it at least as well as with
the network's estimate it started from (``epid.reconstruction.fallback``): a reconstruction is
never worse than its start on the measured frames.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from epid.models.families import model_strips
from epid.reconstruction.descent import descend
from epid.reconstruction.fallback import (
    BATCH_FRAMES,
    ControlPointRun,
    Kept,
    keep_better,
    open_leaves,
    render_run,
    uncrossed,
)
from epid.reconstruction.leaves import track_leaves
from epid.reconstruction.rows import RowDomain
from epid.synthesis.geometry import STRIPS, StripGrid

METHODS = ("network", "pair", "arc")
"""Reconstructions: the inverse network's estimate, refined per frame pair (``pair_estimate``),
refined jointly over consecutive frames (``reconstruct_arc``)."""
Stages = tuple[tuple[float, float], ...]
"""A tracking schedule: (range, grid step) mm of each stage (``epid.reconstruction.leaves``)."""
RELINEARISED_STAGES: Stages = ((4.0, 0.4),)
"""Stages of each further pass under a broad response (``RowDomain.broad``), the rows read relative
to the fit before instead of the start: the rows are exact at the point they are read
from, and a start 2 to 3 mm off (the network on irregular arcs) is too far for the first.
Chosen on 40 frames of arcs 5, 85, 165, 325, 405 (12 mm wide response, realistic physics,
noise): leaf MAE 0.55 -> 0.47 mm, 88.7 -> 92.2 % within 1 mm; arc 165 1.05 -> 0.67 mm. Its first
stage then widened from +-2 mm (0.2 mm steps, the same 21 states) to +-4 mm, where a fit a
millimetre or two off has room to come back: 0.389 -> 0.376 mm, 95.5 -> 96.3 % (the same frames,
with ``POLISH_SIGMA_MM``; +-6 and +-8 mm and a third stage gave 96.0 to 96.4 %); the `elongated`
and 16 mm responses unchanged (95.7 and 82.1 %). Its second stage (+-1 mm in 0.1 mm steps) left out
since the Gauss-Newton steps (``epid.reconstruction.descent``) follow: with them, 16 mm wide
response, leaf MAE 0.661 mm / 86.4 % with it and 0.665 / 86.6 % without (3 steps)."""

RELINEARISED_PASSES = 3
"""Most passes read relative to the fit before them under a broad response; a pass is repeated while
the one before moved the positions the jaws leave open by more than ``SETTLED_MM`` on average. The
row domain is exact only at the point the rows are read from, and under a 16 mm wide response the
network's estimate of an irregular arc starts too far from the truth for one pass (two stages in one
pass, ((4, 0.4), (4, 0.4)), did not do what a second pass does). 150 frames of the tuning arcs 5, 85,
165, 325, 405 (realistic physics, 20-minute checkpoints, seed 0), leaf MAE / share within 1 mm with
one pass and with up to three: 16 mm wide response 0.678 mm / 84.3 % -> 0.634 / 86.3 % (arc 165
73.3 -> 80.4 %, 405 78.3 -> 78.9 %, 85 81.3 -> 81.9 %, the regular arcs 5 and 325 settled after one);
12 mm wide 0.358 / 95.84 -> 0.356 / 95.89 % (only arc 165 repeated, 94.40 -> 94.58 %). A pass costs
about 12 ms a frame on 2 CPU cores (AMD EPYC, AVX2). The fine strips of HD120 take one: there the repeated
passes cost 32 ms a frame on average (300 frames of the tuning arcs 5, 85, 165, 12 mm wide response, 20-minute
checkpoint: 75.2 -> 75.9 % within 1 mm at 8.2 frames/s against 11.2, under the 10 a whole arc must
keep)."""
SETTLED_MM = 0.3
"""Mean move of the open positions after which a pass is not repeated. Where a pass gains nothing,
further passes still move them 0.15 to 0.25 mm (the fit wanders within the noise: four passes on the
regular arc 5 under the 16 mm wide response moved them 0.25, 0.21, 0.19, 0.18 mm, 93.1 -> 92.6 % within
1 mm); on the irregular arc 165 they moved 0.73, 0.47, 0.31, 0.24 mm (16 mm wide) and 0.66, 0.17 mm
(12 mm wide)."""

CINE_PAIR_STEP = 2
"""A measured cine series' tracking starts from the network's estimates of every other frame pair
(each control point from one pair, not the mean of two): a cine frame spans a fraction of a
control-point interval, so neighbouring pairs see nearly the same motion. Decided on the simulated
clinic deliveries of tuning arcs 5, 85, 165, 325, 405 (commissioned sharp model, 238-246 frames
each): leaf MAE 0.093 / 0.115 / 0.364 / 0.138 / 0.171 mm with every pair, 0.091 / 0.121 / 0.360 /
0.126 / 0.180 with every other (within 1 mm 100 / 100 / 94.3 / 100 / 99.5 against 99.8 / 100 /
94.3 / 99.8 / 99.5 %), the five QAs 52.9 -> 46.3 s."""


@dataclass(frozen=True)
class ArcReconstruction:
    """Control points reconstructed from N consecutive frames: leaf_a, leaf_b (N + 1, strips) and jaws
    (N + 1, 2) [jaw_1, jaw_2] mm at control points 0..N (frame k integrates k - 1 -> k), mu (N,)
    of each frame, ``method`` ("network" or "arc tracking") and ``from_start``: the share of the
    leaf positions the jaws leave open for which the network's estimate was kept over the fit
    (``epid.reconstruction.fallback``), ``leaves_from_start`` (N + 1, strips) bool: the positions
    it was kept at (None for the network's estimate); ``signal_mu`` (N,): each frame's MU from its whole
    signal (``fallback.frame_misfits``), None for the network's estimate."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor
    method: str
    from_start: float = 0.0
    signal_mu: Tensor | None = None
    leaves_from_start: Tensor | None = None


def stages_of(inverse_model: nn.Module) -> Stages:
    """The tracking stages of an aperture inverse model's config (empty: no refinement)."""
    config = getattr(inverse_model, "config", None)
    return tuple(tuple(stage) for stage in getattr(config, "track_stages", ()))


def can_refine(forward_model: nn.Module, inverse_model: nn.Module) -> bool:
    """Whether the pair can refine the network's estimate: a forward model that renders
    (``render``, ``response``, ``aperture``) and an inverse model with tracking stages."""
    return hasattr(forward_model, "render") and bool(stages_of(inverse_model))


def method_used(forward_model: nn.Module, inverse_model: nn.Module, method: str) -> str:
    """The reconstruction that ``method`` (one of ``METHODS``) gives for this pair: "network"
    when it cannot refine."""
    if method not in METHODS:
        raise ValueError(f"unknown reconstruction {method!r}; expected one of {', '.join(METHODS)}")
    return method if can_refine(forward_model, inverse_model) else "network"


def pair_estimate(forward_model: nn.Module, inverse_model: nn.Module, epid_prev: Tensor, epid_curr: Tensor,
                  refine: bool = True, stages: Stages | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse network's estimate of frame pairs (B, 1, 256, 256) [prev, curr], refined (when
    ``refine`` and ``can_refine``) by tracking the leaves over the pair with the forward model's
    lag taken out of the curr frame: (leaf_a, leaf_b (B, 104) [prev, curr] mm, scalars (B, 5) [MU
    curr, jaw_1 prev, curr, jaw_2 prev, curr]). ``stages`` default to the inverse model's own."""
    leaf_a, leaf_b, scalars, _ = inverse_model(epid_prev, epid_curr)
    stages = stages_of(inverse_model) if stages is None else stages
    if not (refine and stages and can_refine(forward_model, inverse_model)):
        return leaf_a, leaf_b, scalars
    frames = torch.cat([epid_prev, epid_curr], 1).float()
    lag = forward_model.lag_fraction.detach()
    signals = torch.stack([frames[:, 0], (frames[:, 1] - lag * frames[:, 0]) / (1.0 - lag)], 1)
    half = leaf_a.shape[-1] // 2
    jaws = scalars[:, 1:].view(-1, 2, 2).transpose(1, 2)  # (B, 2 [prev, curr], 2 [jaw_1, jaw_2])

    def with_start(prev: Tensor, curr: Tensor) -> Tensor:
        return torch.stack([2 * prev - curr, prev, curr], 1).float()

    start = ControlPointRun(with_start(leaf_a[:, :half], leaf_a[:, half:]),
                            with_start(leaf_b[:, :half], leaf_b[:, half:]), with_start(jaws[:, 0], jaws[:, 1]))
    kept = _tracked_from(forward_model, signals, start, stages, BATCH_FRAMES)
    points = kept.points
    jaws = points.jaws[:, 1:]  # (B, 2 [prev, curr], 2 [jaw_1, jaw_2])
    return (points.leaf_a[:, 1:].flatten(1), points.leaf_b[:, 1:].flatten(1),
            torch.cat([kept.mu[:, 1:], jaws[..., 0], jaws[..., 1]], 1))


def reconstruct_arc(forward_model: nn.Module, inverse_model: nn.Module, frames: Tensor, *,
                    frame_before: Tensor | None = None, stages: Stages | None = None,
                    batch_frames: int = BATCH_FRAMES, cine: bool = False,
                    progress: Callable[[int], None] | None = None) -> ArcReconstruction:
    """Control points 0..N of N >= 2 consecutive recorded frames (N, 256, 256) of one arc.

    ``frame_before`` (256, 256) is the recorded frame before the first (zeros at the start of an
    arc); without it the first frame's lag stays in and control point 0 comes from the first
    pair's estimate extrapolated. The inverse network estimates every consecutive pair; each
    control point starts at the mean of the (up to two) pair estimates that contain it; the
    leaves are then tracked over the whole run (``stages`` default to the inverse model's own)
    and each frame's MU fitted with the forward model's rendering. No stages, or a pair that
    cannot refine: the network's estimate (the first frame's MU NaN without ``frame_before``).
    ``cine``: the frames are a measured cine series (``CINE_PAIR_STEP``, ``between_frames``). ``progress`` is called
    with the number of frames each step finished."""
    frames = frames.float()
    count = len(frames)
    if count < 2:
        raise ValueError(f"an arc reconstruction needs at least 2 frames, got {count}")
    stages = stages_of(inverse_model) if stages is None else stages
    if not can_refine(forward_model, inverse_model):
        stages = ()
    lag = forward_model.lag_fraction.detach() if stages else _network_lag(inverse_model)
    before = frames[:1] if frame_before is None else frame_before.float().reshape(1, *frames.shape[1:])
    recorded = torch.cat([before, frames])  # (N + 1, 256, 256): the pairs (k - 1, k) for k = 1..N
    signals = (frames - lag * recorded[:-1]) / (1.0 - lag)
    if frame_before is None:
        signals[0] = frames[0]
    leaf_a, leaf_b, jaws, network_mu = _pair_estimates(inverse_model, recorded, batch_frames,
                                                       first_pair=frame_before is not None,
                                                       step=CINE_PAIR_STEP if cine and stages else 1)
    if not stages:
        if progress is not None:
            progress(count)
        return ArcReconstruction(leaf_a, leaf_b, jaws, network_mu, method="network")
    kept = _tracked_from(forward_model, signals[None], ControlPointRun(leaf_a[None], leaf_b[None], jaws[None]),
                         stages, batch_frames, cine)
    if progress is not None:
        progress(count)
    points = kept.points
    return ArcReconstruction(points.leaf_a[0], points.leaf_b[0], points.jaws[0], kept.mu[0], method="arc tracking",
                             from_start=kept.from_start, signal_mu=kept.signal_mu[0],
                             leaves_from_start=kept.leaves_from_start[0])


def _tracked_from(forward_model: nn.Module, signals: Tensor, start: ControlPointRun, stages: Stages,
                  batch_frames: int, cine: bool = False) -> Kept:
    """B runs of lag-free frames (B, F, 256, 256) tracked from ``start`` through ``stages``, read as the start's
    rows plus the filtered residuals of the forward model's rendering of the start (``epid.reconstruction.leaves``);
    under a broad response further passes read them relative to the fit before them (``RELINEARISED_STAGES``,
    ``RELINEARISED_PASSES``) and Gauss-Newton steps on the forward model's own misfit follow
    (``epid.reconstruction.descent``) on the 52 strips. The fine strips of HD120 take the passes alone: the steps
    cost them three times the 52 strips' (a rendering with its gradient on rows of 0.5 mm), and on 300 frames of the
    tuning arcs 5, 85, 165 (HD120, 12 mm wide response, realistic physics, 20-minute checkpoint, 2-core AVX2 EPYC)
    took the leaves from 1.001 mm, 74.8 % within 1 mm to 0.927 mm, 76.7 % and the jaws from 0.156 to 0.126 mm at 8.2
    frames/s against 11.0, under the 10 a whole arc must keep. For a ``cine`` series the fit's points are taken
    ``between_frames``. Neither the start nor the fit has a pair whose leaves cross (``uncrossed``); the fit is kept
    only where the frames agree with it better (``epid.reconstruction.fallback``)."""
    domain = RowDomain.of(forward_model, signals.device)
    start = uncrossed(start)
    prepared = render_run(forward_model, signals, start, batch_frames, residuals=True)
    tracked = track_leaves(domain, prepared.residuals, start.leaf_a, start.leaf_b, start.jaws, stages,
                           chunk_frames=batch_frames, start_mu=prepared.mu)
    prepared = dataclasses.replace(prepared, residuals=None)  # a whole arc's frames, no longer needed
    fit = ControlPointRun(tracked.leaf_a, tracked.leaf_b, tracked.jaws)
    rendering = None
    if domain.broad:
        for _ in range(RELINEARISED_PASSES if domain.grid is STRIPS else 1):
            again = render_run(forward_model, signals, fit, batch_frames, residuals=True)
            tracked = track_leaves(domain, again.residuals, fit.leaf_a, fit.leaf_b, fit.jaws, RELINEARISED_STAGES,
                                   chunk_frames=batch_frames, jaw_stages=(), start_mu=again.mu)
            del again
            moved = _open_leaf_change(fit, tracked.leaf_a, tracked.leaf_b, domain.grid)
            fit = ControlPointRun(tracked.leaf_a, tracked.leaf_b, tracked.jaws)
            if moved <= SETTLED_MM:
                break
        if domain.grid is STRIPS:
            fit, rendering = descend(forward_model, domain, signals, fit, batch_frames=batch_frames)
    if cine:
        fit, rendering = between_frames(fit), None
    crossed = uncrossed(fit)
    if crossed is not fit:
        fit, rendering = crossed, None
    return keep_better(forward_model, signals, start, fit, batch_frames, start_rendering=prepared,
                       fit_rendering=rendering)


def _open_leaf_change(run: ControlPointRun, leaf_a: Tensor, leaf_b: Tensor, grid: StripGrid) -> float:
    """The mean over the positions the jaws of ``run`` leave open of the larger of the two banks' moves
    from ``run`` to leaf_a, leaf_b (both (B, N + 1, strips)), mm (0 where none is open)."""
    shown = open_leaves(run.jaws, grid)
    moves = torch.maximum((leaf_a - run.leaf_a).abs(), (leaf_b - run.leaf_b).abs())[shown]
    return float(moves.mean()) if moves.numel() else 0.0


def between_frames(run: ControlPointRun) -> ControlPointRun:
    """The control points of a cine series' fit, each inner one the mean of the mean positions of
    the two frames that meet there ((x[k - 1] + 2 x[k] + x[k + 1]) / 4; the first and last kept).

    A frame fixes the mean of its edges' positions over the frame sharply; their spread, the motion
    within the frame, only through the shape of the blurred edges. A cine frame spans a fraction of
    a control-point interval and its leaves move little, so where a real panel's blur is not the
    model's, the extra blur reads as motion: the tracked points zig-zag from frame to frame about
    the truth, every point in turn too far out and too far in, with the frames' means right. On the
    simulated clinic deliveries of ``bench_error_detection`` (tuning arcs 5 and 85, 240 frames at
    9.5 frames/s) the whole bank alternated by +2.3 / -1.8 mm from one frame to the next: leaf MAE
    1.89 and 1.95 mm against the plan, 0.15 and 0.13 mm taken between the frames. The zig-zag is the
    one motion this mean removes entirely; a steady motion passes unchanged, a change of speed at a
    control point by a quarter of the change per frame."""
    def settled(points: Tensor) -> Tensor:
        if points.shape[1] < 3:
            return points
        inner = (points[:, :-2] + 2 * points[:, 1:-1] + points[:, 2:]) / 4
        return torch.cat([points[:, :1], inner, points[:, -1:]], 1)

    return ControlPointRun(settled(run.leaf_a), settled(run.leaf_b), settled(run.jaws))


def _network_lag(inverse_model: nn.Module) -> Tensor | float:
    """The lag fraction the inverse network takes out of a curr frame (0 for a model without one)."""
    lag = getattr(inverse_model, "lag_percent", None)
    return 0.0 if lag is None else lag.detach() / 100.0


def _pair_estimates(inverse_model: nn.Module, recorded: Tensor, batch_frames: int, first_pair: bool,
                    step: int = 1) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Control points 0..N (leaf_a, leaf_b (N + 1, strips), jaws (N + 1, 2)) and each frame's MU (N,)
    from the network's estimates of the pairs of ``recorded`` (N + 1 frames, the first the frame
    before the arc's first): each point the mean of the estimates that contain it. Without the
    ``first_pair``, control point 0 is extrapolated and the first frame's MU is NaN. ``step``: the
    pairs estimated begin every ``step`` frames (and the last pair), so that with 2 each point
    has one estimate and the frames between the pairs keep their MU NaN."""
    count = len(recorded) - 1
    half = model_strips(inverse_model).count
    sums = recorded.new_zeros(count + 1, 2 * half + 2)
    weights = recorded.new_zeros(count + 1, 1)
    mu = recorded.new_full((count,), math.nan)
    first = 0 if first_pair else 1
    begins = list(range(first, count, step))
    if begins[-1] != count - 1:
        begins.append(count - 1)
    begins = torch.tensor(begins, device=recorded.device)
    for batch in begins.split(batch_frames):
        leaf_a, leaf_b, scalars, _ = inverse_model(recorded[batch, None], recorded[batch + 1, None])
        for point, columns in ((0, slice(None, half)), (1, slice(half, None))):
            jaws = scalars[:, [1 + point, 3 + point]]
            sums.index_add_(0, batch + point, torch.cat([leaf_a[:, columns], leaf_b[:, columns], jaws], 1).float())
            weights.index_add_(0, batch + point, weights.new_ones(len(batch), 1))
        mu[batch] = scalars[:, 0].float()
    points = sums / weights.clamp_min(1)
    if not first_pair:
        points[0] = 2 * points[1] - points[2]
    return points[:, :half], points[:, half:2 * half], points[:, 2 * half:], mu
