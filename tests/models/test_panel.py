"""The beam and panel forms commissioning fits (epid.models.panel): the off-axis profile, the
field-size output, the sag and the panel's recording of a series, checked against hand-worked
values, a slow reference loop and scipy, and neutral until fitted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.ndimage
import torch

from epid.models.aperture import column_centres, leaf_grid_centres
from epid.models.families import build_models
from epid.models.panel import LAG_FRAMES, BeamProfile, PanelRecording, sag_shift, shift_frames
from tests.models.test_aperture import whole_mm_control_points


def test_the_sag_follows_the_gantry_angle_as_written():
    sag = torch.tensor([[0.7, 0.2], [0.1, 0.5]], dtype=torch.float64)
    shifts = sag_shift(sag, torch.tensor([0.0, 90.0, 180.0, 270.0]))
    # x = 0.7 sin g + 0.2 (1 - cos g), y = 0.1 sin g + 0.5 (1 - cos g)
    expected = [[0.0, 0.0], [0.9, 0.6], [0.4, 1.0], [-0.5, 0.4]]
    np.testing.assert_allclose(shifts.numpy(), expected, atol=1e-12)


@pytest.mark.parametrize("shift", [(1.3, -0.7), (-2.0, 0.25)])
def test_a_frame_moves_as_scipy_moves_it(shift):
    rng = np.random.default_rng(3)
    image = scipy.ndimage.gaussian_filter(rng.random((64, 80)), 3.0)
    moved = shift_frames(torch.from_numpy(image)[None], torch.tensor([shift], dtype=torch.float64))[0].numpy()
    # row 0 is the most positive y: +y moves the content towards row 0
    expected = scipy.ndimage.shift(image, (-shift[1], shift[0]), order=1, mode="constant")
    inner = (slice(4, -4), slice(4, -4))
    np.testing.assert_allclose(moved[inner], expected[inner], atol=1e-9)
    back = shift_frames(torch.from_numpy(moved)[None], -torch.tensor([shift], dtype=torch.float64))[0].numpy()
    np.testing.assert_allclose(back[inner], image[inner], atol=0.02 * image.max())


def test_the_off_axis_profile_and_the_field_size_output_by_hand():
    beam = BeamProfile()
    with torch.no_grad():
        beam.off_axis.copy_(torch.tensor([0.01, -0.02, 0.03, 0.005]))
        beam.output_per_log_area.fill_(0.03)
    y, x = leaf_grid_centres(), column_centres()
    profile = beam.profile(torch.ones(1, len(y), len(x)), y, x)[0]
    row, column = int(torch.argmin((y - 49.5).abs())), int(torch.argmin((x - 99.5).abs()))
    u, v = 99.5 / 100, 49.5 / 100
    r2 = u * u + v * v
    assert float(profile[row, column]) == pytest.approx(1 + 0.01 * u - 0.02 * v + 0.03 * r2 + 0.005 * r2 * r2, rel=1e-6)
    # a 100 x 100 mm field: output 1; 50 x 50 mm: 1 + 0.03 ln(1/4); 5 x 5 mm: the 1 cm^2 floor
    fluence = torch.full((3, len(y), len(x)), 0.015)  # the leaves' transmission is not field
    fluence[0, 80:180, 78:178] = 1.0
    fluence[1, 105:155, 103:153] = 0.8
    fluence[1, 105:130, 103:153] = 0.6  # reaches half of the highest: in the field
    fluence[2, 128:133, 128:133] = 1.0  # 25 mm^2, below the floor
    output = beam.output(fluence)
    np.testing.assert_allclose(output.numpy(), [1.0, 1 + 0.03 * math.log(0.25), 1 + 0.03 * math.log(0.01)], rtol=1e-6)


def test_the_forms_leave_the_forward_model_as_it_was_until_fitted():
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    leaf_a, leaf_b, scalars = whole_mm_control_points(2, seed=4, move_mm=3.0)
    with torch.no_grad():
        fluence = forward.aperture(leaf_a, leaf_b, scalars)
        rendered = forward.render(leaf_a, leaf_b, scalars)[0]
        torch.testing.assert_close(rendered, forward.response(fluence), rtol=0, atol=0)
        assert not forward.panel_shift(torch.tensor([90.0, 270.0])).any()
        forward.beam.output_per_log_area.fill_(0.05)
        area = float((fluence[0] >= 0.5 * fluence[0].max()).sum())
        scaled = forward.render(leaf_a, leaf_b, scalars)[0]
    torch.testing.assert_close(scaled[0], forward.response(fluence)[0] * (1 + 0.05 * math.log(area / 1e4)))


def recorded_by_loop(frames: np.ndarray, shares_percent, power_percent: float) -> np.ndarray:
    """The panel's recording of ``frames`` (K, H, W) pixel by pixel in float64: each pixel's response
    v x v^(-p), then each lag component's average of the responses before it, updated after it."""
    count, height, width = frames.shape
    out = np.zeros_like(frames, dtype=np.float64)
    for row in range(height):
        for column in range(width):
            averages = [0.0] * len(LAG_FRAMES)
            for k in range(count):
                value = float(frames[k, row, column])
                response = value * value ** (-power_percent / 100.0) if value > 0 else value
                out[k, row, column] = response + sum(share / 100.0 * (average - response)
                                                     for share, average in zip(shares_percent, averages, strict=True))
                averages = [average + (1.0 - math.exp(-1.0 / frames_)) * (response - average)
                            for average, frames_ in zip(averages, LAG_FRAMES, strict=True)]
    return out


def test_the_panels_recording_is_the_reference_loops_and_keeps_a_long_series_total():
    rng = np.random.default_rng(3)
    frames = rng.uniform(0.0, 2.0, size=(40, 3, 4)).astype(np.float32)
    frames[5:9, 1] = 0.0  # dark frames on one row, and one negative pixel (left as it is by the response)
    frames[12, 0, 0] = -0.01
    recording = PanelRecording()
    with torch.no_grad():
        for name, value in zip(("lag_2_percent", "lag_8_percent", "lag_32_percent"), (2.0, 1.0, 0.5), strict=True):
            getattr(recording, name).fill_(value)
        recording.power_percent.fill_(1.5)
        recorded = recording(torch.from_numpy(frames))
    np.testing.assert_allclose(recorded.numpy(), recorded_by_loop(frames, (2.0, 1.0, 0.5), 1.5), rtol=1e-5, atol=1e-6)
    # read back (as measured frames are before their leaves are reconstructed), the series returns
    with torch.no_grad():
        undone = recording.undo(recording(torch.from_numpy(frames).double()))
    np.testing.assert_allclose(undone.numpy(), frames, rtol=1e-6, atol=1e-9)  # the coefficients are float32
    # a lag moves signal later, it makes none: a long series of constant frames after a dark start
    # records the constant (the averages reach it) and loses only what the first frames lent
    steady = torch.ones(400, 1, 1)
    with torch.no_grad():
        recording.power_percent.fill_(0.0)
        out = recording(steady)
    assert float(out[-1]) == pytest.approx(1.0, abs=1e-5)
    assert float(out[0]) == pytest.approx(1.0 - 0.035, abs=1e-6)
    lent = sum(share / 100 / (1 - math.exp(-1 / frames_)) for share, frames_ in zip((2.0, 1.0, 0.5), LAG_FRAMES,
                                                                                   strict=True))
    assert float(out.sum()) == pytest.approx(400 - lent, rel=1e-5)


def test_the_recording_leaves_frames_as_they_are_until_fitted_and_one_image_always():
    frames = torch.rand(6, 5, 5)
    recording = PanelRecording()
    assert recording(frames) is frames and recording.undo(frames) is frames
    with torch.no_grad():
        recording.lag_8_percent.fill_(3.0)
        recording.power_percent.fill_(2.0)
    assert torch.equal(recording(frames[:1]), frames[:1]) and torch.equal(recording.undo(frames[:1]), frames[:1])
    assert not torch.equal(recording(frames), frames)
    assert all(not parameter.requires_grad for parameter in recording.parameters()), "held in training"


def grid_sampled(frames: torch.Tensor, shift_mm: torch.Tensor, padding: str = "zeros") -> torch.Tensor:
    """The same move by ``torch.nn.functional.grid_sample`` (bilinear, ``padding`` beyond the frame)."""
    count, height, width = frames.shape
    theta = torch.zeros(count, 2, 3, dtype=frames.dtype)
    theta[:, 0, 0] = theta[:, 1, 1] = 1.0
    theta[:, 0, 2] = -2.0 * shift_mm[:, 0] / width
    theta[:, 1, 2] = 2.0 * shift_mm[:, 1] / height
    grid = torch.nn.functional.affine_grid(theta, [count, 1, height, width], align_corners=False)
    return torch.nn.functional.grid_sample(frames[:, None], grid, mode="bilinear", padding_mode=padding,
                                           align_corners=False)[:, 0]


@pytest.mark.parametrize("edge, padding", [(False, "zeros"), (True, "border")])
def test_a_move_is_grid_samples_over_the_whole_frame_and_so_is_its_gradient(edge, padding):
    rng = np.random.default_rng(5)
    frames = torch.from_numpy(rng.random((5, 40, 56)))
    shifts = torch.tensor([[0.0, 0.0], [1.3, -0.7], [-2.0, 3.0], [-7.25, 0.5], [70.0, -0.1]], dtype=torch.float64,
                          requires_grad=True)
    moved = shift_frames(frames, shifts, edge=edge)
    expected = grid_sampled(frames, shifts, padding)
    torch.testing.assert_close(moved, expected, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(moved[0], frames[0])
    beyond = moved[4].detach()  # moved 70 mm along x, beyond the frame
    if edge:  # every column the frame's first column (read 0.1 mm off along y)
        assert float((beyond - beyond[:, :1]).abs().max()) == 0.0 < float(beyond.min())
    else:
        assert float(beyond.abs().max()) == 0.0
    weights = torch.from_numpy(rng.random(frames.shape))
    gradient, = torch.autograd.grad((moved * weights).sum(), shifts)
    expected_gradient, = torch.autograd.grad((expected * weights).sum(), shifts)
    fractional = [1, 3]  # at a whole-pixel shift each takes the derivative of a different side
    torch.testing.assert_close(gradient[fractional], expected_gradient[fractional], rtol=1e-9, atol=1e-9)
    # not zero; continued edges take part of the move's derivative away (0.048 at least on these frames)
    assert float(gradient[fractional].abs().min()) > (0.01 if edge else 0.1)
