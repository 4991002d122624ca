"""Delivery QA of one RT Plan beam with a trained model pair: the plan's EPID frames predicted
by the forward model and, with measured frames (RT Images), gamma per frame, the control
points reconstructed from the measured frames and compared with the plan, and pass/fail
against AAPM TG-218 (gamma) and TG-142 (MLC leaf position).

Frames are numbered as in the plan: frame k (1 <= k <= N - 1) integrates the motion from
control point k - 1 to control point k and is tied to k (``epid.dicom.image``). They lie on the
project's 1 mm grid at the isocentre in the collimator's frame (x along the leaves' travel).

Prediction (``predict_plan_frames``) comes from the plan alone: the forward model renders
every frame from its two control points; a model that learned the detector's lag carries its
own previous predicted frame into each frame (nothing before frame 1).

QA (``match_frames``, ``frame_gamma``, ``reconstruct``, ``summarise``): measured frames are
matched to the plan by their control point; cine frames and integrated images, which name none,
are placed on the plan's timeline (``epid.evaluation.timeline``), whose frames play the intervals'
part; the reconstruction takes the longest run of consecutive frames. Gamma
is global with a 10 % lower cutoff of the measured frame's maximum, the measured frame the
reference, at 3 %/2 mm (TG-218: 95 % tolerance, 90 % action) and 2 %/2 mm, per frame and on
the arc-integrated image (the sum of the compared frames). The control points the measured
frames end on are reconstructed from them (``epid.evaluation.arc_review``: "arc", the default, fits the
consecutive frames jointly; "pair" frame pair by frame pair; "network" the inverse network
alone); when the first measured frame is not frame 1, it serves as the recorded frame before
the others and its own control point is not reconstructed. Leaves are scored inside the jaw
band (leaf pairs whose rows the plan's jaws leave open at that control point).

Measured frames are compared in the models' units (signal of the synthesis, proportional to
MU): the project's own frames are, and measured ones are brought there by one least-squares scale
per delivery (``timeline.calibration_scale``, reported; it absorbs a global MU error).

An integrated image (one per beam) gets gamma only (``integrated_summary``), no reconstruction.
The report's files: ``epid.evaluation.qa_report``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from epid.core.errors import InputError
from epid.dicom.image import MeasuredFrames
from epid.dicom.plan import PlanBeam
from epid.dicom.series import MeasuredSeries
from epid.evaluation import arc_review, delivery_errors, timeline
from epid.evaluation.gamma import GammaCriteria, gamma_maps, gamma_pass_rates
from epid.evaluation.timeline import Progress
from epid.models.aperture import X_JAW_SCALARS
from epid.models.families import model_strips
from epid.reconstruction.estimate import Stages
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.sequences import ControlPoints

GAMMA_CRITERIA = {
    "3_2mm": GammaCriteria(dose_percent=3.0, distance_mm=2.0),
    "2_2mm": GammaCriteria(dose_percent=2.0, distance_mm=2.0),
}
"""Gamma criteria of the report (global, 10 % cutoff), by the key suffix they give."""
TG218_CRITERION = "3_2mm"
TG218_TOLERANCE_PERCENT = 95.0
TG218_ACTION_PERCENT = 90.0
TG142_LEAF_TOLERANCE_MM = 1.0
OUTSIDE_WARNING_PERCENT = 1.0
"""Share of a measured frame's field signal outside the grid above which the run warns, percent."""
LEAF_PASS_PERCENT = 95.0
"""Share of the in-band leaf positions that must lie within the TG-142 tolerance: the
reconstruction has an error of its own, so single positions beyond 1 mm are expected."""

BANK_NAMES = ("A = X1 (IEC 61217: the -x side, the first half of each MLCX LeafJawPositions; Varian's bank B), "
              "B = X2 (+x, the second half; Varian's bank A)")
"""How the report's banks A and B map onto IEC 61217 and a vendor's names (``qa_summary.json``'s ``banks``)."""

SUMMARY_KEYS = (
    "plan", "beam", "beam_name", "machine", "mlc", "banks", "unverifiable_leaf_pairs", "control_points", "beam_mu",
    "gantry_start_deg", "gantry_stop_deg", "collimator_deg", "measured_frames", "frames", "first_control_point",
    "last_control_point", "gamma_cutoff_percent",
    "gamma_3_2mm_mean", "gamma_3_2mm_min", "gamma_3_2mm_integrated", "frames_passing_3_2mm",
    "gamma_2_2mm_mean", "gamma_2_2mm_min", "gamma_2_2mm_integrated", "frames_passing_2_2mm",
    "worst_frame_control_point", "reconstruction", "reconstructed_control_points", "leaves_scored",
    "leaf_mae_mm", "leaf_rms_mm", "leaf_bias_mm", "leaf_max_mm", "leaf_within_1mm_percent", "worst_leaf",
    "jaw_mae_mm", "jaw_max_mm", "x_jaw_positions", "x_jaw_mae_mm", "x_jaw_max_mm", "mu_error_percent", "mu_planned",
    "mu_reconstructed", "mu_total_error_percent",
    "criteria", "pass", "delivery_errors",
)


# --------------------------------------------------------------------------- prediction


def frame_inputs(control_points: ControlPoints, x_jaws: np.ndarray | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Forward-model inputs of frames 1..N-1 (frame k: prev control point k - 1, curr k), CPU
    float32: leaf_a, leaf_b (N - 1, 104) mm [prev 52, curr 52] and scalars (N - 1, 5) [MU of the
    frame, jaw_1 prev, jaw_1 curr, jaw_2 prev, jaw_2 curr]; with a beam's ``x_jaws`` (N, 2),
    (N - 1, 9): [X1 prev, X1 curr, X2 prev, X2 curr] appended."""
    cp = control_points

    def pair(values: np.ndarray) -> Tensor:
        return torch.from_numpy(np.concatenate([values[:-1], values[1:]], axis=1).astype(np.float32))

    columns = [cp.mu[1:], cp.jaw_1[:-1], cp.jaw_1[1:], cp.jaw_2[:-1], cp.jaw_2[1:]]
    if x_jaws is not None:
        columns += timeline.x_jaw_columns(x_jaws[:-1], x_jaws[1:])
    return pair(cp.leaf_a), pair(cp.leaf_b), torch.from_numpy(np.stack(columns, axis=1).astype(np.float32))


def predict_plan_frames(forward_model: nn.Module, control_points: ControlPoints, device: torch.device | str = "cpu",
                        batch_size: int = 64, progress: Progress | None = None,
                        x_jaws: np.ndarray | None = None) -> Tensor:
    """Frames 1..N-1 of the plan (N - 1, 256, 256) float32 on the CPU, predicted by
    ``forward_model`` (on ``device``, switched to eval mode) ``batch_size`` frames at a time, with
    the model's own lag carried from frame to frame (``timeline.predict_intervals``); the beam's
    ``x_jaws`` (N, 2) rendered as jaws where given (``frame_inputs``)."""
    leaf_a, leaf_b, scalars = frame_inputs(control_points, x_jaws)
    return timeline.predict_intervals(forward_model, leaf_a, leaf_b, scalars, device, batch_size, progress)


# --------------------------------------------------------------------------- matching


def match_frames(beam: PlanBeam, measured: MeasuredFrames) -> np.ndarray:
    """The control point (K,) each measured frame ends on, checked against the beam: every frame
    inside 1..N-1, increasing, finite, and a run of consecutive frames long enough to reconstruct
    control points from (2 after the frame before, which is the dark frame 0 when the run starts
    at frame 1); frames missing between others are dropped frames, tolerated. InputError (one line
    naming the image files and the plan) otherwise."""
    points = np.asarray(measured.control_point_index, dtype=np.int64)
    last = len(beam) - 1
    where = f"{measured.path}: measured frames of control points {points[0]}..{points[-1]}"
    plan = f"beam {beam.beam_number} of {beam.path}"
    if len(points) > last:
        raise InputError(f"{where}: {len(points)} frames for the {last} control-point intervals of {plan}")
    if points[0] < 1 or points[-1] > last:
        raise InputError(f"{where}: outside the frames 1..{last} of {plan} (frame k ends on control point k)")
    if np.any(np.diff(points) < 1):
        raise InputError(f"{where}: two frames of one control point; each control-point interval may have one frame")
    run = points[longest_run(points)]
    needed = 2 if run[0] == 1 else 3
    if len(run) < needed:
        raise InputError(f"{where}: the longest run of consecutive frames has {len(run)}; at least {needed} are "
                         f"needed to reconstruct control points of {plan} (2, after the frame before them)")
    bad = np.flatnonzero(~np.isfinite(measured.frames).reshape(len(points), -1).all(axis=1))
    if bad.size:
        raise InputError(f"{measured.path}: the frame of control point {points[bad[0]]} holds values that are not "
                         "finite")
    return points


def longest_run(points: np.ndarray) -> slice:
    """The slice of ``points`` (increasing) holding its longest run of consecutive values (the first
    of equal length)."""
    breaks = np.concatenate([[0], np.flatnonzero(np.diff(points) != 1) + 1, [len(points)]])
    lengths = np.diff(breaks)
    longest = int(np.argmax(lengths))
    return slice(int(breaks[longest]), int(breaks[longest + 1]))


def placed_frames(series: MeasuredSeries, placement: timeline.Placement) -> MeasuredFrames:
    """The frames of ``series`` as frames of ``placement``'s timeline (their control point k: the
    timeline frame each integrates)."""
    return MeasuredFrames(path=series.path, frames=series.frames, control_point_index=placement.frame_of,
                          sid_mm=series.sid_mm)


def calibrate(mode: str, placement: timeline.Placement, measured: Tensor, predicted: Tensor,
              commissioned: float | None = None, image: dict[str, Any] | None = None) -> dict[str, Any]:
    """How measured frames come to the models' units, for the report: ``mode`` none (scale 1), fit
    (``timeline.calibration_scale``), commissioned (the scale ``commissioned`` a commissioned
    checkpoint holds), image (``image``, from ``calibration_image``) or auto (none for frames placed
    by their control points, the project's own; else the calibration image where one is given,
    else commissioned where there is a scale, else fit). Returns {mode, method, scale}."""
    if mode == "auto":
        mode = "none" if placement.by_control_points else "image" if image is not None else \
            "fit" if commissioned is None else "commissioned"
    if mode == "image":
        if image is None:
            raise InputError("--calibration image: no --calibration-image given")
        return image
    if mode == "none":
        return {"mode": mode, "method": "none: the measured frames are taken in the models' units", "scale": 1.0}
    if mode == "commissioned":
        if commissioned is None:
            raise InputError("--calibration commissioned: the checkpoint is not commissioned (inference_visualize.py "
                             "--commission writes one)")
        return {"mode": mode, "method": "the commissioned panel calibration (a global MU error of the delivery shows)",
                "scale": float(commissioned)}
    return {"mode": "fit", "method": "least-squares scale per delivery (it absorbs a global MU error of the delivery)",
            "scale": timeline.calibration_scale(measured, predicted)}


def calibrated_frames(series: MeasuredSeries, placement: timeline.Placement, predicted: Tensor, mode: str,
                      commissioned: float | None = None, image: dict[str, Any] | None = None
                      ) -> tuple[Tensor, dict[str, Any]]:
    """The measured frames of ``series`` (K, 256, 256) in the models' units by ``calibrate`` against
    their ``predicted`` frames, and the calibration {method, scale}."""
    frames = torch.from_numpy(np.array(series.frames, dtype=np.float32))
    calibration = calibrate(mode, placement, frames, predicted, commissioned, image)
    return frames.mul_(calibration["scale"]), calibration


def calibration_image(forward_model: nn.Module, series: MeasuredSeries, width_mm: float, length_mm: float,
                      mu: float, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The calibration {method, scale} from a measured image of an open reference field
    (``timeline.open_field``: ``width_mm`` x ``length_mm``, ``mu`` MU): the least-squares scale of
    the measured image to the forward model's prediction of that field over the field. InputError
    for a series that is not one image."""
    if len(series) != 1:
        raise InputError(f"{series.path}: {len(series)} frames; a calibration image is one image of an open field")
    field = timeline.open_field(width_mm, length_mm, mu, model_strips(forward_model))
    predicted = predict_plan_frames(forward_model, field, device)
    scale = timeline.calibration_scale(torch.from_numpy(np.array(series.frames)), predicted)
    return {"mode": "image", "method": f"calibration image {series.path}: open field {width_mm:g} x {length_mm:g} mm, "
                                      f"{mu:g} MU (a global MU error of the delivery shows)", "scale": scale}


# --------------------------------------------------------------------------- gamma


@dataclass(frozen=True)
class FrameGamma:
    """Gamma of predicted against measured frames (K frames).

    pass_rates: per criterion key of ``GAMMA_CRITERIA``, (K,) percent, NaN for a frame with no
    point above the cutoff. integrated: per key, the pass rate of the summed frames.
    worst: index of the frame of lowest 3 %/2 mm pass rate; worst_map: its gamma map (256, 256),
    NaN below the cutoff.
    """

    pass_rates: Mapping[str, np.ndarray]
    integrated: Mapping[str, float]
    worst: int
    worst_map: np.ndarray


def frame_gamma(measured: Tensor, predicted: Tensor, device: torch.device | str = "cpu", batch_size: int = 16,
                progress: Progress | None = None) -> FrameGamma:
    """``FrameGamma`` of ``predicted`` against ``measured`` (K, 256, 256) under ``GAMMA_CRITERIA``,
    computed on ``device`` ``batch_size`` frames at a time; only pass rates are kept per frame."""
    rates: dict[str, list[Tensor]] = {key: [] for key in GAMMA_CRITERIA}
    for start in range(0, len(measured), batch_size):
        stop = min(start + batch_size, len(measured))
        for key, criteria in GAMMA_CRITERIA.items():
            rates[key].append(gamma_pass_rates(measured[start:stop], predicted[start:stop], criteria, device,
                                               batch_size=batch_size))
        if progress is not None:
            progress(stop - start)
    pass_rates = {key: torch.cat(values).numpy().astype(np.float64) for key, values in rates.items()}
    tg218 = pass_rates[TG218_CRITERION]
    worst = int(np.nanargmin(tg218)) if np.isfinite(tg218).any() else 0
    worst_map = gamma_maps(measured[worst:worst + 1], predicted[worst:worst + 1], GAMMA_CRITERIA[TG218_CRITERION],
                           device)[0].numpy()
    integrated = {key: float(gamma_pass_rates(measured.sum(0, keepdim=True), predicted.sum(0, keepdim=True),
                                              criteria, device)[0])
                  for key, criteria in GAMMA_CRITERIA.items()}
    return FrameGamma(pass_rates, integrated, worst, worst_map)


# --------------------------------------------------------------------------- reconstruction


def plan_segment(beam: PlanBeam, points: np.ndarray, frames: Tensor) -> arc_review.ArcSegment:
    """The ``ArcSegment`` of measured ``frames`` (K, 256, 256) ending on the control points
    ``points`` (from ``match_frames``) with the plan's control points: from frame 1 all K frames
    after a dark frame 0, else the last K - 1 after the first."""
    cp = beam.control_points
    if points[0] == 1:
        frames, scored = torch.cat([torch.zeros_like(frames[:1]), frames]), points
    else:
        scored = points[1:]
    hidden = beam.behind_x_jaws()
    return arc_review.ArcSegment(
        dataset_id=beam.beam_number, pattern=cp.pattern, first=int(scored[0]), frames=frames.float(),
        **{name: np.array(getattr(cp, name)[scored]) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu")},
        behind_x_jaws=None if hidden is None else hidden[:, scored],
        x_jaws=None if beam.x_jaws is None else np.array(beam.x_jaws[scored], dtype=np.float64),
    )


def reconstruct(models: tuple[nn.Module, nn.Module], segment: arc_review.ArcSegment, method: str = "arc",
                device: torch.device | str = "cpu", progress: Progress | None = None, stages: Stages | None = None,
                mlc: MlcGeometry = LEGACY_GRID, cine: bool = False) -> arc_review.ArcEstimate:
    """The control points of ``segment`` by ``method`` (``arc_review.reconstruct_segment``: tracking
    ``stages``, default the inverse model's; one per leaf of ``mlc``), the models in eval mode."""
    for model in models:
        model.eval()
    return arc_review.reconstruct_segment(method, models, segment, device, stages=stages, progress=progress, mlc=mlc,
                                          cine=cine)


def measured_qa(models: tuple[nn.Module, nn.Module], series: MeasuredSeries, placement: timeline.Placement,
                calibration_mode: str = "auto", commissioned: float | None = None, method: str = "arc",
                device: torch.device | str = "cpu", batch_size: int = 16,
                stage: Callable[[str], None] | None = None, image: dict[str, Any] | None = None,
                predicted: Tensor | None = None, mu_reference: float = 1.0) -> tuple[PlanQA, dict[str, Any]]:
    """The QA of measured frames (not an integrated image) placed on a beam: every frame of the
    timeline predicted over its span (or ``predicted``, the timeline's frames where the caller has
    them: the plan's own for frames naming control points), the measured frames calibrated
    (``calibrate``), gamma per frame, the longest run of consecutive frames moved back by the sag
    and reconstructed by ``method``. ``mu_reference``: a commissioned checkpoint's (``PlanQA``),
    taken where the calibration is the commissioned one. Returns the ``PlanQA``, the calibration;
    ``stage`` hears each step."""
    say = stage or (lambda message: None)
    measured = placed_frames(series, placement)
    points = match_frames(placement.beam, measured)
    if predicted is None:
        say(f"predicting the {len(placement.boundaries_mu) - 1} frame(s) of the timeline over their spans")
        predicted = timeline.predict_spans(models[0], placement, device, batch_size)
    compared = predicted[points - 1]
    frames, calibration = calibrated_frames(series, placement, compared, calibration_mode, commissioned, image)
    say(f"  calibration: {calibration['method']}, scale {calibration['scale']:.6g}")
    say(f"gamma of {len(points)} measured frames: 3 %/2 mm and 2 %/2 mm global, cutoff 10 %")
    gamma = frame_gamma(frames, compared, device, batch_size)
    segment, estimate = _reconstructed(models, placement, points, frames, method, device, say)
    reference = mu_reference if calibration["mode"] == "commissioned" else 1.0
    return PlanQA(placement.beam, measured, points, compared, gamma, segment, estimate, reference), calibration


def _reconstructed(models: tuple[nn.Module, nn.Module], placement: timeline.Placement, points: np.ndarray,
                   frames: Tensor, method: str, device: torch.device | str, say: Callable[[str], None]
                   ) -> tuple[arc_review.ArcSegment, arc_review.ArcEstimate]:
    """The longest run of consecutive calibrated ``frames`` (K, 256, 256), ending on ``points`` (K,),
    read back through the forward model's panel recording (``epid.models.panel.PanelRecording.undo``:
    its slower lag and non-linear response taken out, which the reconstruction's frame-pair rendering
    does not carry), moved back by the sag and reconstructed by ``method``: its segment and estimate."""
    run = longest_run(points)
    shown = frames
    if hasattr(models[0], "recording"):
        with torch.no_grad():
            shown = models[0].recording.undo(frames)  # the whole series: the run's first frames have their past
    shown = shown[run]
    segment = plan_segment(placement.beam, points[run],
                           timeline.with_sag(models[0], shown, timeline.frame_gantry(placement)[run], undo=True))
    cine = not placement.by_control_points
    say(f"reconstructing control points {segment.first}-{segment.first + len(segment) - 1} of the "
        f"{'timeline' if cine else 'plan'} from the measured frames ({method})")
    estimate = reconstruct(models, segment, method, device, mlc=placement.beam.geometry, cine=cine)
    return segment, read_x_jaws(models[0], segment, estimate)


def read_x_jaws(forward_model: nn.Module, segment: arc_review.ArcSegment,
                estimate: arc_review.ArcEstimate) -> arc_review.ArcEstimate:
    """``estimate`` of a beam with X jaws read as the frames show them, for a model that renders X
    jaws (the aperture family): the positions an X jaw hides as that jaw's edge
    (``arc_review.read_hidden_edges``), and each frame's signal MU (the arc fit's) with the jaws
    rendered; else ``estimate`` itself.

    Beyond the field the fit's rendering leaks the leaves' transmission where the jaws pass theirs,
    which the signal MU reads as less MU. So each frame's signal MU is scaled by its rendering without X
    jaws over its rendering with them: each X jaw at the mean of the hidden positions that show its edge
    (in the jaw band, the pair open by ``arc_review.X_JAW_EDGE_OPEN_MM``), the plan's where none does (frame
    0's motion taken as its control point's alone). On a simulated clinic's error-free deliveries
    with X jaws following the leaves (``bench_error_detection --x-jaws``), without this: X1 +0.32
    mm, X2 -0.30 mm, the total MU -3.9 %."""
    read = arc_review.read_hidden_edges(forward_model, segment, estimate)
    if read is estimate or estimate.signal_mu is None:
        return read
    hidden = segment.behind_x_jaws
    leaf_a, leaf_b = read.leaf_a.double().numpy(), read.leaf_b.double().numpy()
    x_jaws = segment.x_jaws.copy()
    opening = segment.leaf_b - segment.leaf_a
    shown = arc_review.leaf_errors(estimate, segment).band & (opening > arc_review.X_JAW_EDGE_OPEN_MM)
    for side, (code, edges) in enumerate(((1, leaf_a), (2, leaf_b))):
        seen = (hidden[side] == code) & shown
        count = seen.sum(1)
        x_jaws[:, side] = np.where(count > 0, np.where(seen, edges, 0.0).sum(1) / np.maximum(count, 1),
                                   x_jaws[:, side])
    jaws = estimate.jaws.numpy()

    def from_first(values: np.ndarray) -> np.ndarray:
        """``values`` (N, ...) after a copy of their first: frame 0 a motion from its own control point."""
        return np.concatenate([values[:1], values]).astype(np.float32)

    points = ControlPoints(from_first(estimate.leaf_a.numpy()), from_first(estimate.leaf_b.numpy()),
                           from_first(jaws[:, 0]), from_first(jaws[:, 1]), np.ones(len(jaws) + 1, dtype=np.float32),
                           np.ones((len(jaws) + 1, estimate.leaf_a.shape[-1]), dtype=np.float32), segment.dataset_id,
                           "plan")
    leaf_a_inputs, leaf_b_inputs, scalars = frame_inputs(points, from_first(x_jaws))
    parameter = next(forward_model.parameters())
    with torch.inference_mode():
        sums = [forward_model.render(leaf_a_inputs.to(parameter), leaf_b_inputs.to(parameter), values.to(parameter)
                                     )[0].sum((-2, -1)).double().cpu()
                for values in (scalars[:, :-X_JAW_SCALARS], scalars)]
    signal_mu = estimate.signal_mu.double() * sums[0] / sums[1].clamp_min(1e-12)
    return dataclasses.replace(read, signal_mu=signal_mu.float())


def commissioned_mu_reference(models: tuple[nn.Module, nn.Module], deliveries: Sequence[tuple[MeasuredSeries,
                              timeline.Placement]], scale: float, device: torch.device | str = "cpu") -> float:
    """``PlanQA.mu_reference`` of a commissioned model pair and calibration ``scale``: the planned MU
    over the signal MU (``fallback.frame_misfits``) of the commissioning ``deliveries`` (each measured
    series and its placement), as their QA reconstructs them (no prediction, no gamma)."""
    planned = signal = 0.0
    for series, placement in deliveries:
        points = match_frames(placement.beam, placed_frames(series, placement))
        frames = torch.from_numpy(np.array(series.frames, dtype=np.float32)).mul_(scale)
        segment, estimate = _reconstructed(models, placement, points, frames, "arc", device, lambda message: None)
        planned += float(segment.mu.sum())
        signal += float(_signal_mu(estimate).sum())
    if not signal > 0:
        raise InputError("the commissioning deliveries' reconstruction holds no signal; no MU reference")
    return planned / signal


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class PlanQA:
    """Everything the report shows: the beam, the measured frames (K) and the control points
    they end on, the predictions of those frames (K, 256, 256), their gamma, and the
    reconstruction of the segment's control points; ``mu_reference``: the planned over the
    reconstructed signal MU of the plans a commissioned model was commissioned on
    (``commissioned_mu_reference``; 1 without), which the total MU is read against."""

    beam: PlanBeam
    measured: MeasuredFrames
    points: np.ndarray
    predicted: Tensor
    gamma: FrameGamma
    segment: arc_review.ArcSegment
    estimate: arc_review.ArcEstimate
    mu_reference: float = 1.0

    def scored_points(self) -> np.ndarray:
        """Control points reconstructed and scored (S,)."""
        return np.arange(self.segment.first, self.segment.first + len(self.segment))


def _signal_mu(estimate: arc_review.ArcEstimate) -> Tensor:
    """The frames' MU (N,) the totals are read from: the arc fit's signal MU, else the estimate's MU."""
    return estimate.mu if estimate.signal_mu is None else estimate.signal_mu


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def _statistic(values: np.ndarray, reduce: Callable[[np.ndarray], float]) -> float:
    finite = values[np.isfinite(values)]
    return float(reduce(finite)) if finite.size else math.nan


def summarise(qa: PlanQA) -> dict[str, Any]:
    """The report's figures, keys ``SUMMARY_KEYS`` (NaN becomes None):

    plan, beam (number), beam_name, machine, mlc, banks, unverifiable_leaf_pairs (leaf pairs beyond the
    imager, never scored), control_points (N), beam_mu, gantry_start_deg,
    gantry_stop_deg, collimator_deg: the beam. measured_frames (the image files), frames (K
    compared), first_control_point, last_control_point. gamma_cutoff_percent (10);
    gamma_3_2mm_mean / _min over the frames, gamma_3_2mm_integrated (the summed frames),
    frames_passing_3_2mm (frames at or above the 95 % tolerance), the same for 2_2mm;
    worst_frame_control_point. reconstruction (the method used), reconstructed_control_points,
    leaves_scored (in-band leaf positions, both banks), leaf_mae_mm, leaf_rms_mm, leaf_bias_mm
    (reconstructed - planned), leaf_max_mm, leaf_within_1mm_percent, worst_leaf {bank, leaf,
    control_point, error_mm}; jaw_mae_mm, jaw_max_mm (jaw_1 and jaw_2); x_jaw_positions, x_jaw_mae_mm,
    x_jaw_max_mm (the in-band leaf positions an X jaw hides, scored as the jaw's edge, not as leaves:
    ``arc_review.LeafErrors``); mu_error_percent (mean
    relative error of the frames' least-squares MU, frames with planned MU), mu_planned and
    mu_reconstructed (sums over the reconstructed frames; the latter of the arc fit's signal MU,
    ``fallback.frame_misfits``, times ``PlanQA.mu_reference``), mu_total_error_percent. delivery_errors
    (``delivery_errors.error_summary``). criteria: per criterion {rule, value, limit, pass}: TG-218 gamma,
    TG-142 leaves and no delivery error flagged (``delivery_errors.criterion``); pass: every criterion passes.
    """
    beam, gamma, estimate, segment = qa.beam, qa.gamma, qa.estimate, qa.segment
    errors = arc_review.leaf_errors(estimate, segment)
    scored = errors.scored_errors()
    absolute = np.abs(scored)
    worst_leaf = None
    if scored.size:
        masks = errors.scored()
        ranked = np.stack([np.where(masks[bank], np.abs(error), -1.0) for bank, error in errors.banks.items()])
        bank, row, leaf = np.unravel_index(int(np.argmax(ranked)), ranked.shape)
        worst_leaf = {"bank": "AB"[bank], "leaf": int(leaf), "control_point": int(qa.scored_points()[row]),
                      "error_mm": float(errors.banks["AB"[bank]][row, leaf])}
    x_jaws = np.abs(np.concatenate(list(errors.x_jaws().values())))
    jaws = np.abs(estimate.jaws.numpy() - np.stack([segment.jaw_1, segment.jaw_2], axis=1))
    mu_planned, mu_reconstructed = segment.mu.astype(np.float64), estimate.mu.numpy().astype(np.float64)
    delivering = mu_planned > 0
    mu_relative = np.abs(mu_reconstructed - mu_planned)[delivering] / mu_planned[delivering]
    mu_total = float(_signal_mu(estimate).double().sum()) * qa.mu_reference
    summary: dict[str, Any] = {
        "plan": beam.path, "beam": beam.beam_number, "beam_name": beam.beam_name, "machine": beam.machine,
        "mlc": beam.mlc, "banks": BANK_NAMES, "unverifiable_leaf_pairs": beam.geometry.hidden_pairs,
        "control_points": len(beam), "beam_mu": beam.beam_mu,
        "gantry_start_deg": float(beam.gantry_deg[0]), "gantry_stop_deg": float(beam.gantry_deg[-1]),
        "collimator_deg": beam.collimator_deg, "measured_frames": qa.measured.path, "frames": len(qa.points),
        "first_control_point": int(qa.points[0]), "last_control_point": int(qa.points[-1]),
        "gamma_cutoff_percent": GAMMA_CRITERIA[TG218_CRITERION].cutoff_percent,
    }
    for key, rates in gamma.pass_rates.items():
        summary[f"gamma_{key}_mean"] = _statistic(rates, np.mean)
        summary[f"gamma_{key}_min"] = _statistic(rates, np.min)
        summary[f"gamma_{key}_integrated"] = gamma.integrated[key]
        summary[f"frames_passing_{key}"] = int((rates >= TG218_TOLERANCE_PERCENT).sum())
    summary.update({
        "worst_frame_control_point": int(qa.points[gamma.worst]), "reconstruction": estimate.method,
        "reconstructed_control_points": len(segment), "leaves_scored": int(scored.size),
        "leaf_mae_mm": _statistic(absolute, np.mean),
        "leaf_rms_mm": _statistic(scored, lambda errors: np.sqrt(np.mean(errors * errors))),
        "leaf_bias_mm": _statistic(scored, np.mean), "leaf_max_mm": _statistic(absolute, np.max),
        "leaf_within_1mm_percent": _statistic(absolute,
                                              lambda errors: 100 * np.mean(errors <= TG142_LEAF_TOLERANCE_MM)),
        "worst_leaf": worst_leaf, "jaw_mae_mm": float(jaws.mean()), "jaw_max_mm": float(jaws.max()),
        "x_jaw_positions": int(x_jaws.size), "x_jaw_mae_mm": _statistic(x_jaws, np.mean),
        "x_jaw_max_mm": _statistic(x_jaws, np.max),
        "mu_error_percent": _statistic(100 * mu_relative, np.mean), "mu_planned": round(float(mu_planned.sum()), 4),
        "mu_reconstructed": mu_total,
        "mu_total_error_percent": 100 * (mu_total - mu_planned.sum()) / mu_planned.sum() if mu_planned.sum() > 0
        else math.nan,
    })
    summary["delivery_errors"] = delivery_errors.error_summary(
        errors, leaf_error_rows(qa), summary["mu_total_error_percent"],
        gamma.pass_rates[TG218_CRITERION], qa.points, qa.beam.gantry_deg[qa.points], TG218_TOLERANCE_PERCENT)
    flags = delivery_errors.criterion(summary["delivery_errors"])
    summary["criteria"] = {**_criteria(summary), "delivery_errors": flags}
    summary["pass"] = all(item["pass"] for item in summary["criteria"].values())
    return {key: _finite(value) if isinstance(value, float) else value for key, value in summary.items()}


def leaf_error_rows(qa: PlanQA) -> list[dict[str, Any]]:
    """Per bank and leaf, the reconstructed-minus-planned figures and flags (``delivery_errors.leaf_table``)."""
    points = qa.scored_points()
    return delivery_errors.leaf_table(arc_review.leaf_errors(qa.estimate, qa.segment), points,
                                      qa.beam.gantry_deg[points], qa.beam.geometry.grid.centres_mm,
                                      qa.beam.geometry.leaf_labels)


def integrated_summary(beam: PlanBeam, measured: str, gamma: FrameGamma) -> dict[str, Any]:
    """The report's figures for an integrated image of the beam: the beam (as ``summarise``),
    ``measured_image``, gamma_<key>_integrated per criterion, criteria (TG-218 on the image) and pass."""
    summary: dict[str, Any] = {
        "plan": beam.path, "beam": beam.beam_number, "beam_name": beam.beam_name, "machine": beam.machine,
        "mlc": beam.mlc, "control_points": len(beam), "beam_mu": beam.beam_mu, "measured_image": measured,
        "gamma_cutoff_percent": GAMMA_CRITERIA[TG218_CRITERION].cutoff_percent,
    }
    summary.update({f"gamma_{key}_integrated": gamma.integrated[key] for key in GAMMA_CRITERIA})
    value = summary[f"gamma_{TG218_CRITERION}_integrated"]
    summary["criteria"] = {"gamma_3_2mm_integrated": {
        "rule": f"TG-218: 3 %/2 mm pass rate of the integrated image >= {TG218_TOLERANCE_PERCENT:g} %",
        "value": _finite(value), "limit": TG218_TOLERANCE_PERCENT,
        "pass": bool(math.isfinite(value) and value >= TG218_TOLERANCE_PERCENT)}}
    summary["pass"] = summary["criteria"]["gamma_3_2mm_integrated"]["pass"]
    return {key: _finite(value) if isinstance(value, float) else value for key, value in summary.items()}


def _criteria(summary: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Pass/fail of TG-218 gamma (frames and integrated image) and TG-142 leaf position."""
    tolerance = TG218_TOLERANCE_PERCENT
    items = {
        "gamma_3_2mm_frames": (f"TG-218: mean 3 %/2 mm pass rate of the frames >= {tolerance:g} %",
                               summary["gamma_3_2mm_mean"], tolerance),
        "gamma_3_2mm_integrated": (f"TG-218: 3 %/2 mm pass rate of the arc-integrated image >= {tolerance:g} %",
                                   summary["gamma_3_2mm_integrated"], tolerance),
        "leaf_1mm": (f"TG-142: >= {LEAF_PASS_PERCENT:g} % of the in-band leaf positions within "
                     f"{TG142_LEAF_TOLERANCE_MM:g} mm of the plan", summary["leaf_within_1mm_percent"],
                     LEAF_PASS_PERCENT),
    }
    return {name: {"rule": rule, "value": _finite(value), "limit": limit,
                   "pass": bool(math.isfinite(value) and value >= limit)}
            for name, (rule, value, limit) in items.items()}
