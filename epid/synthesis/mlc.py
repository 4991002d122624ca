"""Clinical MLCs as data: leaf boundaries along y, layers, travel and jaws of each.

An ``MlcGeometry`` describes one multileaf collimator at the isocentre (IEC 61217 BEAM LIMITING
DEVICE coordinates: leaves travel along x, leaf pairs stacked along y). The legacy grid (52
pairs of 5 mm over y in [-130, 130) mm) is the one the synthesis, the models and the
reconstruction use; the others are the MLCs clinical plans are written for, known here so that a
plan's MLC is named, its positions checked against its own travel, and a plan the legacy grid
cannot hold is refused naming its MLC (``epid.dicom.plan``). ``identify`` finds a plan's MLC
from its leaf boundaries (and, for a dual-layer MLC, from the pair counts of its layers, never
from device names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from epid.synthesis.geometry import LEAF_WIDTH_MM, MLC_Y_MIN_MM, NUM_LEAF_PAIRS

BOUNDARY_MATCH_MM = 1e-3
"""Largest difference between two leaf boundaries taken as the same, mm."""


@dataclass(frozen=True)
class MlcGeometry:
    """One MLC: ``name``, ``description``, the leaf boundaries of each layer along y (mm, pairs + 1
    increasing values; a second layer only for a dual-layer MLC, whose aperture is where both
    layers are open), how far a leaf tip reaches from the beam axis (``travel_mm``) and whether
    the beam has X and Y jaws."""

    name: str
    description: str
    layers: tuple[tuple[float, ...], ...]
    travel_mm: float
    x_jaws: bool = True
    y_jaws: bool = True

    @property
    def pairs(self) -> tuple[int, ...]:
        """Leaf pairs of each layer."""
        return tuple(len(boundaries) - 1 for boundaries in self.layers)

    def matches(self, layers: Sequence[np.ndarray]) -> bool:
        """Whether leaf boundaries of a plan's layers (in any order) are this MLC's."""
        if sorted(len(b) for b in layers) != sorted(len(b) for b in self.layers):
            return False
        remaining = [np.asarray(b, dtype=np.float64) for b in self.layers]
        for given in layers:
            found = next((i for i, own in enumerate(remaining) if len(own) == len(given)
                          and np.allclose(own, given, rtol=0.0, atol=BOUNDARY_MATCH_MM)), None)
            if found is None:
                return False
            remaining.pop(found)
        return True


def _boundaries(start_mm: float, widths: Sequence[tuple[int, float]]) -> tuple[float, ...]:
    """Boundaries from ``start_mm`` of runs of (count, width mm) leaves."""
    edges = [start_mm]
    for count, width in widths:
        first = edges[-1]
        edges.extend([first + width * (k + 1) for k in range(count)])
    return tuple(round(edge, 6) for edge in edges)


LEGACY_GRID = MlcGeometry(
    "legacy", f"the legacy grid: {NUM_LEAF_PAIRS} pairs of {LEAF_WIDTH_MM:g} mm",
    (_boundaries(MLC_Y_MIN_MM, [(NUM_LEAF_PAIRS, LEAF_WIDTH_MM)]),), travel_mm=200.0,
)
MLC_GEOMETRIES: dict[str, MlcGeometry] = {geometry.name: geometry for geometry in (
    LEGACY_GRID,
    MlcGeometry("agility", "Elekta Agility: 80 pairs of 5 mm", (_boundaries(-200.0, [(80, 5.0)]),),
                travel_mm=200.0),
    MlcGeometry("millennium120", "Varian Millennium 120: 10 x 10, 40 x 5, 10 x 10 mm",
                (_boundaries(-200.0, [(10, 10.0), (40, 5.0), (10, 10.0)]),), travel_mm=200.0),
    MlcGeometry("hd120", "Varian HD120: 14 x 5, 32 x 2.5, 14 x 5 mm",
                (_boundaries(-110.0, [(14, 5.0), (32, 2.5), (14, 5.0)]),), travel_mm=200.0),
    MlcGeometry("mlci2", "Elekta MLCi2: 40 pairs of 10 mm", (_boundaries(-200.0, [(40, 10.0)]),),
                travel_mm=200.0),
    MlcGeometry("halcyon", "Varian Halcyon / Ethos: two stacked layers of 10 mm leaves staggered by 5 mm, no jaws",
                (_boundaries(-140.0, [(28, 10.0)]), _boundaries(-145.0, [(29, 10.0)])), travel_mm=140.0,
                x_jaws=False, y_jaws=False),
)}
"""The built-in MLCs by name."""


def identify(layers: Sequence[np.ndarray]) -> MlcGeometry | None:
    """The built-in MLC whose layers' leaf boundaries these are (one array per layer), or None."""
    return next((geometry for geometry in MLC_GEOMETRIES.values() if geometry.matches(layers)), None)
