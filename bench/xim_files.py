"""Varian XIM files written in the compressed form TrueBeam panels write: the cine frames of
``bench.clinic_delivery`` in Varian's own format, and the tests' (the reader is pylinac's, which
reads these back pixel for pixel, tests/dicom/test_xim.py).

Layout (little-endian): "VMS.XI" padded to 8 bytes; version, width, height, bits and bytes per
pixel, compression flag (int32 each); the lookup table's size and bytes (a 2-bit code per
difference, four to a byte, the lowest bits first: 0 one byte, 1 two, 2 four); the compressed
buffer's size and bytes (the first row and the first pixel of the second row as int32, then every
other pixel as the difference p[i] - p[i - 1] - p[i - w] + p[i - w - 1] in raster order, in the
bytes its code says); the uncompressed buffer's size; the histogram's bin count and bins; the
properties (name length, name, type, value: 0 int32, 1 float64, 2 string with its length,
4 float64 array and 5 int32 array with their byte counts).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

PROPERTY_INT, PROPERTY_DOUBLE, PROPERTY_STRING, PROPERTY_DOUBLES = 0, 1, 2, 4


def _compressed(pixels: np.ndarray) -> tuple[bytes, bytes]:
    """(lookup table, compressed buffer) of int32 ``pixels`` (height, width)."""
    height, width = pixels.shape
    flat = pixels.astype(np.int64).ravel()
    head = flat[: width + 1].astype("<i4").tobytes()
    index = np.arange(width + 1, flat.size)
    differences = flat[index] - flat[index - 1] - flat[index - width] + flat[index - width - 1]
    codes = np.where(np.abs(differences) < 128, 0, np.where(np.abs(differences) < 32768, 1, 2))
    widths = 1 << codes  # bytes of each difference: the low bytes of its little-endian int32
    as_bytes = differences.astype("<i4").view(np.uint8).reshape(-1, 4)
    body = as_bytes[np.arange(4) < widths[:, None]].tobytes()
    padded = np.concatenate([codes, np.zeros((-codes.size) % 4, dtype=codes.dtype)]).reshape(-1, 4)
    table = (padded << np.array([0, 2, 4, 6])).sum(1).astype(np.uint8).tobytes()
    return table, head + body


def _property(name: str, value: object) -> bytes:
    encoded = struct.pack("<i", len(name)) + name.encode()
    if isinstance(value, bool | int):
        return encoded + struct.pack("<ii", PROPERTY_INT, int(value))
    if isinstance(value, float):
        return encoded + struct.pack("<id", PROPERTY_DOUBLE, value)
    if isinstance(value, str):
        return encoded + struct.pack("<ii", PROPERTY_STRING, len(value)) + value.encode()
    values = np.asarray(value, dtype="<f8")
    return encoded + struct.pack("<ii", PROPERTY_DOUBLES, values.nbytes) + values.tobytes()


def write_xim(path: str | Path, pixels: np.ndarray, properties: dict[str, object]) -> Path:
    """An XIM file of int32 ``pixels`` (height, width) with ``properties`` (int, float, str or a
    sequence of floats each)."""
    height, width = pixels.shape
    table, buffer = _compressed(pixels)
    parts = [b"VMS.XI\x00\x00", struct.pack("<7i", 1, width, height, 32, 4, 1, len(table)), table,
             struct.pack("<i", len(buffer)), buffer, struct.pack("<ii", pixels.size * 4, 0),
             struct.pack("<i", len(properties)), *(_property(name, value) for name, value in properties.items())]
    path = Path(path)
    path.write_bytes(b"".join(parts))
    return path
