"""Synthetic control points: patterns, seeds, determinism and every limit of the specification.

Limits are checked in whole tenths of a millimetre (positions are rounded to 0.1 mm), so
each one is tested at its exact value with no tolerance.
"""

import numpy as np
import pytest

from epid.synthesis.sequences import ControlPoints, generate_control_points, pattern_for, seed_for

SAMPLED_IDS = {
    "regular": (0, 79, 320, 399),
    "semiregular": (80, 159, 400, 479),
    "irregular": (160, 319, 480, 639),
}
NEIGHBOUR_LIMIT = {"regular": 0, "semiregular": 100, "irregular": 500}
MIN_OPENING = {"regular": 200, "semiregular": 100, "irregular": 100}
MIN_JAW_GAP = {"regular": 200, "semiregular": 100, "irregular": 100}
JAW_1_MAX = {"regular": 1100, "semiregular": 1200, "irregular": 1200}


@pytest.mark.parametrize(
    ("dataset_id", "pattern"),
    [
        (0, "regular"),
        (79, "regular"),
        (80, "semiregular"),
        (159, "semiregular"),
        (160, "irregular"),
        (319, "irregular"),
        (320, "regular"),
        (399, "regular"),
        (400, "semiregular"),
        (479, "semiregular"),
        (480, "irregular"),
        (639, "irregular"),
    ],
)
def test_pattern_boundaries(dataset_id, pattern):
    assert pattern_for(dataset_id) == pattern


@pytest.mark.parametrize("dataset_id", [-1, 640, 10_000])
def test_ids_outside_0_to_639_are_rejected(dataset_id):
    with pytest.raises(ValueError, match=str(dataset_id)):
        pattern_for(dataset_id)
    with pytest.raises(ValueError):
        generate_control_points(dataset_id, 4)


def test_seeds_follow_the_id():
    assert [seed_for(i) for i in (0, 1, 479)] == [42, 43, 521]
    assert [seed_for(i) for i in (480, 639)] == [523, 682]


def test_same_id_same_control_points():
    first, second = generate_control_points(123, 300), generate_control_points(123, 300)
    for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu", "leaf_weight"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    other = generate_control_points(124, 300)
    assert not np.array_equal(first.leaf_a, other.leaf_a)


def test_short_arcs_keep_the_limits():
    cp = generate_control_points(7, 4)
    assert len(cp) == 4 and cp.leaf_a.shape == (4, 52)
    check_limits(cp)
    with pytest.raises(ValueError):
        generate_control_points(7, 0)


def test_arrays_are_read_only_float32():
    cp = generate_control_points(5, 20)
    for name, shape in (
        ("leaf_a", (20, 52)),
        ("leaf_b", (20, 52)),
        ("jaw_1", (20,)),
        ("jaw_2", (20,)),
        ("mu", (20,)),
        ("leaf_weight", (20, 52)),
    ):
        values = getattr(cp, name)
        assert values.shape == shape and values.dtype == np.float32
        with pytest.raises(ValueError):
            values[0] = 0
    assert cp.dataset_id == 5 and cp.pattern == "regular"
    assert cp.nbytes == 20 * (3 * 52 + 3) * 4


def tenths(values: np.ndarray) -> np.ndarray:
    """Values in whole tenths; asserts they are on the 0.1 grid."""
    scaled = values.astype(np.float64) * 10
    whole = np.rint(scaled)
    assert np.abs(scaled - whole).max() < 1e-3
    return whole.astype(np.int64)


def band_edge(jaw_tenths: np.ndarray) -> np.ndarray:
    """ceil((130 + jaw) / 5) in exact integer arithmetic on tenths."""
    return -((-(1300 + jaw_tenths)) // 50)


def check_limits(cp: ControlPoints) -> dict[str, float]:
    pattern = cp.pattern
    leaf_a, leaf_b = tenths(cp.leaf_a), tenths(cp.leaf_b)
    jaw_1, jaw_2, mu = tenths(cp.jaw_1), tenths(cp.jaw_2), tenths(cp.mu)
    n = len(cp)

    assert np.abs(np.diff(jaw_1)).max(initial=0) <= 200
    assert np.abs(np.diff(jaw_2)).max(initial=0) <= 200
    assert np.abs(np.diff(leaf_a, axis=0)).max(initial=0) <= 400
    assert np.abs(np.diff(leaf_b, axis=0)).max(initial=0) <= 400
    assert jaw_1.min() >= -1300 and jaw_1.max() <= JAW_1_MAX[pattern]
    assert jaw_2.max() <= 1300
    assert (jaw_2 - jaw_1).min() >= MIN_JAW_GAP[pattern]
    assert mu.min() >= 10 and mu.max() <= 400
    assert (leaf_a <= leaf_b).all()

    lo, hi = band_edge(jaw_1)[:, None], band_edge(jaw_2)[:, None]
    leaf = np.arange(52)[None, :]
    band = (leaf >= lo) & (leaf < hi)
    below = (leaf >= lo - 2) & (leaf < lo)
    above = (leaf >= hi) & (leaf < hi + 2)
    parked = ~(band | below | above)
    assert band.sum(axis=1).min() >= 1
    rows = np.arange(n)
    for bank in (leaf_a, leaf_b):
        first, last = bank[rows, lo[:, 0]][:, None], bank[rows, hi[:, 0] - 1][:, None]
        assert (bank == first)[below].all()
        assert (bank == last)[above].all()
        if pattern == "regular":
            assert (bank == first)[band].all()
        neighbours = band[:, 1:] & band[:, :-1]
        assert (np.abs(np.diff(bank, axis=1)) <= NEIGHBOUR_LIMIT[pattern])[neighbours].all()
    assert (leaf_a[parked] == -200).all() and (leaf_b[parked] == 200).all()
    assert (leaf_b - leaf_a)[band].min() >= MIN_OPENING[pattern]

    expected_weight = np.where((leaf >= lo - 2) & (leaf < hi + 2), 1.0, 0.5)
    np.testing.assert_array_equal(cp.leaf_weight, expected_weight)
    return {
        "band_changes": float(np.mean((np.diff(lo[:, 0]) != 0) | (np.diff(hi[:, 0]) != 0))) if n > 1 else 0.0,
        "jaw_1_span": float(jaw_1.max() - jaw_1.min()) / 10,
        "band_leaf_std": float(leaf_a[band].std()) / 10,
    }


@pytest.mark.parametrize(
    "dataset_id", [i for ids in SAMPLED_IDS.values() for i in ids], ids=lambda i: f"id{i}-{pattern_for(i)}"
)
def test_every_limit_holds_on_a_full_arc(dataset_id):
    cp = generate_control_points(dataset_id)
    assert len(cp) == 2050 and cp.pattern == pattern_for(dataset_id)
    motion = check_limits(cp)
    # a generator that never moved would pass the limits trivially
    assert motion["band_changes"] > 0.05
    assert motion["jaw_1_span"] > 100
    assert motion["band_leaf_std"] > 10


def test_mu_is_uniform_on_1_to_40():
    mu = np.concatenate([generate_control_points(i, 2050).mu for i in (3, 90, 200)])
    assert mu.min() == pytest.approx(1.0, abs=0.2) and mu.max() == pytest.approx(40.0, abs=0.2)
    counts, _ = np.histogram(mu, bins=13, range=(1.0, 40.0))
    assert counts.min() > 0.8 * len(mu) / 13 and counts.max() < 1.2 * len(mu) / 13


def test_semiregular_fields_vary_between_leaves_and_irregular_more():
    def neighbour_steps(dataset_id):
        cp = generate_control_points(dataset_id, 1000)
        lo, hi = band_edge(tenths(cp.jaw_1))[:, None], band_edge(tenths(cp.jaw_2))[:, None]
        leaf = np.arange(52)[None, :]
        inside = ((leaf >= lo) & (leaf < hi))[:, 1:] & ((leaf >= lo) & (leaf < hi))[:, :-1]
        return np.abs(np.diff(tenths(cp.leaf_a), axis=1))[inside]

    semiregular, irregular = neighbour_steps(100), neighbour_steps(500)
    assert semiregular.mean() > 0 and semiregular.max() <= 100
    assert irregular.mean() > 2 * semiregular.mean() and irregular.max() > 100


def open_band_extremes(control_points: ControlPoints) -> tuple[np.ndarray, np.ndarray]:
    """Per control point, the outermost bank A and bank B edges of the pairs the Y jaws show open (a loop
    over strips with their edges from the grid; +-inf where none is open)."""
    grid = control_points.mlc.grid
    lowest, highest = np.full(len(control_points), np.inf), np.full(len(control_points), -np.inf)
    for point in range(len(control_points)):
        for strip in range(grid.count):
            bottom, top = grid.edges_mm[strip], grid.edges_mm[strip + 1]
            a, b = control_points.leaf_a[point, strip], control_points.leaf_b[point, strip]
            if top > control_points.jaw_1[point] and bottom < control_points.jaw_2[point] and b > a:
                lowest[point], highest[point] = min(lowest[point], a), max(highest[point], b)
    return lowest, highest


def test_x_jaws_open_track_the_leaves_or_stand_still_and_leave_the_arc_as_it_was():
    """On an MLC with X jaws each arc has them, drawn apart from its leaves and Y jaws (the same as on
    the MLC without X jaws): open outside the imager, tracking (never inside an open leaf of the
    control point or its neighbours, within 5 mm of the outermost), or static (at least 10 mm apart,
    inside the outermost open leaf at some control points, never at most). The legacy grid has none."""
    import dataclasses

    from epid.synthesis.mlc import MLC_GEOMETRIES

    mlc = MLC_GEOMETRIES["millennium120"]
    assert generate_control_points(14, 30).x_jaws is None
    modes = []
    for dataset_id in range(2, 640, 23):
        arc = generate_control_points(dataset_id, 30, mlc)
        without = generate_control_points(dataset_id, 30, dataclasses.replace(mlc, x_jaws=False))
        assert without.x_jaws is None and arc.x_jaws.shape == (30, 2) and arc.x_jaws.dtype == np.float32
        for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu"):
            np.testing.assert_array_equal(getattr(arc, name), getattr(without, name))
        x_1, x_2 = arc.x_jaws[:, 0].astype(np.float64), arc.x_jaws[:, 1].astype(np.float64)
        lowest, highest = open_band_extremes(arc)
        if np.all(x_1 == -200) and np.all(x_2 == 200):
            modes.append("open")
        elif np.ptp(x_1) == 0 and np.ptp(x_2) == 0 and np.any(lowest < x_1) | np.any(highest > x_2):
            modes.append("static")
            assert x_2[0] - x_1[0] >= 10 - 1e-4
            assert np.mean((lowest < x_1) | (highest > x_2)) <= 0.5
        else:
            modes.append("tracking")
            for shift in (-1, 0, 1):
                points = slice(max(shift, 0), 30 + min(shift, 0))
                others = slice(max(-shift, 0), 30 + min(-shift, 0))
                assert np.all(x_1[points] <= lowest[others] + 1e-4) and np.all(x_2[points] >= highest[others] - 1e-4)
            seen = np.isfinite(lowest)
            assert np.all(lowest[seen] - x_1[seen] <= 5 + 40 + 1e-4)  # the margin plus a neighbour's leaf step
    assert set(modes) == {"open", "tracking", "static"} and min(modes.count(mode) for mode in set(modes)) >= 4


def test_folding_into_the_x_jaws_cuts_each_opening_at_them():
    """A pair open across X1 starts at X1; one wholly behind X2 closes at X2; one inside is as it was."""
    from epid.synthesis.sequences import behind_x_jaws, fold_into_x_jaws

    leaf_a, leaf_b = np.array([[-50.0, 30.0, -10.0]]), np.array([[10.0, 45.0, 5.0]])
    x_jaws = np.array([[-20.0, 25.0]])
    folded_a, folded_b = fold_into_x_jaws(leaf_a, leaf_b, x_jaws)
    np.testing.assert_array_equal(folded_a, [[-20.0, 25.0, -10.0]])
    np.testing.assert_array_equal(folded_b, [[10.0, 25.0, 5.0]])
    np.testing.assert_array_equal(behind_x_jaws(folded_a, folded_b, x_jaws), [[[1, 2, 0]], [[0, 2, 0]]])
