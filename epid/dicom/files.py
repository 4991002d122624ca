"""DICOM files in and out, as clinical systems write them: read with a one-line error naming the
file when it is missing, not DICOM, truncated or of the wrong kind; files without the 128-byte
preamble and file meta (as Monaco writes plans) read as bare data sets and said so once; written
atomically (a temporary file renamed over the target) with the modules every object needs.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pydicom
from pydicom.datadict import keyword_for_tag
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.errors import InvalidDicomError
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid

from epid.core.errors import InputError
from epid.core.files import fsync_directory, temporary_path

UNDEFINED_LENGTH = 0xFFFFFFFF


def read_dataset(path: str | Path, error: type[InputError], what: str) -> Dataset:
    """The DICOM dataset in ``path`` (pixel data included); ``error`` naming the file when it is
    missing, not DICOM or truncated. ``what`` names the expected content in messages."""
    try:
        try:
            dataset = pydicom.dcmread(path)
        except InvalidDicomError:
            dataset = _without_preamble(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file (expected {what})") from None
    except IsADirectoryError:
        raise error(f"{path}: a directory, not {what}") from None
    except (EOFError, OSError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError) as problem:
        reason = (str(problem).strip().splitlines() or [type(problem).__name__])[0]
        raise error(f"{path}: unreadable or truncated DICOM file ({reason})") from None
    if dataset is None:
        raise error(f"{path}: not a DICOM file (expected {what})")
    for tag in dataset.keys():
        element = dataset.get_item(tag)
        found = len(element.value or b"") if element.is_raw else 0
        if element.is_raw and element.length != UNDEFINED_LENGTH and found < element.length:
            name = keyword_for_tag(tag) or str(tag)
            raise error(f"{path}: truncated DICOM file ({name}: {found} of {element.length} bytes)")
    if "SOPClassUID" not in dataset and "MediaStorageSOPClassUID" in dataset.file_meta:
        raise error(f"{path}: truncated DICOM file (the data set ends before its SOP Class UID)")
    return dataset


def _without_preamble(path: str | Path) -> Dataset | None:
    """A data set written without the 128-byte preamble and file meta (as Monaco writes plans),
    read by pydicom with ``force`` (its transfer syntax the encoding pydicom found, so that its pixels
    decode); None unless it names its SOP class or modality. The first such file of a process is
    reported once on stderr."""
    try:
        dataset = pydicom.dcmread(path, force=True)
        named = bool(str(dataset.get("SOPClassUID", "")) or str(dataset.get("Modality", "")))
    except (EOFError, OSError, ValueError, KeyError, TypeError, AttributeError, NotImplementedError, InvalidDicomError):
        return None
    if not named:
        return None
    if "TransferSyntaxUID" not in dataset.file_meta:
        implicit, little = dataset.original_encoding
        dataset.file_meta.TransferSyntaxUID = (ImplicitVRLittleEndian if implicit else
                                               ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    if not _PREAMBLE_NOTED:
        _PREAMBLE_NOTED.append(str(path))
        print(f"note: {path} has no DICOM preamble or file meta; read as a bare data set "
              "(and so is any further such file)", file=sys.stderr)
    return dataset


_PREAMBLE_NOTED: list[str] = []
"""The first file read without a preamble (``_without_preamble`` says so once per process)."""


def check_sop_class(path: str, dataset: Dataset, sop_class_uid: str, modality: str, what: str,
                    error: type[InputError]) -> None:
    """``error`` unless ``dataset`` is of ``sop_class_uid`` (or, without a SOP class, of ``modality``)."""
    found_class, found_modality = str(dataset.get("SOPClassUID", "")), str(dataset.get("Modality", ""))
    if found_class != sop_class_uid and not (not found_class and found_modality == modality):
        raise error(f"{path}: not {what} (SOP class {found_class or 'missing'}, "
                    f"modality {found_modality or 'missing'})")


def save_dataset(path: str | Path, dataset: Dataset) -> None:
    """Write ``dataset`` as a DICOM file (Explicit VR Little Endian) atomically: a temporary file
    beside ``path``, renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = dataset.SOPClassUID
    meta.MediaStorageSOPInstanceUID = dataset.SOPInstanceUID
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    dataset.file_meta = meta
    temporary = temporary_path(path)
    try:
        dataset.save_as(temporary, enforce_file_format=True)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


def new_dataset(sop_class_uid: str, modality: str, description: str, reference: Dataset | None = None) -> Dataset:
    """A dataset with the patient, general study, series, general equipment and SOP common
    modules filled in. Patient and study come from ``reference`` (e.g. the plan of an image) when
    given, else a synthetic patient and a new study."""
    now = datetime.datetime.now()
    dataset = Dataset()
    dataset.SOPClassUID = sop_class_uid
    dataset.SOPInstanceUID = generate_uid()
    dataset.InstanceCreationDate = now.strftime("%Y%m%d")
    dataset.InstanceCreationTime = now.strftime("%H%M%S")
    for keyword, default in (("PatientName", "Synthetic^Arc"), ("PatientID", "EPID"), ("PatientBirthDate", ""),
                             ("PatientSex", ""), ("StudyInstanceUID", generate_uid()),
                             ("StudyDate", now.strftime("%Y%m%d")), ("StudyTime", now.strftime("%H%M%S")),
                             ("ReferringPhysicianName", ""), ("StudyID", "EPID"), ("AccessionNumber", "")):
        setattr(dataset, keyword, reference.get(keyword, default) if reference is not None else default)
    dataset.Modality = modality
    dataset.SeriesInstanceUID = generate_uid()
    dataset.SeriesNumber = 1
    dataset.SeriesDescription = description[:64]
    dataset.OperatorsName = ""
    dataset.Manufacturer = "epid"
    return dataset
