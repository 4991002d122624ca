"""Synthetic VMAT deliveries: the control points of each dataset ID.

Each dataset ID is one synthetic arc of N control points (CPs): positions of 52 MLC leaf
pairs (bank A ``leaf_a`` <= bank B ``leaf_b``, mm along x), two jaws (``jaw_1`` lower,
``jaw_2`` upper, mm along y) and the MU of each CP. The pattern and the random seed follow
from the ID alone, so the same ID gives the same arc on any machine. An MLC with leaves of 2.5 mm
(HD120) has its arcs generated on the 104 strips of 2.5 mm (``epid.synthesis.geometry.StripGrid``)
with the same limits per millimetre along y (a neighbour step per strip of half the pattern's,
the leaves copying the band's edge over the same 10 mm), its jaws inside the span of its leaves.

Everything is generated in whole tenths of a millimetre (and of an MU) as integers, so
every limit holds exactly and the 0.1 rounding of the specification cannot break one.
Motion comes in segments that start at random CPs: the jaws and leaves head for new goals
at a segment speed. The whole arc is built with array operations, with no loop over CPs:

- jaws: a bounded step per CP toward their goals, goals inside the jaw ranges, the upper
  jaw pushed up where the lower one comes within the minimum gap;
- leaves: each bank is a field V (CP x leaf) fitted to its targets under difference
  constraints: at most 40 mm between consecutive CPs, at most the pattern's neighbour
  limit between neighbouring leaves (0 for regular fields: one shared pair), at least the
  minimum opening between the banks, inside the leaf travel. A band leaf shows V, the two
  leaves on each side just outside the band show V of the edge leaf, the others are parked.
  Wherever a leaf changes what it shows between two CPs (the band moved), the values it
  shows before and after are held within 20 mm of its parked position, so that the change
  stays within 40 mm. The parked positions themselves satisfy every constraint, so a fit
  always exists; it is found exactly with min-plus envelopes (cumulative minima).

On an MLC with X jaws other than the legacy grid, each arc also has X jaws (``x_jaw_path``), drawn
from a stream of their own so that the leaves and Y jaws are the same arc's: open (outside the
imager), tracking the open leaves with a margin as planning systems' jaw tracking sets them, or
static over the arc, standing inside the widest openings at some control points so that frames show
their edges and hide leaves behind them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from epid.synthesis.geometry import LEAF_WIDTH_MM, MLC_Y_MIN_MM, STRIPS, TENTHS_PER_MM, StripGrid
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry

if TYPE_CHECKING:
    import torch

Positions = TypeVar("Positions", "np.ndarray", "torch.Tensor")

NUM_DATASETS = 640
DEFAULT_CONTROL_POINTS = 2050
MIN_CONTROL_POINTS = 4
"""The fewest control points an arc may have: two samples, one per split."""

PATTERNS = ("regular", "semiregular", "irregular")
MAX_JAW_STEP_MM = 20.0
MAX_LEAF_STEP_MM = 40.0
JAW_1_MIN_MM = -130.0
JAW_2_MAX_MM = 130.0
PARKED_LEAF_A_MM = -20.0
PARKED_LEAF_B_MM = 20.0
EDGE_COPY_LEAVES = 2
"""Leaves on each side just outside the band that copy the nearest band leaf."""
LEAF_RANGE_MM = (-120.0, 120.0)
"""Travel allowed to band leaves, so that both field edges stay inside the imager."""
MU_RANGE = (1.0, 40.0)
X_JAW_MODES = ("open", "tracking", "static")
"""How an arc's X jaws move (``x_jaw_path``), one drawn per arc with equal chances."""
X_JAW_OPEN_MM = 200.0
"""Where open X jaws stand, mm from the beam axis: outside the imager."""
X_JAW_MARGIN_MM = (0.0, 5.0)
"""Range of the margin between tracking X jaws and the open leaves, mm (one per jaw and arc)."""
X_JAW_HIDING_SHARE = (0.05, 0.25)
"""Range of the share of an arc's control points at which a static X jaw stands inside the widest
opening on its side (one per jaw and arc)."""
X_JAW_MATCH_MM = 0.05
"""A leaf within this of an X jaw (or behind it) is taken as hidden by it (``behind_x_jaws``)."""
X_JAW_STREAM = 0x58
"""Second word of the seed of the X jaws' random stream (``seed_for`` the first)."""



@dataclass(frozen=True)
class PatternLimits:
    """The limits of section 3 that differ between patterns (mm)."""

    jaw_1_max_mm: float
    min_jaw_gap_mm: float
    min_leaf_gap_mm: float
    max_neighbour_step_mm: float
    """Largest difference between neighbouring band leaves; 0 means one shared pair."""
    leaf_jitter: bool = False
    """Whether each leaf's target jitters on its own (irregular), not only each bank's."""


PATTERN_LIMITS = {
    "regular": PatternLimits(jaw_1_max_mm=110.0, min_jaw_gap_mm=20.0, min_leaf_gap_mm=20.0, max_neighbour_step_mm=0.0),
    "semiregular": PatternLimits(
        jaw_1_max_mm=120.0, min_jaw_gap_mm=10.0, min_leaf_gap_mm=10.0, max_neighbour_step_mm=10.0
    ),
    "irregular": PatternLimits(
        jaw_1_max_mm=120.0, min_jaw_gap_mm=10.0, min_leaf_gap_mm=10.0, max_neighbour_step_mm=50.0, leaf_jitter=True
    ),
}

_SEGMENT_PROBABILITY = 1.0 / 30.0
"""Chance per CP that a new segment (new goals and speeds) starts."""


@dataclass(frozen=True)
class ControlPoints:
    """The control points of one synthetic delivery (read-only float32 arrays).

    leaf_a, leaf_b: (N, strips) leaf positions of banks A and B, mm along x (52 strips, or 104 on
    the fine strips of an MLC with 2.5 mm leaves: ``mlc.grid``).
    jaw_1, jaw_2: (N,) lower and upper jaw positions, mm along y.
    mu: (N,) monitor units delivered at each CP.
    leaf_weight: (N, strips) 1.0 for leaves in [lo - 2, hi + 2) of the open band, else 0.5; 0 for
    a strip beyond the MLC's leaves (``MlcGeometry.under_leaves``: open, nothing to estimate).
    mlc: the MLC whose strips these are (``epid.synthesis.mlc``): its layers and leaf boundaries
    shape the fluence of a real MLC (``epid.synthesis.fluence.physics_fluence``).
    x_jaws: (N, 2) [X1, X2] mm along x, the X jaws, or None (a beam without them): the leaves are
    the planned positions, also where a jaw hides them (``folded_into_x_jaws``: what frames show).
    """

    leaf_a: np.ndarray
    leaf_b: np.ndarray
    jaw_1: np.ndarray
    jaw_2: np.ndarray
    mu: np.ndarray
    leaf_weight: np.ndarray
    dataset_id: int
    pattern: str
    mlc: MlcGeometry = LEGACY_GRID
    x_jaws: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.mu.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        arrays = (self.leaf_a, self.leaf_b, self.jaw_1, self.jaw_2, self.mu, self.leaf_weight, self.x_jaws)
        return sum(a.nbytes for a in arrays if a is not None)

    def folded_into_x_jaws(self) -> ControlPoints:
        """These control points with every leaf edge an X jaw hides at that jaw's edge
        (``fold_into_x_jaws``), the edges frames show and the inverse models estimate; themselves
        without X jaws."""
        if self.x_jaws is None:
            return self
        leaf_a, leaf_b = fold_into_x_jaws(self.leaf_a, self.leaf_b, self.x_jaws)
        return dataclasses.replace(self, leaf_a=_read_only(leaf_a), leaf_b=_read_only(leaf_b))


def behind_x_jaws(leaf_a: np.ndarray, leaf_b: np.ndarray, x_jaws: np.ndarray) -> np.ndarray:
    """(2, N, strips) int8 for bank A's and bank B's edges (N, strips) mm: 1 where the edge lies at or
    behind the X1 jaw, 2 where at or behind X2 (within ``X_JAW_MATCH_MM`` of the jaws (N, 2) [X1, X2]
    mm), so that an image shows that jaw's edge, not the leaf's; 0 elsewhere."""
    low, high = x_jaws[:, :1] + X_JAW_MATCH_MM, x_jaws[:, 1:] - X_JAW_MATCH_MM
    return np.stack([np.where(leaves <= low, 1, np.where(leaves >= high, 2, 0)).astype(np.int8)
                     for leaves in (leaf_a, leaf_b)])


def fold_into_x_jaws(leaf_a: Positions, leaf_b: Positions, x_jaws: Positions) -> tuple[Positions, Positions]:
    """Leaf edges (N, strips) mm with the part of each opening outside the X jaws (N, 2) [X1, X2] mm
    cut off: bank A's edges clipped into [X1, X2], bank B's too and never below bank A's (a pair
    wholly behind one jaw closed at its edge). numpy arrays or torch tensors alike."""
    low, high = x_jaws[:, :1], x_jaws[:, 1:]
    folded_a = leaf_a.clip(low, high)
    return folded_a, leaf_b.clip(low, high).clip(folded_a)


def pattern_for(dataset_id: int) -> str:
    """The leaf pattern of a dataset ID: "regular", "semiregular" or "irregular"."""
    _check_dataset_id(dataset_id)
    if dataset_id < 80 or 320 <= dataset_id < 400:
        return "regular"
    if dataset_id < 160 or 400 <= dataset_id < 480:
        return "semiregular"
    return "irregular"


def seed_for(dataset_id: int) -> int:
    """The random seed of a dataset ID: 42 + id, or 43 + id for IDs 480-639."""
    _check_dataset_id(dataset_id)
    return (43 if dataset_id >= 480 else 42) + dataset_id


def leaf_band(jaw_1: np.ndarray, jaw_2: np.ndarray, grid: StripGrid = STRIPS) -> tuple[np.ndarray, np.ndarray]:
    """Open band of strips [lo, hi) between the jaws (mm): lo = ceil((130 + jaw_1) / 5), hi likewise
    (strips of ``grid.strip_mm``)."""
    lo = np.ceil((np.asarray(jaw_1, dtype=np.float64) - MLC_Y_MIN_MM) / grid.strip_mm)
    hi = np.ceil((np.asarray(jaw_2, dtype=np.float64) - MLC_Y_MIN_MM) / grid.strip_mm)
    return lo.astype(np.int64), hi.astype(np.int64)


def leaf_weights(jaw_1: np.ndarray, jaw_2: np.ndarray, grid: StripGrid = STRIPS) -> np.ndarray:
    """Leaf weights (N, strips) float32 for jaws (N,) in mm: 1.0 for the strips in [lo - 2, hi + 2)
    of the open band (``leaf_band``; 10 mm of strips each side on any grid), else 0.5."""
    lo, hi = leaf_band(jaw_1, jaw_2, grid)
    leaf, copies = np.arange(grid.count), _edge_copies(grid)
    shaping = (leaf >= lo[:, None] - copies) & (leaf < hi[:, None] + copies)
    return np.where(shaping, 1.0, 0.5).astype(np.float32)


def mlc_leaf_weights(jaw_1: np.ndarray, jaw_2: np.ndarray, mlc: MlcGeometry) -> np.ndarray:
    """``leaf_weights`` on the strips of ``mlc`` (``mlc.grid``), 0 for a strip beyond its leaves
    (``MlcGeometry.under_leaves``: open, nothing to estimate)."""
    return leaf_weights(jaw_1, jaw_2, mlc.grid) * mlc.under_leaves


def generate_control_points(dataset_id: int, n_control_points: int = DEFAULT_CONTROL_POINTS,
                            mlc: MlcGeometry = LEGACY_GRID) -> ControlPoints:
    """The N control points of a dataset ID on the strips of ``mlc`` (``epid.synthesis.mlc``),
    deterministic per ID (numpy Generator seeded by ``seed_for``).

    The legacy grid's arcs are the design's. On another MLC the same arc is what that MLC can show
    of it (``MlcGeometry.shown``: a 10 mm leaf at the mean of its two strips, a dual layer's edges
    where both layers are open); an MLC without Y jaws keeps them open over the whole strip span
    and closes the pairs the design parks outside the field (both leaves at 0 mm), so the field's
    extent along y is the leaves'.
    """
    if n_control_points < 1:
        raise ValueError(f"n_control_points={n_control_points}: expected at least 1")
    pattern = pattern_for(dataset_id)
    grid = mlc.grid
    limits = _on_grid(PATTERN_LIMITS[pattern], grid)
    rng = np.random.default_rng(seed_for(dataset_id))
    starts = _segment_starts(rng, n_control_points)
    jaws = _jaw_path(rng, limits, starts, n_control_points, _jaw_span(mlc))
    lo, hi = _band_edge_tenths(jaws[:, 0], grid), _band_edge_tenths(jaws[:, 1], grid)
    shown = _shown_leaf(lo, hi, grid)
    field = _leaf_field(_leaf_targets(rng, limits, starts, n_control_points, grid.count), shown, limits)
    shown_values = np.take_along_axis(field, np.maximum(shown, 0)[:, None, :], axis=2)
    leaves = np.where(shown[:, None, :] >= 0, shown_values, _PARKED[None, :, None])
    mu = rng.integers(round(MU_RANGE[0] * TENTHS_PER_MM), round(MU_RANGE[1] * TENTHS_PER_MM) + 1, size=n_control_points)
    if not mlc.y_jaws:
        leaves = np.where(shown[:, None, :] >= 0, leaves, 0)
        jaws = np.tile([_tenths(JAW_1_MIN_MM), _tenths(JAW_2_MAX_MM)], (n_control_points, 1))
    if not mlc.identity:
        shown_a, shown_b = mlc.shown(leaves[:, 0] / TENTHS_PER_MM, leaves[:, 1] / TENTHS_PER_MM)
        leaves = np.rint(np.stack([shown_a, shown_b], axis=1).astype(np.float64) * TENTHS_PER_MM).astype(np.int64)
    jaw_1, jaw_2 = _read_only_mm(jaws[:, 0]), _read_only_mm(jaws[:, 1])
    x_jaws = None
    if mlc.arcs_have_x_jaws:
        x_jaws = _read_only_mm(x_jaw_path(np.random.default_rng([seed_for(dataset_id), X_JAW_STREAM]), leaves, jaws,
                                          grid))
    return ControlPoints(
        leaf_a=_read_only_mm(leaves[:, 0]),
        leaf_b=_read_only_mm(leaves[:, 1]),
        jaw_1=jaw_1,
        jaw_2=jaw_2,
        mu=_read_only_mm(mu),
        leaf_weight=_read_only(mlc_leaf_weights(jaw_1, jaw_2, mlc)),
        dataset_id=int(dataset_id),
        pattern=pattern,
        mlc=mlc,
        x_jaws=x_jaws,
    )


def x_jaw_path(rng: np.random.Generator, leaves: np.ndarray, jaws: np.ndarray, grid: StripGrid) -> np.ndarray:
    """X jaws (n, 2) [X1, X2] in tenths for leaves (n, 2, strips) and Y jaws (n, 2) in tenths, in one of
    ``X_JAW_MODES``: open at +-``X_JAW_OPEN_MM``; tracking, each jaw a margin (``X_JAW_MARGIN_MM``)
    outside the outermost open leaf the Y jaws show at the control point and its two neighbours, so
    that no leaf is hidden during a frame; static, each jaw where the outermost open leaf on its side
    reaches beyond it at a share ``X_JAW_HIDING_SHARE`` of the control points. Static jaws stand at
    least 10 mm apart, within the leaves' travel."""
    mode = X_JAW_MODES[int(rng.integers(len(X_JAW_MODES)))]
    margins = rng.integers(_tenths(X_JAW_MARGIN_MM[0]), _tenths(X_JAW_MARGIN_MM[1]) + 1, size=2)
    shares = rng.uniform(*X_JAW_HIDING_SHARE, size=2)
    n = len(leaves)
    if mode == "open":
        return np.tile([-_tenths(X_JAW_OPEN_MM), _tenths(X_JAW_OPEN_MM)], (n, 1))
    step = _tenths(grid.strip_mm)
    lower = _MLC_Y_MIN + step * np.arange(grid.count)
    seen = (lower + step > jaws[:, :1]) & (lower < jaws[:, 1:])  # (n, strips): the strips the Y jaws show
    leaf_a, leaf_b = leaves[:, 0], leaves[:, 1]
    open_pairs = seen & (leaf_b > leaf_a)
    counted = np.where(open_pairs.any(1, keepdims=True), open_pairs, seen)
    widest = np.stack([np.where(counted, leaf_a, _LEAF_MAX).min(1), np.where(counted, leaf_b, _LEAF_MIN).max(1)], 1)
    if mode == "tracking":
        padded = np.pad(widest, ((1, 1), (0, 0)), mode="edge")
        x1 = np.minimum(np.minimum(padded[:-2, 0], padded[1:-1, 0]), padded[2:, 0]) - margins[0]
        x2 = np.maximum(np.maximum(padded[:-2, 1], padded[1:-1, 1]), padded[2:, 1]) + margins[1]
        return np.stack([x1, x2], 1)
    x1 = int(np.quantile(widest[:, 0], shares[0], method="inverted_cdf"))
    x2 = int(np.quantile(widest[:, 1], 1.0 - shares[1], method="inverted_cdf"))
    gap = _tenths(10.0)
    if x2 - x1 < gap:
        middle = (x1 + x2) // 2
        x1, x2 = middle - gap // 2, middle + gap // 2
    x1, x2 = max(x1, _LEAF_MIN), min(x2, _LEAF_MAX)
    return np.tile([x1, x2], (n, 1))


def _check_dataset_id(dataset_id: int) -> None:
    if not 0 <= dataset_id < NUM_DATASETS:
        raise ValueError(f"dataset_id={dataset_id}: expected an integer in 0..{NUM_DATASETS - 1}")


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _read_only_mm(tenths: np.ndarray) -> np.ndarray:
    return _read_only(tenths.astype(np.float32) / np.float32(TENTHS_PER_MM))


def _tenths(mm: float) -> int:
    return round(mm * TENTHS_PER_MM)


_MLC_Y_MIN = _tenths(MLC_Y_MIN_MM)
_PARKED = np.array([_tenths(PARKED_LEAF_A_MM), _tenths(PARKED_LEAF_B_MM)])
_JAW_STEP = _tenths(MAX_JAW_STEP_MM)
_LEAF_STEP = _tenths(MAX_LEAF_STEP_MM)
_LEAF_MIN, _LEAF_MAX = (_tenths(v) for v in LEAF_RANGE_MM)
_NEAR_PARKED = _LEAF_STEP // 2
"""Largest distance from the parked position of a value shown before or after a band move."""


def _band_edge_tenths(jaw: np.ndarray, grid: StripGrid) -> np.ndarray:
    """ceil((jaw - (-130 mm)) / strip width) for jaw positions in tenths of a mm (exact integer arithmetic)."""
    return -((_MLC_Y_MIN - jaw) // _tenths(grid.strip_mm))


def _edge_copies(grid: StripGrid) -> int:
    """Strips each side of the band that copy its edge leaf: ``EDGE_COPY_LEAVES`` strips of 5 mm' worth."""
    return round(EDGE_COPY_LEAVES * LEAF_WIDTH_MM / grid.strip_mm)


def _on_grid(limits: PatternLimits, grid: StripGrid) -> PatternLimits:
    """A pattern's limits for neighbouring strips of ``grid``: the neighbour step scaled to the strip width."""
    if grid.strip_mm == LEAF_WIDTH_MM:
        return limits
    return dataclasses.replace(limits, max_neighbour_step_mm=limits.max_neighbour_step_mm * grid.strip_mm
                               / LEAF_WIDTH_MM)


def _jaw_span(mlc: MlcGeometry) -> tuple[int, int]:
    """(lowest, highest) jaw position in tenths: the span of the strips under a leaf of every layer of
    ``mlc`` (the whole strip span, [-130, 130] mm, for every MLC whose leaves cover it)."""
    strips = np.flatnonzero(mlc.under_leaves)
    edges = mlc.grid.edges_mm
    return _tenths(edges[strips[0]]), _tenths(edges[strips[-1] + 1])


def _segment_starts(rng: np.random.Generator, n: int) -> np.ndarray:
    """First CP of each motion segment (0 first)."""
    starts = rng.random(n) < _SEGMENT_PROBABILITY
    starts[0] = True
    return np.flatnonzero(starts)


def _approach(start: np.ndarray, goals: np.ndarray, speeds: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """Positions (n, ...) that head for each segment's goal at its speed and then stay.

    start: initial position (...); goals: (segments, ...); speeds: (segments, ...) per CP.
    Consecutive positions differ by at most the segment's speed.
    """
    path = np.empty((n, *start.shape), dtype=np.int64)
    position = start
    stops = [*starts[1:], n]
    for first, stop, goal, speed in zip(starts, stops, goals, speeds, strict=True):
        reach = speed * np.arange(1, stop - first + 1).reshape(-1, *([1] * start.ndim))
        path[first:stop] = position + np.clip(goal - position, -reach, reach)
        position = path[stop - 1]
    return path


def _jaw_path(rng: np.random.Generator, limits: PatternLimits, starts: np.ndarray, n: int,
              span: tuple[int, int]) -> np.ndarray:
    """Jaws (n, 2) [jaw_1, jaw_2] in tenths: goals in range (the jaw ranges brought inside ``span``,
    tenths), steps <= 20 mm, gap >= the minimum."""
    low, high = span
    jaw_1_max, gap = _tenths(limits.jaw_1_max_mm) - (_tenths(JAW_2_MAX_MM) - high), _tenths(limits.min_jaw_gap_mm)
    count = len(starts)
    jaw_1 = rng.integers(max(_tenths(JAW_1_MIN_MM), low), jaw_1_max + 1, size=count)
    jaw_2 = rng.integers(jaw_1 + gap, high + 1)
    goals = np.stack([jaw_1, jaw_2], axis=1)
    speeds = rng.integers(10, _JAW_STEP + 1, size=(count, 1))
    path = _approach(goals[0], goals, speeds, starts, n)
    # both paths step <= 20 mm, so does the larger of jaw_2 and jaw_1 + gap (<= jaw_1_max + gap <= high)
    path[:, 1] = np.maximum(path[:, 1], path[:, 0] + gap)
    return path


def _leaf_targets(rng: np.random.Generator, limits: PatternLimits, starts: np.ndarray, n: int,
                  strips: int) -> np.ndarray:
    """Target positions (n, 2, strips) of both banks: segment goals approached at a segment speed, plus jitter.

    Goal profiles already respect the pattern: one pair (regular), or centre and width
    profiles that drift by at most a quarter of the neighbour limit per leaf.
    """
    count = len(starts)
    shape = (count, strips)
    gap = _tenths(limits.min_leaf_gap_mm)
    drift = _tenths(limits.max_neighbour_step_mm) // 4
    centre = rng.integers(-700, 701, size=(count, 1))
    width = rng.integers(gap, 1201, size=(count, 1))
    centre_profile = centre + np.cumsum(rng.integers(-drift, drift + 1, size=shape), axis=1)
    centre_profile -= centre_profile[:, strips // 2, None] - centre
    width_profile = np.maximum(width + np.cumsum(rng.integers(-drift, drift + 1, size=shape), axis=1), gap)
    leaf_a = np.clip(centre_profile - width_profile // 2, _LEAF_MIN, _LEAF_MAX - gap)
    leaf_b = np.clip(leaf_a + width_profile, leaf_a + gap, _LEAF_MAX)
    goals = np.stack([leaf_a, leaf_b], axis=1)
    speeds = rng.integers(20, _LEAF_STEP + 1, size=(count, 1, 1))
    targets = _approach(goals[0], goals, speeds, starts, n)
    targets += np.rint(rng.normal(0.0, 10.0, size=(n, 2, 1))).astype(np.int64)
    if limits.leaf_jitter:
        targets += np.rint(rng.normal(0.0, 10.0, size=(n, 2, strips))).astype(np.int64)
    return targets


def _shown_leaf(lo: np.ndarray, hi: np.ndarray, grid: StripGrid) -> np.ndarray:
    """(n, strips): the band leaf whose value each leaf shows (itself, or the nearest edge for the
    leaves of the 10 mm each side of the band), or -1 for a parked leaf."""
    leaf, copies = np.arange(grid.count)[None, :], _edge_copies(grid)
    lo, hi = lo[:, None], hi[:, None]
    shown = np.where((leaf >= lo) & (leaf < hi), leaf, -1)
    shown = np.where((leaf >= lo - copies) & (leaf < lo), lo, shown)
    return np.where((leaf >= hi) & (leaf < hi + copies), hi - 1, shown)


def _near_parked_cells(shown: np.ndarray) -> np.ndarray:
    """(n, strips) cells of the field shown just before or just after a leaf changes what it shows."""
    cells = np.zeros(shown.shape, dtype=bool)
    before, leaf = np.nonzero(shown[1:] != shown[:-1])
    for cp in (before, before + 1):
        source = shown[cp, leaf]
        cells[cp[source >= 0], source[source >= 0]] = True
    return cells


def _lower_envelope(values: np.ndarray, step: int, axis: int) -> np.ndarray:
    """min_i (values_i + step |i - j|) along ``axis``: the largest function <= values whose
    neighbours along ``axis`` differ by at most ``step``."""
    shape = [1] * values.ndim
    shape[axis] = values.shape[axis]
    ramp = (np.arange(values.shape[axis]) * step).reshape(shape)
    reverse = [slice(None)] * values.ndim
    reverse[axis] = slice(None, None, -1)
    reverse = tuple(reverse)
    forward = np.minimum.accumulate(values - ramp, axis=axis) + ramp
    backward = np.minimum.accumulate((values + ramp)[reverse], axis=axis)[reverse] - ramp
    return np.minimum(forward, backward)


class _FieldLimits:
    """Min-plus envelopes for fields (n, strips) with steps <= 40 mm between CPs and <= ``neighbour``
    between leaves: the distance between cells is 400 |dn| + neighbour |dj| (tenths)."""

    def __init__(self, neighbour_step: int) -> None:
        self.neighbour_step = neighbour_step

    def below(self, values: np.ndarray) -> np.ndarray:
        """The largest field <= values within the limits."""
        return _lower_envelope(_lower_envelope(values, _LEAF_STEP, 0), self.neighbour_step, 1)

    def above(self, values: np.ndarray) -> np.ndarray:
        """The smallest field >= values within the limits."""
        return -self.below(-values)

    def fit(self, target: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
        """A field within the limits and within tight bounds [lower, upper] (themselves envelopes),
        near ``target``: the floor-midpoint of the envelopes of the clipped target, both of which
        stay inside the bounds."""
        clipped = np.clip(target, lower, upper)
        return (self.below(clipped) + self.above(clipped)) // 2


def _leaf_field(targets: np.ndarray, shown: np.ndarray, limits: PatternLimits) -> np.ndarray:
    """Fields (n, 2, strips) of both banks fitted to ``targets``.

    Constraints (tenths): step <= 400 between CPs and <= the neighbour limit between leaves
    (the whole field, a stronger form of the band rule), travel in the leaf range, within
    200 of the parked position on the cells returned by ``_near_parked_cells``, and
    b - a >= the minimum opening. They are difference constraints; bank A's upper bounds
    come through bank B's (a <= b - gap), bank B's lower bounds through bank A's.
    """
    field_limits = _FieldLimits(_tenths(limits.max_neighbour_step_mm))
    gap = _tenths(limits.min_leaf_gap_mm)
    near = _near_parked_cells(shown)
    bounds = [
        (np.where(near, parked - _NEAR_PARKED, _LEAF_MIN), np.where(near, parked + _NEAR_PARKED, _LEAF_MAX))
        for parked in _PARKED
    ]
    (lower_a, upper_a), (lower_b, upper_b) = bounds
    lower_a = field_limits.above(lower_a)
    upper_b = field_limits.below(upper_b)
    upper_a = field_limits.below(np.minimum(upper_a, upper_b - gap))
    leaf_a = field_limits.fit(targets[:, 0], lower_a, upper_a)
    lower_b = field_limits.above(np.maximum(lower_b, leaf_a + gap))
    leaf_b = field_limits.fit(targets[:, 1], lower_b, upper_b)
    return np.stack([leaf_a, leaf_b], axis=1)
