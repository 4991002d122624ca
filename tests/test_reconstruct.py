"""Reconstruction of control points from consecutive frames: the window fit settles what a frame
pair cannot (a leaf that goes out and comes back), the arc's windows and their stitching, the lag
taken out with the recorded frame before, and which reconstruction a model pair gets."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from epid import reconstruct
from epid.families import build_models
from epid.reconstruct import FitSettings, Window, fit_window, reconstruct_arc

JAWS = (-40.0, 45.0)
"""jaw_1, jaw_2 (mm) of every control point: rows 18..34 open."""
OPEN_ROWS = slice(19, 34)


def forward_with_2mm_response(lag_percent: float = 0.0) -> nn.Module:
    """The tiny aperture forward model, every Gaussian of its response 2 mm wide, with a lag."""
    torch.manual_seed(0)
    forward, _ = build_models("tiny", "aperture")
    with torch.no_grad():
        forward.response.profile_x.log_width.fill_(np.log(2.0))
        forward.response.profile_y.log_width.fill_(np.log(2.0))
        forward.lag_percent.fill_(lag_percent)
    return forward.eval()


def out_and_back(points: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control points (points, 52) of leaves that go 6 mm out and come back, then rest: bank A at
    x0, x0 + 6, x0, x0, ... (x0 off the grid, differing per row), bank B 30 mm beyond; jaws (points, 2)."""
    x0 = -20.3 + 0.7 * (torch.arange(52) % 5)
    offsets = torch.tensor([0.0, 6.0] + [0.0] * (points - 2))
    leaf_a = x0[None, :] + offsets[:, None]
    return leaf_a, leaf_a + 30.0, torch.tensor(JAWS).repeat(points, 1)


def record(forward: nn.Module, leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaws: torch.Tensor, mu: torch.Tensor,
           before: torch.Tensor) -> torch.Tensor:
    """Recorded frames (N, 256, 256) of control points 0..N: the forward model's signal of each
    motion times its MU, with the lag of the recorded frame before (``before`` for the first)."""
    window = [t[None] for t in (leaf_a, leaf_b, jaws)]
    with torch.no_grad():
        signals = reconstruct._render(forward, window) * mu[:, None, None]
    lag = float(forward.lag_fraction.detach())
    recorded = [before]
    for signal in signals:
        recorded.append((1 - lag) * signal + lag * recorded[-1])
    return torch.stack(recorded[1:])


def test_three_frames_settle_the_excursion_a_pair_leaves_open():
    forward = forward_with_2mm_response()
    leaf_a, leaf_b, jaws = out_and_back(4)
    frames = record(forward, leaf_a, leaf_b, jaws, torch.tensor([8.0, 12.0, 10.0]), torch.zeros(256, 256))
    # the mirror excursion (x0 + 6, x0, x0 + 6) renders the first two frames alike: a pair cannot choose
    mirror = torch.stack([leaf_a[1], leaf_a[0], leaf_a[1]])
    with torch.no_grad():
        pair = reconstruct._render(forward, [t[None] for t in (leaf_a[:3], leaf_b[:3], jaws[:3])])
        mirrored = reconstruct._render(forward, [mirror[None], (mirror + 30.0)[None], jaws[None, :3]])
    torch.testing.assert_close(pair, mirrored)

    neutral = torch.full_like(leaf_a, 3.0) + leaf_a[0]  # every point at the mean position
    start = Window(neutral[None], (neutral + 30.0)[None], jaws[None])
    fitted = fit_window(forward, frames[None], start, FitSettings(60, 2, 30))
    error = (fitted.leaf_a[0] - leaf_a)[:, OPEN_ROWS].abs()
    assert error.max() < 0.3, error.amax(1)
    torch.testing.assert_close(fitted.mu[0], torch.tensor([8.0, 12.0, 10.0]), rtol=0.02, atol=0.0)


def test_windows_cover_the_arc_and_each_point_goes_to_the_window_it_lies_most_inside():
    starts = reconstruct._window_starts(10, 4, 2)
    assert starts == [0, 2, 4, 6]
    assert reconstruct._owners(starts, 4, 10).tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    assert reconstruct._window_starts(11, 4, 2) == [0, 2, 4, 6, 7]  # the last window ends at the arc's end
    assert reconstruct._window_starts(3, 4, 2) == [0]


class ShiftedTruth(nn.Module):
    """An inverse network stand-in: the true control points of each pair of consecutive frames
    (matched by the frame's index in ``frames``), bank A off by +0.8 mm, bank B by -0.8 mm."""

    def __init__(self, frames: torch.Tensor, leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaws: torch.Tensor,
                 mu: torch.Tensor, fit: FitSettings) -> None:
        super().__init__()
        self.frames, self.points = frames, (leaf_a + 0.8, leaf_b - 0.8, jaws)
        self.mu = mu
        self.config = type("Config", (), {"fit_steps": fit.steps, "split_rounds": fit.split_rounds,
                                          "refine_steps": fit.refine_steps})()
        self.lag_percent = torch.zeros(())

    def forward(self, epid_prev: torch.Tensor, epid_curr: torch.Tensor):
        index = torch.stack([(self.frames - frame).abs().flatten(1).sum(1).argmin() for frame in epid_curr[:, 0]])
        leaf_a, leaf_b, jaws = self.points
        pair = index + 1  # frame k (0-based) ends at control point k + 1
        scalars = torch.cat([self.mu[index, None], jaws[pair - 1, :1], jaws[pair, :1], jaws[pair - 1, 1:],
                             jaws[pair, 1:]], 1)
        return (torch.cat([leaf_a[pair - 1], leaf_a[pair]], 1), torch.cat([leaf_b[pair - 1], leaf_b[pair]], 1),
                scalars, None)


def test_an_arc_is_reconstructed_through_overlapping_windows_with_the_lag_taken_out():
    forward = forward_with_2mm_response(lag_percent=3.0)
    points = 9
    leaf_a, leaf_b, jaws = out_and_back(points)
    leaf_a[4:] += torch.linspace(0.0, 8.0, points - 4)[:, None]  # a second motion later in the arc
    leaf_b[4:] += torch.linspace(0.0, 8.0, points - 4)[:, None]
    mu = torch.linspace(6.0, 14.0, points - 1)
    with torch.no_grad():
        before = reconstruct._render(forward, [t[None, :2] for t in (leaf_a, leaf_b, jaws)])[0] * 9.0
    frames = record(forward, leaf_a, leaf_b, jaws, mu, before)
    network = ShiftedTruth(frames, leaf_a, leaf_b, jaws, mu, FitSettings(60, 1, 30))

    estimate = reconstruct_arc(forward, network, frames, frame_before=before, window=4, overlap=2)
    assert estimate.method == "arc fit"
    assert estimate.leaf_a.shape == (points, 52) and estimate.jaws.shape == (points, 2) and estimate.mu.shape == (8,)
    for fitted, truth in ((estimate.leaf_a, leaf_a), (estimate.leaf_b, leaf_b)):
        error = (fitted - truth)[:, OPEN_ROWS].abs()
        assert error.max() < 0.3, error.amax(1)
    torch.testing.assert_close(estimate.mu, mu, rtol=0.02, atol=0.0)  # the lag is out of every frame

    network_only = reconstruct_arc(forward, network, frames, frame_before=before,
                                   settings=FitSettings(0, 0, 0))
    assert network_only.method == "network"
    torch.testing.assert_close(network_only.leaf_a, leaf_a + 0.8)  # both pair estimates of a point agree
    torch.testing.assert_close(network_only.mu, mu)


def test_a_pair_that_cannot_render_gets_the_network_estimate():
    legacy_forward, legacy_inverse = build_models("tiny", "legacy")
    forward, inverse = build_models("tiny", "aperture")
    assert reconstruct.method_used(legacy_forward, legacy_inverse, "arc") == "network"
    assert reconstruct.method_used(forward, inverse, "arc") == "arc"
    assert not reconstruct.can_refine(forward, build_models("tiny", "aperture")[1].__class__(
        type(inverse.config)(**{**inverse.config.__dict__, "fit_steps": 0})))
    frames = torch.rand(2, 1, 256, 256)
    with torch.inference_mode():
        network = inverse.eval()(frames[:1], frames[1:])
        refined = reconstruct.pair_estimate(forward.eval(), inverse, frames[:1], frames[1:])
        unrefined = reconstruct.pair_estimate(forward, inverse, frames[:1], frames[1:], refine=False)
    for a, b in zip(network[:3], unrefined, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(refined[0], network[0])  # the fit moved the estimate, under inference mode
