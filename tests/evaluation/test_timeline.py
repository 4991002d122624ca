"""Measured frames placed on a plan's delivery and the plan integrated over their spans
(epid.evaluation.timeline): cine frames at 9.5 frames/s whose gantry angles fall between control
points, dropped frames, meterset weights, integrated images, calibration, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.ndimage
import torch

from epid.core.errors import InputError
from epid.dicom.plan import read_plan, write_plan
from epid.dicom.series import MeasuredSeries
from epid.evaluation import plan_qa, timeline
from epid.models.families import build_models, predict_frames
from epid.synthesis.sequences import generate_control_points

FRAME_RATE = 9.5


def arc_80(folder):
    """The 12 control points of arc 80 written as an RT Plan in ``folder`` and read back."""
    write_plan(folder / "arc.dcm", generate_control_points(80, 12), label="arc 80")
    (read,) = read_plan(folder / "arc.dcm")
    return read


@pytest.fixture(scope="module")
def beam(tmp_path_factory):
    return arc_80(tmp_path_factory.mktemp("plan"))


def reference_cumulative(beam) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(beam.control_points.mu[1:].astype(np.float64))])


def reference_angles(beam, mu: np.ndarray) -> np.ndarray:
    """Gantry angles at cumulative MU ``mu``, interpolated with numpy alone (the arc's angles
    unwrapped by hand)."""
    unwrapped = np.rad2deg(np.unwrap(np.deg2rad(beam.gantry_deg.astype(np.float64))))
    return np.interp(mu, reference_cumulative(beam), unwrapped) % 360.0


def series_of(beam, ends: np.ndarray, *, angles=None, weights=None, times=None) -> MeasuredSeries:
    count = len(ends)
    return MeasuredSeries(
        path="cine", frames=np.zeros((count, 256, 256), np.float32), sources=tuple(f"frame_{i}.dcm" for i in
                                                                                   range(count)),
        gantry_deg=reference_angles(beam, ends) if angles is None else angles,
        time_s=np.arange(count) / FRAME_RATE if times is None else times,
        meterset_weight=np.full((count, 2), np.nan) if weights is None else weights,
        meterset_exposure=np.full(count, np.nan), delivered_mu=np.full((count, 2), np.nan),
        control_point_index=np.zeros(count, np.int64),
        outside_percent=np.zeros(count), beam_number=beam.beam_number, sid_mm=1000.0, pixel_mm=1.0,
    )


def cine_ends(beam, count: int = 28) -> np.ndarray:
    return np.linspace(0.0, reference_cumulative(beam)[-1], count)[1:]


def direct_integral(model, beam, spans: np.ndarray, steps: int = 48, leaf_shift_mm: float = 0.0) -> torch.Tensor:
    """Each span [m0, m1] of the plan cut into ``steps`` equal parts, every part's positions
    interpolated per leaf with numpy (both banks shifted by ``leaf_shift_mm``), predicted by
    ``model`` and summed (no lag)."""
    cumulative = reference_cumulative(beam)
    cp = beam.control_points

    def at(name, mu):
        values = getattr(cp, name).astype(np.float64)
        if values.ndim == 1:
            return np.interp(mu, cumulative, values)
        return np.stack([np.interp(mu, cumulative, values[:, leaf]) for leaf in range(values.shape[1])], -1)

    frames = []
    for start, end in spans:
        cuts = np.linspace(start, end, steps + 1)
        before, after = cuts[:-1], cuts[1:]
        leaf_a = torch.tensor(np.concatenate([at("leaf_a", before), at("leaf_a", after)], 1) + leaf_shift_mm,
                              dtype=torch.float32)
        leaf_b = torch.tensor(np.concatenate([at("leaf_b", before), at("leaf_b", after)], 1) + leaf_shift_mm,
                              dtype=torch.float32)
        scalars = torch.tensor(np.stack([after - before, at("jaw_1", before), at("jaw_1", after), at("jaw_2", before),
                                         at("jaw_2", after)], 1), dtype=torch.float32)
        with torch.no_grad():
            predicted, _ = predict_frames(model, leaf_a, leaf_b, scalars, torch.zeros(steps, 1, 256, 256))
        frames.append(predicted[:, 0].sum(0))
    return torch.stack(frames)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    with torch.no_grad():
        forward.lag_percent.fill_(0.0)
    return forward


def test_cine_frames_between_control_points_are_placed_and_predicted_as_the_plans_integral(beam, model):
    ends = cine_ends(beam)
    placement = timeline.place_frames(beam, series_of(beam, ends))
    assert placement.placed_by == "gantry angles" and placement.dropped == 0
    assert placement.frame_of.tolist() == list(range(1, len(ends) + 1))
    np.testing.assert_allclose(placement.boundaries_mu[1:], ends, atol=1e-6)
    inside = [(np.abs(reference_cumulative(beam) - end) > 0.5).all() for end in ends]
    assert sum(inside) > 20, "most frames end between control points"
    predicted = timeline.predict_spans(model, placement)
    spans = np.stack([placement.boundaries_mu[:-1], placement.boundaries_mu[1:]], 1)
    expected = direct_integral(model, beam, spans)
    error = (predicted - expected).abs().amax((1, 2)) / expected.amax((1, 2))
    assert float(error.max()) < 0.01, error
    # the timeline's control points are the plan at the frames' ends: same gantry angles
    np.testing.assert_allclose(placement.beam.gantry_deg[1:], reference_angles(beam, ends), atol=1e-3)
    np.testing.assert_allclose(placement.beam.control_points.mu[1:], np.diff(placement.boundaries_mu), rtol=1e-6)


def test_rounded_gantry_angles_are_read_through_the_frames_times(beam):
    """120 frames at regular times whose angles are rounded to 0.1 deg (4 % of a frame's 2.4 deg): the
    line in time through each control-point interval's frames places their ends three times closer to
    the truth than the rounded angles themselves (numpy's interpolation of the arc)."""
    ends = cine_ends(beam, 121)
    angles = np.round(reference_angles(beam, ends), 1)
    placement = timeline.place_frames(beam, series_of(beam, ends, angles=angles))
    frame_mu = ends[1] - ends[0]
    unwrapped = np.rad2deg(np.unwrap(np.deg2rad(beam.gantry_deg.astype(np.float64))))
    by_angle = np.interp(np.rad2deg(np.unwrap(np.deg2rad(angles))), unwrapped, reference_cumulative(beam))
    placed_error = (placement.boundaries_mu[1:] - ends) / frame_mu
    angle_error = (by_angle - ends) / frame_mu
    assert placement.dropped == 0 and np.abs(angle_error).max() > 0.02
    assert np.sqrt(np.mean(placed_error**2)) < np.sqrt(np.mean(angle_error**2)) / 3
    assert np.abs(placed_error).max() < 0.02


def test_the_plans_own_intervals_predict_as_the_plans_frames(beam, model):
    placement = timeline.place_frames(beam, series_of(beam, reference_cumulative(beam)[1:]))
    np.testing.assert_allclose(placement.boundaries_mu[1:], reference_cumulative(beam)[1:], atol=1e-6)
    expected = direct_integral(model, beam, np.stack([placement.boundaries_mu[:-1], placement.boundaries_mu[1:]], 1))
    predicted = timeline.predict_spans(model, placement)
    # whole intervals move leaves up to 40 mm: the 0.5 mm snapshots leave up to 2 % at the moving edges
    assert float(((predicted - expected).abs().amax((1, 2)) / expected.amax((1, 2))).max()) < 0.02


def test_a_dropped_frame_leaves_a_gap_and_the_frame_after_it_integrates_its_own_period(beam):
    ends = cine_ends(beam)
    kept = np.delete(np.arange(len(ends)), 10)
    times = (np.arange(len(ends)) / FRAME_RATE)[kept]
    placement = timeline.place_frames(beam, series_of(beam, ends[kept], times=times))
    assert placement.dropped == 1 and placement.frame_of[10] - placement.frame_of[9] == 2
    after = placement.frame_of[10]
    start, end = placement.boundaries_mu[after - 1], placement.boundaries_mu[after]
    step = ends[11] - ends[10]
    assert end == pytest.approx(ends[11]) and abs(start - ends[10]) < 0.3 * step
    assert "1 dropped frame" in placement.describe()


def test_meterset_weights_place_frames_exactly_and_an_integrated_image_spans_the_beam(beam):
    total = reference_cumulative(beam)[-1]
    ends = cine_ends(beam, 8)
    starts = np.concatenate([[0.0], ends[:-1]])
    weights = np.stack([starts, ends], 1) * beam.final_meterset_weight / beam.beam_mu
    placement = timeline.place_frames(beam, series_of(beam, ends, angles=np.full(len(ends), np.nan), weights=weights))
    assert placement.placed_by == "meterset weights"
    np.testing.assert_allclose(placement.boundaries_mu, np.concatenate([[0.0], ends]), atol=1e-9)
    whole = series_of(beam, np.array([total]), angles=np.array([np.nan]))
    integrated = timeline.place_frames(beam, whole)
    assert "integrated" in integrated.placed_by and integrated.boundaries_mu.tolist() == pytest.approx([0.0, total])


def test_lag_is_carried_from_frame_to_frame_of_the_timeline(beam):
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    ends = cine_ends(beam, 6)
    placement = timeline.place_frames(beam, series_of(beam, ends))
    with torch.no_grad():
        forward.lag_percent.fill_(0.0)
        without = timeline.predict_spans(forward, placement)
        forward.lag_percent.fill_(5.0)
        lag = float(forward.lag_fraction)
        with_lag = timeline.predict_spans(forward, placement)
    # the model records (1 - lag) x the signal plus lag x the frame before
    expected = (1 - lag) * without
    for k in range(1, len(expected)):
        expected[k] += lag * expected[k - 1]
    torch.testing.assert_close(with_lag, expected, atol=1e-4, rtol=1e-4)


def test_the_timeline_is_recorded_as_the_models_panel_records_a_series(beam):
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    placement = timeline.place_frames(beam, series_of(beam, cine_ends(beam, 8)))
    with torch.no_grad():
        forward.lag_percent.fill_(3.0)
        lagged = timeline.predict_spans(forward, placement)
        forward.recording.lag_8_percent.fill_(2.0)
        forward.recording.power_percent.fill_(1.0)
        recorded = timeline.predict_spans(forward, placement)
        expected = forward.recording(lagged)
        summed = timeline.predict_spans(forward, placement, recorded=False)
        recorded_after = timeline.record(forward, summed.clone())
    assert not torch.equal(recorded, lagged)
    torch.testing.assert_close(recorded, expected, atol=1e-6, rtol=1e-6)
    # the sums before the recording, recorded afterwards (as commissioning's solve moves the
    # recording), are the frames predicted at once
    assert not torch.equal(summed, recorded)
    torch.testing.assert_close(recorded_after, recorded, atol=1e-6, rtol=1e-6)


def test_an_integrated_image_keeps_the_lag_share(beam):
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    whole = timeline.place_frames(beam, series_of(beam, np.array([reference_cumulative(beam)[-1]]),
                                                  angles=np.array([np.nan])))
    with torch.no_grad():
        forward.lag_percent.fill_(5.0)
        with_lag = timeline.predict_spans(forward, whole)
        forward.lag_percent.fill_(0.0)
        without = timeline.predict_spans(forward, whole)
        expected = direct_integral(forward, beam, whole.boundaries_mu[None])
    # the panel carries the lag from readout to readout within the image: the whole signal is in it
    torch.testing.assert_close(with_lag, without, atol=1e-4, rtol=1e-4)
    assert float(with_lag.sum()) == pytest.approx(float(expected.sum()), rel=2e-3)


def test_a_field_past_the_imagers_edge_keeps_its_signal_when_moved_back_by_the_sag():
    forward = build_models("tiny", "aperture")[0].eval()
    with torch.no_grad():
        forward.sag_mm.copy_(torch.tensor([[0.0, 0.0], [0.0, 0.45]]))
    # a band open from y = 104 mm to past the imager's top edge (row 0), seen at gantry 180 deg: the
    # panel sagged 0.9 mm towards +y, so the frame moves back 0.9 mm towards -y and what lay beyond its
    # top edge comes in: the band goes on past the edge (zeros would open a 0.9 mm gap at the top)
    band = torch.zeros(1, 256, 256)
    band[0, :24, 40:200] = 1.0
    back = timeline.with_sag(forward, band, np.array([180.0]), undo=True)
    torch.testing.assert_close(back[0, :24], band[0, :24])
    assert float(back.sum()) == pytest.approx(float(band.sum()) + 0.9 * 160, rel=1e-5)  # its far end moved


def test_the_panels_sag_moves_each_piece_and_the_measured_frames_back(beam):
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    placement = timeline.place_frames(beam, series_of(beam, cine_ends(beam, 150)))
    angles = timeline.frame_gantry(placement)
    np.testing.assert_allclose(angles, reference_angles(beam, placement.boundaries_mu[:-1] + np.diff(
        placement.boundaries_mu) / 2), atol=1e-3)
    with torch.no_grad():
        still = timeline.predict_spans(forward, placement)
        forward.sag_mm.copy_(torch.tensor([[1.5, 0.0], [0.0, 1.0]]))
        sagged = timeline.predict_spans(forward, placement)
        back = timeline.with_sag(forward, sagged, angles, undo=True)
    radians = np.deg2rad(angles)
    for k in (20, 70, 110):
        # each frame moved by the sag at its own angle (its pieces' angles within 2.4 deg of it)
        expected = scipy.ndimage.shift(still[k].numpy(), (-(1 - np.cos(radians[k])), 1.5 * np.sin(radians[k])),
                                       order=1, mode="constant")
        assert float(np.abs(sagged[k].numpy() - expected).max()) < 0.01 * float(still[k].max())
    def centroid(frames):  # (F, 2) [x, y] mm, row 0 the most positive y
        weights = frames / frames.sum((1, 2), keepdim=True)
        centres = torch.arange(256) - 127.5
        return torch.stack([(weights.sum(1) * centres).sum(1), (weights.sum(2) * -centres).sum(1)], 1)

    shift = np.stack([1.5 * np.sin(radians), 1 - np.cos(radians)], 1)
    np.testing.assert_allclose((centroid(sagged) - centroid(still)).numpy(), shift, atol=0.05)
    np.testing.assert_allclose((centroid(back) - centroid(still)).numpy(), 0.0, atol=0.05)


def test_calibration_scale_recovers_the_units_factor(beam, model):
    placement = timeline.place_frames(beam, series_of(beam, cine_ends(beam, 6)))
    predicted = timeline.predict_spans(model, placement)
    measured = predicted * 37.0
    assert timeline.calibration_scale(measured, predicted) == pytest.approx(1 / 37.0, rel=1e-5)
    calibration = plan_qa.calibrate("auto", placement, measured, predicted)
    assert calibration["scale"] == pytest.approx(1 / 37.0, rel=1e-5) and "global MU error" in calibration["method"]
    with pytest.raises(InputError, match="no signal"):
        timeline.calibration_scale(torch.zeros_like(predicted), predicted)


@pytest.mark.parametrize("case", ["outside", "no angle", "backwards", "other beam"])
def test_frames_that_cannot_be_placed_are_refused_in_one_line(beam, case):
    ends = cine_ends(beam, 10)
    angles = reference_angles(beam, ends)
    if case == "outside":
        # the arc turns from 181 deg through 0 to 179 deg: the 2 deg it leaves out lie outside it
        angles[-3:] = 180.0, 180.2, 179.8
        series, expected = series_of(beam, ends, angles=angles), "3 of 9 frames at gantry angles outside the arc"
    elif case == "no angle":
        angles[4] = np.nan
        series, expected = series_of(beam, ends, angles=angles), "frame_4.dcm: a cine frame without a gantry angle"
    elif case == "backwards":
        angles[5], angles[6] = angles[6], angles[5]
        series, expected = series_of(beam, ends, angles=angles), "frame_6.dcm: gantry angle"
    else:
        series = series_of(beam, ends)
        series = MeasuredSeries(**{**series.__dict__, "beam_number": 7})
        expected = "images of beam 7"
    with pytest.raises(InputError) as error:
        timeline.place_frames(beam, series)
    message = str(error.value)
    assert "\n" not in message and expected in message, message


def test_a_calibration_image_of_an_open_field_gives_the_panels_scale(model):
    field = timeline.open_field(100.0, 80.0, 100.0)
    assert field.leaf_a[0, 26] == -50.0 and field.leaf_b[0, 26] == 50.0
    assert field.leaf_a[0, 0] == 0.0 == field.leaf_b[0, 0]
    assert field.jaw_1.tolist() == [-40.0, -40.0] and field.mu.tolist() == [0.0, 100.0]
    predicted = plan_qa.predict_plan_frames(model, field)
    # the open field's prediction: flat inside, its edges where the field's are
    assert float(predicted[0, 128, 128]) > 0.9 * float(predicted.max())
    assert float(predicted[0, 128, 60]) < 0.05 * float(predicted.max())
    image = series_of_image(predicted[0].numpy() * 37.0)
    calibration = plan_qa.calibration_image(model, image, 100.0, 80.0, 100.0)
    assert calibration["scale"] == pytest.approx(1 / 37.0, rel=1e-5) and "100 x 80 mm, 100 MU" in calibration["method"]
    with pytest.raises(InputError, match="a calibration image is one image"):
        two = MeasuredSeries(**{**image.__dict__, "frames": np.concatenate([image.frames, image.frames])})
        plan_qa.calibration_image(model, two, 100.0, 80.0, 100.0)


def series_of_image(frame: np.ndarray) -> MeasuredSeries:
    return MeasuredSeries(
        path="calibration.dcm", frames=frame[None].astype(np.float32), sources=("calibration.dcm",),
        gantry_deg=np.array([np.nan]), time_s=np.array([0.0]), meterset_weight=np.full((1, 2), np.nan),
        meterset_exposure=np.array([np.nan]), delivered_mu=np.full((1, 2), np.nan),
        control_point_index=np.zeros(1, np.int64), outside_percent=np.zeros(1),
        beam_number=None, sid_mm=1000.0, pixel_mm=1.0)


def test_frames_carrying_their_mu_are_laid_end_to_end_even_where_the_gantry_waits(beam):
    ends = cine_ends(beam, 12)
    exposure = np.diff(np.concatenate([[0.0], ends])) * 1.03  # a delivery 3 % over: the spans still cover the beam
    series = series_of(beam, ends, angles=np.full(len(ends), np.nan))
    series = MeasuredSeries(**{**series.__dict__, "meterset_exposure": exposure})
    placement = timeline.place_frames(beam, series)
    assert placement.placed_by.startswith("delivered MU")
    np.testing.assert_allclose(placement.boundaries_mu, np.concatenate([[0.0], ends]), atol=1e-9)
    short = MeasuredSeries(**{**series.__dict__, "meterset_exposure": exposure[:6]})
    short = MeasuredSeries(**{**short.__dict__, **{name: getattr(short, name)[:6] for name in (
        "frames", "gantry_deg", "time_s", "meterset_weight", "delivered_mu", "control_point_index",
        "outside_percent")},
        "sources": short.sources[:6]})
    with pytest.raises(InputError, match="MetersetExposure sum to .* no gantry angle"):
        timeline.place_frames(beam, short)
    # with their gantry angles, frames whose MU do not cover the beam (dropped ones) are placed by angle
    angled = MeasuredSeries(**{**short.__dict__, "gantry_deg": reference_angles(beam, ends[:6])})
    assert timeline.place_frames(beam, angled).placed_by == "gantry angles"
