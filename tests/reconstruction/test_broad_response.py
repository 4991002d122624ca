"""Reconstruction under broad detector responses: the row domain sees the frames through the
sharpest Gaussian its Wiener filter can reproduce, tracking holds on noisy frames synthesised with
a response 2.5 times as broad as the built-in one, and a fit is never returned where the frames
agree better with its start."""

from __future__ import annotations

import copy
import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

from epid.models import response as filters
from epid.models.families import build_models
from epid.reconstruction import estimate as estimate_module
from epid.reconstruction import fallback, leaves, rows
from epid.synthesis.frames import render_frames
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import Physics
from epid.synthesis.sequences import generate_control_points, leaf_band
from tests.reconstruction.test_estimate import ShiftedTruth, render, with_real_mlc

MLC_PHYSICS = Physics(leaf_transmission_percent=0.5, jaw_transmission_percent=0.1, interleaf_leakage_percent=0.5,
                      tongue_groove_mm=0.8, leaf_end_offset_mm=0.6)
"""The synthesis physics of ``with_real_mlc``'s forward model (no lag, no backscatter)."""
STAGES = ((16.0, 1.0), (2.0, 0.2), (16.0, 1.0), (1.0, 0.1))


def forward_with_response(sigma_mm: float, mlc: str = "legacy") -> nn.Module:
    """The tiny aperture forward model of ``mlc`` with a real MLC's physics, every Gaussian of its
    response ``sigma_mm`` wide (a core 2.355 sigma wide at half maximum)."""
    torch.manual_seed(0)
    forward, _ = build_models("tiny", "aperture", MLC_GEOMETRIES[mlc])
    with torch.no_grad():
        forward.response.profile_x.log_width.fill_(np.log(sigma_mm))
        forward.response.profile_y.log_width.fill_(np.log(sigma_mm))
    return with_real_mlc(forward).eval()


def model_kernel(forward: nn.Module) -> np.ndarray:
    response = forward.response
    return (response.kernel() * response.log_gain.exp()).detach().double().numpy()


def numpy_filter_error(kernel: np.ndarray, sigma_mm: float, shape: tuple[int, int], floor: float) -> float:
    """||W K - T|| / ||T|| computed independently with numpy's FFT on the full (not half) spectrum."""
    def centred(image: np.ndarray) -> np.ndarray:
        padded = np.zeros(shape)
        padded[:image.shape[0], :image.shape[1]] = image
        return np.roll(padded, (-(image.shape[0] // 2), -(image.shape[1] // 2)), (0, 1))

    reach = int(np.ceil(4 * sigma_mm))
    taps = np.exp(-0.5 * (np.arange(-reach, reach + 1) / sigma_mm) ** 2)
    taps /= taps.sum()
    response, target = np.fft.fft2(centred(kernel)), np.fft.fft2(centred(np.outer(taps, taps)))
    power = np.abs(response) ** 2
    wiener = target * np.conj(response) / (power + floor * power.max())
    return float(np.linalg.norm(wiener * response - target) / np.linalg.norm(target))


def test_the_filter_error_matches_an_independent_computation():
    forward = forward_with_response(5.0)
    response = forward.response
    spectrum = response._spectrum(torch.from_numpy(model_kernel(forward)))
    for sigma_mm in (2.0, 4.0, 6.0):
        expected = numpy_filter_error(model_kernel(forward), sigma_mm, tuple(response.fft_shape), filters.WIENER_FLOOR)
        assert filters.filter_error(spectrum, sigma_mm, tuple(response.fft_shape)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("sigma_mm, low, high", [(1.5, 2.0, 2.0), (2.0, 2.0, 2.0), (5.0, 3.6, 4.6)])
def test_the_target_is_the_sharpest_gaussian_the_filter_reproduces(sigma_mm, low, high):
    forward = forward_with_response(sigma_mm)
    domain = rows.RowDomain.of(forward)
    assert low <= domain.target_sigma_mm <= high
    spectrum = forward.response._spectrum(torch.from_numpy(model_kernel(forward)))
    shape = tuple(forward.response.fft_shape)
    assert filters.filter_error(spectrum, domain.target_sigma_mm, shape) <= filters.TARGET_FIDELITY
    if domain.target_sigma_mm > filters.MIN_TARGET_SIGMA_MM:
        sharper = domain.target_sigma_mm - filters.TARGET_STEP_MM
        assert filters.filter_error(spectrum, sharper, shape) > filters.TARGET_FIDELITY
    assert len(domain.taps) == 2 * int(np.ceil(4 * domain.target_sigma_mm)) + 1


def noisy_broad_run(frames: int = 24, dataset_id: int = 82, mlc: str = "legacy"):
    """A forward model of ``mlc`` with a 5 mm (12 mm at half maximum) response, and ``frames``
    noisy frames of dataset ``dataset_id`` on that MLC synthesised by ``render_frames`` with that
    kernel and the model's MLC physics; the true control points (leaf_a, leaf_b, jaws) and the band
    mask (points, strips) of the leaves scored."""
    forward, geometry = forward_with_response(5.0, mlc), MLC_GEOMETRIES[mlc]
    points = generate_control_points(dataset_id, frames + 1, geometry)
    signals = render_frames(points, np.arange(1, frames + 1), model_kernel(forward), dataset_id=dataset_id,
                            noise_std=0.005, physics=MLC_PHYSICS)
    truth = fallback.ControlPointRun(*(torch.tensor(np.asarray(v, dtype=np.float32))[None] for v in (
        points.leaf_a, points.leaf_b, np.stack([points.jaw_1, points.jaw_2], 1))))
    lo, hi = leaf_band(points.jaw_1, points.jaw_2, geometry.grid)
    band = torch.zeros(frames + 1, geometry.grid.count, dtype=torch.bool)
    for point in range(frames + 1):
        band[point, lo[point]:hi[point]] = True
    return forward, signals, truth, band


def network_like(truth: fallback.ControlPointRun, seed: int = 0) -> fallback.ControlPointRun:
    """A start off as a network's is: each leaf biased by up to +-1.5 mm, plus 0.4 mm jitter; jaws
    off by up to 0.3 mm."""
    generator = torch.Generator().manual_seed(seed)

    def off(values: torch.Tensor, bias: float, jitter: float) -> torch.Tensor:
        per_leaf = bias * (2 * torch.rand(values.shape[-1], generator=generator) - 1)
        return values + per_leaf + jitter * torch.randn(values.shape, generator=generator)

    return fallback.ControlPointRun(off(truth.leaf_a, 1.5, 0.4), off(truth.leaf_b, 1.5, 0.4),
                                    off(truth.jaws, 0.3, 0.0))


def leaf_mae(points: fallback.ControlPointRun, truth: fallback.ControlPointRun, band: torch.Tensor) -> float:
    errors = torch.cat([(points.leaf_a - truth.leaf_a)[0][band], (points.leaf_b - truth.leaf_b)[0][band]])
    return float(errors.abs().mean())


def test_tracking_holds_on_noisy_frames_of_a_broad_response():
    forward, signals, truth, band = noisy_broad_run()
    start = network_like(truth)
    domain = rows.RowDomain.of(forward)
    # the rows read as the reconstruction reads them: relative to the forward model's rendering of the start
    prepared = estimate_module.render_run(forward, signals[None], start, 64, residuals=True)
    tracked = leaves.track_leaves(domain, prepared.residuals, start.leaf_a, start.leaf_b, start.jaws, STAGES,
                                  start_mu=prepared.mu)
    fit = fallback.ControlPointRun(tracked.leaf_a, tracked.leaf_b, tracked.jaws)
    assert leaf_mae(start, truth, band) > 0.85
    assert leaf_mae(fit, truth, band) < 0.35  # a 12 mm wide core and the noise leave about 0.3 mm
    with mock.patch.object(filters, "MAX_TARGET_SIGMA_MM", filters.MIN_TARGET_SIGMA_MM):  # T fixed at 2 mm: fails
        sharp = rows.RowDomain.of(forward)
    assert sharp.target_sigma_mm == 2.0
    biased = leaves.track_leaves(sharp, signals[None], start.leaf_a, start.leaf_b, start.jaws, STAGES)
    assert leaf_mae(fallback.ControlPointRun(biased.leaf_a, biased.leaf_b, biased.jaws), truth, band) > 2.0


def test_a_fit_worse_than_its_start_is_never_returned():
    forward, signals, truth, band = noisy_broad_run(frames=12)
    start = network_like(truth)
    bad = fallback.ControlPointRun(truth.leaf_a + 4.0, truth.leaf_b - 4.0, truth.jaws)
    kept = fallback.keep_better(forward, signals[None], start, bad)
    torch.testing.assert_close(kept.points.leaf_a, start.leaf_a)
    assert kept.from_start == 1.0
    misfit = fallback.render_run(forward, signals[None], kept.points).misfits.sum()
    assert misfit <= fallback.render_run(forward, signals[None], start).misfits.sum()

    # wrong in six leaves only: those come from the start, the leaves the broad response does not
    # mix with them (three leaves away and more) from the fit
    partly = dataclasses.replace(truth, leaf_a=truth.leaf_a.clone())
    partly.leaf_a[..., 30:36] += 4.0
    kept = fallback.keep_better(forward, signals[None], start, partly)
    from_start = kept.leaves_from_start[0]
    assert from_start[:, 30:36][band[:, 30:36]].all()
    assert not from_start[:, :27][band[:, :27]].any() and not from_start[:, 39:][band[:, 39:]].any()
    misfit = fallback.render_run(forward, signals[None], kept.points).misfits.sum()
    assert misfit <= fallback.render_run(forward, signals[None], start).misfits.sum()
    assert misfit <= fallback.render_run(forward, signals[None], partly).misfits.sum()
    assert 0 < kept.from_start < 1

    # a good fit is kept whole
    kept = fallback.keep_better(forward, signals[None], start, truth)
    assert kept.from_start == 0.0
    torch.testing.assert_close(kept.points.leaf_b, truth.leaf_b)


def test_an_arc_reconstruction_falls_back_to_the_network_where_tracking_fails():
    forward, signals, truth, band = noisy_broad_run(frames=12)
    mu = torch.full((12,), 1.0)
    network = ShiftedTruth(signals, truth.leaf_a[0], truth.leaf_b[0], truth.jaws[0], mu)
    network.config = type("Config", (), {"track_stages": STAGES})()

    def tracking_gone_wrong(domain, signals, leaf_a, leaf_b, jaws, stages, **options):
        return leaves.Tracked(leaf_a + 5.0, leaf_b - 5.0, jaws, torch.ones(leaf_a.shape[0], leaf_a.shape[1] - 1))

    with mock.patch.object(estimate_module, "track_leaves", tracking_gone_wrong):
        estimate = estimate_module.reconstruct_arc(forward, network, signals)
    assert estimate.from_start == 1.0 and bool(estimate.leaves_from_start[band].all())
    torch.testing.assert_close(estimate.leaf_a[1:], truth.leaf_a[0, 1:] + 0.8)  # the network's estimate, kept
    honest = estimate_module.reconstruct_arc(forward, network, signals)
    assert honest.from_start < 0.05
    assert honest.leaves_from_start.shape == honest.leaf_a.shape
    shown = fallback.open_leaves(honest.jaws)
    assert float(honest.leaves_from_start[shown].float().mean()) == pytest.approx(honest.from_start)


@pytest.mark.parametrize(("moves", "hidden", "passes", "mlc"), [
    ([1.0, 0.2], False, 2, "legacy"),  # settles at the second pass
    ([1.0, 0.5, 0.4], False, 3, "legacy"),  # still moving: the most passes
    ([0.2], False, 1, "legacy"),  # settled at once
    ([2.0], True, 1, "legacy"),  # only leaves behind the jaws moved: nothing the frames show
    ([1.0, 0.5], False, 1, "hd120"),  # the fine strips take one pass
])
def test_passes_repeat_while_the_fit_moves_the_open_leaves(moves, hidden, passes, mlc):
    forward, signals, _, _ = noisy_broad_run(frames=6, mlc=mlc)
    _, network = build_models("tiny", "aperture", MLC_GEOMETRIES[mlc])
    relinearised = []

    def scripted(domain, residuals, leaf_a, leaf_b, jaws, stages, **options):
        if stages != estimate_module.RELINEARISED_STAGES:  # the first pass: the start as it is
            return leaves.Tracked(leaf_a, leaf_b, jaws, torch.ones(leaf_a.shape[0], leaf_a.shape[1] - 1))
        move = torch.full_like(leaf_a, moves[len(relinearised)])
        if hidden:
            move[fallback.open_leaves(jaws, domain.grid)] = 0.0
        relinearised.append(float(move.abs().max()))
        return leaves.Tracked(leaf_a - move, leaf_b, jaws, torch.ones(leaf_a.shape[0], leaf_a.shape[1] - 1))

    assert estimate_module.RELINEARISED_PASSES == 3 and estimate_module.SETTLED_MM == 0.3
    with torch.no_grad(), mock.patch.object(estimate_module, "track_leaves", scripted):
        estimate_module.reconstruct_arc(forward, network.eval(), signals)
    assert relinearised == pytest.approx(moves[:passes])


def test_the_tracking_reads_the_frames_through_the_starts_rendering():
    """A forward model with a 12 mm wide response whose broad term holds a fifth of the signal
    through a 21 mm blur (as a model trained on a broad response learns): frames it renders itself
    are tracked from the network's estimate only when the tracking reads them as the start's rows
    plus the filtered residuals of the start's rendering (the broad term and whatever else of the
    response the row domain leaves out cancel), not the filtered frames themselves."""
    forward = forward_with_response(5.0)
    with torch.no_grad():
        forward.response.broad_gain.copy_(torch.tensor([0.18, 0.07]))
        forward.response.broad_log_width.fill_(np.log(21.0))
    points = generate_control_points(86, 13)
    # arc 86's openings and jaws, every leaf moving 0.5 mm per control point (the travel cost,
    # not the reading, decides the synthetic patterns' jitter from one point to the next)
    moving = 0.5 * torch.arange(13, dtype=torch.float32)[:, None]
    truth = fallback.ControlPointRun(torch.tensor(points.leaf_a[:1])[None] + moving,
                                     torch.tensor(points.leaf_b[:1])[None] + moving,
                                     torch.tensor(np.stack([points.jaw_1, points.jaw_2], 1), dtype=torch.float32)[None])
    pairs = [torch.stack([value[0, :-1], value[0, 1:]], 1) for value in (truth.leaf_a, truth.leaf_b, truth.jaws)]
    scalars = torch.cat([torch.tensor(points.mu[1:, None]), pairs[2][:, :, 0], pairs[2][:, :, 1]], 1)
    with torch.no_grad():
        signals = forward(pairs[0].flatten(1), pairs[1].flatten(1), scalars)[0][:, 0]
    lo, hi = leaf_band(points.jaw_1, points.jaw_2)
    band = torch.zeros(13, 52, dtype=torch.bool)
    for point in range(1, 13):  # control point 0 is extrapolated without the frame before
        band[point, lo[point]:hi[point]] = True
    network = ShiftedTruth(signals, truth.leaf_a[0], truth.leaf_b[0], truth.jaws[0], torch.tensor(points.mu[1:]))
    network.config = type("Config", (), {"track_stages": STAGES})()

    def frames_themselves(domain, residuals, leaf_a, leaf_b, jaws, stages, start_mu=None, **options):
        return leaves.track_leaves(domain, signals[None], leaf_a, leaf_b, jaws, stages, **options)

    with torch.no_grad():
        estimate = estimate_module.reconstruct_arc(forward, network, signals)
        with mock.patch.object(estimate_module, "track_leaves", frames_themselves):
            plain = estimate_module.reconstruct_arc(forward, network, signals)

    def mae(reconstruction) -> float:
        return leaf_mae(fallback.ControlPointRun(reconstruction.leaf_a[None], reconstruction.leaf_b[None],
                                                 reconstruction.jaws[None]), truth, band)

    assert mae(estimate) < 0.35 and mae(plain) > 1.0  # worse than its start, 0.8 mm off


def test_rendering_again_only_the_changed_frames_matches_a_whole_rendering():
    forward, signals, truth, band = noisy_broad_run(frames=8)
    moved = dataclasses.replace(truth, leaf_a=truth.leaf_a.clone())
    moved.leaf_a[:, 3, 30] += 2.0  # control point 3: frames 2 and 3 change
    before = fallback.render_run(forward, signals[None], truth)
    changed = torch.zeros(1, 8, dtype=torch.bool)
    changed[0, 2:4] = True
    again = fallback.rerender(forward, signals[None], moved, before, changed, batch_frames=1)
    whole = fallback.render_run(forward, signals[None], moved)
    torch.testing.assert_close(again.misfits, whole.misfits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again.mu, whole.mu)
    assert (whole.misfits[0, 2:4, 30] > before.misfits[0, 2:4, 30]).all()
    torch.testing.assert_close(again.misfits[0, [0, 1, 4, 5, 6, 7]], before.misfits[0, [0, 1, 4, 5, 6, 7]])


@pytest.mark.parametrize(("sigma_mm", "groups"), [(2.0, 1), (3.5, 2), (4.6, 3), (5.8, 3)])
def test_leaves_move_in_groups_that_hardly_see_each_other(sigma_mm, groups):
    """Every leaf in exactly one group; within a group, leaves n x 5 mm apart see each other through T
    at no more than ``GROUP_COUPLING`` of its centre tap, and n is the fewest for which that holds
    (T a Gaussian of sigma_mm, independently evaluated)."""
    domain = rows.RowDomain.of(forward_with_response(2.0))
    domain = dataclasses.replace(domain, response_filter=dataclasses.replace(domain.response_filter,
                                                                             target_sigma_mm=sigma_mm))
    found = leaves.leaf_groups(domain, "cpu")
    assert len(found) == groups
    assert sorted(torch.cat(found).tolist()) == list(range(52))
    for group in found:
        spacing = int(group[1] - group[0])
        assert spacing == groups and bool((torch.diff(group) == spacing).all())
        assert np.exp(-0.5 * (spacing * 5.0 / sigma_mm) ** 2) <= leaves.GROUP_COUPLING
    if groups > 1:
        assert np.exp(-0.5 * ((groups - 1) * 5.0 / sigma_mm) ** 2) > leaves.GROUP_COUPLING


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mlc", ["legacy", "hd120"])
def test_a_broad_responses_arc_reconstruction_on_cuda_is_the_cpus(mlc):
    """On the 52 strips and on HD120's 104 fine ones (rows of 0.5 mm, two row-tap phases)."""
    forward, signals, truth, band = noisy_broad_run(frames=12, mlc=mlc)
    _, inverse = build_models("tiny", "aperture", MLC_GEOMETRIES[mlc])
    results = []
    for device in ("cpu", "cuda"):
        models = [copy.deepcopy(model).to(device).eval() for model in (forward, inverse)]
        with torch.inference_mode():
            arc = estimate_module.reconstruct_arc(*models, signals.to(device))
        results.append(fallback.ControlPointRun(arc.leaf_a[None].cpu(), arc.leaf_b[None].cpu(), arc.jaws[None].cpu()))
    assert rows.RowDomain.of(forward.to("cuda"), torch.device("cuda")).broad
    assert leaf_mae(results[1], results[0], band) < 0.05


def neighbour_costs_by_loop(points: torch.Tensor, seen: torch.Tensor, moving: list[int],
                            offsets: torch.Tensor) -> torch.Tensor:
    """``leaves._neighbour_distances`` summed over a frame's two ends, one entry at a time: half of each
    end's distance to each shown neighbour."""
    runs, frames, count = points.shape[0], points.shape[1] - 1, points.shape[2]
    out = torch.zeros(runs, frames, len(moving), len(offsets), len(offsets), dtype=points.dtype)
    for run in range(runs):
        for frame in range(frames):
            for index, leaf in enumerate(moving):
                for i, first in enumerate(offsets.tolist()):
                    for j, last in enumerate(offsets.tolist()):
                        for neighbour in (leaf - 1, leaf + 1):
                            if 0 <= neighbour < count and seen[run, frame, neighbour]:
                                out[run, frame, index, i, j] += 0.5 * (
                                    abs(points[run, frame, leaf] + first - points[run, frame, neighbour])
                                    + abs(points[run, frame + 1, leaf] + last - points[run, frame + 1, neighbour]))
    return out


def test_the_neighbour_costs_are_the_distances_to_the_shown_neighbours():
    gen = torch.Generator().manual_seed(0)
    points = 5.0 * torch.randn(2, 4, 6, generator=gen, dtype=torch.float64)
    seen = torch.rand(2, 3, 6, generator=gen) > 0.3
    offsets = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    for moving in ([0, 2, 5], [1, 3], [4]):
        first, last = leaves._neighbour_distances(points, seen, torch.tensor(moving), offsets)
        torch.testing.assert_close(first[..., :, None] + last[..., None, :],
                                   neighbour_costs_by_loop(points, seen, moving, offsets))


def tracked_from(forward: nn.Module, signals: torch.Tensor, start: fallback.ControlPointRun) -> leaves.Tracked:
    """The tracking of ``signals`` (N, 256, 256) read relative to the forward model's rendering of ``start``."""
    prepared = estimate_module.render_run(forward, signals[None], start, 64, residuals=True)
    return leaves.track_leaves(rows.RowDomain.of(forward), prepared.residuals, start.leaf_a, start.leaf_b,
                               start.jaws, ((4.0, 0.5), (2.0, 0.2), (1.0, 0.1), (1.0, 0.1)),
                               start_mu=prepared.mu)


def tracked_apart_and_pulled(forward: nn.Module, leaf_a: torch.Tensor, leaf_b: torch.Tensor,
                             jaws: torch.Tensor) -> tuple[leaves.Tracked, leaves.Tracked]:
    """The forward model's frames of ``leaf_a``, ``leaf_b`` (N, strips) and ``jaws`` (N, 2), tracked from
    a start of leaves alternately 1 mm out and in about them, without the neighbour cost and with it."""
    signals = render(forward, leaf_a, leaf_b, jaws) * 10.0
    alternation = (-1.0) ** torch.arange(leaf_a.shape[-1])
    start = fallback.ControlPointRun(leaf_a[None] + alternation, leaf_b[None] - alternation, jaws[None])
    with mock.patch.object(leaves, "NEIGHBOUR_COST", 0.0):
        apart = tracked_from(forward, signals, start)
    return apart, tracked_from(forward, signals, start)


def test_leaves_a_broad_response_cannot_tell_apart_come_together_and_a_step_it_shows_stays():
    """Under a 16.5 mm wide response (sigma 7 mm) leaves alternately 1 mm out and in along y reach the
    frames through a transfer of about 1e-3: started so about the truth, aligned leaves or leaves that
    step 12 mm halfway up the field, the tracking leaves them apart without the neighbour cost and
    brings them over halfway back with it, each half of the step where it was."""
    forward = forward_with_response(7.0)
    assert rows.RowDomain.of(forward).broad
    points, open_rows, below, above = 8, slice(19, 34), slice(19, 27), slice(27, 34)
    jaws = torch.tensor((-40.0, 45.0)).repeat(points, 1)
    for step_mm in (0.0, 12.0):
        leaf_a = (-20.3 + step_mm * (torch.arange(52) >= 27)).repeat(points, 1)
        leaf_b = leaf_a + 40.0
        apart, tracked = tracked_apart_and_pulled(forward, leaf_a, leaf_b, jaws)
        for fit, truth in ((apart.leaf_a[0], leaf_a), (apart.leaf_b[0], leaf_b)):
            assert float((fit - truth)[:, open_rows].abs().mean()) > 0.65
        for fit, truth in ((tracked.leaf_a[0], leaf_a), (tracked.leaf_b[0], leaf_b)):
            assert float((fit - truth)[:, open_rows].abs().mean()) < 0.45
            for half in (below, above):
                assert abs(float((fit - truth)[:, half].mean())) < 0.2


@pytest.mark.parametrize("sigma_mm, share", [(2.25, 0.97), (3.5, 0.9)])
def test_hd120s_fine_strips_take_the_neighbour_cost(sigma_mm, share):
    """HD120's 2.5 mm strips, broad to every response: under one as wide as the built-in kernel's core
    (2.25 mm, not broad to 5 mm strips) and a wider one, started alternately 1 mm out and in about
    aligned leaves, the fit ends nearer the truth with the neighbour cost than without it (by ``share``),
    each bank's mean where it was."""
    forward = forward_with_response(sigma_mm, "hd120")
    assert rows.RowDomain.of(forward).broad
    points, strips, open_rows = 8, 104, slice(38, 69)
    jaws = torch.tensor((-40.0, 45.0)).repeat(points, 1)
    leaf_a = torch.full((points, strips), -20.3)
    leaf_b = leaf_a + 40.0
    apart, tracked = tracked_apart_and_pulled(forward, leaf_a, leaf_b, jaws)

    def off(fit: leaves.Tracked) -> float:
        return float(((fit.leaf_a[0] - leaf_a).abs() + (fit.leaf_b[0] - leaf_b).abs())[:, open_rows].mean()) / 2

    assert off(tracked) < share * off(apart)
    for fit, truth in ((tracked.leaf_a[0], leaf_a), (tracked.leaf_b[0], leaf_b)):
        assert abs(float((fit - truth)[:, open_rows].mean())) < 0.2


def test_the_neighbour_cost_leaves_a_sharp_responses_tracking_as_it_was():
    forward = forward_with_response(2.0)
    assert not rows.RowDomain.of(forward).broad
    points = 6
    leaf_a = (-20.3 + 0.7 * (torch.arange(52) % 5)).repeat(points, 1) + torch.linspace(0, 5, points)[:, None]
    jaws = torch.tensor((-40.0, 45.0)).repeat(points, 1)
    signals = render(forward, leaf_a, leaf_a + 30.0, jaws) * 10.0
    start = fallback.ControlPointRun((leaf_a + 0.8)[None], (leaf_a + 29.0)[None], jaws[None])
    tracked = tracked_from(forward, signals, start)
    with mock.patch.object(leaves, "NEIGHBOUR_COST", 1.0):
        again = tracked_from(forward, signals, start)
    torch.testing.assert_close(again.leaf_a, tracked.leaf_a, rtol=0, atol=0)
    torch.testing.assert_close(again.leaf_b, tracked.leaf_b, rtol=0, atol=0)
