"""Clinical MLCs as data: leaf boundaries along y, layers, travel and jaws of each.

An ``MlcGeometry`` describes one multileaf collimator at the isocentre (IEC 61217 BEAM LIMITING
DEVICE coordinates: leaves travel along x, leaf pairs stacked along y). ``identify`` finds a
plan's MLC from its leaf boundaries (and, for a dual-layer MLC, from the pair counts of its
layers, never from device names).

The synthesis, the models and the reconstruction see an MLC through its *strips*
(``epid.synthesis.geometry.StripGrid``): the 52 rows of 5 mm over y in [-130, 130) mm that span the
imager, each with the aperture edges an image of it shows, or for leaves of 2.5 mm (HD120) 104 strips
of 2.5 mm. An MLC's ``grid`` is the coarsest on which every strip lies within at most one leaf of
each layer (``strip_leaves``): a 10 mm leaf is two strips that share its position (Millennium 120's
outer leaves, MLCi2), a leaf outside the strips is beyond the imager (Agility's outer 28 pairs:
not verifiable from an image), a strip beyond a layer's leaves is open in that layer (HD120's
leaves end at +-110 mm), and for a dual-layer MLC (Halcyon) a strip's edges are where both layers
are open: bank A's edge the larger of its two leaves, bank B's the smaller. The legacy grid is the
52 strips themselves. The aperture models take an MLC on its own strips (``modelled``: some grid
shows it); the legacy family only one on the 52 strips with every strip under a leaf
(``design_strips_reason``).

The synthesis of a real MLC renders each layer's leaves over the strips (``layer_edges``) and
leaks only at the boundaries between two leaves of a layer (``interleaf``).

``leaves`` takes strip edges (..., strips) to the positions of each layer's leaves (a leaf over
several strips at their mean, rounded to 0.1 mm outwards, or for a dual-layer MLC at the most open
of its strips' edges), ``strips`` takes those back; ``strips(leaves(x))`` is what the MLC can
show of edges x, unchanged for the legacy grid, and a second pass changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from epid.synthesis.geometry import (
    LEAF_WIDTH_MM,
    MLC_Y_MIN_MM,
    NUM_LEAF_PAIRS,
    STRIP_GRIDS,
    STRIPS,
    TENTHS_PER_MM,
    StripGrid,
)

BOUNDARY_MATCH_MM = 1e-3
"""Largest difference between two leaf boundaries taken as the same, mm."""
STRIP_EDGES_MM = STRIPS.edges_mm
"""Edges of the 52 strips along y, mm."""
ROUNDING_SLACK = 1e-3
"""Tenths of a mm by which a float32 position may miss its whole tenth and still be taken as on it."""


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

    def to_dict(self) -> dict[str, Any]:
        """Plain-typed copy (for checkpoints and cache keys)."""
        return {"name": self.name, "description": self.description, "layers": [list(b) for b in self.layers],
                "travel_mm": self.travel_mm, "x_jaws": self.x_jaws, "y_jaws": self.y_jaws}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> MlcGeometry:
        """Rebuild from ``to_dict`` output: the built-in MLC of that name when it is the same, or when only
        its X jaws differ (earlier releases flagged X jaws on Agility, whose head has none)."""
        geometry = cls(str(values["name"]), str(values["description"]),
                       tuple(tuple(float(v) for v in b) for b in values["layers"]), float(values["travel_mm"]),
                       bool(values.get("x_jaws", True)), bool(values.get("y_jaws", True)))
        known = MLC_GEOMETRIES.get(geometry.name)
        if known is not None and replace(geometry, description=known.description, x_jaws=known.x_jaws) == known:
            return known
        return geometry

    @property
    def arcs_have_x_jaws(self) -> bool:
        """Whether this MLC's synthetic arcs have X jaws (``epid.synthesis.sequences.x_jaw_path``), and so
        its batches' scalars and the models that learn them: every MLC with X jaws but the legacy grid,
        whose arcs stay the design's."""
        return self.x_jaws and self != LEGACY_GRID

    @property
    def pairs(self) -> tuple[int, ...]:
        """Leaf pairs of each layer."""
        return tuple(len(boundaries) - 1 for boundaries in self.layers)

    def matches(self, layers: Sequence[np.ndarray]) -> bool:
        """Whether leaf boundaries of a plan's layers (in any order) are this MLC's."""
        return self.layer_order(layers) is not None

    def layer_order(self, layers: Sequence[np.ndarray]) -> list[int] | None:
        """For each of this MLC's layers, the index of the given layer (leaf boundaries, any order)
        that is it; None when the given layers are not this MLC's."""
        if len(layers) != len(self.layers):
            return None
        order: list[int] = []
        for own in self.layers:
            found = next((i for i, given in enumerate(layers) if i not in order and len(given) == len(own)
                          and np.allclose(given, own, rtol=0.0, atol=BOUNDARY_MATCH_MM)), None)
            if found is None:
                return None
            order.append(found)
        return order

    @property
    def grid(self) -> StripGrid:
        """The coarsest strips on which every strip lies within at most one leaf of each layer;
        ValueError naming the first leaf boundary inside a strip of the finest."""
        for grid in STRIP_GRIDS:
            found = _strip_leaves(self.layers, grid)
            if isinstance(found, tuple):
                return grid
        raise ValueError(f"MLC {self.name} ({self.description}): {found}")

    @property
    def modelled(self) -> bool:
        """Whether the aperture models can take this MLC: its strips (``grid``) exist."""
        return not self.unmodelled_reason

    @property
    def unmodelled_reason(self) -> str:
        """Why no strips can show this MLC ("" when some can)."""
        found = _strip_leaves(self.layers, STRIP_GRIDS[-1])
        return found if isinstance(found, str) else ""

    @property
    def under_leaves(self) -> np.ndarray:
        """(strips,) bool: the strips of ``grid`` under a leaf of every layer (the others are open
        wherever the jaws are: nothing there to estimate)."""
        return np.logical_and.reduce([leaves >= 0 for leaves in self.strip_leaves])

    @property
    def narrow_strips(self) -> np.ndarray:
        """(strips,) bool: the strips under a leaf narrower than 5 mm in every layer (HD120's 2.5 mm
        leaves; none on the 52 strips)."""
        narrow = [np.append(np.diff(np.asarray(boundaries)) < LEAF_WIDTH_MM - BOUNDARY_MATCH_MM, False)[leaves]
                  for boundaries, leaves in zip(self.layers, self.strip_leaves, strict=True)]
        return np.logical_and.reduce(narrow) & self.under_leaves

    @property
    def design_strips_reason(self) -> str:
        """Why this MLC is not on the design's 52 strips with every strip under a leaf of each layer,
        as the legacy model family needs ("" when it is)."""
        found = _strip_leaves(self.layers, STRIPS)
        if isinstance(found, str):
            return found
        for number, (leaves, boundaries) in enumerate(zip(found, self.layers, strict=True)):
            if (leaves < 0).any():
                layer = f"layer {number + 1}'s " if len(self.layers) > 1 else ""
                return (f"{layer}leaves span y in [{boundaries[0]:g}, {boundaries[-1]:g}] mm, not the imager's "
                        f"strips [{STRIP_EDGES_MM[0]:g}, {STRIP_EDGES_MM[-1]:g}] mm")
        return ""

    @property
    def strip_leaves(self) -> tuple[np.ndarray, ...]:
        """Per layer, the leaf (index into that layer's pairs) over each strip of ``grid``, (strips,)
        int each, -1 for a strip beyond that layer's leaves."""
        found = _strip_leaves(self.layers, self.grid)
        assert isinstance(found, tuple)
        return found

    @property
    def leaf_labels(self) -> tuple[str, ...]:
        """Per strip of ``grid``, the MLC's own leaf over it as a physicist names it: numbered from 1 in
        the plan's order, one per layer joined by "/" (Halcyon's distal/proximal), "" beyond its leaves."""
        return tuple("/".join(str(int(leaves[strip]) + 1) for leaves in self.strip_leaves if leaves[strip] >= 0)
                     for strip in range(self.grid.count))

    @property
    def identity(self) -> bool:
        """Whether the strips are the leaves (one layer, one strip per leaf: ``strips(leaves(x)) == x``)."""
        leaves = self.strip_leaves[0]
        return len(self.layers) == 1 and (leaves >= 0).all() and len(np.unique(leaves)) == len(leaves)

    @property
    def strip_layout(self) -> tuple[tuple[int, ...], ...]:
        """``strip_leaves`` as plain ints for a model's config: empty when the strips are the leaves
        (``identity``: the legacy grid, Agility), so that their models stay as they were."""
        return () if self.identity else tuple(tuple(int(v) for v in leaves) for leaves in self.strip_leaves)

    @property
    def interleaf(self) -> np.ndarray:
        """(layers, strips - 1) float32: 1 where the boundary between two neighbouring strips is one
        between two of that layer's leaves (where interleaf leakage passes and tongue and groove
        meet), 0 where both strips lie in one leaf or one is beyond the layer's leaves."""
        return np.stack([(np.diff(leaves) != 0) & (leaves[:-1] >= 0) & (leaves[1:] >= 0)
                         for leaves in self.strip_leaves]).astype(np.float32)

    def layer_edges(self, leaf_a: np.ndarray, leaf_b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Strip edges leaf_a, leaf_b (..., strips) mm -> per layer, the edges (..., strips) of that
        layer's leaves over each strip: a single layer's are the strip edges; a dual layer's leaves stand
        at the most open positions their strips allow (``leaves``: the synthetic arcs' own)."""
        if len(self.layers) == 1:
            return [(np.asarray(leaf_a, dtype=np.float64), np.asarray(leaf_b, dtype=np.float64))]
        return [(a[..., leaf], b[..., leaf]) for (a, b), leaf in zip(self.leaves(leaf_a, leaf_b, tenths=False),
                                                                    self.strip_leaves, strict=True)]

    @property
    def hidden_pairs(self) -> int:
        """Leaf pairs (all layers) that cover no strip: beyond the imager, never verifiable from an image."""
        return sum(self.pairs) - sum(len(np.unique(leaves[leaves >= 0])) for leaves in self.strip_leaves)

    def leaves(self, leaf_a: np.ndarray, leaf_b: np.ndarray,
               tenths: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
        """Strip edges leaf_a, leaf_b (..., strips) mm -> per layer, the (bank A, bank B) positions
        (..., pairs) of its leaves (a single layer's mean rounded outwards to whole tenths of a mm
        when ``tenths``); a leaf that covers no strip closed at the middle of the nearest strip's
        opening."""
        leaf_a, leaf_b = np.asarray(leaf_a, dtype=np.float64), np.asarray(leaf_b, dtype=np.float64)
        dual = len(self.layers) > 1
        result = []
        for pairs, strip_leaf in zip(self.pairs, self.strip_leaves, strict=True):
            under = strip_leaf >= 0
            if not under.all():
                leaf_a, leaf_b, strip_leaf = leaf_a[..., under], leaf_b[..., under], strip_leaf[under]
            covered = np.zeros(pairs, dtype=bool)
            covered[strip_leaf] = True
            counts = np.bincount(strip_leaf, minlength=pairs)
            if dual:
                bank_a = _reduce(np.minimum, leaf_a, strip_leaf, pairs)
                bank_b = _reduce(np.maximum, leaf_b, strip_leaf, pairs)
            elif tenths:
                bank_a = np.floor(_mean(leaf_a, strip_leaf, counts) * TENTHS_PER_MM + ROUNDING_SLACK) / TENTHS_PER_MM
                bank_b = np.ceil(_mean(leaf_b, strip_leaf, counts) * TENTHS_PER_MM - ROUNDING_SLACK) / TENTHS_PER_MM
            else:
                bank_a, bank_b = _mean(leaf_a, strip_leaf, counts), _mean(leaf_b, strip_leaf, counts)
            nearest = _nearest_covered(covered)
            middle = 0.5 * (bank_a + bank_b)[..., nearest]
            result.append((np.where(covered, bank_a, middle), np.where(covered, bank_b, middle)))
        return result

    def strips(self, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """Per layer (bank A, bank B) leaf positions (..., pairs) mm -> the strip edges leaf_a,
        leaf_b (..., strips) an image shows: where every layer is open (a strip beyond a layer's
        leaves open to its travel in that layer)."""
        edges = [(np.where(leaf >= 0, np.asarray(a, dtype=np.float64)[..., leaf], -self.travel_mm),
                  np.where(leaf >= 0, np.asarray(b, dtype=np.float64)[..., leaf], self.travel_mm))
                 for (a, b), leaf in zip(layers, self.strip_leaves, strict=True)]
        leaf_a = functools.reduce(np.maximum, [a for a, _ in edges])
        leaf_b = functools.reduce(np.minimum, [b for _, b in edges])
        return leaf_a, np.maximum(leaf_b, leaf_a)

    def shown(self, leaf_a: np.ndarray, leaf_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Strip edges (..., strips) mm as this MLC can show them: ``strips(leaves(...))`` (float32;
        the same values for the legacy grid)."""
        if self.identity:
            return np.asarray(leaf_a, dtype=np.float32), np.asarray(leaf_b, dtype=np.float32)
        leaf_a, leaf_b = self.strips(self.leaves(leaf_a, leaf_b))
        return leaf_a.astype(np.float32), leaf_b.astype(np.float32)

    def tied(self, leaf_a: np.ndarray, leaf_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Estimates of the strip edges (..., strips) mm as one estimate per leaf: the strips of a single
        layer's leaf at their mean, unrounded (a 10 mm leaf seen in two strips is one leaf); a
        dual-layer MLC's strips are its edges already and stay as they are."""
        if self.identity or len(self.layers) > 1:
            return np.asarray(leaf_a), np.asarray(leaf_b)
        leaf_a, leaf_b = self.strips(self.leaves(leaf_a, leaf_b, tenths=False))
        return leaf_a.astype(np.float32), leaf_b.astype(np.float32)


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
    MlcGeometry("agility", "Elekta Agility: 80 pairs of 5 mm, Y diaphragms, no X jaws",
                (_boundaries(-200.0, [(80, 5.0)]),), travel_mm=200.0, x_jaws=False),
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


def from_boundaries(layers: Sequence[np.ndarray], travel_mm: float) -> MlcGeometry:
    """The built-in MLC whose leaf boundaries these are, else an MLC named "plan" with them (layers
    in the given order) and ``travel_mm``, with X and Y jaws."""
    known = identify(layers)
    if known is not None:
        return known
    described = "; ".join(widths_text(np.asarray(b, dtype=np.float64)) for b in layers)
    return MlcGeometry("plan", f"an MLC read from a plan: {described}",
                       tuple(tuple(round(float(v), 6) for v in b) for b in layers), travel_mm=travel_mm)


def widths_text(boundaries: np.ndarray) -> str:
    """Leaf widths run-length encoded: "10 x 10 mm, 40 x 5 mm, 10 x 10 mm"."""
    runs: list[list[float]] = []
    for width in np.round(np.diff(boundaries), 3):
        if runs and runs[-1][1] == width:
            runs[-1][0] += 1
        else:
            runs.append([1, width])
    return ", ".join(f"{count:g} x {width:g} mm" for count, width in runs)


@functools.lru_cache(maxsize=32)
def _strip_leaves(layers: tuple[tuple[float, ...], ...], grid: StripGrid) -> tuple[np.ndarray, ...] | str:
    """Per layer, the leaf over each strip of ``grid`` (-1 beyond the layer's leaves), or why a strip
    lies over two."""
    found = []
    strip_edges = grid.edges_mm
    for number, boundaries in enumerate(layers):
        edges = np.asarray(boundaries, dtype=np.float64)
        lower = np.searchsorted(edges, strip_edges[:-1] + BOUNDARY_MATCH_MM, side="right") - 1
        upper = np.searchsorted(edges, strip_edges[1:] - BOUNDARY_MATCH_MM, side="left") - 1
        layer = f"layer {number + 1}'s " if len(layers) > 1 else ""
        beyond = (lower < 0) | (upper >= len(edges) - 1)
        split = np.flatnonzero((lower != upper) & ~beyond)
        if len(split) or (beyond & ~((upper < 0) | (lower >= len(edges) - 1))).any():
            strip = int(split[0]) if len(split) else int(np.flatnonzero(beyond)[0])
            inside = edges[(edges > strip_edges[strip]) & (edges < strip_edges[strip + 1])]
            return (f"{layer}leaves are finer than the models' {grid.strip_mm:g} mm strips (leaf boundary at "
                    f"{inside[0]:g} mm inside the strip y in [{strip_edges[strip]:g}, {strip_edges[strip + 1]:g}) mm)")
        lower = np.where(beyond, -1, lower)
        lower.flags.writeable = False
        found.append(lower)
    return tuple(found)


def _mean(values: np.ndarray, strip_leaf: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Mean (..., pairs) of ``values`` (..., strips) over the strips of each leaf (0 where none)."""
    sums = np.zeros(values.shape[:-1] + (len(counts),))
    np.add.at(sums, (..., strip_leaf), values)
    return sums / np.maximum(counts, 1)


def _reduce(operation: np.ufunc, values: np.ndarray, strip_leaf: np.ndarray, pairs: int) -> np.ndarray:
    """``operation`` (minimum or maximum) of ``values`` (..., strips) over the strips of each leaf."""
    start = np.inf if operation is np.minimum else -np.inf
    reduced = np.full(values.shape[:-1] + (pairs,), start)
    operation.at(reduced, (..., strip_leaf), values)
    return np.where(np.isfinite(reduced), reduced, 0.0)


def _nearest_covered(covered: np.ndarray) -> np.ndarray:
    """For each leaf, the nearest leaf (itself where covered) that covers a strip."""
    indices = np.flatnonzero(covered)
    leaf = np.arange(len(covered))
    return indices[np.abs(leaf[:, None] - indices[None, :]).argmin(axis=1)]


def identify(layers: Sequence[np.ndarray]) -> MlcGeometry | None:
    """The built-in MLC whose layers' leaf boundaries these are (one array per layer), or None."""
    return next((geometry for geometry in MLC_GEOMETRIES.values() if geometry.matches(layers)), None)
