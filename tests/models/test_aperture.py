"""The aperture family: its fluence against the frame engine's masks, its detector response
against scipy's convolution, the inverse model's layout and parameter groups,
rebuilding a pair from a checkpoint (of today's configs and of those stored before leaf tracking), and
a real MLC's layers rendered as the synthesis renders them."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
import torch

from epid.models import aperture as aperture_module
from epid.models.checkpoint import build_models_from_checkpoint
from epid.models.families import PairConfig, build_models, predict_frames
from epid.models.losses import shown_leaves
from epid.models.panel import COMMISSIONING_PARAMETERS
from epid.models.response import DetectorResponse, to_imager
from epid.reconstruction.rows import RowDomain
from epid.synthesis import geometry
from epid.synthesis.fluence import aperture_fluence, frame_positions, physics_fluence, rasterize
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import PRESETS
from epid.synthesis.sequences import generate_control_points


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


def test_a_beams_x_jaws_reach_the_aperture_as_jaws_and_the_legacy_family_leaves_them_to_the_folded_leaves():
    leaf_a, leaf_b, scalars = whole_mm_control_points(3, seed=2, move_mm=6.0)
    forward, _ = build_models("tiny", "aperture")
    forward.eval()
    with torch.no_grad():
        forward.aperture.jaw_transmission_percent.fill_(0.5)
    x_jaws = torch.tensor([[-30.0, -24.0, 35.0, 41.0]]).expand(3, 4)  # X1 and X2 moving 6 mm in the frame
    wide = torch.tensor([[-200.0, -200.0, 200.0, 200.0]]).expand(3, 4)
    with torch.no_grad():
        plain, _ = forward(leaf_a, leaf_b, scalars)
        open_jaws, _ = forward(leaf_a, leaf_b, torch.cat([scalars, wide], 1))
        jawed = forward.aperture(leaf_a, leaf_b, torch.cat([scalars, x_jaws], 1))
    torch.testing.assert_close(open_jaws, plain)  # X jaws outside the field change nothing
    moving = [aperture_module.sub_aperture_positions(scalars[:, i], scalars[:, i + 1]) for i in (1, 3)]
    edges = aperture_module.ApertureFluence.moving_leaves(leaf_a, leaf_b)
    expected = aperture_fluence(*edges, *moving, torch.full((3, 7), 1 / 7), jaw_transmission=0.005,
                                x_jaws=(aperture_module.sub_aperture_positions(x_jaws[:, 0], x_jaws[:, 1]),
                                        aperture_module.sub_aperture_positions(x_jaws[:, 2], x_jaws[:, 3])))
    torch.testing.assert_close(jawed, expected)
    columns = aperture_module.column_centres()
    assert float(jawed[..., columns < -31].max()) <= 0.005 + 1e-7 < float(jawed.max())  # behind X1 all frame
    legacy_forward, _ = build_models("tiny", "legacy")
    legacy_forward.eval()
    previous = torch.zeros(3, 1, 256, 256)
    folded_a, folded_b = shown_leaves(leaf_a, leaf_b, torch.cat([scalars, x_jaws], 1))
    assert bool((folded_a != leaf_a).any()) and bool((folded_b != leaf_b).any())  # the X jaws cut both banks
    with torch.no_grad():
        torch.testing.assert_close(predict_frames(legacy_forward, leaf_a, leaf_b, torch.cat([scalars, x_jaws], 1),
                                                  previous)[0],
                                   predict_frames(legacy_forward, folded_a, folded_b, scalars, previous)[0])


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


def test_detector_response_adds_its_broad_term_weighted_per_row():
    response = DetectorResponse(reach=20, widths_mm=(1.0, 3.0), start_width_mm=3.0)
    with torch.no_grad():
        response.broad_gain.copy_(torch.tensor([0.04, 0.1]))
        response.broad_log_width.fill_(np.log(9.0))
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=5, move_mm=6.0)
    fluence = aperture_module.ApertureFluence()(leaf_a, leaf_b, scalars)
    frame = response(fluence).detach().numpy()
    kernel = np.outer(response.profile_y().detach().numpy(), response.profile_x().detach().numpy())
    taps = response.broad_taps().detach().numpy()
    rows = (np.arange(256) + 0.5) / 256  # imager row 0 at the top
    weight = 0.04 + 0.1 * rows
    window = slice(geometry.IMAGER_MARGIN, geometry.IMAGER_MARGIN + 256)
    for i in range(2):
        full = fluence[i].detach().numpy()
        sharp = scipy.signal.convolve2d(full, kernel, mode="same")[window][::-1]
        broad = scipy.signal.convolve2d(full, np.outer(taps, taps), mode="same")[window][::-1]
        np.testing.assert_allclose(frame[i], sharp + weight[:, None] * broad, atol=1e-5)


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
    assert held == {*COMMISSIONING_PARAMETERS, *aperture_module.X_JAW_PARAMETERS}  # the legacy grid has no X jaws
    learning = build_models(size, "aperture", MLC_GEOMETRIES["millennium120"])
    assert {name for name, p in learning[0].named_parameters() if not p.requires_grad} == set(COMMISSIONING_PARAMETERS)
    assert not any(p.requires_grad for name, p in learning[1].named_parameters() if "x_jaw" in name)
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


def realistic_aperture(strip_leaves) -> aperture_module.ApertureFluence:
    """An aperture of ``strip_leaves`` whose physics is set to the realistic synthesis's."""
    physics = PRESETS["realistic"]
    fluence = aperture_module.ApertureFluence(strip_leaves)
    with torch.no_grad():
        fluence.leaf_end_offset.fill_(physics.leaf_end_offset_mm)
        fluence.leaf_transmission_percent.fill_(physics.leaf_transmission_percent)
        fluence.jaw_transmission_percent.fill_(physics.jaw_transmission_percent)
        fluence.interleaf_leakage_percent.fill_(physics.interleaf_leakage_percent)
        fluence.tongue_groove_mm.fill_(physics.tongue_groove_mm)
        fluence.x_jaw_transmission_change_percent.fill_(physics.x_jaw_transmission_percent
                                                        - physics.jaw_transmission_percent)
    return fluence


@pytest.mark.parametrize(("name", "one_layer_miss"), [("halcyon", 0.1), ("mlci2", 1e-3), ("millennium120", 0.0),
                                                      ("hd120", None)])
def test_a_real_mlcs_aperture_renders_its_layers_as_the_synthesis_does(name, one_layer_miss):
    """The models' aperture of a real MLC (each layer's leaves placed from the strips' edges at each
    control point in torch; HD120 on its 104 strips of 2.5 mm, those beyond its leaves open) against
    the synthesis's frames of an irregular arc (placed per layer in numpy, ``frame_positions``), with
    its X jaws where the MLC has them: the same fluence. The 52 strips rendered as one layer miss by
    more than ``one_layer_miss`` of an open cell (Millennium 120's 10 mm leaves lie beyond the jaws
    here)."""
    mlc = MLC_GEOMETRIES[name]
    control_points = generate_control_points(162, 40, mlc)
    frames = np.arange(1, 40)
    positions, layers = frame_positions(control_points, frames, torch.device("cpu"))
    expected = physics_fluence(*positions, torch.ones(len(frames)), PRESETS["realistic"], **layers)
    pair = [torch.from_numpy(np.concatenate([values[frames - 1], values[frames]], 1)).float()
            for values in (control_points.leaf_a, control_points.leaf_b)]
    jaws = [control_points.jaw_1[frames - 1], control_points.jaw_1[frames], control_points.jaw_2[frames - 1],
            control_points.jaw_2[frames]]
    if control_points.x_jaws is not None:  # the X jaws with their own transmission
        x_jaws = control_points.x_jaws
        jaws += [x_jaws[frames - 1, 0], x_jaws[frames, 0], x_jaws[frames - 1, 1], x_jaws[frames, 1]]
    scalars = torch.from_numpy(np.stack([np.ones(len(frames)), *jaws], 1)).float()
    with torch.no_grad():
        layered = realistic_aperture(mlc.strip_layout)(*pair, scalars)
    torch.testing.assert_close(layered, expected, atol=1e-5, rtol=0)
    if one_layer_miss is not None:
        with torch.no_grad():
            one_layer = realistic_aperture(())(*pair, scalars)
        assert float((one_layer - expected).abs().max()) > one_layer_miss


def test_a_pair_built_for_an_mlc_keeps_it_through_a_checkpoint():
    """Models for the legacy grid and Agility (strips are leaves, no X jaws to learn) have the configs they
    always had, Millennium 120's forward model learns its X jaws; a real MLC's leaves over the strips are in
    both configs, rebuilt from a checkpoint, and in the row domain's leakage (none inside a 10 mm leaf)."""
    agility = build_models("tiny", "aperture", MLC_GEOMETRIES["agility"])
    assert [model.config for model in agility] == [model.config for model in build_models("tiny")]
    assert build_models("tiny", "aperture", MLC_GEOMETRIES["millennium120"])[0].config.x_jaws
    mlc = MLC_GEOMETRIES["halcyon"]
    forward, inverse = build_models("tiny", "aperture", mlc)
    assert forward.config.strip_leaves == inverse.config.strip_leaves == mlc.strip_layout
    assert len(mlc.strip_layout) == 2
    checkpoint = {"model_config": PairConfig.of(forward, inverse).to_dict(), "forward_model": forward.state_dict(),
                  "inverse_model": inverse.state_dict()}
    rebuilt, _ = build_models_from_checkpoint(checkpoint)
    assert rebuilt.config.strip_leaves == mlc.strip_layout
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=3, move_mm=4.0)
    torch.testing.assert_close(rebuilt(leaf_a, leaf_b, scalars)[0], forward(leaf_a, leaf_b, scalars)[0])
    mlci2, _ = build_models("tiny", "aperture", MLC_GEOMETRIES["mlci2"])
    np.testing.assert_array_equal(RowDomain.of(mlci2).interleaf.numpy(), MLC_GEOMETRIES["mlci2"].interleaf[0])
    assert RowDomain.of(forward).interleaf.sum() == geometry.NUM_LEAF_PAIRS - 1
    with pytest.raises(ValueError, match="strip_leaves"):
        aperture_module.ApertureForwardConfig(strip_leaves=((0, 1, 2),))
