"""Reconstruction of control points from consecutive frames: leaf tracking settles what a frame
pair cannot (a leaf that goes out and comes back), its pair costs are the misfit of the rendered
steps, a whole arc with the lag taken out with the recorded frame before, and which
reconstruction a model pair gets."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from epid.models.aperture import LeafEdgeInverseConfig
from epid.models.families import build_models
from epid.reconstruction import estimate as estimate_module
from epid.reconstruction import leaves
from epid.reconstruction import rows as rows_module
from epid.reconstruction.estimate import reconstruct_arc
from epid.synthesis.mlc import MLC_GEOMETRIES

JAWS = (-40.0, 45.0)
"""jaw_1, jaw_2 (mm) of every control point: rows 18..34 open."""
OPEN_ROWS = slice(19, 34)


def forward_with_2mm_response(lag_percent: float = 0.0, mlc: str = "legacy") -> nn.Module:
    """The tiny aperture forward model of ``mlc``, every Gaussian of its response 2 mm wide, with a lag."""
    torch.manual_seed(0)
    forward, _ = build_models("tiny", "aperture", MLC_GEOMETRIES[mlc])
    with torch.no_grad():
        forward.response.profile_x.log_width.fill_(np.log(2.0))
        forward.response.profile_y.log_width.fill_(np.log(2.0))
        forward.lag_percent.fill_(lag_percent)
    return forward.eval()


def with_real_mlc(forward: nn.Module) -> nn.Module:
    """``forward`` with a real MLC's learned physics: 0.5 % leaf and 0.1 % jaw transmission, 0.5 %
    interleaf leakage, a 0.8 mm tongue-and-groove strip, leaf ends 0.6 mm out."""
    with torch.no_grad():
        aperture = forward.aperture
        aperture.leaf_transmission_percent.fill_(0.5)
        aperture.jaw_transmission_percent.fill_(0.1)
        aperture.interleaf_leakage_percent.fill_(0.5)
        aperture.tongue_groove_mm.fill_(0.8)
        aperture.leaf_end_offset.fill_(0.6)
    return forward


def out_and_back(points: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control points (points, 52) of leaves that go 6 mm out and come back, then rest: bank A at
    x0, x0 + 6, x0, x0, ... (x0 off the grid, differing per row), bank B 30 mm beyond; jaws (points, 2)."""
    x0 = -20.3 + 0.7 * (torch.arange(52) % 5)
    offsets = torch.tensor([0.0, 6.0] + [0.0] * (points - 2))
    leaf_a = x0[None, :] + offsets[:, None]
    return leaf_a, leaf_a + 30.0, torch.tensor(JAWS).repeat(points, 1)


def render(forward: nn.Module, leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaws: torch.Tensor) -> torch.Tensor:
    """Signals per MU (N, 256, 256) of the motions between consecutive control points (N + 1, ...)."""
    scalars = torch.cat([torch.ones(len(jaws) - 1, 1), jaws[:-1, :1], jaws[1:, :1], jaws[:-1, 1:], jaws[1:, 1:]], 1)
    with torch.no_grad():
        return forward.render(torch.cat([leaf_a[:-1], leaf_a[1:]], 1), torch.cat([leaf_b[:-1], leaf_b[1:]], 1),
                              scalars)[0]


def record(forward: nn.Module, leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaws: torch.Tensor, mu: torch.Tensor,
           before: torch.Tensor) -> torch.Tensor:
    """Recorded frames (N, 256, 256) of control points 0..N: the forward model's signal of each
    motion times its MU, with the lag of the recorded frame before (``before`` for the first)."""
    signals = render(forward, leaf_a, leaf_b, jaws) * mu[:, None, None]
    lag = float(forward.lag_fraction.detach())
    recorded = [before]
    for signal in signals:
        recorded.append((1 - lag) * signal + lag * recorded[-1])
    return torch.stack(recorded[1:])


def track(forward: nn.Module, frames: torch.Tensor, leaf_a: torch.Tensor, leaf_b: torch.Tensor,
          jaws: torch.Tensor, stages=((8.0, 0.5), (1.0, 0.1))) -> leaves.Tracked:
    """``track_leaves`` on one run of lag-free frames (N, 256, 256) from control points (N + 1, ...)."""
    domain = rows_module.RowDomain.of(forward)
    return leaves.track_leaves(domain, frames[None], leaf_a[None], leaf_b[None], jaws[None], stages)


def test_three_frames_settle_the_excursion_a_pair_leaves_open():
    forward = forward_with_2mm_response()
    leaf_a, leaf_b, jaws = out_and_back(4)
    frames = record(forward, leaf_a, leaf_b, jaws, torch.tensor([8.0, 12.0, 10.0]), torch.zeros(256, 256))
    # the mirror excursion (x0 + 6, x0, x0 + 6) renders the first two frames alike: a pair cannot choose
    mirror = torch.stack([leaf_a[1], leaf_a[0], leaf_a[1]])
    torch.testing.assert_close(render(forward, leaf_a[:3], leaf_b[:3], jaws[:3]),
                               render(forward, mirror, mirror + 30.0, jaws[:3]))

    neutral = torch.full_like(leaf_a, 3.0) + leaf_a[0]  # every point at the mean position
    tracked = track(forward, frames, neutral, neutral + 30.0, jaws)
    for fitted, truth in ((tracked.leaf_a[0], leaf_a), (tracked.leaf_b[0], leaf_b)):
        error = (fitted - truth)[:, OPEN_ROWS].abs()
        assert error.max() < 0.3, error.amax(1)
    torch.testing.assert_close(tracked.mu[0], torch.tensor([8.0, 12.0, 10.0]), rtol=0.02, atol=0.0)


def test_pair_costs_are_the_misfit_of_the_rendered_steps():
    forward = forward_with_2mm_response()
    domain = rows_module.RowDomain.of(forward)
    gen = torch.Generator().manual_seed(3)
    leaf_a = (-20.0 + torch.randn(4, 52, generator=gen) * 3).cumsum(0) / 2
    banks = [leaf_a[None], leaf_a[None] + 30.0]
    weights = 1.0 + torch.rand(1, 3, 52, 7, generator=gen)  # a_t, unequal where a jaw would move
    rows = torch.randn(1, 3, 52, 255, generator=gen) * 0.05
    offsets = torch.linspace(-1.5, 1.5, 7)
    costs = leaves._pair_costs(domain, domain.correlate(rows), weights, banks[0], offsets, 0)
    t = torch.linspace(0.0, 1.0, 7)
    for frame, leaf in ((0, 5), (2, 30)):
        u = leaf_a[frame, leaf] + offsets[:, None, None]
        v = leaf_a[frame + 1, leaf] + offsets[None, :, None]
        edges = leaves._edges(domain, u + (v - u) * t, 0)  # (S, S, 7)
        steps = domain.blur(domain.splat(edges, weights[0, frame, leaf].expand_as(edges)))
        misfit = (rows[0, frame, leaf] - steps).square().sum(-1)
        expected = misfit - misfit.min()
        got = costs[0, frame, leaf] - costs[0, frame, leaf][misfit == misfit.min()]
        # equal a_t are exact; unequal ones take the cell-phase part at their mean
        torch.testing.assert_close(got, expected, atol=0.02 * float(expected.max()), rtol=0.0)
    equal = weights.mean(-1, keepdim=True).expand_as(weights)
    costs = leaves._pair_costs(domain, domain.correlate(rows), equal, banks[0], offsets, 0)
    u = leaf_a[1, 7] + offsets[:, None, None]
    v = leaf_a[2, 7] + offsets[None, :, None]
    edges = leaves._edges(domain, u + (v - u) * t, 0)
    misfit = (rows[0, 1, 7] - domain.blur(domain.splat(edges, equal[0, 1, 7].expand_as(edges)))).square().sum(-1)
    expected = misfit - misfit[0, 0]  # exact but for the cell-phase table's interpolation
    tolerance = 0.005 * float(expected.abs().max())
    torch.testing.assert_close(costs[0, 1, 7] - costs[0, 1, 7, 0, 0], expected, atol=tolerance, rtol=0.0)


def mlc_leaves(mlc: str, leaf_a: torch.Tensor, leaf_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strip edges (..., strips) as the MLC ``mlc`` shows them: HD120's 5 mm leaves tied over their
    two fine strips (unrounded)."""
    tied = MLC_GEOMETRIES[mlc].tied(leaf_a.numpy(), leaf_b.numpy())
    return tuple(torch.from_numpy(np.asarray(value, dtype=np.float32)) for value in tied)


@pytest.mark.parametrize("mlc, tied", [("legacy", True), ("hd120", True), ("hd120", False)])
def test_row_model_is_the_rendered_frame_seen_through_the_wiener_filter(mlc, tied):
    """The differenced profiles ``_model`` predicts are those of the forward model's own rendering
    after the Wiener filter, with a real MLC's physics (transmission, rounded leaf ends, interleaf
    leakage, a tongue-and-groove strip between leaves that differ by mm) and rows the moving jaws
    leave partly open; on the 52 strips of 5 mm and on HD120's 104 of 2.5 mm (rows of 0.5 mm), its
    5 mm leaves' two strips level (as a plan has them) or apart (as a fit may have them: no tongue and
    groove between two strips of one leaf)."""
    forward = with_real_mlc(forward_with_2mm_response(mlc=mlc))
    count = forward.aperture.grid.count
    gen = torch.Generator().manual_seed(0)
    leaf_a = -20.3 + (torch.randn(3, count, generator=gen) * 3).cumsum(0) + 4 * torch.randn(count, generator=gen)
    leaf_b = leaf_a + 25.0 + 4 * torch.randn(count, generator=gen)
    if tied:
        leaf_a, leaf_b = mlc_leaves(mlc, leaf_a, leaf_b)
    jaws = torch.tensor([[-41.3, 43.6], [-40.2, 44.9], [-38.7, 47.2]])  # edges inside rows 17 and 34 (of 5 mm)
    domain = rows_module.RowDomain.of(forward)
    openings = domain.jaw_openings(jaws[None])
    row_weights = domain.row_weights(openings)
    first, last = (17, 34) if count == 52 else (35, 69)
    assert 0.0 < float(openings[0, :, :, first].mean()) < 0.5 and 0.0 < float(openings[0, :, :, last].mean()) < 0.95
    profiles = domain.profiles(render(forward, leaf_a, leaf_b, jaws)[None], row_weights)
    coupling = domain.coupling(openings, row_weights)
    model = leaves._model(domain, coupling, [leaf_a[None], leaf_b[None]])
    torch.testing.assert_close(profiles, model, atol=0.01 * float(model.abs().max()), rtol=0.0)
    every_third = torch.arange(1, count, 3)  # a group step's leaves: their profiles alone, the same values
    some = leaves._model(domain, coupling, [leaf_a[None], leaf_b[None]], rows=every_third)
    torch.testing.assert_close(some, model[:, :, every_third], atol=1e-6 * float(model.abs().max()), rtol=0.0)


@pytest.mark.parametrize("mlc", ["legacy", "hd120"])
def test_a_leaf_no_frame_shows_costs_nothing_so_its_costs_can_be_skipped(mlc):
    """The tracking computes the pair costs of a chunk of frames only for the leaves some frame of it
    shows: computed for every leaf, those of a leaf whose rows the jaws close in every frame (or in
    the frames of a chunk) are exactly 0, not merely small, whatever the residual."""
    forward = with_real_mlc(forward_with_2mm_response(mlc=mlc))
    count = forward.aperture.grid.count
    gen = torch.Generator().manual_seed(5)
    points = 9
    leaf_a = -20.3 + 0.7 * (torch.arange(count) % 5) + (torch.randn(points, count, generator=gen) * 2).cumsum(0)
    leaf_a, leaf_b = mlc_leaves(mlc, leaf_a, leaf_a + 30.0)
    jaws = torch.tensor(JAWS).repeat(points, 1)
    jaws[4:, 1] = 20.0  # the upper jaw closes in: strips seen in the first frames only
    frames = record(forward, leaf_a, leaf_b, jaws, 10.0 * torch.ones(points - 1), torch.zeros(256, 256))
    frames = frames + 0.01 * torch.randn(frames.shape, generator=gen)
    domain = rows_module.RowDomain.of(forward)
    banks = [(leaf_a + 1.0)[None], (leaf_b - 1.0)[None]]
    observed = leaves._Observed.of(domain, frames[None], jaws[None], 64, row_sums=False)
    every = torch.arange(count)
    offsets = torch.linspace(-2.0, 2.0, 11)
    for bank in (0, 1):
        costs = leaves._chunk_costs(domain, observed.profiles, observed.coupling, banks, bank, offsets, 1.0,
                                    observed.seen, every)
        unseen = ~observed.seen[0].any(0)
        assert 0 < int(unseen.sum()) < count and bool((costs[0][:, unseen] == 0).all())
        assert bool((costs[0][:, ~unseen].abs().amax((-2, -1)) > 0).any(0).all())
        late = ~observed.seen[0, 4:].any(0) & observed.seen[0, :4].any(0)  # shown early only: 0 in the late frames
        assert bool(late.any()) and bool((costs[0][4:, late] == 0).all())


def test_travel_cost_settles_a_zigzag_the_frames_hardly_see():
    """Static leaves started on a zig-zag (each control point in turn 1.5 mm out and in): the
    frames barely tell the motion within a frame, so without the travel cost some zig-zag stays;
    with it the chain comes back to rest on the truth."""
    forward = forward_with_2mm_response()
    points = 16
    leaf_a = (-20.3 + 0.7 * (torch.arange(52) % 5)).repeat(points, 1)
    jaws = torch.tensor(JAWS).repeat(points, 1)
    frames = record(forward, leaf_a, leaf_a + 30.0, jaws, torch.full((points - 1,), 10.0), torch.zeros(256, 256))
    zigzag = 1.5 * (-1.0) ** torch.arange(points)[:, None]
    stages = ((4.0, 0.2), (1.0, 0.05))

    def error(travel_cost: float) -> torch.Tensor:
        with mock.patch.object(leaves, "TRAVEL_COST", travel_cost):
            tracked = track(forward, frames, leaf_a + zigzag, leaf_a + 30.0 - zigzag, jaws, stages)
        return (tracked.leaf_a[0] - leaf_a)[:, OPEN_ROWS].abs()

    assert error(0.0).max() > 0.3
    assert error(leaves.TRAVEL_COST).max() < 0.05


@pytest.mark.parametrize("mlc, rows, mean_mm, max_mm", [("legacy", slice(21, 32), 0.1, 0.5),
                                                         ("hd120", slice(42, 64), 0.3, 2.5)])
def test_tracking_recovers_rendered_motions_from_a_rough_start(mlc, rows, mean_mm, max_mm):
    """Leaves started 2 mm off (std) come back to the rendered ones, each frame's MU with them; on
    HD120's 2.5 mm strips, which see their neighbours far more through a 2 mm response, less closely."""
    forward = forward_with_2mm_response(mlc=mlc)
    with torch.no_grad():
        forward.aperture.edge_shift.fill_(0.3)
    count = forward.aperture.grid.count
    gen = torch.Generator().manual_seed(0)
    points = 12
    leaf_a = -20.3 + 0.7 * (torch.arange(count) % 5) + (torch.randn(points, count, generator=gen) * 3).cumsum(0)
    leaf_a, leaf_b = mlc_leaves(mlc, leaf_a, leaf_a + 25.0 + 5.0 * torch.rand(points, count, generator=gen))
    jaws = torch.tensor(JAWS).repeat(points, 1) + torch.randn(points, 2, generator=gen).cumsum(0)
    mu = 5.0 + 10.0 * torch.rand(points - 1, generator=gen)
    frames = record(forward, leaf_a, leaf_b, jaws, mu, torch.zeros(256, 256))
    start_a = leaf_a + 2.0 * torch.randn(points, count, generator=gen)
    start_b = leaf_b + 2.0 * torch.randn(points, count, generator=gen)
    tracked = track(forward, frames, start_a, start_b, jaws, LeafEdgeInverseConfig().track_stages)
    for fitted, truth, start in ((tracked.leaf_a[0], leaf_a, start_a), (tracked.leaf_b[0], leaf_b, start_b)):
        assert (start - truth)[:, rows].abs().mean() > 1.0  # rows open at every control point
        error = (fitted - truth)[:, rows].abs()
        assert error.mean() < mean_mm and error.max() < max_mm, (error.mean(), error.max())
    torch.testing.assert_close(tracked.mu[0], mu, rtol=0.01, atol=0.0)
    closed = slice(0, 2 * count // 10)  # no jaw opens these rows: they keep their start
    torch.testing.assert_close(tracked.leaf_a[0][:, closed], start_a[:, closed])


def test_closed_pairs_started_open_close_without_crossing():
    """Every other leaf closed (both banks at x0), started 0.8 mm open on bank A and 0.5 mm on bank
    B, frames the tracking's own forward model rendered: unbounded, bank A (moved first) took the
    whole excess slit and crossed bank B by more than a mm; bounded, the pair meets, nearer the
    truth, and the open leaves beside it stay where they are."""
    forward = with_real_mlc(forward_with_2mm_response())
    points = 10
    leaf_a = (-10.3 + 0.7 * (torch.arange(52) % 5)).repeat(points, 1)
    leaf_b = leaf_a.clone()
    leaf_b[:, ::2] += 30.0
    jaws = torch.tensor(JAWS).repeat(points, 1)
    frames = record(forward, leaf_a, leaf_b, jaws, torch.full((points - 1,), 10.0), torch.zeros(256, 256))
    closed, opened = slice(OPEN_ROWS.start, OPEN_ROWS.stop, 2), slice(OPEN_ROWS.start + 1, OPEN_ROWS.stop, 2)
    assert bool((leaf_a[:, closed] == leaf_b[:, closed]).all()) and bool((leaf_b[:, opened] > leaf_a[:, opened]).all())

    def tracked(crossing_cost: float) -> tuple[torch.Tensor, torch.Tensor]:
        with mock.patch.object(leaves, "CROSSING_COST", crossing_cost):
            fit = track(forward, frames, leaf_a - 0.8, leaf_b + 0.5, jaws)
        return fit.leaf_a[0], fit.leaf_b[0]

    free_a, free_b = tracked(0.0)
    assert float((free_a - free_b)[:, closed].max()) > 1.0
    fit_a, fit_b = tracked(leaves.CROSSING_COST)
    assert bool((fit_a <= fit_b).all())
    error = torch.cat([fit_a - leaf_a, fit_b - leaf_b])[:, closed].abs().mean()
    free_error = torch.cat([free_a - leaf_a, free_b - leaf_b])[:, closed].abs().mean()
    assert error < 0.5 and error < 0.7 * free_error, (error, free_error)
    assert float((fit_a - leaf_a)[:, opened].abs().max()) < 0.2


def jaw_errors(points: int) -> torch.Tensor:
    """(points, 2) errors of a network's jaws, mm: independent for each control point, up to 0.4."""
    return 0.4 * torch.rand(points, 2, generator=torch.Generator().manual_seed(5)) - 0.2


class ShiftedTruth(nn.Module):
    """An inverse network stand-in: the true control points of each pair of consecutive frames
    (matched by the frame's index in ``frames``), bank A off by +0.8 mm, bank B by -0.8 mm, the
    jaws by up to 0.4 mm, each control point by its own amount (``jaw_errors``)."""

    def __init__(self, frames: torch.Tensor, leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaws: torch.Tensor,
                 mu: torch.Tensor) -> None:
        super().__init__()
        self.frames, self.points = frames, (leaf_a + 0.8, leaf_b - 0.8, jaws + jaw_errors(len(jaws)))
        self.mu = mu
        self.config = type("Config", (), {"track_stages": ((4.0, 0.5), (1.0, 0.1))})()
        self.lag_percent = torch.zeros(())

    def forward(self, epid_prev: torch.Tensor, epid_curr: torch.Tensor):
        index = torch.stack([(self.frames - frame).abs().flatten(1).sum(1).argmin() for frame in epid_curr[:, 0]])
        leaf_a, leaf_b, jaws = self.points
        pair = index + 1  # frame k (0-based) ends at control point k + 1
        scalars = torch.cat([self.mu[index, None], jaws[pair - 1, :1], jaws[pair, :1], jaws[pair - 1, 1:],
                             jaws[pair, 1:]], 1)
        return (torch.cat([leaf_a[pair - 1], leaf_a[pair]], 1), torch.cat([leaf_b[pair - 1], leaf_b[pair]], 1),
                scalars, None)


def test_an_arc_is_reconstructed_with_the_lag_taken_out():
    forward = forward_with_2mm_response(lag_percent=10.0)
    points = 9
    leaf_a, leaf_b, jaws = out_and_back(points)
    leaf_a[4:] += torch.linspace(0.0, 8.0, points - 4)[:, None]  # a second motion later in the arc
    leaf_b[4:] += torch.linspace(0.0, 8.0, points - 4)[:, None]
    mu = torch.tensor([6.0, 30.0, 4.0, 25.0, 5.0, 30.0, 6.0, 20.0])  # a 4 MU frame after 30 MU: 75 % ghost
    before = render(forward, leaf_a[:2], leaf_b[:2], jaws[:2])[0] * 9.0
    frames = record(forward, leaf_a, leaf_b, jaws, mu, before)
    network = ShiftedTruth(frames, leaf_a, leaf_b, jaws, mu)

    estimate = reconstruct_arc(forward, network, frames, frame_before=before)
    assert estimate.method == "arc tracking"
    assert estimate.leaf_a.shape == (points, 52) and estimate.jaws.shape == (points, 2) and estimate.mu.shape == (8,)
    for fitted, truth in ((estimate.leaf_a, leaf_a), (estimate.leaf_b, leaf_b)):
        error = (fitted - truth)[:, OPEN_ROWS].abs()
        assert error.max() < 0.45, error.amax(1)
    assert (estimate.jaws - jaws).abs().mean() < 0.05 < jaw_errors(points).abs().mean()  # refined
    torch.testing.assert_close(estimate.mu, mu, rtol=0.005, atol=0.0)  # the lag is out of every frame

    with torch.no_grad():  # the same frames read by a model that leaves the lag in: the MU are off
        forward.lag_percent.fill_(0.0)
    lag_left_in = reconstruct_arc(forward, network, frames, frame_before=before)
    assert ((lag_left_in.mu - mu).abs() / mu).max() > 0.2

    network_only = reconstruct_arc(forward, network, frames, frame_before=before, stages=())
    assert network_only.method == "network"
    torch.testing.assert_close(network_only.leaf_a, leaf_a + 0.8)  # both pair estimates of a point agree
    torch.testing.assert_close(network_only.jaws, jaws + jaw_errors(points))
    torch.testing.assert_close(network_only.mu, mu)


def test_a_pair_that_cannot_render_gets_the_network_estimate():
    legacy_forward, legacy_inverse = build_models("tiny", "legacy")
    forward, inverse = build_models("tiny", "aperture")
    assert estimate_module.method_used(legacy_forward, legacy_inverse, "arc") == "network"
    assert estimate_module.method_used(forward, inverse, "arc") == "arc"
    assert not estimate_module.can_refine(forward, build_models("tiny", "aperture")[1].__class__(
        type(inverse.config)(**{**inverse.config.__dict__, "track_stages": ()})))
    frames = torch.rand(2, 1, 256, 256)
    with torch.inference_mode():
        network = inverse.eval()(frames[:1], frames[1:])
        refined = estimate_module.pair_estimate(forward.eval(), inverse, frames[:1], frames[1:])
        unrefined = estimate_module.pair_estimate(forward, inverse, frames[:1], frames[1:], refine=False)
    for a, b in zip(network[:3], unrefined, strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(refined[0], network[0])  # the fit moved the estimate, under inference mode


def test_a_cine_fit_is_taken_between_the_frames():
    steps = torch.arange(7.0)[None, :, None]  # (1 run, 7 control points, 1)
    zigzag = torch.tensor([2.0, -2.0, 2.0, -2.0, 2.0, -2.0, 2.0])[None, :, None]
    ends = zigzag * torch.tensor([1.0, 0, 0, 0, 0, 0, 1.0])[None, :, None]
    run = estimate_module.ControlPointRun((-30 + 1.5 * steps + zigzag).expand(1, 7, 52),
                                          (10 + 0.5 * steps - zigzag).expand(1, 7, 52),
                                          torch.tensor([-40.0, 45.0]).expand(1, 7, 2) + zigzag)
    settled = estimate_module.between_frames(run)
    # (x[k - 1] + 2 x[k] + x[k + 1]) / 4: the zig-zag gone, the steady motion and both ends kept
    torch.testing.assert_close(settled.leaf_a, (-30 + 1.5 * steps + ends).expand(1, 7, 52))
    torch.testing.assert_close(settled.leaf_b, (10 + 0.5 * steps - ends).expand(1, 7, 52))
    torch.testing.assert_close(settled.jaws, torch.tensor([-40.0, 45.0]) + ends.expand(1, 7, 2))
    calls = []
    original = estimate_module.between_frames
    with mock.patch.object(estimate_module, "between_frames", lambda fit: calls.append(fit) or original(fit)):
        forward = forward_with_2mm_response()
        leaf_a, leaf_b, jaws = out_and_back(5)
        mu = torch.full((4,), 10.0)
        frames = record(forward, leaf_a, leaf_b, jaws, mu, torch.zeros(256, 256))
        network = ShiftedTruth(frames, leaf_a, leaf_b, jaws, mu)
        reconstruct_arc(forward, network, frames, frame_before=torch.zeros(256, 256))
        assert not calls, "the project's own frames keep the tracked points"
        reconstruct_arc(forward, network, frames, frame_before=torch.zeros(256, 256), cine=True)
        assert len(calls) == 1 and calls[0].leaf_a.shape == (1, 5, 52)


@pytest.mark.parametrize("first_pair", [True, False])
def test_every_other_frame_pair_gives_each_control_point_one_estimate(first_pair):
    """Frames whose value is their index; the stand-in network estimates the pair (k - 1, k) as
    control points k - 1 and k at positions 10 k - 10 and 10 k, and frame k's MU as k."""
    calls = []

    class Indexed(nn.Module):
        def forward(self, epid_prev, epid_curr):
            calls.append(len(epid_curr))
            prev, curr = epid_prev.mean((1, 2, 3)), epid_curr.mean((1, 2, 3))
            leaves = torch.cat([10 * prev[:, None].expand(-1, 52), 10 * curr[:, None].expand(-1, 52)], 1)
            scalars = torch.stack([curr, 10 * prev, 10 * curr, 10 * prev + 1, 10 * curr + 1], 1)
            return leaves, -leaves, scalars, None

    recorded = torch.arange(10.0)[:, None, None].expand(10, 4, 4)  # the frame before, then 9 frames
    for step in (1, 2):
        calls.clear()
        leaf_a, leaf_b, jaws, mu = estimate_module._pair_estimates(Indexed(), recorded, 3, first_pair, step)
        first = 0 if first_pair else 1
        begins = sorted(set(range(first, 9, step)) | {8})  # the last pair always
        assert sum(calls) == len(begins) and max(calls) <= 3
        points = torch.arange(10.0)
        if not first_pair:
            points[0] = 0.0  # extrapolated from points 1 and 2
        torch.testing.assert_close(leaf_a, 10 * points[:, None].expand(10, 52))
        torch.testing.assert_close(leaf_b, -10 * points[:, None].expand(10, 52))
        torch.testing.assert_close(jaws, torch.stack([10 * points, 10 * points + 1], 1))
        estimated = torch.zeros(9, dtype=torch.bool)
        estimated[begins] = True
        torch.testing.assert_close(mu[estimated], torch.tensor(begins, dtype=torch.float32) + 1)
        assert torch.isnan(mu[~estimated]).all()
