"""DICOM RT Images: EPID frames written for other tools, and measured frames read onto the
project's grid.

The project's grid (design section 4): 256 x 256 pixels of 1 mm at the isocentre, pixel (r, c)
centred at x = c - 127.5 mm, y = 127.5 - r mm (row 0 the most positive y), in the collimator's
frame (IEC BEAM LIMITING DEVICE: x along the leaves' travel).

RT Image geometry (DICOM PS3.3 C.8.8.2), RT Image Plane NORMAL: the image is seen from the
source, its columns run along +x and its rows along -y of the IEC X-RAY IMAGE RECEPTOR system;
``RTImagePosition`` is the centre of the first pixel there (mm at the imager), and
``ImagePlanePixelSpacing`` is [row spacing, column spacing] at the imager. A point at the
isocentre plane is magnified by SID / SAD at the imager. The receptor system is the gantry's
turned by ``XRayImageReceptorAngle`` and shifted by ``XRayImageReceptorTranslation`` (x, y);
the collimator's is the gantry's turned by ``BeamLimitingDeviceAngle``. Angles are
counterclockwise seen from the source.

Each frame integrates one control-point interval: frame i of an image holds the signal from
control point k - 1 to control point k, and carries k. The classic RT Image has no standard
per-frame control-point attribute (an Exposure Sequence item can name its frame but not its
control point), so ``write_frames`` stores k of every frame in a private element,
(0011,1001) "control point index of each frame" (IS, one value per frame) of the private
creator "EPID control points", and points the Multi-frame module's ``FrameIncrementPointer``
at it. ``read_frames`` also accepts ``ExposureSequence`` items that carry
``ReferencedControlPointIndex`` (300C,00F0) (with ``ReferencedFrameNumber`` in a multi-frame
image), as other tools can write them.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import pydicom.pixels
import scipy.ndimage
import scipy.sparse
import torch
from pydicom.dataset import Dataset
from pydicom.sequence import Sequence as DicomSequence

from epid.core.errors import InputError
from epid.dicom.files import check_sop_class, new_dataset, read_dataset, save_dataset
from epid.dicom.plan import SAD_MM, PlanBeam, PlanError, read_plan
from epid.synthesis.geometry import GRID_SIZE, PIXEL_MM

RT_IMAGE_STORAGE = "1.2.840.10008.5.1.4.1.1.481.1"
PRIVATE_GROUP = 0x0011
PRIVATE_CREATOR = "EPID control points"
CONTROL_POINT_ELEMENT = 0x01
"""Offset in the private block of the control point index of each frame, (0011,1001)."""
STORED_LEVELS = 65535
"""Largest stored value (16-bit unsigned pixels; RT Images allow 8 or 16 bits)."""
FRAMES_PER_CHUNK = 64
Parsed = TypeVar("Parsed")


class ImageError(InputError):
    """An RT Image file that cannot be read as frames on the project's grid; one line naming
    the file and the problem."""


@dataclass(frozen=True)
class MeasuredFrames:
    """Frames read from RT Images, on the project's grid, sorted by control point.

    frames: (F, 256, 256) float32, 1 mm pixels at the isocentre, row 0 the most positive y, in
    the images' own units (after their rescale slope and intercept).
    control_point_index: (F,) int64; frame i integrates control point k - 1 to k and holds k.
    sid_mm: the source-to-imager distance of the (first) image, mm.
    """

    path: str
    """The file read, or the files, comma-separated."""
    frames: np.ndarray
    control_point_index: np.ndarray
    sid_mm: float

    def __len__(self) -> int:
        return int(self.frames.shape[0])


# --------------------------------------------------------------------------- writing


def write_frames(
    path: str | Path,
    frames: np.ndarray | torch.Tensor,
    *,
    control_point_index: Sequence[int] | None = None,
    plan_path: str | Path | None = None,
    beam: int | None = None,
    description: str = "predicted",
) -> None:
    """Write ``frames`` (F, 256, 256) on the project's grid as one multi-frame RT Image.

    Pixels are 1 mm at the isocentre with RTImageSID = RadiationMachineSAD = 1000 mm, so the
    image plane is the isocentre plane. ``control_point_index`` gives the control point k of
    each frame (frame i integrates k - 1 -> k; default 1..F). With ``plan_path`` the image
    references that RT Plan (its SOP instance, patient and study) and its beam ``beam`` (default:
    the plan's only treatment beam, or its first), and the receptor is turned with the beam's
    collimator (XRayImageReceptorAngle = BeamLimitingDeviceAngle), so that the image axes are
    the collimator's, like the frames'.

    Precision: values are stored as 16-bit unsigned integers with one RescaleSlope and
    RescaleIntercept for the whole image (intercept min(0, smallest value), slope (largest -
    intercept) / 65535), so each value is kept within half a step, (largest - intercept) / 131070
    (``read_frames`` adds the float32 rounding of its frames).
    """
    values = _frames_array(frames)
    count = values.shape[0]
    indices = list(range(1, count + 1)) if control_point_index is None else [int(k) for k in control_point_index]
    if len(indices) != count:
        raise ValueError(f"{len(indices)} control point indices for {count} frames")
    if min(indices) < 1:
        raise ValueError("control point indices start at 1 (frame k integrates control point k - 1 to k)")
    plan_dataset, plan_beam = _plan_reference(plan_path, beam)
    dataset = new_dataset(RT_IMAGE_STORAGE, "RTIMAGE", description, reference=plan_dataset)
    dataset.InstanceNumber = 1
    dataset.PatientOrientation = ""
    dataset.ContentDate = dataset.InstanceCreationDate
    dataset.ContentTime = dataset.InstanceCreationTime
    _image_pixel(dataset, values)
    dataset.NumberOfFrames = count
    block = dataset.private_block(PRIVATE_GROUP, PRIVATE_CREATOR, create=True)
    block.add_new(CONTROL_POINT_ELEMENT, "IS", indices)
    dataset.FrameIncrementPointer = block.get_tag(CONTROL_POINT_ELEMENT)
    _rt_image(dataset, description, plan_dataset, plan_beam)
    save_dataset(path, dataset)


def _frames_array(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(frames, torch.Tensor):
        frames = frames.detach().cpu().numpy()
    values = np.asarray(frames, dtype=np.float64)
    if values.ndim != 3 or values.shape[1:] != (GRID_SIZE, GRID_SIZE) or values.shape[0] < 1:
        raise ValueError(f"frames of shape {values.shape}: expected (F, {GRID_SIZE}, {GRID_SIZE}) with F >= 1")
    if not np.all(np.isfinite(values)):
        raise ValueError("frames hold values that are not finite")
    return values


def _plan_reference(plan_path: str | Path | None, beam: int | None) -> tuple[Dataset | None, PlanBeam | None]:
    """The plan's dataset and the chosen beam (a ``PlanBeam``), or (None, None) without a plan."""
    if plan_path is None:
        return None, None
    beams = read_plan(plan_path, beam)
    return read_dataset(plan_path, PlanError, "an RT Plan"), beams[0]


def decimal_string(value: float) -> str:
    """``value`` as a decimal string of at most 16 characters (DS)."""
    return f"{value:.9g}"


def _image_pixel(dataset: Dataset, values: np.ndarray) -> None:
    """Image Pixel and Modality LUT: 16-bit unsigned pixels, rescaled to the frames' values."""
    intercept = min(0.0, float(values.min()))
    span = float(values.max()) - intercept
    slope_text = decimal_string(span / STORED_LEVELS if span > 0 else 1.0)
    intercept_text = decimal_string(intercept)
    slope, intercept = float(slope_text), float(intercept_text)
    stored = np.clip(np.rint((values - intercept) / slope), 0, STORED_LEVELS).astype("<u2")
    dataset.SamplesPerPixel = 1
    dataset.PhotometricInterpretation = "MONOCHROME2"
    dataset.Rows, dataset.Columns = GRID_SIZE, GRID_SIZE
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit = 16, 16, 15
    dataset.PixelRepresentation = 0
    dataset.PixelIntensityRelationship = "LIN"
    dataset.PixelIntensityRelationshipSign = 1
    dataset.RescaleIntercept = intercept_text
    dataset.RescaleSlope = slope_text
    dataset.RescaleType = "US"
    dataset.PixelData = stored.tobytes()


def _rt_image(dataset: Dataset, description: str, plan: Dataset | None, beam: PlanBeam | None) -> None:
    """RT Image module: the isocentre plane (SID = SAD), the project's grid, the plan's beam."""
    collimator = f"{beam.collimator_deg:g}" if beam is not None else "0"
    dataset.RTImageLabel = description[:16]
    dataset.RTImageDescription = description
    dataset.ImageType = ["DERIVED", "SECONDARY", "PORTAL"]
    dataset.ConversionType = "WSD"
    dataset.ReportedValuesOrigin = "PLAN"
    dataset.RTImagePlane = "NORMAL"
    dataset.XRayImageReceptorTranslation = [0, 0, 0]
    dataset.XRayImageReceptorAngle = collimator
    dataset.BeamLimitingDeviceAngle = collimator
    dataset.ImagePlanePixelSpacing = [f"{PIXEL_MM:g}", f"{PIXEL_MM:g}"]
    first = (GRID_SIZE - 1) / 2 * PIXEL_MM
    dataset.RTImagePosition = [f"{-first:g}", f"{first:g}"]
    dataset.RadiationMachineName = beam.machine if beam is not None else "EPID"
    dataset.PrimaryDosimeterUnit = "MU"
    dataset.RadiationMachineSAD = f"{SAD_MM:g}"
    dataset.RTImageSID = f"{SAD_MM:g}"
    if plan is not None:
        reference = Dataset()
        reference.ReferencedSOPClassUID = plan.SOPClassUID
        reference.ReferencedSOPInstanceUID = plan.SOPInstanceUID
        dataset.ReferencedRTPlanSequence = DicomSequence([reference])
        dataset.ReferencedBeamNumber = beam.beam_number


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class _Geometry:
    """Where an RT Image's pixels lie: spacing (row, column) and first pixel centre (x, y) at the
    imager in mm, SID and SAD in mm, and the angle (degrees) that turns receptor axes into
    collimator axes, with the receptor origin's offset in the collimator frame at the imager."""

    spacing: tuple[float, float]
    first_pixel: tuple[float, float]
    sid_mm: float
    sad_mm: float
    angle_deg: float
    offset: tuple[float, float]


def read_frames(paths: str | Path | Sequence[str | Path]) -> MeasuredFrames:
    """Frames of one or more RT Images (single-frame files, a multi-frame file, or several),
    resampled onto the project's 256 x 256 grid of 1 mm at the isocentre and sorted by their
    control point.

    Every frame must integrate one control-point interval and say which: the private element
    ``write_frames`` writes, or ``ReferencedControlPointIndex`` in its ``ExposureSequence`` item.
    Pixel size at the isocentre = ImagePlanePixelSpacing x RadiationMachineSAD / RTImageSID; an
    image without RTImagePosition is taken as centred on the beam axis.

    Resampling is area-weighted: each 1 mm pixel is the mean of the image over its square
    (each detector pixel counted by the share of its area inside); parts of the grid outside
    the detector read 0. When the receptor is turned against the collimator, the area-weighted
    1 mm image in receptor axes is then turned onto the grid by bilinear interpolation
    (scipy.ndimage.map_coordinates, order 1).

    ImageError (one line naming the file) for a file that is not a readable RT Image, lacks
    pixel spacing, SID, SAD or a control-point reference per frame, or repeats a control point.
    """
    given = [paths] if isinstance(paths, str | Path) else list(paths)
    if not given:
        raise ImageError("no RT Image files given")
    frames, indices, sources, sids = [], [], [], []
    for path in map(str, given):
        image_frames, image_indices, sid_mm = _read_image(path)
        frames.append(image_frames)
        indices.append(image_indices)
        sources.extend([path] * len(image_indices))
        sids.append(sid_mm)
    index = np.concatenate(indices)
    order = np.argsort(index, kind="stable")
    index = index[order]
    repeated = np.flatnonzero(np.diff(index) == 0)
    if repeated.size:
        first = repeated[0]
        raise ImageError(f"{sources[order[first + 1]]}: control point {index[first]} is also in "
                         f"{sources[order[first]]}; each control-point interval may have one frame")
    stacked = np.concatenate(frames)[order]
    stacked.flags.writeable = False
    index.flags.writeable = False
    return MeasuredFrames(path=", ".join(map(str, given)), frames=stacked, control_point_index=index,
                          sid_mm=sids[0])


def _read_image(path: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(frames (F, 256, 256) float32 on the grid, control point of each frame (F,), SID in mm)."""
    return read_rt_image(path, _image_frames)


def read_rt_image(path: str, parse: Callable[[str, Dataset], Parsed]) -> Parsed:
    """``parse(path, dataset)`` of the RT Image in ``path``; ImageError (one line naming the file)
    for a file that is not a readable RT Image, or whose parsing meets malformed elements or pixel
    data it cannot decode."""
    dataset = read_dataset(path, ImageError, "an RT Image")
    check_sop_class(path, dataset, RT_IMAGE_STORAGE, "RTIMAGE", "an RT Image", ImageError)
    try:
        return parse(path, dataset)
    except ImageError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError, NotImplementedError) as problem:
        reason = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
        raise ImageError(f"{path}: malformed RT Image or undecodable pixel data ({reason})") from None


def _image_frames(path: str, dataset: Dataset) -> tuple[np.ndarray, np.ndarray, float]:
    pixels = grid_frames(path, dataset)
    indices = _control_points(path, dataset, len(pixels.frames))
    return pixels.frames, indices, pixels.sid_mm


@dataclass(frozen=True)
class GridFrames:
    """The frames of one RT Image on the project's grid.

    frames: (F, 256, 256) float32, 1 mm pixels at the isocentre, in the image's own units (after its
    rescale slope and intercept). outside_percent: (F,) share of each frame's field signal (pixels
    at or above 10 % of the frame's maximum) that falls outside the grid, percent.
    sid_mm: the image's source-to-imager distance; pixel_mm: its pixel at the isocentre (the
    larger of row and column spacing x SAD / SID).
    """

    frames: np.ndarray
    outside_percent: np.ndarray
    sid_mm: float
    pixel_mm: float


FIELD_LEVEL = 0.1
"""Share of a frame's maximum above which its pixels count as the field (``GridFrames.outside_percent``)."""


def grid_frames(path: str, dataset: Dataset,
                correction: Callable[[str, np.ndarray], np.ndarray] | None = None) -> GridFrames:
    """Every frame of the RT Image ``dataset`` (read from ``path``) resampled onto the grid
    (``read_frames`` says how), each first corrected on its own pixels by ``correction(path,
    values (B, rows, columns))`` where given (a panel's dark offset and flood-field gain,
    ``epid.dicom.series.PanelCorrection``); ImageError (one line naming the file) for an image
    without pixel data, spacing, SID or SAD, or whose pixels are not integrated signal."""
    geometry = _geometry(path, dataset)
    resample = _resampler(geometry, int(dataset.Rows), int(dataset.Columns))
    count = int(dataset.get("NumberOfFrames", 1) or 1)
    frames = np.empty((count, GRID_SIZE, GRID_SIZE), dtype=np.float32)
    outside = np.zeros(count)
    for start, values in _rescaled_chunks(path, dataset):
        if correction is not None:
            values = correction(path, values)
        frames[start:start + len(values)] = resample(values)
        outside[start:start + len(values)] = resample.outside_percent(values)
    scale = geometry.sad_mm / geometry.sid_mm
    return GridFrames(frames=frames, outside_percent=outside, sid_mm=geometry.sid_mm,
                      pixel_mm=max(geometry.spacing) * scale)


def detector_frames(path: str, dataset: Dataset) -> np.ndarray:
    """Every frame of the RT Image ``dataset`` on its own detector pixels, after its rescale:
    (F, rows, columns) float32 (dark and flood images, ``epid.dicom.series.panel_correction``)."""
    return np.concatenate([values for _, values in _rescaled_chunks(path, dataset)])


def _rescaled_chunks(path: str, dataset: Dataset) -> Iterator[tuple[int, np.ndarray]]:
    """(first frame, frames (B, rows, columns) float32 after ``RescaleSlope`` / ``RescaleIntercept``)
    of the RT Image ``dataset``, ``FRAMES_PER_CHUNK`` frames at a time; ImageError (one line naming
    the file) for pixels that are not one sample of integrated signal, or fewer than its frames."""
    if "PixelData" not in dataset:
        raise ImageError(f"{path}: RT Image without pixel data")
    if int(dataset.get("SamplesPerPixel", 1)) != 1:
        raise ImageError(f"{path}: {dataset.SamplesPerPixel} samples per pixel; EPID frames have 1")
    if int(dataset.get("PixelIntensityRelationshipSign", 1)) == -1:
        raise ImageError(f"{path}: pixel values fall as the intensity rises (PixelIntensityRelationshipSign -1); "
                         "expected frames of integrated signal")
    count = int(dataset.get("NumberOfFrames", 1) or 1)
    slope = float(dataset.get("RescaleSlope", 1) or 1)
    intercept = float(dataset.get("RescaleIntercept", 0) or 0)
    stored = pydicom.pixels.iter_pixels(dataset)
    for start in range(0, count, FRAMES_PER_CHUNK):
        chunk = list(itertools.islice(stored, FRAMES_PER_CHUNK))
        if not chunk:
            raise ImageError(f"{path}: pixel data for {start} frames, NumberOfFrames {count}")
        yield start, np.stack(chunk).astype(np.float32) * slope + intercept


def _control_points(path: str, dataset: Dataset, count: int) -> np.ndarray:
    """The control point k of each of the ``count`` frames (frame integrates k - 1 -> k)."""
    indices = frame_control_points(path, dataset, count)
    if indices is None:
        raise ImageError(f"{path}: no control-point reference: each frame must integrate one control-point interval "
                         "and name it (ReferencedControlPointIndex in its ExposureSequence item, or the frames' "
                         "control-point element that epid writes); measured cine frames and integrated images "
                         "are read by epid.dicom.series")
    return indices


def frame_control_points(path: str, dataset: Dataset, count: int) -> np.ndarray | None:
    """The control point k (``count``,) each frame of ``dataset`` names (it integrates k - 1 -> k),
    or None when the image names none; ImageError for references that are partial or below 1."""
    indices = None
    try:
        block = dataset.private_block(PRIVATE_GROUP, PRIVATE_CREATOR)
        if CONTROL_POINT_ELEMENT in block:
            indices = np.atleast_1d(np.asarray(block[CONTROL_POINT_ELEMENT].value, dtype=np.int64))
    except KeyError:
        indices = None
    if indices is None:
        indices = _exposure_control_points(path, dataset, count)
    if indices is None:
        return None
    if len(indices) != count:
        raise ImageError(f"{path}: {len(indices)} control-point references for {count} frames")
    if np.any(indices < 1):
        raise ImageError(f"{path}: control point index {int(indices.min())}: a frame integrates control point "
                         "k - 1 to k, so k >= 1")
    return indices


def exposure_items(path: str, dataset: Dataset, count: int) -> list[Dataset | None]:
    """The ``ExposureSequence`` item of each of the ``count`` frames (None where a frame has
    none): a one-frame image's only item, else the items by ReferencedFrameNumber."""
    items = list(dataset.get("ExposureSequence", []))
    if count == 1 and len(items) == 1:
        return items
    by_frame: list[Dataset | None] = [None] * count
    for item in items:
        frame = int(item.get("ReferencedFrameNumber", 0) or 0)
        if not 1 <= frame <= count:
            raise ImageError(f"{path}: ExposureSequence item with ReferencedFrameNumber {frame or 'missing'} "
                             f"in an image of {count} frames")
        by_frame[frame - 1] = item
    return by_frame


def _exposure_control_points(path: str, dataset: Dataset, count: int) -> np.ndarray | None:
    """Control points from ``ExposureSequence`` items with ReferencedControlPointIndex, or None
    when no item names one."""
    items = exposure_items(path, dataset, count)
    named = [item is not None and "ReferencedControlPointIndex" in item for item in items]
    if not any(named):
        return None
    if not all(named):
        raise ImageError(f"{path}: frame {named.index(False) + 1} has no control-point reference "
                         "(ReferencedControlPointIndex) where other frames have one")
    return np.array([int(item.ReferencedControlPointIndex) for item in items], dtype=np.int64)


def _number(path: str, dataset: Dataset, keyword: str, count: int) -> list[float]:
    value = dataset.get(keyword)
    values = [] if value in (None, "") else [float(v) for v in np.atleast_1d(value)]
    if len(values) < count:
        raise ImageError(f"{path}: no {keyword}; the pixel size at the isocentre needs it")
    return values[:count]


def _geometry(path: str, dataset: Dataset) -> _Geometry:
    plane = str(dataset.get("RTImagePlane", "NORMAL") or "NORMAL")
    if plane != "NORMAL":
        raise ImageError(f"{path}: RTImagePlane {plane}; only images normal to the beam are read")
    spacing = _number(path, dataset, "ImagePlanePixelSpacing", 2)
    sid = _number(path, dataset, "RTImageSID", 1)[0]
    sad = _number(path, dataset, "RadiationMachineSAD", 1)[0]
    if min(spacing) <= 0 or sid <= 0 or sad <= 0:
        raise ImageError(f"{path}: pixel spacing {spacing}, SID {sid} and SAD {sad} must be positive")
    rows, columns = int(dataset.Rows), int(dataset.Columns)
    position = dataset.get("RTImagePosition")
    if position in (None, "") or len(position) < 2:
        first = (-(columns - 1) / 2 * spacing[1], (rows - 1) / 2 * spacing[0])
    else:
        first = (float(position[0]), float(position[1]))
    translation = dataset.get("XRayImageReceptorTranslation")
    shift = (0.0, 0.0) if translation in (None, "") or len(translation) < 2 else \
        (float(translation[0]), float(translation[1]))
    receptor = float(dataset.get("XRayImageReceptorAngle", 0) or 0)
    collimator = float(dataset.get("BeamLimitingDeviceAngle", 0) or 0)
    offset = _turn(shift, -collimator)
    return _Geometry(spacing=(spacing[0], spacing[1]), first_pixel=first, sid_mm=sid, sad_mm=sad,
                     angle_deg=(receptor - collimator) % 360.0, offset=offset)


def _turn(point: tuple[float, float], angle_deg: float) -> tuple[float, float]:
    """``point`` turned counterclockwise by ``angle_deg``."""
    cos, sin = math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))
    return (cos * point[0] - sin * point[1], sin * point[0] + cos * point[1])


def _box_weights(pixel_edges: np.ndarray, cell_edges: np.ndarray) -> np.ndarray:
    """(cells, pixels) share of each 1 mm cell covered by each pixel (edges increasing, mm)."""
    low = np.maximum(cell_edges[:-1, None], pixel_edges[None, :-1])
    high = np.minimum(cell_edges[1:, None], pixel_edges[None, 1:])
    overlap = np.clip(high - low, 0.0, None)
    return overlap / (cell_edges[1:, None] - cell_edges[:-1, None])


@functools.lru_cache(maxsize=4)
def _resampler(geometry: _Geometry, rows: int, columns: int) -> _Resampler:
    """The ``_Resampler`` of an image geometry, made once: the single-frame files of a cine series
    share theirs (its weights took two fifths of reading a series)."""
    return _Resampler(geometry, rows, columns)


class _Resampler:
    """Maps frames (B, rows, columns) of an RT Image onto the project's grid (B, 256, 256).

    With q the receptor's x, y scaled to the isocentre, a grid point p (collimator frame) lies
    at q = R(-angle) (p - offset). Area weighting is separable along the receptor's axes:
    out = W_y @ image @ W_x^T, W the share of each 1 mm cell covered by each detector pixel,
    normalised by the covered share (a cell half on the detector is the mean of its covered
    half). Without a turn the cells are the grid's own pixels; with one, a larger receptor-aligned
    grid of 1 mm cells around the grid's centre is filled and the grid is read from it bilinearly.
    """

    def __init__(self, geometry: _Geometry, rows: int, columns: int) -> None:
        scale = geometry.sad_mm / geometry.sid_mm
        self.angle = math.radians(geometry.angle_deg)
        self.turned = not math.isclose(math.cos(self.angle), 1.0, abs_tol=1e-12)
        # a turned grid's corners reach sqrt(2) x its half-width; an even size keeps the cell centres
        # on the grid's half-millimetres, so that quarter turns read cells exactly
        margin = 0 if not self.turned else int(math.ceil(GRID_SIZE * (math.sqrt(2) - 1) / 2)) + 2
        self.size = GRID_SIZE + 2 * margin
        self.offset = (geometry.offset[0] * scale, geometry.offset[1] * scale)
        self.centre = self._receptor(0.0, 0.0)
        centres = (np.arange(self.size) - (self.size - 1) / 2) * PIXEL_MM
        cell_x, cell_y = centres + self.centre[0], centres[::-1] + self.centre[1]
        first_x, first_y = geometry.first_pixel[0] * scale, geometry.first_pixel[1] * scale
        row_pitch, column_pitch = geometry.spacing[0] * scale, geometry.spacing[1] * scale
        pixel_x_edges = first_x + (np.arange(columns + 1) - 0.5) * column_pitch
        pixel_y_edges = first_y - (np.arange(rows + 1) - 0.5) * row_pitch
        self.weights_x = _normalised(_box_weights(pixel_x_edges, _edges(cell_x)))
        # rows run toward -y: weigh on increasing y, then put cells and pixels back in row order
        weights_y = _box_weights(pixel_y_edges[::-1], _edges(cell_y[::-1]))[::-1, ::-1]
        # float32 weights and frames: a detector's counts need no more, and half the memory traffic
        self.weights_y = scipy.sparse.csr_array(_normalised(np.ascontiguousarray(weights_y)).astype(np.float32))
        self.weights_x = scipy.sparse.csr_array(self.weights_x.astype(np.float32))
        pixel_x = first_x + np.arange(columns) * column_pitch
        pixel_y = first_y - np.arange(rows) * row_pitch
        grid_x, grid_y = self._collimator(pixel_x[None, :], pixel_y[:, None])
        half = GRID_SIZE / 2 * PIXEL_MM
        # flat indices of the pixels off the grid (int32: a 1280 x 1280 panel's take 6.5 MB at most)
        self.outside = np.flatnonzero((np.abs(grid_x) > half) | (np.abs(grid_y) > half)).astype(np.int32)

    def _receptor(self, x: np.ndarray | float, y: np.ndarray | float) -> tuple[np.ndarray | float, np.ndarray | float]:
        """Receptor coordinates q (mm at the isocentre) of collimator points (x, y)."""
        cos, sin = math.cos(self.angle), math.sin(self.angle)
        shifted_x, shifted_y = x - self.offset[0], y - self.offset[1]
        return cos * shifted_x + sin * shifted_y, -sin * shifted_x + cos * shifted_y

    def _collimator(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Collimator points (x, y) of receptor coordinates (mm at the isocentre): ``_receptor`` undone."""
        cos, sin = math.cos(self.angle), math.sin(self.angle)
        return cos * x - sin * y + self.offset[0], sin * x + cos * y + self.offset[1]

    def outside_percent(self, frames: np.ndarray) -> np.ndarray:
        """(B,) share of each frame's field signal (pixels at or above ``FIELD_LEVEL`` of its
        maximum) on detector pixels whose centres fall outside the grid, percent."""
        flat = frames.reshape(len(frames), -1)
        field = np.where(flat >= FIELD_LEVEL * flat.max(axis=1, keepdims=True), flat, 0.0)
        total = field.sum(axis=1)
        outside = field[:, self.outside].sum(axis=1)
        return np.divide(100.0 * outside, total, out=np.zeros(len(frames)), where=total > 0)

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        frames = frames.astype(np.float32, copy=False)
        # rows first: the detector's rows are contiguous, and the one transpose is of the smaller product
        averaged = np.stack([(self.weights_x @ (self.weights_y @ frame).T).T for frame in frames])
        if not self.turned:
            return averaged.astype(np.float32)
        centres = (np.arange(GRID_SIZE) - (GRID_SIZE - 1) / 2) * PIXEL_MM
        grid_x, grid_y = np.meshgrid(centres, centres[::-1])
        receptor_x, receptor_y = self._receptor(grid_x, grid_y)
        middle = (self.size - 1) / 2
        coordinates = np.stack([middle - (receptor_y - self.centre[1]), middle + (receptor_x - self.centre[0])])
        return np.stack([scipy.ndimage.map_coordinates(frame, coordinates, order=1, cval=0.0)
                         for frame in averaged]).astype(np.float32)


def _normalised(weights: np.ndarray) -> np.ndarray:
    """Rows of ``weights`` divided by their sums (rows summing to 0 stay 0)."""
    covered = weights.sum(axis=1, keepdims=True)
    return np.divide(weights, covered, out=np.zeros_like(weights), where=covered > 1e-9)


def _edges(centres: np.ndarray) -> np.ndarray:
    """Edges (n + 1) of 1 mm cells around increasing ``centres`` (n)."""
    return np.concatenate([centres - PIXEL_MM / 2, centres[-1:] + PIXEL_MM / 2])
