"""Measured EPID images as clinics record them: one integrated image of a beam (portal dosimetry),
or a cine series whose frames carry a gantry angle and a time rather than a control point.

``read_series`` reads RT Images (files, folders of files, glob patterns; single- or multi-frame;
with or without the DICOM preamble) onto the project's grid (``epid.dicom.image.grid_frames``:
each image's own rescale, pixel spacing, SID and receptor offsets) and keeps, per frame, what
places it in the delivery:

- ``StartCumulativeMetersetWeight`` / ``EndCumulativeMetersetWeight`` (300C,0008 / 0009) of a
  one-frame image: the span of the beam's meterset it integrates, exact;
- a control point (the frames ``epid.dicom.image.write_frames`` writes, or
  ``ReferencedControlPointIndex`` in an ``ExposureSequence`` item);
- the gantry angle: ``GantryAngle`` of the frame's ``ExposureSequence`` item, else of the image;
- the time: ``AcquisitionDateTime`` (else ``AcquisitionDate`` + ``AcquisitionTime``, else
  ``ContentDate`` + ``ContentTime``) of the image, plus ``FrameTime`` (ms) per frame of a multi-frame
  image;
- ``MetersetExposure`` of the frame's ``ExposureSequence`` item (the MU it integrated);
- the linac's MU counter at the frame's start and end, from Varian's XIM cine frames
  (``epid.dicom.xim``: read through pylinac, an optional extra; a frame with only its end
  starts where the frame before it ended, the first at 0).

Frames are ordered by control point where every frame names one, else by the MU counter where
every frame has it, else by time where every frame has one, else by ``InstanceNumber`` and the
order given. XIM files and RT Images may be given alike (an XIM file is known by its first
bytes). A series is one beam: images naming different ``ReferencedBeamNumber`` are refused;
``read_beam_series`` splits a whole plan's delivery into one series per beam by that number.
``epid.evaluation.timeline`` places the frames on a plan's arc.
"""

from __future__ import annotations

import datetime
import glob
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset

from epid.core.files import GLOB_CHARACTERS
from epid.dicom.image import (
    ImageError,
    Parsed,
    detector_frames,
    exposure_items,
    frame_control_points,
    grid_frames,
    read_rt_image,
)
from epid.dicom.xim import is_xim, read_xim

FLOOD_CENTRE_SHARE = 0.1
"""Share of the panel's rows and columns, about its centre, over which a flood image's gain is 1."""
MIN_FLOOD_GAIN = 0.2
"""Least gain a flood image may give a pixel (relative to its centre): below it the flood field does
not cover the panel."""
TIMESTAMP = re.compile(r"^(\d{8}(?:\d{2}){0,3})(?:\.(\d{1,6}))?")
"""A DICOM DT (date, then hours, minutes, seconds, fraction; any UTC offset after it ignored)."""


@dataclass(frozen=True)
class MeasuredSeries:
    """Frames of measured RT Images on the project's grid, in delivery order (F frames).

    frames: (F, 256, 256) float32, 1 mm pixels at the isocentre, in the images' own units.
    sources: the file of each frame. gantry_deg: (F,) NaN where a frame has no angle. time_s: (F,)
    seconds after the series' first frame, NaN where a frame has no time. meterset_weight: (F, 2)
    start and end cumulative meterset weight of each frame's span, NaN where not given.
    meterset_exposure: (F,) MU each frame integrated, NaN where not given. delivered_mu: (F, 2) the
    linac's MU counter at each frame's start and end, NaN where not given. control_point_index:
    (F,) the control point k a frame names (it integrates k - 1 -> k), 0 where none.
    outside_percent: (F,) share of each frame's field signal outside the grid, percent.
    beam_number: the ``ReferencedBeamNumber`` the images name, None where none does.
    sid_mm, pixel_mm: the first image's SID and pixel at the isocentre.
    """

    path: str
    frames: np.ndarray
    sources: tuple[str, ...]
    gantry_deg: np.ndarray
    time_s: np.ndarray
    meterset_weight: np.ndarray
    meterset_exposure: np.ndarray
    delivered_mu: np.ndarray
    control_point_index: np.ndarray
    outside_percent: np.ndarray
    beam_number: int | None
    sid_mm: float
    pixel_mm: float

    def __len__(self) -> int:
        return int(self.frames.shape[0])

    @property
    def integrated(self) -> bool:
        """One image that names no control point: the integrated image of the whole beam (or of
        its meterset span, where it gives one)."""
        return len(self) == 1 and not self.control_point_index[0]


def expand_paths(given: str | Path | Sequence[str | Path]) -> list[str]:
    """The files ``given`` names: files as they are, every file of a folder (sorted, hidden ones
    left out), the sorted matches of a glob pattern. ImageError for a name that matches nothing."""
    names = [given] if isinstance(given, str | Path) else list(given)
    if not names:
        raise ImageError("no RT Image files given")
    files: list[str] = []
    for name in map(str, names):
        if Path(name).is_dir():
            found = sorted(str(p) for p in Path(name).iterdir() if p.is_file() and not p.name.startswith("."))
            if not found:
                raise ImageError(f"{name}: a folder without files; expected RT Images")
            files.extend(found)
        elif GLOB_CHARACTERS.search(name) and not Path(name).exists():
            found = sorted(p for p in glob.glob(name) if Path(p).is_file())
            if not found:
                raise ImageError(f"{name}: no file matches this pattern")
            files.extend(found)
        else:
            files.append(name)
    return files


@dataclass(frozen=True)
class PanelCorrection:
    """A panel's dark offset and flood-field gain on its own pixels, (rows, columns) float32 each:
    a frame's pixels p become (p - dark) / gain before they are resampled onto the grid. ``dark``
    is the mean of the dark images (0 without), ``gain`` the mean flood image less the dark over its
    mean in the panel's central ``FLOOD_CENTRE_SHARE`` (1 without). As a panel's own flood
    calibration does, the gain takes the beam's off-axis profile out of the frames with the pixels'
    response; a commissioned forward model learns the profile that is left (``--commission`` fits
    it). ``sources``: the files, for the report."""

    dark: np.ndarray
    gain: np.ndarray
    sources: dict[str, list[str]]

    def __call__(self, path: str, values: np.ndarray) -> np.ndarray:
        """Frames ``values`` (B, rows, columns) of the image in ``path`` corrected; ImageError, one
        line naming the file, where its pixels are not the dark and flood images' own."""
        if values.shape[-2:] != self.dark.shape:
            raise ImageError(f"{path}: {values.shape[-2]} x {values.shape[-1]} pixels, but the dark and flood "
                             f"images have {self.dark.shape[0]} x {self.dark.shape[1]}; they must be the same panel's")
        return (values - self.dark) / self.gain


def panel_correction(dark: str | Path | Sequence[str | Path] | None,
                     flood: str | Path | Sequence[str | Path] | None) -> PanelCorrection | None:
    """The ``PanelCorrection`` of ``dark`` and ``flood`` images (files, folders or glob patterns of RT
    Images or XIM files; each the mean of its frames), None without either. ImageError, one line
    naming the file, for images of different sizes, or a flood image that does not cover the panel
    (a pixel's gain below ``MIN_FLOOD_GAIN`` of its centre's, or not finite)."""
    if dark is None and flood is None:
        return None
    dark_files, offset = _mean_pixels(dark) if dark is not None else ([], None)
    flood_files, flooded = _mean_pixels(flood) if flood is not None else ([], None)
    if offset is not None and flooded is not None and offset.shape != flooded.shape:
        raise ImageError(f"{flood_files[0]}: a flood image of {flooded.shape[0]} x {flooded.shape[1]} pixels, but "
                         f"the dark image {dark_files[0]} has {offset.shape[0]} x {offset.shape[1]}")
    if offset is None:
        offset = np.zeros(flooded.shape, np.float32)
    gain = np.ones_like(offset) if flooded is None else _flood_gain(flood_files[0], flooded - offset)
    return PanelCorrection(offset, gain, {name: files for name, files in (("dark", dark_files), ("flood", flood_files))
                                          if files})


def _flood_gain(path: str, signal: np.ndarray) -> np.ndarray:
    """A flood image's signal (rows, columns) over its mean in the panel's central
    ``FLOOD_CENTRE_SHARE``; ImageError naming ``path`` where it does not cover the panel."""
    def central(size: int) -> slice:
        first = round(size * (1 - FLOOD_CENTRE_SHARE) / 2)
        return slice(first, max(first + 1, size - first))

    level = float(signal[central(signal.shape[0]), central(signal.shape[1])].mean())
    gain = (signal / level if level > 0 else np.full_like(signal, np.nan)).astype(np.float32)
    low = ~(gain >= MIN_FLOOD_GAIN)
    if low.any():
        row, column = np.argwhere(low)[0]
        raise ImageError(f"{path}: {int(low.sum())} of {gain.size} flood-image pixels at less than "
                         f"{MIN_FLOOD_GAIN:.0%} of its centre's signal (first: row {row}, column {column}); a flood "
                         "field covers the whole panel")
    return gain


def _mean_pixels(given: str | Path | Sequence[str | Path]) -> tuple[list[str], np.ndarray]:
    """The files ``given`` names and the mean of all their frames on the detector's own pixels."""
    files = expand_paths(given)
    frames = []
    for path in files:
        frames.append(_parsed(path, lambda name, dataset, _: detector_frames(name, dataset)))
        if frames[-1].shape[1:] != frames[0].shape[1:]:
            raise ImageError(f"{path}: {frames[-1].shape[1]} x {frames[-1].shape[2]} pixels, but {files[0]} has "
                             f"{frames[0].shape[1]} x {frames[0].shape[2]}")
    return files, np.concatenate(frames).mean(0, dtype=np.float64).astype(np.float32)


def read_series(given: str | Path | Sequence[str | Path], correction: PanelCorrection | None = None) -> MeasuredSeries:
    """The measured frames of one beam's delivery (module docstring) from ``given``: RT Image or
    XIM files, folders or glob patterns, each frame corrected by ``correction`` where given.
    ImageError, one line naming the file, for a file that is not a readable RT Image or XIM file,
    lacks what its pixels need (spacing, SID, SAD), or names another beam than the files before it; or for a
    series that mixes frames naming control points with frames that do not."""
    files = expand_paths(given)
    parts = [_read(path, correction) for path in files]
    beams = {part.beam_number for part in parts if part.beam_number is not None}
    if len(beams) > 1:
        first = next(part for part in parts if part.beam_number is not None)
        other = next(part for part in parts if part.beam_number not in (None, first.beam_number))
        raise ImageError(f"{other.path}: an image of beam {other.beam_number}, but {first.path} is of beam "
                         f"{first.beam_number}; a series is the delivery of one beam")
    return _series(parts)


def read_beam_series(given: str | Path | Sequence[str | Path],
                     correction: PanelCorrection | None = None) -> list[MeasuredSeries]:
    """The measured frames of each beam's delivery in ``given`` (RT Image or XIM files, folders or
    glob patterns of a whole plan's delivery; each frame corrected by ``correction`` where given),
    grouped by the ``ReferencedBeamNumber`` the images name, in beam-number order; images naming no
    beam join the one beam the others name, or form the only series. ImageError, one line naming
    the file, for an image naming no beam beside images of two or more beams, and for every problem
    ``read_series`` refuses within a beam."""
    files = expand_paths(given)
    parts = [_read(path, correction) for path in files]
    beams = sorted({part.beam_number for part in parts if part.beam_number is not None})
    if len(beams) <= 1:
        return [_series(parts)]
    unnamed = next((part for part in parts if part.beam_number is None), None)
    if unnamed is not None:
        raise ImageError(f"{unnamed.path}: names no beam (ReferencedBeamNumber) beside images of beams "
                         f"{', '.join(map(str, beams))}; each image of a plan's delivery must name its beam")
    return [_series([part for part in parts if part.beam_number == beam]) for beam in beams]


def _series(parts: list[_Image]) -> MeasuredSeries:
    """One beam's frames from its images ``parts`` (at most one beam number among them), in delivery
    order (module docstring)."""
    files = [part.path for part in parts]
    beams = {part.beam_number for part in parts if part.beam_number is not None}
    control_points = np.concatenate([part.control_point_index for part in parts])
    named = control_points > 0
    if named.any() and not named.all():
        without = parts[[bool((part.control_point_index == 0).any()) for part in parts].index(True)].path
        raise ImageError(f"{without}: frames without a control-point reference in a series whose other frames "
                         "name their control points")
    part_of = np.repeat(np.arange(len(parts)), [len(part.frames) for part in parts])
    times = _series_times(parts)
    counted = np.concatenate([part.delivered_mu for part in parts])
    if named.all():
        order = np.argsort(control_points, kind="stable")
    elif np.isfinite(counted[:, 1]).all():
        order = np.argsort(counted[:, 1], kind="stable")
    elif np.isfinite(times).all():
        order = np.argsort(times, kind="stable")
    else:
        instances = np.concatenate([np.full(len(part.frames), part.instance) for part in parts])
        order = np.lexsort((np.arange(len(instances)), instances))
    if np.isfinite(times).any():
        times = times - np.nanmin(times)

    def ordered(name: str) -> np.ndarray:
        values = np.concatenate([getattr(part, name) for part in parts])[order]
        values.flags.writeable = False
        return values

    first = parts[int(part_of[order[0]])]
    within = np.concatenate([np.arange(len(part.frames)) for part in parts])
    frames = np.stack([parts[part_of[i]].frames[within[i]] for i in order])  # one copy, in delivery order
    frames.flags.writeable = False
    times = times[order]
    times.flags.writeable = False
    delivered = counted[order]
    if np.isfinite(delivered[:, 1]).all():  # a frame that gives only its end starts where the one before ended
        delivered[:, 0] = np.where(np.isfinite(delivered[:, 0]), delivered[:, 0],
                                   np.concatenate([[0.0], delivered[:-1, 1]]))
    delivered.flags.writeable = False
    return MeasuredSeries(
        path=", ".join(files) if len(files) <= 3 else f"{files[0]} ... {files[-1]} ({len(files)} files)",
        frames=frames, sources=tuple(parts[i].path for i in part_of[order]), gantry_deg=ordered("gantry_deg"),
        time_s=times, meterset_weight=ordered("meterset_weight"), meterset_exposure=ordered("meterset_exposure"),
        delivered_mu=delivered, control_point_index=ordered("control_point_index"),
        outside_percent=ordered("outside_percent"),
        beam_number=beams.pop() if beams else None, sid_mm=first.sid_mm, pixel_mm=first.pixel_mm,
    )


@dataclass(frozen=True)
class _Image:
    """One RT Image's frames and what places them (``MeasuredSeries``'s fields, per image)."""

    path: str
    frames: np.ndarray
    gantry_deg: np.ndarray
    start_s: float
    frame_s: np.ndarray
    meterset_weight: np.ndarray
    meterset_exposure: np.ndarray
    delivered_mu: np.ndarray
    control_point_index: np.ndarray
    outside_percent: np.ndarray
    beam_number: int | None
    instance: int
    sid_mm: float
    pixel_mm: float


def _read(path: str, correction: PanelCorrection | None) -> _Image:
    """The measured image in ``path``, its frames corrected by ``correction`` where given."""
    return _parsed(path, lambda name, dataset, delivered_mu: _image(name, dataset, delivered_mu, correction))


def _parsed(path: str, parse: Callable[[str, Dataset, np.ndarray | None], Parsed]) -> Parsed:
    """``parse(path, dataset, delivered_mu)`` of the image in ``path``: an XIM file (``epid.dicom.xim``:
    its RT Image data set and the linac's MU counter) or an RT Image (no counter)."""
    if is_xim(path):
        frame = read_xim(path, ImageError)
        return parse(path, frame.dataset, frame.delivered_mu)
    return read_rt_image(path, lambda name, dataset: parse(name, dataset, None))


def _image(path: str, dataset: Dataset, delivered_mu: np.ndarray | None,
           correction: PanelCorrection | None) -> _Image:
    pixels = grid_frames(path, dataset, correction)
    count = len(pixels.frames)
    items = exposure_items(path, dataset, count)
    control_points = frame_control_points(path, dataset, count)
    own_angle = _number(dataset, "GantryAngle") if count == 1 else math.nan
    gantry = np.array([_number(item, "GantryAngle") if item is not None and "GantryAngle" in item else own_angle
                       for item in items])
    exposure = np.array([_number(item, "MetersetExposure") if item is not None else math.nan for item in items])
    weights = np.full((count, 2), math.nan)
    if count == 1:
        weights[0] = (_number(dataset, "StartCumulativeMetersetWeight"),
                      _number(dataset, "EndCumulativeMetersetWeight"))
    beam = dataset.get("ReferencedBeamNumber")
    return _Image(
        path=path, frames=pixels.frames, gantry_deg=gantry, start_s=_acquired_s(dataset),
        frame_s=_frame_offsets_s(dataset, count), meterset_weight=weights, meterset_exposure=exposure,
        delivered_mu=np.full((count, 2), math.nan) if delivered_mu is None else np.tile(delivered_mu, (count, 1)),
        control_point_index=np.zeros(count, np.int64) if control_points is None else control_points,
        outside_percent=pixels.outside_percent, beam_number=int(beam) if beam not in (None, "") else None,
        instance=int(dataset.get("InstanceNumber", 0) or 0), sid_mm=pixels.sid_mm, pixel_mm=pixels.pixel_mm,
    )


def _number(item: Dataset, keyword: str) -> float:
    """``item``'s ``keyword`` as a float (its first value), NaN where absent or empty."""
    value = item.get(keyword)
    if value in (None, ""):
        return math.nan
    return float(np.atleast_1d(value)[0])


def _acquired_s(dataset: Dataset) -> float:
    """The image's acquisition time, seconds since the epoch (the clock as written), NaN if none."""
    stamp = str(dataset.get("AcquisitionDateTime", "") or "")
    if not stamp:
        for date, time in (("AcquisitionDate", "AcquisitionTime"), ("ContentDate", "ContentTime")):
            if dataset.get(time):
                stamp = str(dataset.get(date, "") or "19700101") + str(dataset.get(time)).replace(":", "")
                break
    match = TIMESTAMP.match(stamp)
    if match is None:
        return math.nan
    whole, fraction = match.groups()
    moment = datetime.datetime.strptime(whole.ljust(14, "0"), "%Y%m%d%H%M%S").replace(tzinfo=datetime.UTC)
    return moment.timestamp() + (float("0." + fraction) if fraction else 0.0)


def _frame_offsets_s(dataset: Dataset, count: int) -> np.ndarray:
    """(count,) seconds of each frame after the image's acquisition: ``FrameTime`` (ms) apart, or
    the cumulated ``FrameTimeVector``; NaN for the frames after the first without either."""
    offsets = np.full(count, math.nan)
    offsets[0] = 0.0
    if count == 1:
        return offsets
    if dataset.get("FrameTime") not in (None, ""):
        return np.arange(count) * float(dataset.FrameTime) / 1000.0
    vector = dataset.get("FrameTimeVector")
    if vector not in (None, "") and len(vector) == count:
        return np.cumsum(np.asarray(vector, dtype=np.float64)) / 1000.0
    return offsets


def _series_times(parts: list[_Image]) -> np.ndarray:
    """Every frame's time, seconds since the epoch as written (NaN where unknown)."""
    return np.concatenate([part.start_s + part.frame_s for part in parts])
