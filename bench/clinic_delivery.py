"""A clinic's linac and EPID, simulated independently of ``epid``'s synthesis and models: the
measurements that commissioning, the delivery-QA tests and ``bench.bench_error_detection`` need.

Nothing of ``epid.synthesis`` or ``epid.models`` is used; the plan comes from ``epid.dicom.plan``
(its leaves on the strips of its MLC, whose own leaf boundaries place the interleaf leakage and the
tongue and groove) and the images are written with pydicom directly, as a panel would write them.
The physics has forms the synthesis does not have:

- delivery in time: each control-point interval lasts max(MU / dose rate, gantry travel / gantry
  speed); cine frames at a fixed frame rate integrate whatever the linac delivered meanwhile (their
  spans fall anywhere in the control-point intervals) and carry the gantry angle and time at
  their end;
- fluence on a 0.25 mm grid, the leaves' linear motion within each piece of a frame integrated
  exactly (the share of the piece's time each point lies between the banks); rounded leaf ends (a
  radiation edge offset and a Gaussian penumbra along the travel), the Y jaws and a plan's X jaws
  (hard edges, each jaw's transmission multiplying the rest), leaf and jaw transmission,
  interleaf leakage on the leaf boundaries, tongue and groove (the boundary strip open only where
  both neighbours are), an off-axis profile rising towards the field's edge;
- the panel: source size (Gaussian), an optical core and an exponential scatter tail (a
  response of its own form), a field-size dependent output, panel sag that moves the image with
  gantry angle, a mildly non-linear response, lag with two time constants, signal-dependent
  noise; frames in the panel's units (a gain per MU), 0.75 mm pixels at SID 1500 mm.

Errors are injected into the delivery (``DeliveryErrors``): a bank or both banks shifted, one leaf
stuck for part of the arc, the MU scaled, the gantry angles reported with an offset.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.ndimage
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from bench.xim_files import write_xim
from epid.dicom.plan import PlanBeam
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry

FLUENCE_MM = 0.25
IMAGE_MM = 0.5
HALF_FIELD_MM = 130.0
ROWS_Y_MIN_MM = -130.0
RT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.481.1"


@dataclass(frozen=True)
class PanelPhysics:
    """The simulated linac and panel (module docstring); lengths in mm at the isocentre."""

    dose_rate_mu_per_s: float = 10.0
    gantry_speed_deg_per_s: float = 4.8
    frame_rate_per_s: float = 9.5
    leaf_transmission: float = 0.014
    interleaf_transmission: float = 0.03
    interleaf_width_mm: float = 0.6
    jaw_transmission: float = 0.002
    leaf_end_offset_mm: float = 0.35
    leaf_end_sigma_mm: float = 1.1
    tongue_groove_mm: float = 0.7
    horn_per_100mm: float = 0.025
    source_sigma_mm: float = 0.6
    core_sigma_mm: float = 1.6
    tail_share: float = 0.07
    tail_length_mm: float = 18.0
    output_per_log_field: float = 0.03
    sag_mm: tuple[float, float] = (0.7, 0.5)
    nonlinearity: float = 0.03
    lag: tuple[tuple[float, float], ...] = ((0.025, 0.25), (0.01, 2.5))
    gain_per_mu: float = 850.0
    noise_per_sqrt_unit: float = 0.5
    sid_mm: float = 1500.0
    seed: int = 0


@dataclass(frozen=True)
class DeliveryErrors:
    """What goes wrong in a delivery: bank A (and B) shifted along x, mm; one leaf pair's bank A leaf
    stuck at its position from a share of the arc on (``stuck_leaf``: (strip, from share): the MLC's
    leaf over that strip, every strip it covers); every MU
    scaled; the gantry angles reported ``gantry_offset_deg`` off the delivered ones; the X1 jaw of a
    beam with X jaws shifted along x (``x_jaw_1_mm``, positive closing), mm."""

    bank_a_mm: float = 0.0
    bank_b_mm: float = 0.0
    x_jaw_1_mm: float = 0.0
    stuck_leaf: tuple[int, float] | None = None
    mu_scale: float = 1.0
    gantry_offset_deg: float = 0.0


@dataclass
class Delivery:
    """Cine frames of one beam (F, H, W) in panel units on a 0.5 mm grid at the isocentre (row 0
    the most positive y), their reported gantry angles (F,), times (F,) s, true MU spans (F, 2) and
    the linac's MU counter over them (F, 2: the planned MU, which an output error does not change)."""

    frames: np.ndarray
    gantry_deg: np.ndarray
    time_s: np.ndarray
    spans_mu: np.ndarray
    counter_mu: np.ndarray
    delivered: dict[str, np.ndarray] = field(default_factory=dict)


def delivered_plan(beam: PlanBeam, errors: DeliveryErrors) -> dict[str, np.ndarray]:
    """The control points as the linac delivers them: leaf_a, leaf_b (N, 52), jaw_1, jaw_2 (N,),
    cumulative MU (N,) and gantry angles (N,), with ``errors`` applied (not the angle offset); for a
    beam with X jaws also x_jaw_1, x_jaw_2 (N,)."""
    cp = beam.control_points
    leaf_a = cp.leaf_a.astype(np.float64) + errors.bank_a_mm
    leaf_b = cp.leaf_b.astype(np.float64) + errors.bank_b_mm
    if errors.stuck_leaf is not None:
        row, share = errors.stuck_leaf
        start = int(round(share * (len(cp) - 1)))
        over = beam.geometry.strip_leaves[0]
        leaf = np.flatnonzero(over == over[row]) if over[row] >= 0 else np.array([row])  # every strip of its leaf
        leaf_a[start:, leaf] = np.minimum(leaf_a[start, leaf], leaf_b[start:, leaf])
    leaf_b = np.maximum(leaf_b, leaf_a)
    cumulative = np.cumsum(cp.mu.astype(np.float64)) * errors.mu_scale
    plan = {"leaf_a": leaf_a, "leaf_b": leaf_b, "jaw_1": cp.jaw_1.astype(np.float64),
            "jaw_2": cp.jaw_2.astype(np.float64), "cumulative_mu": cumulative,
            "gantry_deg": beam.gantry_deg.astype(np.float64)}
    if beam.x_jaws is not None:
        plan["x_jaw_1"], plan["x_jaw_2"] = (beam.x_jaws[:, side].astype(np.float64) for side in (0, 1))
        plan["x_jaw_1"] += errors.x_jaw_1_mm
    return plan


def frame_schedule(plan: dict[str, np.ndarray], physics: PanelPhysics) -> tuple[np.ndarray, np.ndarray]:
    """(time (N,) s at each control point, cine frame end times (F,) s): an interval lasts the
    longer of its MU at the dose rate and its gantry travel at the gantry speed."""
    travel = np.abs((np.diff(plan["gantry_deg"]) + 180.0) % 360.0 - 180.0)
    mu = np.diff(plan["cumulative_mu"])
    durations = np.maximum(mu / physics.dose_rate_mu_per_s, travel / physics.gantry_speed_deg_per_s)
    times = np.concatenate([[0.0], np.cumsum(durations)])
    period = 1.0 / physics.frame_rate_per_s
    return times, np.arange(period, times[-1] + 1e-9, period)


def _open_share(x: np.ndarray, a0, a1, b0, b1) -> np.ndarray:
    """Share of a piece's time each x (1, X) lies between bank A (a0 -> a1) and bank B (b0 -> b1),
    each (R, 1) moving linearly: exact."""
    def window(p0, p1, below: bool):
        moving = np.abs(p1 - p0) > 1e-9
        t = np.divide(x - p0, p1 - p0, out=np.zeros(np.broadcast_shapes(x.shape, p0.shape)), where=moving)
        rising = p1 > p0
        # below: times when the edge p(t) lies below x (bank A left of x); else above x
        if below:
            low = np.where(rising, 0.0, t)
            high = np.where(rising, t, 1.0)
            still = np.where(p0 < x, 1.0, 0.0)
        else:
            low = np.where(rising, t, 0.0)
            high = np.where(rising, 1.0, t)
            still = np.where(p0 > x, 1.0, 0.0)
        low = np.where(moving, np.clip(low, 0.0, 1.0), np.where(still > 0, 0.0, 1.0))
        high = np.where(moving, np.clip(high, 0.0, 1.0), np.where(still > 0, 1.0, 0.0))
        return low, high

    low_a, high_a = window(a0, a1, below=True)
    low_b, high_b = window(b0, b1, below=False)
    return np.clip(np.minimum(high_a, high_b) - np.maximum(low_a, low_b), 0.0, 1.0)


class ClinicPanel:
    """Renders the cine frames of a beam's delivery (module docstring)."""

    def __init__(self, physics: PanelPhysics = PanelPhysics()) -> None:
        self.physics = physics
        count = int(round(2 * HALF_FIELD_MM / FLUENCE_MM))
        self.x = -HALF_FIELD_MM + (np.arange(count) + 0.5) * FLUENCE_MM
        self.y = HALF_FIELD_MM - (np.arange(count) + 0.5) * FLUENCE_MM
        self.leaf_rows(LEGACY_GRID)  # until a beam names its MLC
        radius = np.hypot(self.x[None, :], self.y[:, None])
        self.horn = 1.0 + physics.horn_per_100mm * (radius / 100.0) ** 2
        size = int(round(2 * HALF_FIELD_MM / IMAGE_MM))
        self.image_size = size
        padded = 2 * size
        coordinates = (np.fft.fftfreq(padded) * padded) * IMAGE_MM
        r = np.hypot(coordinates[None, :], coordinates[:, None])
        core = np.exp(-0.5 * (r / physics.core_sigma_mm) ** 2)
        tail = np.exp(-r / physics.tail_length_mm)
        kernel = (1 - physics.tail_share) * core / core.sum() + physics.tail_share * tail / tail.sum()
        self.kernel_fft = np.fft.rfft2(kernel)
        self.padded = padded

    def leaf_rows(self, mlc: MlcGeometry) -> None:
        """Lays the fluence rows on a plan's MLC (``PlanBeam.geometry``): where each row lies on its
        strips from ``ROWS_Y_MIN_MM`` (the positions a plan read gives) and, within the interleaf or
        tongue-and-groove width of one of the MLC's own leaf boundaries (a single layer's; every strip's
        of a dual layer), the strip across that boundary."""
        p = self.physics
        strip_mm, count = mlc.grid.strip_mm, mlc.grid.count
        boundaries = np.asarray(mlc.layers[0] if len(mlc.layers) == 1 else mlc.grid.edges_mm, dtype=np.float64)
        self.row = np.clip(((self.y - ROWS_Y_MIN_MM) // strip_mm).astype(int), 0, count - 1)
        above = np.clip(np.searchsorted(boundaries, self.y), 1, len(boundaries) - 1)
        lower, upper = boundaries[above - 1], boundaries[above]
        boundary = np.where(self.y - lower < upper - self.y, lower, upper)
        distance = np.abs(self.y - boundary)
        self.interleaf = distance < p.interleaf_width_mm / 2
        self.groove = distance < p.tongue_groove_mm / 2
        across = np.where(self.y > boundary, boundary - strip_mm / 2, boundary + strip_mm / 2)
        self.neighbour = np.clip(((across - ROWS_Y_MIN_MM) // strip_mm).astype(int), 0, count - 1)

    def fluence(self, plan: dict[str, np.ndarray], start_mu: float, end_mu: float) -> np.ndarray:
        """Fluence (Y, X) x MU delivered between cumulative MU ``start_mu`` and ``end_mu``, the motion
        within each control-point interval integrated exactly."""
        cumulative = plan["cumulative_mu"]
        cuts = np.unique(np.concatenate([[start_mu, end_mu],
                                         cumulative[(cumulative > start_mu) & (cumulative < end_mu)]]))
        total = np.zeros((len(self.y), len(self.x)))
        for low, high in zip(cuts[:-1], cuts[1:], strict=True):
            if high - low <= 1e-12:
                continue
            interval = int(np.clip(np.searchsorted(cumulative, (low + high) / 2), 1, len(cumulative) - 1))
            span = cumulative[interval] - cumulative[interval - 1]

            def at(name, mu, interval=interval, span=span):
                share = (mu - cumulative[interval - 1]) / span if span > 0 else 1.0
                return (1 - share) * plan[name][interval - 1] + share * plan[name][interval]

            middle = (low + high) / 2
            x_jaws = (at("x_jaw_1", middle), at("x_jaw_2", middle)) if "x_jaw_1" in plan else None
            total += (high - low) * self._piece(at("leaf_a", low), at("leaf_a", high), at("leaf_b", low),
                                                at("leaf_b", high), at("jaw_1", middle), at("jaw_2", middle), x_jaws)
        return total * self.horn

    def _piece(self, a0, a1, b0, b1, jaw_1, jaw_2, x_jaws=None) -> np.ndarray:
        p = self.physics
        offset = p.leaf_end_offset_mm
        edges = (a0[self.row] - offset, a1[self.row] - offset, b0[self.row] + offset, b1[self.row] + offset)
        share = _open_share(self.x[None, :], *(v[:, None] for v in edges))
        groove_edges = (np.maximum(a0[self.row], a0[self.neighbour]) - offset,
                        np.maximum(a1[self.row], a1[self.neighbour]) - offset,
                        np.minimum(b0[self.row], b0[self.neighbour]) + offset,
                        np.minimum(b1[self.row], b1[self.neighbour]) + offset)
        groove_share = _open_share(self.x[None, :], *(v[:, None] for v in groove_edges))
        share = np.where(self.groove[:, None], groove_share, share)
        closed = np.where(self.interleaf, p.interleaf_transmission, p.leaf_transmission)[:, None]
        jaws = np.where((self.y >= jaw_1) & (self.y <= jaw_2), 1.0, p.jaw_transmission)[:, None]
        if x_jaws is not None:  # the X jaws stand apart from the Y jaws: outside both, both transmit
            jaws = jaws * np.where((self.x >= x_jaws[0]) & (self.x <= x_jaws[1]), 1.0, p.jaw_transmission)[None, :]
        return jaws * (closed + (1 - closed) * share)

    def image(self, fluence: np.ndarray, gantry_deg: float) -> np.ndarray:
        """The panel's signal (H, W) of one frame's ``fluence``: blurred (leaf-end penumbra along x,
        source), binned to 0.5 mm, convolved with the panel's response, its output scaled with the
        field size and shifted by the sag at ``gantry_deg``."""
        p = self.physics
        sigma_x = math.hypot(p.source_sigma_mm, p.leaf_end_sigma_mm) / FLUENCE_MM
        blurred = scipy.ndimage.gaussian_filter(fluence, (p.source_sigma_mm / FLUENCE_MM, sigma_x), mode="constant")
        factor = int(round(IMAGE_MM / FLUENCE_MM))
        size = self.image_size
        binned = blurred[:size * factor, :size * factor].reshape(size, factor, size, factor).mean(axis=(1, 3))
        padded = np.zeros((self.padded, self.padded))
        padded[:size, :size] = binned
        response = np.fft.irfft2(np.fft.rfft2(padded) * self.kernel_fft, s=padded.shape)[:size, :size]
        peak = float(binned.max())
        open_area = float((binned > 0.5 * peak).sum()) * IMAGE_MM ** 2 if peak > 0 else 0.0
        output = 1.0 + p.output_per_log_field * math.log(max(open_area, 100.0) / 10000.0)
        angle = math.radians(gantry_deg)
        sag = (p.sag_mm[0] * math.sin(angle), p.sag_mm[1] * (1.0 - math.cos(angle)))
        return scipy.ndimage.shift(response * output, (-sag[1] / IMAGE_MM, sag[0] / IMAGE_MM), order=1)

    def deliver(self, beam: PlanBeam, errors: DeliveryErrors = DeliveryErrors(), progress=None) -> Delivery:
        """The cine frames of ``beam``'s delivery with ``errors`` (module docstring)."""
        p = self.physics
        self.leaf_rows(beam.geometry)
        plan = delivered_plan(beam, errors)
        times, ends = frame_schedule(plan, p)
        cumulative = plan["cumulative_mu"]
        mu_at = np.interp(ends, times, cumulative)
        travel = np.concatenate([[0.0], np.cumsum((np.diff(plan["gantry_deg"]) + 180.0) % 360.0 - 180.0)])
        gantry = (plan["gantry_deg"][0] + np.interp(ends, times, travel)) % 360.0
        starts = np.concatenate([[0.0], mu_at[:-1]])
        rng = np.random.default_rng(p.seed)
        states = np.zeros((len(p.lag), self.image_size, self.image_size))
        lag_total = sum(share for share, _ in p.lag)
        frames = np.empty((len(ends), self.image_size, self.image_size), dtype=np.float32)
        period = 1.0 / p.frame_rate_per_s
        for index, (start, end) in enumerate(zip(starts, mu_at, strict=True)):
            signal = self.image(self.fluence(plan, start, end), float(gantry[index])) * p.gain_per_mu
            reference = p.gain_per_mu * p.dose_rate_mu_per_s * period
            signal = signal * (1.0 - p.nonlinearity * np.tanh(signal / reference))
            recorded = (1.0 - lag_total) * signal
            for component, (share, constant) in enumerate(p.lag):
                recorded += share * states[component]
                decay = math.exp(-period / constant)
                states[component] = decay * states[component] + (1 - decay) * signal
            noise = rng.normal(size=signal.shape) * p.noise_per_sqrt_unit * np.sqrt(np.clip(recorded, 0.0, None))
            frames[index] = recorded + noise
            if progress is not None:
                progress(1)
        spans = np.stack([starts, mu_at], 1)
        return Delivery(frames=frames, gantry_deg=(gantry + errors.gantry_offset_deg) % 360.0, time_s=ends,
                        spans_mu=spans, counter_mu=spans / errors.mu_scale, delivered=plan)


def write_cine(delivery: Delivery, folder: str | Path, physics: PanelPhysics = PanelPhysics(), beam: int = 1,
               keep: np.ndarray | None = None) -> list[Path]:
    """The frames as single-frame RT Images in ``folder`` (cine_0000.dcm, ...): 0.75 mm pixels at
    SID ``physics.sid_mm`` (0.5 mm at the isocentre), each its own RescaleSlope, GantryAngle,
    AcquisitionDateTime and InstanceNumber (frames not in ``keep`` dropped)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime(2026, 11, 26, 9, 0)
    paths = []
    for index, frame in enumerate(delivery.frames):
        if keep is not None and index not in keep:
            continue
        acquired = started + datetime.timedelta(seconds=float(delivery.time_s[index]))
        path = folder / f"cine_{index:04d}.dcm"
        _rt_image(frame, path, physics, beam, delivery.gantry_deg[index], acquired, index + 1)
        paths.append(path)
    return paths


def write_xim_cine(delivery: Delivery, folder: str | Path, physics: PanelPhysics = PanelPhysics()) -> list[Path]:
    """The frames as Varian XIM files in ``folder`` (frame_0000.xim, ...), as a TrueBeam panel writes
    its cine frames: whole panel units, the pitch in cm (0.75 mm at SID ``physics.sid_mm``), the
    panel's height below the isocentre, the gantry angle on Varian's Standard scale and the linac's
    MU counter at each frame's start and end (``bench.xim_files``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pitch_cm = IMAGE_MM * physics.sid_mm / 1000.0 / 10.0
    header = {"PixelWidth": pitch_cm, "PixelHeight": pitch_cm, "MVSourceVrt": 100.0,
              "MVDetectorVrt": (1000.0 - physics.sid_mm) / 10.0, "MVCollimatorRtn": 180.0}
    paths = []
    for index, frame in enumerate(delivery.frames):
        start, stop = delivery.counter_mu[index]
        paths.append(write_xim(folder / f"frame_{index:04d}.xim", np.rint(frame).astype(np.int32), {
            **header, "GantryRtn": float((180.0 - delivery.gantry_deg[index]) % 360.0), "MVDoseStart": float(start),
            "MVDoseStop": float(stop)}))
    return paths


def write_integrated(delivery: Delivery, path: str | Path, physics: PanelPhysics = PanelPhysics(),
                     beam: int = 1) -> Path:
    """The sum of the delivery's frames as one RT Image (a portal-dosimetry acquisition)."""
    _rt_image(delivery.frames.sum(0), Path(path), physics, beam, None, datetime.datetime(2026, 11, 26, 9, 0), 1)
    return Path(path)


def _rt_image(frame: np.ndarray, path: Path, physics: PanelPhysics, beam: int, gantry_deg: float | None,
              acquired: datetime.datetime, instance: int) -> None:
    size = frame.shape[0]
    pitch = IMAGE_MM * physics.sid_mm / 1000.0
    low = min(0.0, float(frame.min()))
    slope = max(float(frame.max()) - low, 1e-6) / 65535.0
    dataset = Dataset()
    dataset.file_meta = FileMetaDataset()
    dataset.file_meta.MediaStorageSOPClassUID = RT_IMAGE_STORAGE
    dataset.SOPClassUID = RT_IMAGE_STORAGE
    dataset.SOPInstanceUID = dataset.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    dataset.Modality = "RTIMAGE"
    dataset.ImageType = ["ORIGINAL", "PRIMARY", "PORTAL"]
    dataset.SamplesPerPixel = 1
    dataset.PhotometricInterpretation = "MONOCHROME2"
    dataset.Rows = dataset.Columns = size
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit, dataset.PixelRepresentation = 16, 16, 15, 0
    dataset.RescaleSlope, dataset.RescaleIntercept = f"{slope:.9g}", f"{low:.9g}"
    dataset.RTImagePlane = "NORMAL"
    dataset.ImagePlanePixelSpacing = [f"{pitch:g}", f"{pitch:g}"]
    first = (size - 1) / 2 * pitch
    dataset.RTImagePosition = [f"{-first:.4f}", f"{first:.4f}"]
    dataset.RTImageSID = f"{physics.sid_mm:g}"
    dataset.RadiationMachineSAD = "1000"
    dataset.BeamLimitingDeviceAngle = "0"
    dataset.XRayImageReceptorAngle = "0"
    dataset.ReferencedBeamNumber = beam
    dataset.InstanceNumber = instance
    dataset.AcquisitionDateTime = acquired.strftime("%Y%m%d%H%M%S.%f")
    if gantry_deg is not None:
        dataset.GantryAngle = f"{gantry_deg:.2f}"
    stored = np.clip(np.rint((frame - float(dataset.RescaleIntercept)) / float(dataset.RescaleSlope)), 0, 65535)
    dataset.PixelData = stored.astype("<u2").tobytes()
    dataset.save_as(path, enforce_file_format=True)
