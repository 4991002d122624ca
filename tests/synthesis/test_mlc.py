"""The built-in MLCs as data, checked against their published leaf layouts, and a plan's MLC found
from its leaf boundaries (a dual-layer MLC from its layers' pair counts, in either order)."""

from __future__ import annotations

import numpy as np
import pytest

from epid.synthesis.mlc import MLC_GEOMETRIES, MlcGeometry, identify

LAYOUTS = {  # name: [(first boundary mm, [(leaves, width mm), ...]) per layer], travel mm, (X jaws, Y jaws)
    "legacy": ([(-130.0, [(52, 5.0)])], 200.0, (True, True)),
    "agility": ([(-200.0, [(80, 5.0)])], 200.0, (False, True)),  # Y diaphragms only
    "millennium120": ([(-200.0, [(10, 10.0), (40, 5.0), (10, 10.0)])], 200.0, (True, True)),
    "hd120": ([(-110.0, [(14, 5.0), (32, 2.5), (14, 5.0)])], 200.0, (True, True)),
    "mlci2": ([(-200.0, [(40, 10.0)])], 200.0, (True, True)),
    "halcyon": ([(-140.0, [(28, 10.0)]), (-145.0, [(29, 10.0)])], 140.0, (False, False)),
}


def layout(first: float, runs: list[tuple[int, float]]) -> np.ndarray:
    widths = np.concatenate([np.full(count, width) for count, width in runs])
    return first + np.concatenate([[0.0], np.cumsum(widths)])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_built_in_mlc_has_its_published_layout(name):
    layers, travel, jaws = LAYOUTS[name]
    geometry = MLC_GEOMETRIES[name]
    assert len(geometry.layers) == len(layers)
    for own, (first, runs) in zip(geometry.layers, layers, strict=True):
        np.testing.assert_allclose(own, layout(first, runs), atol=1e-9)
    assert geometry.travel_mm == travel and (geometry.x_jaws, geometry.y_jaws) == jaws
    assert geometry.arcs_have_x_jaws == (jaws[0] and name != "legacy")  # the legacy grid's arcs stay the design's
    assert identify([layout(first, runs) for first, runs in layers]) is geometry


def test_a_stored_mlc_is_the_built_in_one_unless_its_leaves_or_jaws_differ():
    agility = MLC_GEOMETRIES["agility"]
    assert MlcGeometry.from_dict(agility.to_dict()) is agility
    earlier = {**agility.to_dict(), "description": "Elekta Agility: 80 pairs of 5 mm", "x_jaws": True}
    assert MlcGeometry.from_dict(earlier) is agility  # a checkpoint of a release that flagged X jaws on it
    moved = MlcGeometry.from_dict({**agility.to_dict(), "travel_mm": 150.0})
    assert moved != agility and moved.travel_mm == 150.0
    open_halcyon = MlcGeometry.from_dict({**MLC_GEOMETRIES["halcyon"].to_dict(), "y_jaws": True})
    assert open_halcyon != MLC_GEOMETRIES["halcyon"] and open_halcyon.y_jaws


def test_halcyon_is_found_from_its_layers_in_either_order_and_unknown_mlcs_are_not():
    distal, proximal = layout(-140.0, [(28, 10.0)]), layout(-145.0, [(29, 10.0)])
    assert identify([proximal, distal]) is MLC_GEOMETRIES["halcyon"]
    assert identify([distal]) is None  # one layer alone is no known MLC
    assert identify([layout(-200.0, [(80, 5.0)]) + 0.5]) is None  # Agility's layout, shifted
    assert identify([layout(-100.0, [(40, 5.0)])]) is None


def fine_aperture(geometry, layers, jaw_1, jaw_2, step=0.1):
    """Independent rasterisation: open cells of a 0.1 mm grid over the imager (rows from the most
    positive y down, as the frames are) where every layer's leaf over the cell's centre and the
    jaws leave it open; ``layers`` per layer (bank A, bank B) of one control point (pairs,)."""
    centres = -128.0 + step * (np.arange(round(256 / step)) + 0.5)
    y, x = centres[::-1, None], centres[None, :]
    open_cells = (y >= jaw_1) & (y < jaw_2) & np.ones_like(x, dtype=bool)
    for boundaries, (bank_a, bank_b) in zip(geometry.layers, layers, strict=True):
        leaf = np.searchsorted(np.asarray(boundaries), y[:, 0], side="right") - 1
        under = (leaf >= 0) & (leaf < len(bank_a))  # beyond the leaves, the layer is open
        leaf = leaf.clip(0, len(bank_a) - 1)
        open_cells &= ~under[:, None] | ((x >= bank_a[leaf][:, None]) & (x < bank_b[leaf][:, None]))
    return open_cells


@pytest.mark.parametrize("name", ["legacy", "agility", "millennium120", "mlci2", "halcyon"])
def test_strips_rasterise_as_the_mlcs_own_leaves_do_at_a_tenth_of_a_millimetre(name):
    from epid.synthesis.fluence import rasterize

    geometry = MLC_GEOMETRIES[name]
    layers = random_layers(geometry, np.random.default_rng(7))
    jaw_1, jaw_2 = (-130.0, 130.0) if not geometry.y_jaws else (-97.3, 111.6)
    leaf_a, leaf_b = geometry.strips(layers)
    mask = rasterize(leaf_a, leaf_b, np.float64(jaw_1), np.float64(jaw_2)).numpy()
    fine = fine_aperture(geometry, layers, jaw_1, jaw_2)
    pooled = fine.reshape(256, 10, 256, 10).any(axis=(1, 3))  # a 1 mm pixel is open where any of it is
    np.testing.assert_array_equal(mask, pooled)


def random_layers(geometry, rng):
    """Per layer, bank A and B positions of its leaves in whole tenths of a mm."""
    layers = []
    for pairs in geometry.pairs:
        bank_a = rng.integers(-800, 0, size=pairs) / 10
        layers.append((bank_a, bank_a + rng.integers(0, 800, size=pairs) / 10))
    return layers


def test_hd120_masks_show_its_2_5_mm_leaves_half_a_pixel_row_each():
    """On the fine strips a pixel row over two 2.5 mm leaves is half of each: the mask is the mean
    of the two half rows of an independent 0.1 mm rasterisation, each open where any of it is."""
    from epid.synthesis.fluence import rasterize

    hd120 = MLC_GEOMETRIES["hd120"]
    assert hd120.grid.count == 104 and hd120.modelled and "finer than the models' 5 mm strips" in \
        hd120.design_strips_reason
    layers = random_layers(hd120, np.random.default_rng(11))
    leaf_a, leaf_b = hd120.strips(layers)
    assert leaf_a.shape == (104,) and np.all(leaf_a[:8] == -200.0)  # beyond the leaves (|y| > 110 mm): open
    mask = rasterize(leaf_a, leaf_b, np.float64(-97.0), np.float64(108.0)).numpy()
    fine = fine_aperture(hd120, layers, -97.0, 108.0)
    halves = fine.reshape(512, 5, 256, 10).any(axis=(1, 3)).reshape(256, 2, 256).mean(axis=1)
    np.testing.assert_array_equal(mask, halves)
    assert np.any(mask == 0.5)  # rows at y = -37.5, -32.5, ... mm lie over two leaves


def test_hd120_fluence_matches_an_independent_rendering_at_a_tenth_of_a_millimetre():
    """``aperture_fluence`` on the fine strips (transmissions, interleaf leakage, tongue and groove)
    against the same physics rendered cell by cell at 0.1 mm and averaged over each pixel (openings
    of neighbouring leaves that overlap, where the renderer's tongue and groove is exact)."""
    import torch

    from epid.synthesis.fluence import aperture_fluence

    hd120 = MLC_GEOMETRIES["hd120"]
    rng = np.random.default_rng(12)  # every opening holds x in [-1, 1] mm: neighbours' openings overlap
    bank_a, bank_b = -rng.integers(10, 600, size=60) / 10, rng.integers(10, 600, size=60) / 10
    layers = [(bank_a, bank_b)]
    jaw_1, jaw_2 = -81.3, 95.6
    leaf_t, leakage, jaw_t, tongue = 0.015, 0.006, 0.002, 0.8
    step = 0.1
    y = -130.0 + step * (np.arange(2600) + 0.5)
    x = -128.0 + step * (np.arange(2560) + 0.5)
    boundaries = np.asarray(hd120.layers[0])
    leaf = np.searchsorted(boundaries, y, side="right") - 1
    under = (leaf >= 0) & (leaf < 60)
    leaf = leaf.clip(0, 59)
    open_leaf = ~under[:, None] | ((x >= bank_a[leaf][:, None]) & (x < bank_b[leaf][:, None]))
    inner = boundaries[1:-1]  # boundaries between two leaves
    nearest = inner[np.abs(y[:, None] - inner[None, :]).argmin(axis=1)]
    distance = np.abs(y - nearest)
    neighbour = np.searchsorted(boundaries, np.where(y < nearest, nearest + 0.05, nearest - 0.05), side="right") - 1
    open_neighbour = (x >= bank_a[neighbour.clip(0, 59)][:, None]) & (x < bank_b[neighbour.clip(0, 59)][:, None])
    in_tongue = (distance < tongue / 2)[:, None] & under[:, None]
    open_leaf = np.where(in_tongue, open_leaf & open_neighbour, open_leaf)
    closed = leaf_t + leakage * ((distance < 1.0) & under)
    leaves = np.where(open_leaf, 1.0, closed[:, None])
    jaws = np.where((y >= jaw_1) & (y < jaw_2), 1.0, jaw_t)[:, None]
    expected = (leaves * jaws).reshape(260, 10, 256, 10).mean(axis=(1, 3))

    leaf_a, leaf_b = (torch.tensor(v, dtype=torch.float32).expand(1, 7, 104) for v in hd120.strips(layers))
    fluence = aperture_fluence(leaf_a, leaf_b, torch.full((1, 7), jaw_1), torch.full((1, 7), jaw_2),
                               torch.full((1, 7), 1 / 7), tongue_groove_mm=tongue, leaf_transmission=leaf_t,
                               interleaf_leakage=leakage, jaw_transmission=jaw_t,
                               interleaf=torch.from_numpy(hd120.interleaf))[0].numpy()
    np.testing.assert_allclose(fluence, expected, atol=1e-5)  # float32 sums of seven sub-apertures
    assert np.abs(fluence - expected).mean() < 1e-7


@pytest.mark.parametrize("name", ["millennium120", "mlci2", "halcyon", "hd120"])
def test_arcs_on_an_mlc_are_what_its_leaves_can_show(name):
    from epid.synthesis.sequences import MAX_LEAF_STEP_MM, generate_control_points

    geometry = MLC_GEOMETRIES[name]
    for dataset_id in (5, 100, 600):
        legacy = generate_control_points(dataset_id, 120)
        arc = generate_control_points(dataset_id, 120, geometry)
        shown = geometry.shown(arc.leaf_a, arc.leaf_b)
        np.testing.assert_array_equal(shown[0], arc.leaf_a)  # nothing the MLC cannot show
        np.testing.assert_array_equal(shown[1], arc.leaf_b)
        assert np.all(arc.leaf_b >= arc.leaf_a)
        assert np.abs(np.diff(arc.leaf_a, axis=0)).max() <= MAX_LEAF_STEP_MM + 1e-4
        np.testing.assert_allclose(arc.leaf_a * 10, np.round(arc.leaf_a * 10), atol=1e-3)
        if geometry.grid.count == 52:  # the same draws: the MU as the legacy arc's
            np.testing.assert_array_equal(arc.mu, legacy.mu)
        if geometry.y_jaws:
            if geometry.grid.count == 52:
                np.testing.assert_array_equal(arc.jaw_1, legacy.jaw_1)
            else:  # the jaws inside the span of the leaves (HD120: +-110 mm)
                assert arc.jaw_1.min() >= -110.0 and arc.jaw_2.max() <= 110.0 and np.all(arc.jaw_2 > arc.jaw_1)
            for leaf in np.unique(geometry.strip_leaves[0]):  # a 10 mm leaf: its two strips share a position
                strips = np.flatnonzero(geometry.strip_leaves[0] == leaf)
                assert np.all(arc.leaf_a[:, strips] == arc.leaf_a[:, strips[:1]])
        else:  # no jaws: open over the strips' span, the leaves shape the field along y too
            assert np.all(arc.jaw_1 == -130.0) and np.all(arc.jaw_2 == 130.0)
            assert np.any(arc.leaf_b - arc.leaf_a == 0.0) and np.all(arc.leaf_weight == 1.0)
    np.testing.assert_array_equal(generate_control_points(5, 120, MLC_GEOMETRIES["legacy"]).leaf_a,
                                  generate_control_points(5, 120).leaf_a)


def test_leaves_of_strips_round_trip_and_are_stored_by_name():
    rng = np.random.default_rng(3)
    for geometry in MLC_GEOMETRIES.values():
        assert geometry.modelled and bool(geometry.design_strips_reason) == (geometry.name == "hd120")
        assert type(geometry).from_dict(geometry.to_dict()) is geometry
        strips = geometry.grid.count
        leaf_a = rng.integers(-600, 0, size=(4, strips)) / 10
        leaf_b = leaf_a + rng.integers(0, 600, size=(4, strips)) / 10
        once = geometry.shown(leaf_a, leaf_b)
        twice = geometry.shown(*once)
        np.testing.assert_array_equal(once[0], twice[0])
        np.testing.assert_array_equal(once[1], twice[1])
        layers = geometry.leaves(*once)
        assert [bank_a.shape for bank_a, _ in layers] == [(4, pairs) for pairs in geometry.pairs]
    assert MLC_GEOMETRIES["agility"].hidden_pairs == 28 and MLC_GEOMETRIES["legacy"].hidden_pairs == 0
    assert MLC_GEOMETRIES["hd120"].hidden_pairs == 0  # its leaves end at +-110 mm, inside the imager


def test_estimates_are_tied_one_per_leaf_without_rounding():
    mlci2 = MLC_GEOMETRIES["mlci2"]
    leaf_a = np.arange(52, dtype=np.float64) * 0.37 - 9.0
    leaf_b = leaf_a + 20.0 + np.arange(52) * 0.011
    tied_a, tied_b = mlci2.tied(leaf_a, leaf_b)
    for leaf in np.unique(mlci2.strip_leaves[0]):  # by hand: each leaf's strips at their plain mean
        strips = np.flatnonzero(mlci2.strip_leaves[0] == leaf)
        np.testing.assert_allclose(tied_a[strips], leaf_a[strips].mean(), atol=1e-5)
        np.testing.assert_allclose(tied_b[strips], leaf_b[strips].mean(), atol=1e-5)
    for name in ("legacy", "agility", "halcyon"):  # strips are the leaves, or a dual layer's edges
        same_a, same_b = MLC_GEOMETRIES[name].tied(leaf_a, leaf_b)
        np.testing.assert_array_equal(same_a, leaf_a)
        np.testing.assert_array_equal(same_b, leaf_b)


def test_leaf_labels_name_each_strips_own_leaves():
    """Worked by hand: HD120's 2.5 mm strips from y = -130 mm, its leaves from -110 mm (14 of 5 mm,
    32 of 2.5 mm, 14 of 5 mm); Halcyon's 5 mm strips under the distal layer's 10 mm leaves from
    -140 mm and the proximal one's from -145 mm."""
    hd120 = MLC_GEOMETRIES["hd120"].leaf_labels
    expected = [""] * 8 + [str(1 + k // 2) for k in range(28)] + [str(15 + k) for k in range(32)]
    expected += [str(47 + k // 2) for k in range(28)] + [""] * 8
    assert list(hd120) == expected
    halcyon = MLC_GEOMETRIES["halcyon"].leaf_labels
    assert halcyon[:4] == ("2/2", "2/3", "3/3", "3/4") and halcyon[-1] == "27/28" and len(halcyon) == 52
