"""Commissioning (epid.evaluation.commission): the forward model's physics fitted to measured frames
recovers known parameters, calibrates the panel's units, and never leaves the given model changed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epid.core.errors import InputError
from epid.dicom.plan import read_plan, write_plan
from epid.evaluation import commission, timeline
from epid.models.families import build_models
from epid.synthesis.sequences import generate_control_points
from tests.evaluation.test_timeline import cine_ends, series_of

UNITS = 37.0


@pytest.fixture(scope="module")
def measurements(tmp_path_factory):
    """Cine frames of three arcs (24 frames each; the last held out of commissioning) from a model
    whose leaf-end offset is 0.6 mm, lag 4 %, tongue and groove 0.9 mm, whose beam rises 3 % at 100
    mm off the axis and whose output rises 3 % per e-fold of field area, and whose panel sags 0.8 mm
    x sin g along x and 0.6 mm x (1 - cos g) along y, in panel units (x 37)."""
    torch.manual_seed(0)
    truth = build_models("tiny", "aperture")[0].eval()
    with torch.no_grad():
        truth.aperture.leaf_end_offset.fill_(0.6)
        truth.aperture.tongue_groove_mm.fill_(0.9)
        truth.lag_percent.fill_(4.0)
        truth.beam.off_axis.copy_(torch.tensor([0.0, 0.0, 0.03, 0.0]))
        truth.beam.output_per_log_area.fill_(0.03)
        truth.sag_mm.copy_(torch.tensor([[0.8, 0.0], [0.0, 0.6]]))
    folder = tmp_path_factory.mktemp("commissioning")
    measured = []
    for dataset_id in (120, 300, 210):
        path = folder / f"arc_{dataset_id}.dcm"
        write_plan(path, generate_control_points(dataset_id, 10), label=f"arc {dataset_id}")
        (beam,) = read_plan(path)
        series = series_of(beam, cine_ends(beam, 25))
        placement = timeline.place_frames(beam, series)
        frames = timeline.predict_spans(truth, placement) * UNITS
        measured.append(commission.Measurement(beam, placement, frames))
    return truth, measured


def test_commissioning_recovers_the_physics_and_the_panels_units(measurements):
    truth, measured = measurements
    torch.manual_seed(0)
    start = build_models("tiny", "aperture")[0].eval()
    kept = {name: value.clone() for name, value in start.state_dict().items()}
    result = commission.commission(start, measured[:2], steps=300)
    parameters = result.summary["parameters"]
    assert parameters["aperture.leaf_end_offset"]["after"] == pytest.approx([0.6, 0.6], abs=0.1)
    assert parameters["aperture.tongue_groove_mm"]["after"] == pytest.approx(
        [0.9], abs=0.15)
    assert parameters["lag_percent"]["after"] == pytest.approx([4.0], abs=0.5)
    assert parameters["sag_mm"]["after"] == pytest.approx([0.8, 0.0, 0.0, 0.6], abs=0.1)
    assert parameters["beam.output_per_log_area"]["after"] == pytest.approx([0.03], abs=0.006)
    tilt_x, tilt_y, c_2, c_4 = parameters["beam.off_axis"]["after"]
    assert c_2 + c_4 == pytest.approx(0.03, abs=0.015), "the profile's rise at 100 mm"
    # the calibration holds on a plan commissioning did not see: its own least-squares scale agrees
    held_out = measured[2]
    predicted = timeline.predict_spans(result.model, held_out.placement)[held_out.placement.frame_of - 1]
    assert timeline.calibration_scale(held_out.frames, predicted) == pytest.approx(result.scale, rel=0.01)
    assert commission.plan_gamma(result.model, held_out, result.scale)["2_2mm"] > 99.0
    assert result.summary["loss_last"] < 0.3 * result.summary["loss_first"]
    for before, after in zip(result.summary["gamma_before"], result.summary["gamma_after"], strict=True):
        assert after["2_2mm"] >= before["2_2mm"] and after["2_2mm"] > 99.0
    for name, value in start.state_dict().items():
        torch.testing.assert_close(value, kept[name]), "the model given is left as it was"


def test_an_integrated_image_or_a_legacy_model_cannot_be_commissioned(measurements):
    _, measured = measurements
    measured = measured[:2]
    with pytest.raises(InputError, match="aperture-family"):
        commission.commission(build_models("tiny", "legacy")[0], measured, steps=1)
    with pytest.raises(InputError, match="at least one plan"):
        commission.commission(build_models("tiny", "aperture")[0], [], steps=1)
    beam = measured[0].beam
    whole = series_of(beam, np.array([float(np.sum(beam.control_points.mu))]), angles=np.array([np.nan]))
    with pytest.raises(InputError, match="one integrated image"):
        commission.Measurement.of(beam, whole)


def test_commissioning_that_lowers_the_gamma_keeps_the_physics_it_was_given(measurements, monkeypatch):
    _, measured = measurements
    # each frame's pass rates: before the fit (one call per plan), then after it, lower
    levels = iter([(99.0, 98.0)] * 2 + [(97.0, 90.0)] * 2)

    def rates(predicted, measurement, scale):
        three, two = next(levels)
        return {"3_2mm": np.full(len(measurement.frames), three), "2_2mm": np.full(len(measurement.frames), two)}

    monkeypatch.setattr(commission, "_frame_rates", rates)
    torch.manual_seed(0)
    start = build_models("tiny", "aperture")[0].eval()
    result = commission.commission(start, measured[:2], steps=5)
    assert "as it was" in result.summary["kept"] and "98.00 -> 90.00" in result.summary["kept"]
    for name, value in start.state_dict().items():
        torch.testing.assert_close(result.model.state_dict()[name], value)
    assert result.scale == pytest.approx(1 / UNITS, rel=0.2)
