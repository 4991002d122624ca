"""Varian's native cine images (XIM), read through pylinac, an optional extra, never a parser of
our own.

A TrueBeam panel writes each cine frame as one XIM file: the pixels in the panel's raw units and a
header of named properties. ``read_xim`` reads one with ``pylinac.core.image.XIM`` and puts what
places its pixels and its frame into an RT Image data set, which ``epid.dicom.series`` then reads
like any measured image (``epid.dicom.image.grid_frames``):

- ``PixelWidth`` / ``PixelHeight`` (cm at the imager) -> ``ImagePlanePixelSpacing`` (mm);
- ``MVSourceVrt`` (cm, the source above the isocentre; 100 cm where absent) -> the SAD, and with
  ``MVDetectorVrt`` (cm, the panel's height, negative below the isocentre) the SID = SAD -
  MVDetectorVrt;
- ``MVDetectorLat`` / ``MVDetectorLng`` (cm) -> ``XRayImageReceptorTranslation`` (x, y);
- ``GantryRtn`` and ``MVCollimatorRtn``, on Varian's Standard scale as pylinac reads them ->
  IEC 61217 by pylinac's own conversion (``GantryAngle``, ``BeamLimitingDeviceAngle``);
- the linac's MU counter: ``MVDoseStart`` and ``MVDoseStop`` (MU at the frame's start and end), or
  ``MVDoseDelivered`` alone (MU at its end; the frame then starts where the frame before it
  ended) -> ``XimFrame.delivered_mu``, which places the frame on the plan by cumulative MU, also
  where the gantry waits.

The image is taken as seen from the source, its rows running along -y and its columns along +x,
centred on the beam axis less the receptor's translation (as an RT Image without
``RTImagePosition``).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, generate_uid

from epid.core.errors import InputError
from epid.dicom.image import RT_IMAGE_STORAGE, decimal_string

SIGNATURE = b"VMS.XI"
"""The first bytes of an XIM file."""
CM = 10.0
"""Millimetres per centimetre (the header's unit of length)."""
DEFAULT_SOURCE_CM = 100.0
"""The SAD where ``MVSourceVrt`` is absent, cm."""
PYLINAC = "python -m pip install -r requirements-xim.txt && python -m pip install --no-deps pylinac==3.49.0"
"""How to install the optional reader (pylinac pins pydicom below 3, which its XIM reader does not need)."""


@dataclass(frozen=True)
class XimFrame:
    """One XIM file as an RT Image ``dataset`` (pixels, geometry, angles) and the linac's MU
    counter at the frame's start and end (``delivered_mu``, (2,), NaN where the header has none)."""

    dataset: Dataset
    delivered_mu: np.ndarray


def is_xim(path: str | Path) -> bool:
    """Whether ``path`` is a file that starts as an XIM file does."""
    try:
        with open(path, "rb") as file:
            return file.read(len(SIGNATURE)) == SIGNATURE
    except OSError:
        return False


def read_xim(path: str | Path, error: type[InputError]) -> XimFrame:
    """The XIM file ``path`` as an ``XimFrame`` (module docstring); ``error``, one line naming the
    file, where pylinac is missing, the file does not decode, or its header lacks the pixel size
    or the panel's height."""
    try:
        from pylinac.core.image import XIM
        from pylinac.core.scale import MachineScale, convert
    except ImportError:
        raise error(f"{path}: a Varian XIM image; reading it needs pylinac, an optional extra: {PYLINAC}") from None
    try:
        image = XIM(path)
        pixels = np.ascontiguousarray(image.array, dtype=np.int32)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError,
            struct.error) as problem:
        reason = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
        raise error(f"{path}: malformed XIM image ({reason})") from None
    header = image.properties

    def number(name: str, default: float = math.nan) -> float:
        value = header.get(name, default)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise error(f"{path}: XIM property {name} = {value!r} is not a number") from None

    width, height = number("PixelWidth"), number("PixelHeight")
    if not (width > 0 and height > 0):
        raise error(f"{path}: XIM without a positive PixelWidth and PixelHeight (cm): {width:g}, {height:g}")
    source, detector = number("MVSourceVrt", DEFAULT_SOURCE_CM), number("MVDetectorVrt")
    if not math.isfinite(detector) or not source - detector > 0 or not source > 0:
        raise error(f"{path}: XIM without the panel's height (MVDetectorVrt {detector:g} cm, MVSourceVrt "
                    f"{source:g} cm); the SID is unknown")
    gantry, collimator, _ = convert(MachineScale.VARIAN_STANDARD, MachineScale.IEC61217,
                                    gantry=number("GantryRtn"), collimator=number("MVCollimatorRtn", 180.0),
                                    rotation=180.0)
    dataset = Dataset()
    dataset.file_meta = FileMetaDataset()
    dataset.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    dataset.SOPClassUID, dataset.SOPInstanceUID, dataset.Modality = RT_IMAGE_STORAGE, generate_uid(), "RTIMAGE"
    dataset.SamplesPerPixel, dataset.PhotometricInterpretation = 1, "MONOCHROME2"
    dataset.Rows, dataset.Columns = pixels.shape
    dataset.BitsAllocated, dataset.BitsStored, dataset.HighBit, dataset.PixelRepresentation = 32, 32, 31, 1
    dataset.PixelData = pixels.astype("<i4").tobytes()
    dataset.RTImagePlane = "NORMAL"
    dataset.ImagePlanePixelSpacing = [decimal_string(height * CM), decimal_string(width * CM)]
    dataset.RadiationMachineSAD = decimal_string(source * CM)
    dataset.RTImageSID = decimal_string((source - detector) * CM)
    dataset.XRayImageReceptorTranslation = [decimal_string(number(name, 0.0) * CM) for name in ("MVDetectorLat",
                                                                                          "MVDetectorLng")] + \
        [decimal_string(detector * CM)]
    dataset.BeamLimitingDeviceAngle = decimal_string(collimator)
    if math.isfinite(gantry):
        dataset.GantryAngle = decimal_string(gantry)
    start, stop = number("MVDoseStart"), number("MVDoseStop")
    if not (math.isfinite(start) and math.isfinite(stop)):
        start, stop = math.nan, number("MVDoseDelivered")
    return XimFrame(dataset, np.array([start, stop]))

