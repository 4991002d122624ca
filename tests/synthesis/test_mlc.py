"""The built-in MLCs as data, checked against their published leaf layouts, and a plan's MLC found
from its leaf boundaries (a dual-layer MLC from its layers' pair counts, in either order)."""

from __future__ import annotations

import numpy as np
import pytest

from epid.synthesis.mlc import MLC_GEOMETRIES, identify

LAYOUTS = {  # name: [(first boundary mm, [(leaves, width mm), ...]) per layer], travel mm, jaws
    "legacy": ([(-130.0, [(52, 5.0)])], 200.0, True),
    "agility": ([(-200.0, [(80, 5.0)])], 200.0, True),
    "millennium120": ([(-200.0, [(10, 10.0), (40, 5.0), (10, 10.0)])], 200.0, True),
    "hd120": ([(-110.0, [(14, 5.0), (32, 2.5), (14, 5.0)])], 200.0, True),
    "mlci2": ([(-200.0, [(40, 10.0)])], 200.0, True),
    "halcyon": ([(-140.0, [(28, 10.0)]), (-145.0, [(29, 10.0)])], 140.0, False),
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
    assert geometry.travel_mm == travel and geometry.x_jaws == jaws and geometry.y_jaws == jaws
    assert identify([layout(first, runs) for first, runs in layers]) is geometry


def test_halcyon_is_found_from_its_layers_in_either_order_and_unknown_mlcs_are_not():
    distal, proximal = layout(-140.0, [(28, 10.0)]), layout(-145.0, [(29, 10.0)])
    assert identify([proximal, distal]) is MLC_GEOMETRIES["halcyon"]
    assert identify([distal]) is None  # one layer alone is no known MLC
    assert identify([layout(-200.0, [(80, 5.0)]) + 0.5]) is None  # Agility's layout, shifted
    assert identify([layout(-100.0, [(40, 5.0)])]) is None
