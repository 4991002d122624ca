"""Synthetic VMAT deliveries: the control points of each dataset ID.

Each dataset ID is one synthetic arc of N control points (CPs): positions of 52 MLC leaf
pairs (bank A ``leaf_a`` <= bank B ``leaf_b``, mm along x), two jaws (``jaw_1`` lower,
``jaw_2`` upper, mm along y) and the MU of each CP. The pattern and the random seed follow
from the ID alone, so the same ID gives the same arc on any machine.

The arc is generated in whole tenths of a millimetre (and tenths of an MU) as integers, so
every limit is checked exactly and the 0.1 rounding of the specification can never break
one. Motion is a sequence of segments: at random CPs new goals are drawn for the jaws and
the leaves, which then move toward them at a segment speed with a little jitter. Each CP is
projected onto the limits:

- the jaws take a bounded step toward their goals inside their ranges;
- the band leaves are fitted to their targets inside boxes that hold every per-CP step
  limit, including those of the leaves that copy the band edge and of the leaves that go
  back to their parked positions, with the pattern's neighbour limit and minimum opening;
- when the proposed jaws change the band in a way the leaves cannot follow within their
  step limit (a leaf far from its parked position would have to park), the jaws stay inside
  the leaves they cover for that CP and the band leaves next to the edges head for their
  parked positions, so that the jaws can move on later. Keeping the band is always
  feasible, so generation never fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_LEAF_PAIRS = 52
LEAF_WIDTH_MM = 5.0
NUM_DATASETS = 640
DEFAULT_CONTROL_POINTS = 2050
MLC_Y_MIN_MM = -130.0
"""Lower edge of leaf 0; leaf j covers y in [-130 + 5 j, -125 + 5 j) mm."""

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

_TENTHS = 10


@dataclass(frozen=True)
class PatternLimits:
    """The limits of section 3 that differ between patterns (mm)."""

    jaw_1_max_mm: float
    min_jaw_gap_mm: float
    min_leaf_gap_mm: float
    max_neighbour_step_mm: float
    """Largest difference between neighbouring band leaves; 0 means one shared pair."""


PATTERN_LIMITS = {
    "regular": PatternLimits(jaw_1_max_mm=110.0, min_jaw_gap_mm=20.0, min_leaf_gap_mm=20.0, max_neighbour_step_mm=0.0),
    "semiregular": PatternLimits(
        jaw_1_max_mm=120.0, min_jaw_gap_mm=10.0, min_leaf_gap_mm=10.0, max_neighbour_step_mm=10.0
    ),
    "irregular": PatternLimits(
        jaw_1_max_mm=120.0, min_jaw_gap_mm=10.0, min_leaf_gap_mm=10.0, max_neighbour_step_mm=50.0
    ),
}

_SEGMENT_PROBABILITY = 1.0 / 30.0
"""Chance per CP that a new segment (new goals and speeds) starts."""
_EDGE_PULL_LEAVES = 4
"""Band leaves next to each edge that head for their parked positions while the jaws wait."""


@dataclass(frozen=True)
class ControlPoints:
    """The control points of one synthetic delivery (read-only float32 arrays).

    leaf_a, leaf_b: (N, 52) leaf positions of banks A and B, mm along x.
    jaw_1, jaw_2: (N,) lower and upper jaw positions, mm along y.
    mu: (N,) monitor units delivered at each CP.
    leaf_weight: (N, 52) 1.0 for leaves in [lo - 2, hi + 2) of the open band, else 0.5.
    """

    leaf_a: np.ndarray
    leaf_b: np.ndarray
    jaw_1: np.ndarray
    jaw_2: np.ndarray
    mu: np.ndarray
    leaf_weight: np.ndarray
    dataset_id: int
    pattern: str

    def __len__(self) -> int:
        return int(self.mu.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays."""
        return sum(a.nbytes for a in (self.leaf_a, self.leaf_b, self.jaw_1, self.jaw_2, self.mu, self.leaf_weight))


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


def leaf_band(jaw_1: np.ndarray, jaw_2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Open band of leaves [lo, hi) between the jaws (mm): lo = ceil((130 + jaw_1) / 5), hi likewise."""
    lo = np.ceil((np.asarray(jaw_1, dtype=np.float64) - MLC_Y_MIN_MM) / LEAF_WIDTH_MM)
    hi = np.ceil((np.asarray(jaw_2, dtype=np.float64) - MLC_Y_MIN_MM) / LEAF_WIDTH_MM)
    return lo.astype(np.int64), hi.astype(np.int64)


def generate_control_points(dataset_id: int, n_control_points: int = DEFAULT_CONTROL_POINTS) -> ControlPoints:
    """The N control points of a dataset ID, deterministic per ID (numpy Generator seeded by ``seed_for``)."""
    if n_control_points < 1:
        raise ValueError(f"n_control_points={n_control_points}: expected at least 1")
    pattern = pattern_for(dataset_id)
    rng = np.random.default_rng(seed_for(dataset_id))
    walk = _ArcWalk(PATTERN_LIMITS[pattern], rng, n_control_points)
    jaws, leaves = walk.run()
    mu = rng.integers(round(MU_RANGE[0] * _TENTHS), round(MU_RANGE[1] * _TENTHS) + 1, size=n_control_points)
    lo = _band_edge_tenths(jaws[:, 0])
    hi = _band_edge_tenths(jaws[:, 1])
    leaf = np.arange(NUM_LEAF_PAIRS)
    shaping = (leaf >= lo[:, None] - EDGE_COPY_LEAVES) & (leaf < hi[:, None] + EDGE_COPY_LEAVES)
    return ControlPoints(
        leaf_a=_read_only_mm(leaves[:, 0]),
        leaf_b=_read_only_mm(leaves[:, 1]),
        jaw_1=_read_only_mm(jaws[:, 0]),
        jaw_2=_read_only_mm(jaws[:, 1]),
        mu=_read_only_mm(mu),
        leaf_weight=_read_only(np.where(shaping, 1.0, 0.5).astype(np.float32)),
        dataset_id=int(dataset_id),
        pattern=pattern,
    )


def _check_dataset_id(dataset_id: int) -> None:
    if not 0 <= dataset_id < NUM_DATASETS:
        raise ValueError(f"dataset_id={dataset_id}: expected an integer in 0..{NUM_DATASETS - 1}")


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _read_only_mm(tenths: np.ndarray) -> np.ndarray:
    return _read_only(tenths.astype(np.float32) / np.float32(_TENTHS))


def _tenths(mm: float) -> int:
    return round(mm * _TENTHS)


_LEAF_WIDTH = _tenths(LEAF_WIDTH_MM)
_MLC_Y_MIN = _tenths(MLC_Y_MIN_MM)
_PARKED = np.array([_tenths(PARKED_LEAF_A_MM), _tenths(PARKED_LEAF_B_MM)])
_PARKED_LEAVES = np.repeat(_PARKED[:, None], NUM_LEAF_PAIRS, axis=1)


def _band_edge_tenths(jaw: np.ndarray | int) -> np.ndarray | int:
    """ceil((jaw - (-130 mm)) / 5 mm) for jaw positions in tenths of a mm (exact integer arithmetic)."""
    return -((_MLC_Y_MIN - jaw) // _LEAF_WIDTH)


def _lower_envelope(values: np.ndarray, step: int) -> np.ndarray:
    """min_i (values_i + step |i - j|) along the last axis: the largest function <= values whose
    neighbours differ by at most ``step``; its negative of -values is the smallest one >= values."""
    ramp = np.arange(values.shape[-1]) * step
    forward = np.minimum.accumulate(values - ramp, axis=-1) + ramp
    backward = np.minimum.accumulate((values + ramp)[..., ::-1], axis=-1)[..., ::-1] - ramp
    return np.minimum(forward, backward)


def _bounds(lower: np.ndarray, upper: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Tightest bounds on a chain with neighbours at most ``step`` apart inside [lower, upper]:
    max_i (lower_i - step |i - j|) and min_i (upper_i + step |i - j|). The chain is feasible
    exactly when they do not cross."""
    tight = _lower_envelope(np.stack([-lower, upper]), step)
    return -tight[0], tight[1]


def _fit_chain(target: np.ndarray, lower: np.ndarray, upper: np.ndarray, step: int) -> np.ndarray:
    """Values near ``target`` inside tight bounds (from ``_bounds``), neighbours at most ``step`` apart.

    The floor-midpoint of the lower and upper envelopes of the clipped target: both
    envelopes respect the step and stay inside tight bounds, and so does the midpoint.
    """
    clipped = np.minimum(np.maximum(target, lower), upper)
    envelopes = _lower_envelope(np.stack([clipped, -clipped]), step)
    return (envelopes[0] - envelopes[1]) // 2


class _ArcWalk:
    """Sequential generation of jaws and leaves in tenths of a mm, one CP at a time.

    Leaves are (2, 52) integer arrays [bank A, bank B]; jaws are Python integers.
    """

    def __init__(self, limits: PatternLimits, rng: np.random.Generator, n_control_points: int) -> None:
        self.n = n_control_points
        self.rng = rng
        self.jaw_1_max = _tenths(limits.jaw_1_max_mm)
        self.jaw_gap = _tenths(limits.min_jaw_gap_mm)
        self.leaf_gap = _tenths(limits.min_leaf_gap_mm)
        self.neighbour_step = _tenths(limits.max_neighbour_step_mm)
        self.jaw_step = _tenths(MAX_JAW_STEP_MM)
        self.leaf_step = _tenths(MAX_LEAF_STEP_MM)
        self.jaw_1_min = _tenths(JAW_1_MIN_MM)
        self.jaw_2_max = _tenths(JAW_2_MAX_MM)
        self.leaf_min, self.leaf_max = (_tenths(v) for v in LEAF_RANGE_MM)

    def run(self) -> tuple[np.ndarray, np.ndarray]:
        """Jaws (N, 2) and leaves (N, 2, 52), integer tenths of a mm."""
        rng, n = self.rng, self.n
        starts = rng.random(n) < _SEGMENT_PROBABILITY
        starts[0] = True
        segment_of_cp = (np.cumsum(starts) - 1).tolist()
        jaw_goals, jaw_speeds = self._jaw_goals(int(starts.sum()))
        leaf_goals, leaf_speeds = self._leaf_goals(int(starts.sum()))
        leaf_jitter = self._leaf_jitter()

        jaws = np.empty((n, 2), dtype=np.int64)
        leaves = np.empty((n, 2, NUM_LEAF_PAIRS), dtype=np.int64)
        jaw_1, jaw_2 = jaw_goals[0]
        leaf = self._place(_band_edge_tenths(jaw_1), _band_edge_tenths(jaw_2), leaf_goals[0])
        jaws[0], leaves[0] = (jaw_1, jaw_2), leaf
        band = _band_edge_tenths(jaw_1), _band_edge_tenths(jaw_2)
        for cp in range(1, n):
            segment = segment_of_cp[cp]
            speed = leaf_speeds[segment]
            jaw_1, jaw_2, new_band = self._jaw_step(jaw_1, jaw_2, jaw_goals[segment], jaw_speeds[segment])
            if new_band == band and self._move_within_band(
                leaf, leaf_goals[segment], speed, leaf_jitter[cp], band, leaves[cp]
            ):
                leaf = leaves[cp]
                jaws[cp] = jaw_1, jaw_2
                continue
            move = np.minimum(np.maximum(leaf_goals[segment] - leaf, -speed), speed)
            target = leaf + move + leaf_jitter[cp]
            new_leaf = None if new_band == band else self._follow(leaf, band, new_band, target)
            if new_leaf is None:
                if new_band != band:
                    jaw_1, jaw_2 = self._hold_band(jaws[cp - 1], jaw_1, jaw_2)
                    target = self._pull_edges_to_parked(leaf, target, band, speed)
                new_leaf = self._follow(leaf, band, band, target)
                new_band = band
            band, leaf = new_band, new_leaf
            jaws[cp], leaves[cp] = (jaw_1, jaw_2), leaf
        return jaws, leaves

    def _move_within_band(
        self,
        previous: np.ndarray,
        goal: np.ndarray,
        speed: int,
        jitter: np.ndarray,
        band: tuple[int, int],
        out: np.ndarray,
    ) -> bool:
        """The common case, the band unchanged: band leaves step toward ``goal`` within their
        step and travel limits. Writes the leaves to ``out`` and returns True when the result
        also meets the pattern; returns False (``out`` unspecified) when it needs fitting."""
        lo, hi = band
        before = previous[:, lo:hi]
        step = before - goal[:, lo:hi]
        np.minimum(step, speed, out=step)
        np.maximum(step, -speed, out=step)
        np.subtract(jitter[:, lo:hi], step, out=step)
        np.minimum(step, self.leaf_step, out=step)
        np.maximum(step, -self.leaf_step, out=step)
        step += before
        np.minimum(step, self.leaf_max, out=step)
        np.maximum(step, self.leaf_min, out=step)
        if not self._fits_pattern(step):
            return False
        out[...] = previous
        out[:, lo:hi] = step
        out[:, max(lo - EDGE_COPY_LEAVES, 0) : lo] = step[:, :1]
        out[:, hi : hi + EDGE_COPY_LEAVES] = step[:, -1:]
        return True

    def _jaw_goals(self, count: int) -> tuple[list[list[int]], list[int]]:
        """Per segment: goal [jaw_1, jaw_2] and speed (tenths per CP)."""
        rng = self.rng
        jaw_1 = rng.integers(self.jaw_1_min, self.jaw_1_max + 1, size=count)
        jaw_2 = rng.integers(jaw_1 + self.jaw_gap, self.jaw_2_max + 1)
        speeds = rng.integers(10, self.jaw_step + 1, size=count)
        return np.stack([jaw_1, jaw_2], axis=1).tolist(), speeds.tolist()

    def _leaf_goals(self, count: int) -> tuple[np.ndarray, list[int]]:
        """Per segment: goal positions (2, 52) of both banks and speed (tenths per CP).

        Goal profiles already respect the pattern: one pair (regular), or centre and width
        profiles drifting by at most a quarter of the neighbour limit per leaf.
        """
        rng = self.rng
        shape = (count, NUM_LEAF_PAIRS)
        centre = rng.integers(-700, 701, size=(count, 1))
        width = rng.integers(self.leaf_gap, 1201, size=(count, 1))
        drift = self.neighbour_step // 4
        centre_profile = centre + np.cumsum(rng.integers(-drift, drift + 1, size=shape), axis=1)
        centre_profile -= centre_profile[:, NUM_LEAF_PAIRS // 2, None] - centre
        width_profile = np.maximum(
            width + np.cumsum(rng.integers(-drift, drift + 1, size=shape), axis=1), self.leaf_gap
        )
        leaf_a = np.clip(centre_profile - width_profile // 2, self.leaf_min, self.leaf_max - self.leaf_gap)
        leaf_b = np.clip(leaf_a + width_profile, leaf_a + self.leaf_gap, self.leaf_max)
        speeds = rng.integers(20, self.leaf_step + 1, size=count)
        return np.stack([leaf_a, leaf_b], axis=1), speeds.tolist()

    def _leaf_jitter(self) -> np.ndarray:
        """Per CP jitter (N, 2, 52): shared by a bank's leaves, plus per leaf for irregular fields."""
        shared = np.rint(self.rng.normal(0.0, 10.0, size=(self.n, 2, 1))).astype(np.int64)
        if self.neighbour_step < _tenths(PATTERN_LIMITS["irregular"].max_neighbour_step_mm):
            return np.broadcast_to(shared, (self.n, 2, NUM_LEAF_PAIRS))
        return shared + np.rint(self.rng.normal(0.0, 10.0, size=(self.n, 2, NUM_LEAF_PAIRS))).astype(np.int64)

    def _jaw_step(self, jaw_1: int, jaw_2: int, goal: list[int], speed: int) -> tuple[int, int, tuple[int, int]]:
        """Jaws after one step of at most ``speed`` toward ``goal`` inside their ranges and
        minimum gap, and their band. Jaws that reach their goal stay there."""
        limit = self.jaw_step
        new_1 = min(max(jaw_1 + min(max(goal[0] - jaw_1, -speed), speed), self.jaw_1_min), self.jaw_1_max)
        low_2 = max(new_1 + self.jaw_gap, jaw_2 - limit)
        new_2 = min(max(jaw_2 + min(max(goal[1] - jaw_2, -speed), speed), low_2), self.jaw_2_max, jaw_2 + limit)
        return new_1, new_2, (_band_edge_tenths(new_1), _band_edge_tenths(new_2))

    def _hold_band(self, jaws: np.ndarray, proposed_1: int, proposed_2: int) -> tuple[int, int]:
        """The proposed jaws clipped to keep the band of ``jaws``; each lies between old and
        proposed, so the step, range and gap limits still hold."""
        jaw_1, jaw_2 = int(jaws[0]), int(jaws[1])
        lo, hi = _band_edge_tenths(jaw_1), _band_edge_tenths(jaw_2)
        high_1 = min(_MLC_Y_MIN + lo * _LEAF_WIDTH, jaw_2 - self.jaw_gap)
        new_1 = min(max(proposed_1, _MLC_Y_MIN + (lo - 1) * _LEAF_WIDTH + 1), high_1)
        low_2 = max(_MLC_Y_MIN + (hi - 1) * _LEAF_WIDTH + 1, new_1 + self.jaw_gap)
        new_2 = min(max(proposed_2, low_2), _MLC_Y_MIN + hi * _LEAF_WIDTH)
        return new_1, new_2

    def _pull_edges_to_parked(
        self, leaf: np.ndarray, target: np.ndarray, band: tuple[int, int], speed: int
    ) -> np.ndarray:
        """Target with the band leaves near both edges moving toward their parked positions,
        so that the jaws can move on at a later CP."""
        lo, hi = band
        near_edge = np.zeros(NUM_LEAF_PAIRS, dtype=bool)
        near_edge[lo : lo + _EDGE_PULL_LEAVES] = True
        near_edge[max(hi - _EDGE_PULL_LEAVES, lo) : hi] = True
        pulled = leaf + np.minimum(np.maximum(_PARKED_LEAVES - leaf, -speed), speed)
        return np.where(near_edge, pulled, target)

    def _place(self, lo: int, hi: int, target: np.ndarray) -> np.ndarray:
        """First CP: band leaves fitted to ``target`` with no step limits."""
        lower = np.full((2, hi - lo), self.leaf_min)
        upper = np.full((2, hi - lo), self.leaf_max)
        return self._assemble(self._fit_band(lower, upper, target[:, lo:hi]), lo, hi)

    def _follow(
        self, previous: np.ndarray, band: tuple[int, int], new_band: tuple[int, int], target: np.ndarray
    ) -> np.ndarray | None:
        """Leaves (2, 52) for ``new_band`` within one step of ``previous``; None if impossible."""
        lo, hi = new_band
        copy_lo, copy_hi = max(lo - EDGE_COPY_LEAVES, 0), min(hi + EDGE_COPY_LEAVES, NUM_LEAF_PAIRS)
        lower = np.maximum(previous[:, lo:hi] - self.leaf_step, self.leaf_min)
        upper = np.minimum(previous[:, lo:hi] + self.leaf_step, self.leaf_max)
        if new_band != band:
            old_lo, old_hi = max(band[0] - EDGE_COPY_LEAVES, 0), min(band[1] + EDGE_COPY_LEAVES, NUM_LEAF_PAIRS)
            newly_parked = np.concatenate([previous[:, old_lo:copy_lo], previous[:, copy_hi:old_hi]], axis=1)
            if (np.abs(newly_parked - _PARKED[:, None]) > self.leaf_step).any():
                return None
            for edge, copies in ((0, previous[:, copy_lo:lo]), (-1, previous[:, hi:copy_hi])):
                if copies.shape[1]:
                    lower[:, edge] = np.maximum(lower[:, edge], copies.max(axis=1) - self.leaf_step)
                    upper[:, edge] = np.minimum(upper[:, edge], copies.min(axis=1) + self.leaf_step)
            if (lower > upper).any():
                return None
        candidate = np.minimum(np.maximum(target[:, lo:hi], lower), upper)
        if self._fits_pattern(candidate):
            return self._assemble(candidate, lo, hi)
        fitted = self._fit_band(lower, upper, target[:, lo:hi])
        return None if fitted is None else self._assemble(fitted, lo, hi)

    def _fits_pattern(self, band: np.ndarray) -> bool:
        """Whether band leaves (2, m) meet the neighbour limit and the minimum opening."""
        if (band[1] - band[0]).min() < self.leaf_gap:
            return False
        if band.shape[1] == 1:
            return True
        return bool(np.abs(band[:, 1:] - band[:, :-1]).max() <= self.neighbour_step)

    def _fit_band(self, lower: np.ndarray, upper: np.ndarray, target: np.ndarray) -> np.ndarray | None:
        """Band leaves (2, m) inside boxes, neighbour limit and b - a >= gap; None if infeasible.

        The limits are difference constraints: bank A is bounded above through bank B's upper
        bounds (a <= b - gap), bank B below through bank A's lower bounds, and each bank's
        bounds are tightened along its chain with the envelopes. A chain is feasible exactly
        when its tightened bounds do not cross.
        """
        step, gap = self.neighbour_step, self.leaf_gap
        lower_a, upper_b = _bounds(lower[0], upper[1], step)
        upper_a = np.minimum(upper[0], upper_b - gap)
        lower_b = np.maximum(lower[1], lower_a + gap)
        lower_b, upper_a = _bounds(lower_b, upper_a, step)
        if (lower_a > upper_a).any() or (lower_b > upper_b).any():
            return None
        leaf_a = _fit_chain(target[0], lower_a, upper_a, step)
        lower_b = _bounds(np.maximum(lower_b, leaf_a + gap), upper_b, step)[0]
        leaf_b = _fit_chain(target[1], lower_b, upper_b, step)
        return np.stack([leaf_a, leaf_b])

    def _assemble(self, band: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """All 52 leaves: band values, edge copies just outside the band, parked elsewhere."""
        leaves = _PARKED_LEAVES.copy()
        leaves[:, lo:hi] = band
        leaves[:, max(lo - EDGE_COPY_LEAVES, 0) : lo] = band[:, :1]
        leaves[:, hi : hi + EDGE_COPY_LEAVES] = band[:, -1:]
        return leaves
