"""Measured frames placed on a plan's delivery, and the plan integrated over exactly their spans.

A beam's delivery is laid out along its cumulative MU m in [0, M] (M the beam's MU): within
control-point interval k (cumulative MU c[k-1] -> c[k]) the linac moves the leaves, jaws and
gantry linearly with the delivered MU, as it interpolates a VMAT plan. A measured frame
integrates one span [m0, m1] of it, placed (``place_frames``) by, in this order:

- the control point it names (frame k: [c[k-1], c[k]]), the project's own frames;
- its ``StartCumulativeMetersetWeight`` / ``EndCumulativeMetersetWeight`` (w x M / the final weight);
- an integrated image without either: the whole beam [0, M];
- the linac's MU counter at its start and end (Varian XIM cine frames, ``epid.dicom.xim``):
  the span as counted, exact; a gap between one frame's end and the next one's start holds
  dropped frames;
- the MU each frame delivered (``MetersetExposure``, where every frame has it and they sum to the
  beam's MU within 10 %, or the frames have no gantry angle): the frames laid end to end from the
  beam's start, their sum taken as the beam's M (this holds when the gantry waits);
- its gantry angle, a cine frame: the angle, read along the arc's direction of rotation, gives
  the travel from the arc's first angle and so the MU at the frame's end (gantry travel is
  linear in MU within each interval); where every frame has a time, the travels are read through
  the times (``travel_in_time``: within an interval the gantry turns at one speed, and the line in
  time through its frames averages the angles' rounding: on ``bench_error_detection``'s panel,
  angles written to 0.01 deg, the frames' MU came 0.3-0.5 % rms from the delivered, against 1.0-1.2 %
  from the angles alone); the frame starts where the frame before it ended. A gap of more than
  ``GAP_FACTOR`` typical frame steps (in time where every frame has one, else in gantry travel)
  holds dropped frames, as many as the typical steps it spans less one: the frame after it
  integrates its share of the gap's gantry travel (the gantry taken to turn evenly over the gap).
  The first frame starts the next frame's step before its end, at the arc's start at the earliest.

The spans' ends form a timeline: control points 0..J at cumulative MU b[0] < ... < b[J], the
plan's positions interpolated there (``Placement.beam``, a ``PlanBeam`` whose frame j integrates
b[j-1] -> b[j]), each measured frame one of its frames; a frame of the timeline without a
measured frame is a dropped one. Leaves reconstructed at the timeline's control points are
compared with the plan interpolated at the same MU (and so at the same gantry angle).

``predict_spans`` predicts every frame of the timeline with a forward model exactly: a frame
that holds one or more of the plan's control points is the sum of its pieces between them
(each piece moves linearly), so the prediction is the plan's integral over the frame's span
whatever the span. The model's lag (``takes_prev_frame``) is carried from piece to piece,
the share it learned per training frame (one control-point interval).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from epid.core.errors import InputError
from epid.dicom.image import FIELD_LEVEL
from epid.dicom.plan import PlanBeam
from epid.dicom.series import MeasuredSeries
from epid.models.families import predict_frames
from epid.models.panel import shift_frames
from epid.synthesis.geometry import FRAME_SHAPE, STRIPS, SUB_APERTURES, StripGrid
from epid.synthesis.sequences import ControlPoints, leaf_weights, mlc_leaf_weights

GAP_FACTOR = 1.6
"""A step between consecutive frames above this many typical steps is a dropped frame."""
ARC_TOLERANCE_DEG = 0.5
"""How far past the arc's first or last angle a frame's gantry angle may read (angle readout
jitter); beyond it the frame is outside the arc and refused."""
SPAN_TOLERANCE_MU = 1e-6
LINE_FRAMES = 3
"""Frames that end in one control-point interval for their gantry travel to be read through their times."""
MU_SUM_RANGE = (0.9, 1.1)
"""Frames placed by their delivered MU must sum to this share of the beam's MU."""
SNAPSHOT_STEP_MM = 0.5
"""Farthest a leaf or jaw may move between two of the forward model's sub-apertures within one
predicted piece (``pieces``), mm: a frame whose leaves move farther is predicted in parts, so that
its prediction follows the continuous motion the detector integrates."""

Progress = Callable[[int], None]
"""Called with the number of items (frames or pieces) a step finished."""


@dataclass(frozen=True)
class Placement:
    """Measured frames on a beam's timeline (module docstring).

    beam: the plan at the timeline's control points 0..J (J frames). frame_of: (F,) the timeline
    frame j (>= 1) each measured frame integrates, increasing. boundaries_mu: (J + 1,) cumulative
    MU of the timeline's control points. placed_by: how the frames were placed. dropped: frames of
    the timeline that no measured frame covers.
    """

    plan: PlanBeam
    beam: PlanBeam
    frame_of: np.ndarray
    boundaries_mu: np.ndarray
    placed_by: str
    dropped: int

    @property
    def by_control_points(self) -> bool:
        """The frames name their control points (the project's own frames), not a cine series or image."""
        return self.placed_by == "control points"

    @property
    def whole_beam(self) -> bool:
        """One frame over the whole beam (an integrated image of all its MU)."""
        total = float(cumulative_mu(self.plan)[-1])
        return len(self.boundaries_mu) == 2 and self.boundaries_mu[0] <= SPAN_TOLERANCE_MU * total and \
            self.boundaries_mu[-1] >= total * (1 - SPAN_TOLERANCE_MU)

    def describe(self) -> str:
        """One line: how many frames were placed by what, and the dropped ones."""
        frames = len(self.frame_of)
        text = f"{frames} measured frame{'s' if frames != 1 else ''} placed by {self.placed_by}"
        if not self.by_control_points:
            text += (f" on MU {self.boundaries_mu[0]:.4g}-{self.boundaries_mu[-1]:.4g} of {self.plan.beam_mu:g} "
                     f"(gantry {self.beam.gantry_deg[0]:.1f} -> {self.beam.gantry_deg[-1]:.1f} deg)")
        return text + (f"; {self.dropped} dropped frame(s) between them" if self.dropped else "")


def cumulative_mu(beam: PlanBeam) -> np.ndarray:
    """(N,) cumulative MU at each control point of ``beam`` (0 at control point 0)."""
    return np.cumsum(beam.control_points.mu.astype(np.float64))


def place_frames(beam: PlanBeam, series: MeasuredSeries) -> Placement:
    """The ``Placement`` of ``series`` on ``beam`` (module docstring). InputError, one line
    naming the images and the plan, for frames that cannot be placed: a cine frame without a
    gantry angle, angles outside the arc or running backwards, a span outside the beam (frames
    naming control points are checked against the beam by ``plan_qa.match_frames``)."""
    where = f"{series.path}"
    plan = f"beam {beam.beam_number} of {beam.path}"
    if series.beam_number is not None and series.beam_number != beam.beam_number:
        raise InputError(f"{where}: images of beam {series.beam_number}, compared with {plan}")
    cumulative = cumulative_mu(beam)
    total = float(cumulative[-1])
    if series.control_point_index.all():
        points = series.control_point_index.astype(np.int64)
        dropped = max(0, int(points.max() - points.min() + 1 - len(points)))
        return Placement(beam, beam, points, cumulative, "control points", dropped)
    weights = series.meterset_weight
    if np.isfinite(weights).all():
        spans = weights * (beam.beam_mu / beam.final_meterset_weight)
        placed_by = "meterset weights"
    elif series.integrated:
        spans = np.array([[0.0, total]])
        placed_by = "the whole beam (one integrated image)"
    elif np.isfinite(series.delivered_mu).all():
        spans = series.delivered_mu.astype(np.float64)
        placed_by = "the linac's MU counter (XIM MVDoseStart / MVDoseStop / MVDoseDelivered)"
    elif np.isfinite(series.meterset_exposure).all() and (
            _covers_beam(series, total) or not np.isfinite(series.gantry_deg).all()):
        spans = _spans_from_exposures(series, total, where, plan)
        placed_by = "delivered MU (MetersetExposure)"
    else:
        spans = _spans_from_angles(beam, series, cumulative, where, plan)
        placed_by = "gantry angles"
    outside = (spans[:, 0] < -SPAN_TOLERANCE_MU * total) | (spans[:, 1] > total * (1 + SPAN_TOLERANCE_MU)) | \
        (spans[:, 1] <= spans[:, 0])
    if outside.any():
        first = int(np.argmax(outside))
        raise InputError(f"{series.sources[first]}: {int(outside.sum())} frame(s) span MU outside 0..{total:.4g} of "
                         f"{plan} or nothing (first: {spans[first, 0]:.4g}-{spans[first, 1]:.4g} MU)")
    boundaries, frame_of, dropped = _timeline(np.clip(spans, 0.0, total), where)
    return Placement(beam, resample(beam, boundaries), frame_of, boundaries, placed_by, dropped)


def arc_travel(gantry_deg: np.ndarray) -> tuple[np.ndarray, float]:
    """Gantry travel (N,) from the first angle along the arc's direction of rotation, degrees, and
    the direction: +1 where the angles rise (clockwise in IEC 61217), -1 where they fall."""
    steps = (np.diff(gantry_deg.astype(np.float64)) + 180.0) % 360.0 - 180.0
    direction = 1.0 if steps.sum() >= 0 else -1.0
    return np.concatenate([[0.0], np.cumsum(steps * direction)]), direction


def _spans_from_angles(beam: PlanBeam, series: MeasuredSeries, cumulative: np.ndarray, where: str,
                       plan: str) -> np.ndarray:
    """(F, 2) MU spans of cine frames from their gantry angles (module docstring)."""
    angles = series.gantry_deg
    if not np.isfinite(angles).all():
        first = int(np.argmax(~np.isfinite(angles)))
        raise InputError(f"{series.sources[first]}: a cine frame without a gantry angle (GantryAngle of the image "
                         "or of its ExposureSequence item); frames are placed on the arc by it")
    travel, direction = arc_travel(beam.gantry_deg)
    if np.any(np.diff(travel) < 0):
        raise InputError(f"{plan}: the gantry turns back within the arc; cine frames are placed by gantry angle "
                         "only on arcs that turn one way")
    moving = np.diff(cumulative) > 0
    still = moving & (np.diff(travel) <= 0)
    if still.any():
        point = int(np.argmax(still)) + 1
        raise InputError(f"{plan}: the gantry stands at {beam.gantry_deg[point]:g} deg while control point "
                         f"{point} delivers MU; cine frames need meterset weights to be placed there")
    arc = float(travel[-1])
    frame_travel = ((angles - float(beam.gantry_deg[0])) * direction) % 360.0
    frame_travel = np.where(frame_travel > (360.0 + arc) / 2, frame_travel - 360.0, frame_travel)
    outside = (frame_travel < -ARC_TOLERANCE_DEG) | (frame_travel > arc + ARC_TOLERANCE_DEG)
    if outside.any():
        first = int(np.argmax(outside))
        raise InputError(f"{where}: {int(outside.sum())} of {len(angles)} frames at gantry angles outside the arc "
                         f"{beam.gantry_deg[0]:g} -> {beam.gantry_deg[-1]:g} deg of {plan} (first: "
                         f"{series.sources[first]} at {angles[first]:g} deg)")
    frame_travel = np.clip(frame_travel, 0.0, arc)
    backwards = np.diff(frame_travel) < -ARC_TOLERANCE_DEG
    if backwards.any():
        index = int(np.argmax(backwards)) + 1
        raise InputError(f"{series.sources[index]}: gantry angle {angles[index]:g} deg after {angles[index - 1]:g} "
                         f"deg: the frames run against the arc's rotation (they are ordered by time, else by "
                         "InstanceNumber)")
    frame_travel = np.maximum.accumulate(frame_travel)
    times = series.time_s
    timed = bool(np.isfinite(times).all() and len(times) > 1 and (np.diff(times) > 0).any())
    if timed:
        frame_travel = travel_in_time(frame_travel, times, travel)
    steps = np.diff(frame_travel)
    typical = float(np.median(steps[steps > 0])) if (steps > 0).any() else arc
    if timed:
        periods = np.diff(times)
        ratio = periods / float(np.median(periods[periods > 0]))
    else:
        ratio = steps / typical
    gaps = ratio > GAP_FACTOR
    missing = np.where(gaps, np.maximum(1, np.rint(ratio) - 1), 0)
    first_step = float(steps[0]) if len(steps) and steps[0] > 0 else typical
    starts = np.concatenate([[frame_travel[0] - first_step], frame_travel[:-1]])
    starts[1:] = np.where(gaps, frame_travel[1:] - steps / (missing + 1), starts[1:])
    ends_mu = np.interp(frame_travel, travel, cumulative)
    starts_mu = np.interp(np.maximum(starts, 0.0), travel, cumulative)
    return np.stack([starts_mu, ends_mu], axis=1)


def travel_in_time(frame_travel: np.ndarray, times: np.ndarray, travel: np.ndarray) -> np.ndarray:
    """The frames' gantry travel (F,) deg read again through their times (F,) s: within one control-point
    interval (``travel`` (N,) at the control points) the gantry turns at one speed, so the travels of
    the frames that end in it lie on one line in time; where at least ``LINE_FRAMES`` frames do, each
    takes the least-squares line's value (kept within the interval). The angle read out with each
    frame is rounded (0.01 deg: 2 % of a 0.5 deg frame) and jitters; the frames' times are regular,
    and the line averages the readings of the interval's frames."""
    interval = np.clip(np.searchsorted(travel, frame_travel, side="right"), 1, len(travel) - 1)
    read = frame_travel.copy()
    for k in np.unique(interval):
        members = interval == k
        if members.sum() >= LINE_FRAMES and np.ptp(times[members]) > 0:
            slope, intercept = np.polyfit(times[members], frame_travel[members], 1)
            read[members] = np.clip(intercept + slope * times[members], travel[k - 1], travel[k])
    return np.maximum.accumulate(read)


def _covers_beam(series: MeasuredSeries, total: float) -> bool:
    """Whether the frames' delivered MU sum to the beam's (within ``MU_SUM_RANGE``): no frame dropped."""
    delivered = float(series.meterset_exposure.sum())
    return bool(np.all(series.meterset_exposure >= 0)) and MU_SUM_RANGE[0] * total <= delivered <= \
        MU_SUM_RANGE[1] * total


def _spans_from_exposures(series: MeasuredSeries, total: float, where: str, plan: str) -> np.ndarray:
    """(F, 2) MU spans of frames that carry the MU each delivered: laid end to end from the beam's
    start, their sum taken as the beam (a delivery's MU error stays in the frames' signal)."""
    exposure = series.meterset_exposure.astype(np.float64)
    delivered = float(exposure.sum())
    if not _covers_beam(series, total):
        raise InputError(f"{where}: the frames' MetersetExposure sum to {delivered:.4g} MU, {plan} delivers "
                         f"{total:.4g} MU, and the frames carry no gantry angle to be placed by instead")
    ends = np.cumsum(exposure) * (total / delivered)
    return np.stack([ends - exposure * (total / delivered), ends], axis=1)


def _timeline(spans: np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """(boundaries (J + 1,), the timeline frame of each span (F,), dropped frames) of spans in
    delivery order; a span starts no earlier than the one before it ends."""
    boundaries = [float(spans[0, 0])]
    frame_of = []
    dropped = 0
    for start, end in spans:
        start = max(float(start), boundaries[-1])
        if start > boundaries[-1] + SPAN_TOLERANCE_MU:
            boundaries.append(start)
            dropped += 1
        if end > boundaries[-1] + SPAN_TOLERANCE_MU:
            boundaries.append(float(end))
        frame_of.append(len(boundaries) - 1)
    frame_of_array = np.asarray(frame_of, dtype=np.int64)
    if np.any(np.diff(frame_of_array) == 0) or frame_of_array[0] == 0:
        raise InputError(f"{where}: two measured frames integrate the same span of the delivery (or a frame "
                         "integrates none)")
    return np.asarray(boundaries), frame_of_array, dropped


def _interval_of(cumulative: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """The plan's control-point interval k (1..N-1) holding each MU ``mu`` (its positions move there)."""
    return np.clip(np.searchsorted(cumulative, mu, side="left"), 1, len(cumulative) - 1)


def positions_at(beam: PlanBeam, mu: np.ndarray, interval: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The plan's positions and gantry angle at cumulative MU ``mu`` (M,), each interpolated within
    control-point interval ``interval`` (M,) (default: the interval holding it): leaf_a, leaf_b
    (M, 52), jaw_1, jaw_2, gantry_deg (M,), and x_jaws (M, 2) for a beam with X jaws, float64."""
    cumulative = cumulative_mu(beam)
    interval = _interval_of(cumulative, mu) if interval is None else interval
    low, high = cumulative[interval - 1], cumulative[interval]
    share = np.divide(mu - low, high - low, out=np.ones_like(mu, dtype=np.float64), where=high > low)
    share = np.clip(share, 0.0, 1.0)
    cp = beam.control_points
    travel, direction = arc_travel(beam.gantry_deg)
    values = {}
    arrays = {name: getattr(cp, name) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2")}
    if beam.x_jaws is not None:
        arrays["x_jaws"] = beam.x_jaws
    for name, array in arrays.items():
        array = array.astype(np.float64)
        weight = share[:, None] if array.ndim == 2 else share
        values[name] = (1 - weight) * array[interval - 1] + weight * array[interval]
    gantry_travel = (1 - share) * travel[interval - 1] + share * travel[interval]
    values["gantry_deg"] = (float(beam.gantry_deg[0]) + direction * gantry_travel) % 360.0
    return values


def resample(beam: PlanBeam, boundaries: np.ndarray) -> PlanBeam:
    """``beam`` at control points of cumulative MU ``boundaries`` (J + 1,): positions interpolated
    as the linac moves them, mu[j] = boundaries[j] - boundaries[j - 1] (mu[0] = 0)."""
    values = positions_at(beam, boundaries)
    mu = np.concatenate([[0.0], np.diff(boundaries)])

    def frozen(array: np.ndarray) -> np.ndarray:
        array = np.ascontiguousarray(array, dtype=np.float32)
        array.flags.writeable = False
        return array

    jaw_1, jaw_2 = frozen(values["jaw_1"]), frozen(values["jaw_2"])
    control_points = ControlPoints(
        leaf_a=frozen(values["leaf_a"]), leaf_b=frozen(values["leaf_b"]), jaw_1=jaw_1, jaw_2=jaw_2, mu=frozen(mu),
        leaf_weight=frozen(mlc_leaf_weights(jaw_1, jaw_2, beam.control_points.mlc)),
        dataset_id=beam.control_points.dataset_id, pattern="plan",
        mlc=beam.control_points.mlc, x_jaws=frozen(values["x_jaws"]) if "x_jaws" in values else None,
    )
    return replace(beam, gantry_deg=frozen(values["gantry_deg"]), control_points=control_points,
                   beam_mu=float(boundaries[-1] - boundaries[0]))


def pieces(plan: PlanBeam, boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of the timeline ``boundaries`` (J + 1,) cut at the plan's control points, each
    cut again into equal parts until no leaf or jaw moves more than ``SNAPSHOT_STEP_MM`` between
    the forward model's sub-apertures: (start MU (P,), end MU (P,), the timeline frame j >= 1 of
    each (P,)), in delivery order."""
    cumulative = cumulative_mu(plan)
    inside = cumulative[(cumulative > boundaries[0] + SPAN_TOLERANCE_MU) &
                        (cumulative < boundaries[-1] - SPAN_TOLERANCE_MU)]
    cuts = np.unique(np.concatenate([boundaries, inside]))
    cuts = cuts[np.concatenate([[True], np.diff(cuts) > SPAN_TOLERANCE_MU])]
    start, end = cuts[:-1], cuts[1:]
    interval = _interval_of(cumulative, (start + end) / 2)
    before, after = positions_at(plan, start, interval), positions_at(plan, end, interval)
    travel = np.max([np.abs(after[name] - before[name]).reshape(len(start), -1).max(axis=1)
                     for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2")], axis=0)
    parts = np.maximum(1, np.ceil(travel / ((SUB_APERTURES - 1) * SNAPSHOT_STEP_MM))).astype(np.int64)
    piece = np.repeat(np.arange(len(start)), parts)
    share = (np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts)) / parts[piece]
    width = (end - start)[piece] / parts[piece]
    piece_start = start[piece] + share * (end - start)[piece]
    frame = np.searchsorted(boundaries, piece_start + width / 2, side="left")
    return piece_start, piece_start + width, frame


def x_jaw_columns(before: np.ndarray, after: np.ndarray) -> list[np.ndarray]:
    """The columns a beam with X jaws appends to the forward model's scalars
    (``epid.models.aperture.X_JAW_SCALARS``) for motions from X jaws ``before`` to ``after`` (P, 2)
    [X1, X2] mm: [X1 before, X1 after, X2 before, X2 after]."""
    return [before[:, 0], after[:, 0], before[:, 1], after[:, 1]]


def piece_inputs(plan: PlanBeam, start: np.ndarray, end: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """Forward-model inputs of pieces [start, end] (P,) of cumulative MU, each inside one of the
    plan's control-point intervals: leaf_a, leaf_b (P, 104) [at start 52, at end 52] mm and scalars
    (P, 5) [MU, jaw_1 at start, at end, jaw_2 at start, at end], float32; for a beam with X jaws
    (P, 9), [X1 at start, at end, X2 at start, at end] appended (``epid.models.families.predict_frames``)."""
    interval = _interval_of(cumulative_mu(plan), (start + end) / 2)
    before, after = positions_at(plan, start, interval), positions_at(plan, end, interval)

    def pair(name: str) -> Tensor:
        return torch.from_numpy(np.concatenate([before[name], after[name]], axis=1).astype(np.float32))

    columns = [end - start, before["jaw_1"], after["jaw_1"], before["jaw_2"], after["jaw_2"]]
    if "x_jaws" in before:
        columns += x_jaw_columns(before["x_jaws"], after["x_jaws"])
    return pair("leaf_a"), pair("leaf_b"), torch.from_numpy(np.stack(columns, axis=1).astype(np.float32))


def piece_gantry(plan: PlanBeam, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The gantry angle (P,) deg at the middle of each piece [start, end] (P,) of cumulative MU."""
    middle = (start + end) / 2
    return positions_at(plan, middle, _interval_of(cumulative_mu(plan), middle))["gantry_deg"]


def with_sag(forward_model: nn.Module, frames: Tensor, gantry_deg: np.ndarray | None, undo: bool = False) -> Tensor:
    """Predicted ``frames`` (P, 256, 256) of pieces at gantry angles ``gantry_deg`` (P,) moved by the
    forward model's panel sag (``epid.models.panel``), or with ``undo`` measured frames moved back
    onto the model's geometry; unchanged where the model has no sag (or no angles are given).

    What enters from beyond the frame continues its edge: a field that reaches past the imager goes
    on past it, where zeros would take a strip of it away. Moved back with zeros, the frames of
    ``bench_error_detection``'s held-out arc 86 (a field band at the imager's top edge for a quarter
    of the arc, a sag of up to 0.9 mm along y) lost that strip: its reconstructed jaw_2 stood 1 mm
    inside the plan's, and its error-free delivery read its total MU 1.8 % high."""
    sag = getattr(forward_model, "sag_mm", None)
    if gantry_deg is None or sag is None or not (sag.requires_grad or bool(sag.any())):
        return frames
    shift = forward_model.panel_shift(torch.from_numpy(np.asarray(gantry_deg))).to(frames.device)
    return shift_frames(frames, -shift if undo else shift, edge=True)


def frame_gantry(placement: Placement) -> np.ndarray:
    """The gantry angle (F,) deg at the middle of each measured frame's span."""
    boundaries = placement.boundaries_mu
    return piece_gantry(placement.plan, boundaries[placement.frame_of - 1], boundaries[placement.frame_of])


def predict_intervals(forward_model: nn.Module, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor,
                      device: torch.device | str = "cpu", batch_size: int = 64, progress: Progress | None = None,
                      frame_of: np.ndarray | None = None, frames: int | None = None,
                      gantry_deg: np.ndarray | None = None, recorded: bool = True) -> Tensor:
    """Frames of consecutive intervals of a delivery (inputs as ``piece_inputs`` gives them, P
    intervals) predicted by ``forward_model`` (on ``device``, switched to eval mode) ``batch_size``
    at a time, summed into ``frames`` frames (frames, 256, 256) float32 on the CPU: interval i
    into frame ``frame_of[i] - 1`` (default: one frame per interval), each moved by the panel's sag
    at its gantry angle ``gantry_deg[i]`` where given (``with_sag``), then recorded (``record``);
    with ``recorded`` False the sums before it."""
    count = len(scalars)
    frame_of = np.arange(1, count + 1) if frame_of is None else frame_of
    output = torch.zeros((count if frames is None else frames, *FRAME_SHAPE))
    forward_model.eval()
    with torch.inference_mode():
        for start in range(0, count, batch_size):
            stop = min(start + batch_size, count)
            dark = torch.zeros((stop - start, 1, *FRAME_SHAPE), device=device)
            epid, _ = predict_frames(forward_model, leaf_a[start:stop].to(device), leaf_b[start:stop].to(device),
                                     scalars[start:stop].to(device), dark)
            epid = with_sag(forward_model, epid[:, 0], None if gantry_deg is None else gantry_deg[start:stop])
            output.index_add_(0, torch.from_numpy(frame_of[start:stop] - 1), epid.float().cpu())
            if progress is not None:
                progress(stop - start)
    return record(forward_model, output) if recorded else output


def record(forward_model: nn.Module, frames: Tensor) -> Tensor:
    """A series of predicted frames (K, 256, 256), each the sum of its pieces' predictions after no
    frame, as the model's panel records it: a model that learned the detector's lag
    (``takes_prev_frame``) is linear in the recorded frame before, so each frame gains the lag times
    the frame before as recorded (dark before the first); the series then passes through the
    model's ``PanelRecording`` (``epid.models.panel``: the commissioned slower lag and non-linear
    response; the frames as they are until commissioned). The lag is added to ``frames`` in place."""
    with torch.no_grad():
        if getattr(forward_model, "takes_prev_frame", False):
            lag = float(forward_model.lag_fraction)
            for k in range(1, len(frames)):
                frames[k].add_(frames[k - 1], alpha=lag)
        return forward_model.recording(frames) if hasattr(forward_model, "recording") else frames


def predict_spans(forward_model: nn.Module, placement: Placement, device: torch.device | str = "cpu",
                  batch_size: int = 64, progress: Progress | None = None, recorded: bool = True) -> Tensor:
    """Every frame of ``placement``'s timeline (J, 256, 256) float32 on the CPU: the sum of the
    forward model's predictions of its pieces (``pieces``, ``predict_intervals``), each moved by the
    panel's sag at its gantry angle, recorded as the panel records a series (``record``; with
    ``recorded`` False, as before it); ``progress`` counts pieces. One image over the whole span (an
    integrated image) keeps the lag's share: the panel carries it from readout to readout within
    the image, where a cine frame passes it on to the next frame."""
    start, end, frame = pieces(placement.plan, placement.boundaries_mu)
    leaf_a, leaf_b, scalars = piece_inputs(placement.plan, start, end)
    predicted = predict_intervals(forward_model, leaf_a, leaf_b, scalars, device, batch_size, progress,
                                  frame_of=frame, frames=len(placement.boundaries_mu) - 1,
                                  gantry_deg=piece_gantry(placement.plan, start, end), recorded=recorded)
    if recorded and len(predicted) == 1 and getattr(forward_model, "takes_prev_frame", False):
        predicted /= 1.0 - float(forward_model.lag_fraction.detach())
    return predicted


def calibration_scale(measured: Tensor, predicted: Tensor, level: float = FIELD_LEVEL) -> float:
    """The one factor s that brings ``measured`` frames closest to ``predicted`` ones (K, 256, 256) in
    least squares over the field (pixels where the prediction reaches ``level`` of its maximum):
    s = sum(m p) / sum(m m). It absorbs any global MU error of the delivery."""
    field = predicted >= level * float(predicted.max())
    m, p = measured[field].double(), predicted[field].double()
    denominator = float((m * m).sum())
    if denominator <= 0 or not math.isfinite(denominator):
        raise InputError("the measured frames hold no signal where the prediction has its field; no calibration "
                         "scale can be fitted")
    return float((m * p).sum()) / denominator


def open_field(width_mm: float, length_mm: float, mu: float, grid: StripGrid = STRIPS) -> ControlPoints:
    """A static open field centred on the beam axis, ``width_mm`` along the leaves' travel by
    ``length_mm`` across them (jaws at +-length / 2; the strips of ``grid`` whose rows lie inside
    open +-width / 2, the others closed at the axis), ``mu`` delivered from control point 0 to 1:
    the reference field of a calibration image."""
    inside = np.abs(grid.centres_mm) < length_mm / 2
    leaf_a = np.tile(np.where(inside, -width_mm / 2, 0.0), (2, 1)).astype(np.float32)
    leaf_b = np.tile(np.where(inside, width_mm / 2, 0.0), (2, 1)).astype(np.float32)
    jaw_1 = np.full(2, -length_mm / 2, np.float32)
    jaw_2 = np.full(2, length_mm / 2, np.float32)
    return ControlPoints(leaf_a=leaf_a, leaf_b=leaf_b, jaw_1=jaw_1, jaw_2=jaw_2,
                         mu=np.array([0.0, mu], np.float32), leaf_weight=leaf_weights(jaw_1, jaw_2, grid), dataset_id=0,
                         pattern="plan")
