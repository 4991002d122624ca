"""The aperture family: its fluence against the frame engine's masks, its detector response
against scipy's convolution, the inverse model's layout and parameter groups,
and rebuilding a pair from a checkpoint (of today's configs and of those stored before leaf tracking)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
import torch

from epid.models import aperture as aperture_module
from epid.models.checkpoint import build_models_from_checkpoint
from epid.models.families import PairConfig, build_models
from epid.models.panel import COMMISSIONING_PARAMETERS
from epid.models.response import DetectorResponse, to_imager
from epid.synthesis import geometry
from epid.synthesis.fluence import rasterize


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
    fluence = aperture_module.ApertureFluence()(leaf_a, leaf_b, scalars)
    masks = rasterize(leaf_a[:, 52:], leaf_b[:, 52:], scalars[:, 2], scalars[:, 4])
    torch.testing.assert_close(to_imager(fluence), masks)


def test_fluence_of_a_moving_aperture_averages_the_seven_sub_apertures():
    leaf_a, leaf_b, scalars = whole_mm_control_points(3, seed=1, move_mm=12.0)  # 2 mm per sub-aperture
    fluence = aperture_module.ApertureFluence()(leaf_a, leaf_b, scalars)
    expected = sum(rasterize(leaf_a[:, :52] + 2.0 * k, leaf_b[:, :52] + 2.0 * k, scalars[:, 1], scalars[:, 3])
                   for k in range(7)) / 7
    torch.testing.assert_close(to_imager(fluence), expected)


def test_fluence_covers_a_cell_by_the_length_of_the_opening_in_it():
    aperture = aperture_module.ApertureFluence()
    leaf_a = torch.full((1, 104), -10.3)
    leaf_b = torch.full((1, 104), 20.25)
    scalars = torch.tensor([[1.0, -50.0, -50.0, 50.0, 50.0]])
    row = to_imager(aperture(leaf_a, leaf_b, scalars))[0, 100]
    columns = aperture_module.column_centres()
    assert row[columns == -10.5].item() == pytest.approx(0.3)  # cell [-11, -10)
    assert row[columns == -9.5].item() == 1.0
    assert row[columns == 20.5].item() == pytest.approx(0.25)  # cell [20, 21)
    assert row[columns == 21.5].item() == 0.0
    with torch.no_grad():
        aperture.edge_shift.fill_(0.5)
    row = to_imager(aperture(leaf_a, leaf_b, scalars))[0, 100]
    assert row[columns == -10.5].item() == pytest.approx(0.8)
    assert row[columns == -11.5].item() == 0.0


def test_detector_response_is_a_same_size_convolution_with_the_profiles_outer_product():
    response = DetectorResponse(reach=20, widths_mm=(1.0, 3.0), start_width_mm=3.0)
    with torch.no_grad():
        response.profile_x.logits.copy_(torch.tensor([0.3, -0.2]))
        response.log_gain.fill_(0.1)
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=3, move_mm=6.0)
    fluence = aperture_module.ApertureFluence()(leaf_a, leaf_b, scalars)
    frame = response(fluence)
    kernel = np.outer(response.profile_y().detach().numpy(), response.profile_x().detach().numpy()) * np.exp(0.1)
    full = fluence.detach().numpy()
    for i in range(2):
        reference = scipy.signal.convolve2d(full[i], kernel, mode="same")  # kernel symmetric in y: no flip issue
        expected = reference[geometry.IMAGER_MARGIN:geometry.IMAGER_MARGIN + 256][::-1]
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
        assert sorted(grouped) == sorted(id(p) for p in model.parameters() if p.requires_grad)
    held = {name for name, p in forward.named_parameters() if not p.requires_grad}
    assert held == set(COMMISSIONING_PARAMETERS)
    sum(t.sum() for t in out).backward()
    assert inverse.stem.weight.grad is not None and inverse.leaf_readout[0].net[0].weight.grad is not None


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


def test_a_config_stored_before_leaf_tracking_refines_as_its_fit_did():
    forward, inverse = build_models("tiny", "aperture")
    stored = PairConfig.of(forward, inverse).to_dict()
    for fit_steps, stages in ((100, aperture_module.LeafEdgeInverseConfig().track_stages), (0, ())):
        old = {key: value for key, value in stored["inverse"].items() if key != "track_stages"}
        old.update(fit_steps=fit_steps, split_rounds=3, refine_steps=40)
        config = PairConfig.from_dict({**stored, "inverse": old})
        assert config.inverse.track_stages == stages
    with pytest.raises(ValueError, match="track_stages"):
        aperture_module.LeafEdgeInverseConfig(track_stages=((8.0, 0.0),))


def test_a_tongue_and_groove_width_below_zero_still_learns_its_way_back():
    """The strip's width renders clamped at 0 mm, yet a parameter a step took below 0 keeps a
    gradient towards the width the frames show (a clamp alone would hold it there for good)."""
    target, learner = aperture_module.ApertureFluence(), aperture_module.ApertureFluence()
    with torch.no_grad():
        target.tongue_groove_mm.fill_(0.8)
        learner.tongue_groove_mm.fill_(-0.3)
    leaf_a = torch.cat([torch.linspace(-30.0, 0.0, 52)] * 2)[None]  # neighbouring leaves at different positions
    leaf_b = leaf_a + 20.0
    scalars = torch.tensor([[1.0, -60.0, -60.0, 60.0, 60.0]])
    assert float(learner.tongue_groove_width.detach()) == 0.0
    without_strip = aperture_module.ApertureFluence()(leaf_a, leaf_b, scalars)
    torch.testing.assert_close(learner(leaf_a, leaf_b, scalars), without_strip)
    loss = (learner(leaf_a, leaf_b, scalars) - target(leaf_a, leaf_b, scalars).detach()).square().sum()
    loss.backward()
    assert float(learner.tongue_groove_mm.grad) < 0  # a gradient step widens the strip
