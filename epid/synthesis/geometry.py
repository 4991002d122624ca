"""The geometry every frame, model and plan shares: the imager grid and the MLC's leaf grid.

Imager (design section 4): 256 x 256 pixels at 1 mm, pixel (r, c) centred at
x = c - 128 + 0.5, y = r - 128 + 0.5 mm before the final up-down flip (row 0 of every
returned image is the most positive y). MLC (design section 3): 52 leaf pairs of 5 mm, leaf j
covering y in [-130 + 5 j, -125 + 5 j) mm. The leaf grid is the MLC's extent in 1 mm rows: the
imager's 256 rows plus two rows beyond it on each side. Leaves finer than 5 mm (HD120's 2.5 mm) are
shown on a finer grid of strips (``StripGrid``).
"""

import math

import numpy as np
import torch

NUM_LEAF_PAIRS = 52
LEAF_WIDTH_MM = 5.0
MLC_Y_MIN_MM = -130.0
"""Lower edge of leaf 0; leaf j covers y in [-130 + 5 j, -125 + 5 j) mm."""

GRID_SIZE = 256
FRAME_SHAPE = (GRID_SIZE, GRID_SIZE)
PIXEL_MM = 1.0
GRID_ORIGIN_MM = -GRID_SIZE / 2 * PIXEL_MM
"""Position of the imager's first pixel edge along x and y."""
TENTHS_PER_MM = 10
"""Positions and MU of control points are whole tenths (of a mm, of an MU)."""
SUB_APERTURES = 7
"""Sub-apertures per frame, at t = 0, 1/6, ..., 1 between consecutive control points."""

ROWS_PER_LEAF = round(LEAF_WIDTH_MM / PIXEL_MM)
LEAF_GRID_ROWS = NUM_LEAF_PAIRS * ROWS_PER_LEAF
"""Rows of the 1 mm leaf grid, y in [-130, 130) mm: two beyond the imager on each side."""
IMAGER_MARGIN = round((GRID_ORIGIN_MM - MLC_Y_MIN_MM) / PIXEL_MM)
"""Leaf-grid rows below the imager's first row (and above its last)."""


class StripGrid:
    """Strips along y over the MLC's span y in [-130, 130) mm, each ``strip_mm`` wide and five
    leaf-grid rows of ``strip_mm / 5`` mm: the unit in which an arc's leaf positions are given
    (one bank A and one bank B edge per strip) and its fluence is rendered.

    ``STRIPS`` (52 of 5 mm, rows of 1 mm) is the design's grid, on which the models work;
    ``FINE_STRIPS`` (104 of 2.5 mm, rows of 0.5 mm, two to each imager row) shows leaves of
    2.5 mm (HD120) exactly: a fluence rendered on its rows is binned to the 1 mm rows of the
    imager (``pixel_rows``).
    """

    def __init__(self, strip_mm: float) -> None:
        self.strip_mm = float(strip_mm)
        self.count = round(-2.0 * MLC_Y_MIN_MM / self.strip_mm)
        self.row_mm = self.strip_mm / ROWS_PER_LEAF
        self.rows = self.count * ROWS_PER_LEAF
        self.rows_per_pixel = round(PIXEL_MM / self.row_mm)

    def __repr__(self) -> str:
        return f"StripGrid({self.count} strips of {self.strip_mm:g} mm)"

    @property
    def phases(self) -> int:
        """How many ways a strip's rows fall on the imager's 1 mm rows: strip j's rows start
        ``j x ROWS_PER_LEAF`` rows from a whole millimetre, which repeats every ``phases`` strips (one on
        rows of 1 mm, two on rows of 0.5 mm)."""
        return self.rows_per_pixel // math.gcd(ROWS_PER_LEAF, self.rows_per_pixel)

    @property
    def edges_mm(self) -> np.ndarray:
        """(count + 1,) edges of the strips along y, mm."""
        return MLC_Y_MIN_MM + self.strip_mm * np.arange(self.count + 1)

    def row_centres(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(rows,) y of this grid's rows' centres, ascending, mm (float32)."""
        return torch.arange(self.rows, device=device, dtype=torch.float32) * self.row_mm + (
            MLC_Y_MIN_MM + self.row_mm / 2)

    @property
    def centres_mm(self) -> np.ndarray:
        """(count,) centres of the strips along y, mm."""
        return MLC_Y_MIN_MM + self.strip_mm * (np.arange(self.count) + 0.5)

    def strip_rows(self, leaf_grid: torch.Tensor) -> torch.Tensor:
        """(..., 260, W) on the 1 mm rows -> (..., rows, W) on this grid's rows, each 1 mm row
        repeated (the same tensor on a grid of 1 mm rows)."""
        if self.rows_per_pixel == 1:
            return leaf_grid
        return leaf_grid.repeat_interleave(self.rows_per_pixel, dim=-2)

    def pixel_rows(self, fluence: torch.Tensor) -> torch.Tensor:
        """(..., rows, W) on this grid's rows -> (..., 260, W) on the 1 mm rows: the mean of the
        rows in each (the same tensor on a grid of 1 mm rows)."""
        if self.rows_per_pixel == 1:
            return fluence
        return fluence.unflatten(-2, (LEAF_GRID_ROWS, self.rows_per_pixel)).mean(-2)


STRIPS = StripGrid(LEAF_WIDTH_MM)
"""The design's 52 strips of 5 mm: the models' grid."""
FINE_STRIPS = StripGrid(LEAF_WIDTH_MM / 2)
"""104 strips of 2.5 mm on rows of 0.5 mm."""
STRIP_GRIDS = (STRIPS, FINE_STRIPS)
"""The grids an MLC can be shown on, coarsest first."""


def strip_grid(count: int) -> StripGrid:
    """The grid of ``count`` strips (the last axis of an arc's leaf positions); ValueError otherwise."""
    for grid in STRIP_GRIDS:
        if grid.count == count:
            return grid
    raise ValueError(f"{count} strips: expected {' or '.join(str(grid.count) for grid in STRIP_GRIDS)}")
