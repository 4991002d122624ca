"""The aperture family: its fluence against the frame engine's masks, its detector response
against scipy's convolution, the inverse model's layout and parameter groups,
the fit to a rendering, and rebuilding a pair from a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
import torch

from epid import aperture_models as am
from epid.checkpoint import build_models_from_checkpoint
from epid.families import PairConfig, build_models
from epid.imaging import rasterize
from epid.reconstruct import FitSettings, Window, fit_window


def whole_mm_control_points(batch: int, seed: int = 0, move_mm: float = 0.0):
    """Leaves and jaws at whole millimetres (prev and curr differ by whole 6ths of ``move_mm``)."""
    gen = torch.Generator().manual_seed(seed)
    leaf_a = -torch.randint(10, 60, (batch, 52), generator=gen).float()
    leaf_b = leaf_a + torch.randint(10, 60, (batch, 52), generator=gen).float()
    jaw_1 = -torch.randint(20, 90, (batch,), generator=gen).float()
    jaw_2 = jaw_1 + torch.randint(20, 120, (batch,), generator=gen).float()
    leaf_a_pair = torch.cat([leaf_a, leaf_a + move_mm], 1)
    leaf_b_pair = torch.cat([leaf_b, leaf_b + move_mm], 1)
    scalars = torch.stack([torch.full((batch,), 10.0), jaw_1, jaw_1, jaw_2, jaw_2], 1)
    return leaf_a_pair, leaf_b_pair, scalars


def test_fluence_of_a_still_aperture_is_the_frame_engines_mask():
    leaf_a, leaf_b, scalars = whole_mm_control_points(4)
    fluence = am.ApertureFluence()(leaf_a, leaf_b, scalars)
    masks = rasterize(leaf_a[:, 52:], leaf_b[:, 52:], scalars[:, 2], scalars[:, 4])
    torch.testing.assert_close(am.to_imager(fluence), masks)


def test_fluence_of_a_moving_aperture_averages_the_seven_sub_apertures():
    leaf_a, leaf_b, scalars = whole_mm_control_points(3, seed=1, move_mm=12.0)  # 2 mm per sub-aperture
    fluence = am.ApertureFluence()(leaf_a, leaf_b, scalars)
    expected = sum(rasterize(leaf_a[:, :52] + 2.0 * k, leaf_b[:, :52] + 2.0 * k, scalars[:, 1], scalars[:, 3])
                   for k in range(7)) / 7
    torch.testing.assert_close(am.to_imager(fluence), expected)


def test_fluence_covers_a_cell_by_the_length_of_the_opening_in_it():
    aperture = am.ApertureFluence()
    leaf_a = torch.full((1, 104), -10.3)
    leaf_b = torch.full((1, 104), 20.25)
    scalars = torch.tensor([[1.0, -50.0, -50.0, 50.0, 50.0]])
    row = am.to_imager(aperture(leaf_a, leaf_b, scalars))[0, 100]
    columns = am.column_centres()
    assert row[columns == -10.5].item() == pytest.approx(0.3)  # cell [-11, -10)
    assert row[columns == -9.5].item() == 1.0
    assert row[columns == 20.5].item() == pytest.approx(0.25)  # cell [20, 21)
    assert row[columns == 21.5].item() == 0.0
    with torch.no_grad():
        aperture.edge_shift.fill_(0.5)
    row = am.to_imager(aperture(leaf_a, leaf_b, scalars))[0, 100]
    assert row[columns == -10.5].item() == pytest.approx(0.8)
    assert row[columns == -11.5].item() == 0.0


def test_detector_response_is_a_same_size_convolution_with_the_profiles_outer_product():
    response = am.DetectorResponse(reach=20, widths_mm=(1.0, 3.0), start_width_mm=3.0)
    with torch.no_grad():
        response.profile_x.logits.copy_(torch.tensor([0.3, -0.2]))
        response.log_gain.fill_(0.1)
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=3, move_mm=6.0)
    fluence = am.ApertureFluence()(leaf_a, leaf_b, scalars)
    frame = response(fluence)
    kernel = np.outer(response.profile_y().detach().numpy(), response.profile_x().detach().numpy()) * np.exp(0.1)
    full = fluence.detach().numpy()
    for i in range(2):
        reference = scipy.signal.convolve2d(full[i], kernel, mode="same")  # kernel symmetric in y: no flip issue
        expected = reference[am.IMAGER_MARGIN:am.IMAGER_MARGIN + 256][::-1]
        np.testing.assert_allclose(frame[i].detach().numpy(), expected, atol=1e-5)


def test_forward_model_adds_the_learned_lag_of_the_recorded_previous_frame():
    forward, _ = build_models("tiny", "aperture")
    leaf_a, leaf_b, scalars = whole_mm_control_points(3, seed=4, move_mm=3.0)
    epid, latent = forward(leaf_a + 0.37, leaf_b - 0.21, scalars)
    assert epid.shape == (3, 1, 256, 256) and latent.shape == (3, 1, 64, 64)
    signal = forward.render(leaf_a + 0.37, leaf_b - 0.21, scalars)[0]
    torch.testing.assert_close(epid[1], 10.0 * signal[1:2])
    previous = torch.rand(3, 1, 256, 256)
    with torch.no_grad():
        forward.lag_percent.fill_(3.0)
    lagged, _ = forward(leaf_a + 0.37, leaf_b - 0.21, scalars, previous)
    torch.testing.assert_close(lagged, 0.97 * epid + 0.03 * previous)


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_inverse_model_layout_and_parameter_groups(size):
    forward, inverse = build_models(size, "aperture")
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=5, move_mm=3.0)
    frames, _ = forward(leaf_a, leaf_b, scalars)
    out = inverse(frames, frames[:, 0])
    assert [tuple(t.shape) for t in out] == [(2, 104), (2, 104), (2, 5), (2, 1, 64, 64)]
    assert all(torch.isfinite(t).all() for t in out)
    for model in (forward, inverse):
        grouped = [id(p) for params, _ in model.parameter_groups() for p in params]
        assert sorted(grouped) == sorted(id(p) for p in model.parameters())
    sum(t.sum() for t in out).backward()
    assert inverse.stem.weight.grad is not None and inverse.leaf_readout[0].net[0].weight.grad is not None


def tiny_forward_with_2mm_response() -> am.ApertureForwardModel:
    """The tiny aperture forward model, every Gaussian of its response 2 mm wide."""
    torch.manual_seed(0)
    forward, _ = build_models("tiny", "aperture")
    with torch.no_grad():
        forward.response.profile_x.log_width.fill_(np.log(2.0))
        forward.response.profile_y.log_width.fill_(np.log(2.0))
    return forward


def still_jaw_opening(jaws: torch.Tensor) -> torch.Tensor:
    """Open fraction (B, 52) of each leaf row between jaws (B, 4) that stay at their curr positions."""
    return am.row_visibility((jaws[:, 1], jaws[:, 1]), (jaws[:, 3], jaws[:, 3]))[0]


def fit_to_frames(forward, frames, leaf_a, leaf_b, jaws, steps, split_rounds=0, refine_steps=0):
    """``fit_window`` on frame pairs (B, 2, 256, 256) from [prev, curr] estimates (leaves (B, 104),
    jaws (B, 4) [jaw_1 prev, curr, jaw_2 prev, curr]), the point before prev extrapolated:
    (leaf_a, leaf_b (B, 104), jaws (B, 4), mu of the curr frame (B,))."""
    def points(pair):
        prev, curr = pair[:, :52], pair[:, 52:]
        return torch.stack([2 * prev - curr, prev, curr], 1)

    jaw_points = jaws.view(-1, 2, 2).transpose(1, 2)
    start = Window(points(leaf_a), points(leaf_b), torch.stack([2 * jaw_points[:, 0] - jaw_points[:, 1],
                                                                 jaw_points[:, 0], jaw_points[:, 1]], 1))
    fitted = fit_window(forward, frames, start, FitSettings(steps, split_rounds, refine_steps))
    return (fitted.leaf_a[:, 1:].flatten(1), fitted.leaf_b[:, 1:].flatten(1),
            fitted.jaws[:, 1:].transpose(1, 2).reshape(-1, 4), fitted.mu[:, 1])


def test_fit_moves_a_perturbed_estimate_to_the_rendered_geometry():
    forward = tiny_forward_with_2mm_response()
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=6, move_mm=3.0)
    leaf_a, leaf_b = leaf_a + 0.4, leaf_b + 0.3  # off the grid
    with torch.no_grad():  # the prev frame's motion starts 3 mm before prev: constant speed
        prev = forward.render(torch.cat([leaf_a[:, :52] - 3.0, leaf_a[:, :52]], 1),
                              torch.cat([leaf_b[:, :52] - 3.0, leaf_b[:, :52]], 1), scalars)[0] * 7.0
        curr = forward.render(leaf_a, leaf_b, scalars)[0] * 12.0
    frames = torch.stack([prev, curr], 1)
    jaws = scalars[:, 1:]
    start_a, start_b = leaf_a + 0.8, leaf_b - 0.8
    fitted_a, fitted_b, fitted_jaws, mu = fit_to_frames(forward, frames, start_a, start_b, jaws + 0.5, 60)
    open_rows = still_jaw_opening(jaws) > 0.99
    error_before = (start_a[:, 52:] - leaf_a[:, 52:]).abs()[open_rows].mean()
    error_after = (fitted_a[:, 52:] - leaf_a[:, 52:]).abs()[open_rows].mean()
    assert error_before == pytest.approx(0.8)
    assert error_after < 0.2
    assert (fitted_jaws - jaws).abs().max() < 0.3
    torch.testing.assert_close(mu, torch.full((2,), 12.0), rtol=0.02, atol=0.0)


def test_split_search_finds_where_prev_lies_when_descent_alone_does_not():
    forward = tiny_forward_with_2mm_response()
    bank_a, bank_b, scalars = whole_mm_control_points(2, seed=6)
    leaf_a, leaf_b = bank_a[:, :52] + 0.4, bank_b[:, :52] + 0.3
    with torch.no_grad():  # 6 mm out from s to prev, 5 mm back from prev to curr
        prev = forward.render(torch.cat([leaf_a, leaf_a + 6.0], 1), torch.cat([leaf_b, leaf_b + 6.0], 1), scalars)[0]
        curr = forward.render(torch.cat([leaf_a + 6.0, leaf_a + 1.0], 1),
                              torch.cat([leaf_b + 6.0, leaf_b + 1.0], 1), scalars)[0]
    frames = torch.stack([7.0 * prev, 12.0 * curr], 1)
    jaws = scalars[:, 1:]
    # the estimate a reader of mean edge positions gives: each frame's mean position, at both ends
    guess_a = torch.cat([leaf_a + 3.0, leaf_a + 3.5], 1)
    guess_b = torch.cat([leaf_b + 3.0, leaf_b + 3.5], 1)
    opening = still_jaw_opening(jaws)
    open_rows, closed_rows = opening > 0.99, opening == 0

    def curr_error(rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
        fitted_a, fitted_b, _, _ = fit_to_frames(forward, frames, guess_a, guess_b, jaws, 60, rounds, 30)
        error = torch.cat([(fitted_a[:, 52:] - leaf_a - 1.0)[open_rows], (fitted_b[:, 52:] - leaf_b - 1.0)[open_rows]])
        moved = torch.cat([fitted_a - guess_a, fitted_b - guess_b], 1)[closed_rows.repeat(1, 4)]
        return error.abs(), moved.abs()

    descent_error, _ = curr_error(0)
    searched_error, closed_moved = curr_error(1)
    assert descent_error.mean() > 1.0 and descent_error.max() > 5.0  # stuck with prev on the wrong side
    assert searched_error.mean() < 0.1 and searched_error.max() < 0.3
    assert closed_moved.max() == 0.0  # rows no jaw opens keep the estimate


def test_a_checkpoint_rebuilds_the_pair_in_eval_mode():
    forward, inverse = build_models("tiny", "aperture")
    config = PairConfig.of(forward, inverse)
    checkpoint = {"model_config": config.to_dict(), "forward_model": forward.state_dict(),
                  "inverse_model": inverse.state_dict()}
    rebuilt_forward, rebuilt_inverse = build_models_from_checkpoint(checkpoint)
    assert config.to_dict()["family"] == "aperture"
    assert not rebuilt_forward.training and not rebuilt_inverse.training
    leaf_a, leaf_b, scalars = whole_mm_control_points(1, seed=7, move_mm=3.0)
    torch.testing.assert_close(rebuilt_forward(leaf_a, leaf_b, scalars)[0], forward(leaf_a, leaf_b, scalars)[0])
