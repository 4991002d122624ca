"""The MLC of an RT Plan beam: its leaf devices read as an ``MlcGeometry``.

A single-layer MLC is the device ``MLCX`` (bank A the first half of its ``LeafJawPositions``, the
IEC 61217 X1 side; bank B the second half, X2). A dual-layer MLC is two devices whose types start
with ``MLCX`` (Halcyon's ``MLCX1`` and ``MLCX2``); which is which is found from the pair counts
and boundaries of each (``epid.synthesis.mlc.identify``), never from the names. An MLC that is not
a built-in one is taken from the plan as it is (``from_boundaries``). Either way every strip of
one of the strip grids (5 or 2.5 mm, ``MlcGeometry.grid``) must lie within at most one leaf of each
layer, or the beam is refused naming the MLC and the first strip that cannot be shown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from pydicom.dataset import Dataset

from epid.synthesis.mlc import MlcGeometry, from_boundaries, widths_text

MLC_TYPE = "MLCX"
MAX_TRAVEL_MM = 200.0
"""Farthest a leaf or jaw of any clinical MLC reaches from the beam axis at isocentre, mm (the
leaves of a known MLC: its own ``MlcGeometry.travel_mm``): a plan position beyond it is an error in
the file, never clamped."""


@dataclass(frozen=True)
class BeamMlc:
    """A beam's MLC: its geometry, the device type of each of the geometry's layers, and how it
    reads in reports ("MLCX (agility) 80 leaf pairs: 80 x 5 mm")."""

    geometry: MlcGeometry
    devices: tuple[str, ...]
    description: str


def read_mlc(where: str, devices: dict[str, Dataset], numbers: Callable[[Dataset, str], np.ndarray | None],
             error: type[Exception]) -> BeamMlc:
    """The MLC of a beam from its ``BeamLimitingDeviceSequence`` items by device type; ``numbers``
    reads a numeric element, ``error`` (one line starting with ``where``) is raised for a beam
    without an MLC, with inconsistent counts or boundaries, or with an MLC the strips cannot show."""
    names = sorted(name for name in devices if name.startswith(MLC_TYPE))
    if not names:
        others = sorted(devices)
        mlcs = [name for name in others if name.startswith("MLC")]
        if mlcs:
            raise error(f"{where}: unsupported MLC {', '.join(mlcs)} (only MLCX devices, leaves moving along x, "
                        "are read)")
        raise error(f"{where}: no MLC (beam limiting devices: {', '.join(others) or 'none'})")
    if MLC_TYPE in names and len(names) > 1:
        raise error(f"{where}: MLC devices {', '.join(names)}: expected MLCX alone or the layers of a dual-layer MLC")
    if len(names) > 2:
        raise error(f"{where}: MLC devices {', '.join(names)}: at most two layers are read")
    layers = [_boundaries(where, name, devices[name], numbers, error) for name in names]
    geometry = from_boundaries(layers, MAX_TRAVEL_MM)
    order = geometry.layer_order(layers)
    named = f" ({geometry.name})" if geometry.name != "plan" else ""
    described = [f"{names[i]}{named if len(names) == 1 else ''} {len(layers[i]) - 1} leaf pairs: "
                 f"{widths_text(layers[i])}" for i in order]
    description = described[0] if len(names) == 1 else \
        f"{geometry.name if named else 'dual-layer MLC'}: {'; '.join(described)}"
    if not geometry.modelled:
        raise error(f"{where}: unsupported MLC: {description}: {geometry.unmodelled_reason}")
    return BeamMlc(geometry, tuple(names[i] for i in order), description)


def _boundaries(where: str, name: str, device: Dataset, numbers: Callable[[Dataset, str], np.ndarray | None],
                error: type[Exception]) -> np.ndarray:
    pairs = device.get("NumberOfLeafJawPairs")
    boundaries = numbers(device, "LeafPositionBoundaries")
    if boundaries is None:
        raise error(f"{where}: {name} has no LeafPositionBoundaries")
    if pairs not in (None, "") and int(pairs) != len(boundaries) - 1:
        raise error(f"{where}: inconsistent leaf counts: {name} has {int(pairs)} leaf pairs but "
                    f"{len(boundaries)} LeafPositionBoundaries (expected {int(pairs) + 1})")
    if len(boundaries) < 2 or np.any(np.diff(boundaries) <= 0):
        raise error(f"{where}: {name} LeafPositionBoundaries are not increasing")
    return boundaries
