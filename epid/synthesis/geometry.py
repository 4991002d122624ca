"""The geometry every frame, model and plan shares: the imager grid and the MLC's leaf grid.

Imager (design section 4): 256 x 256 pixels at 1 mm, pixel (r, c) centred at
x = c - 128 + 0.5, y = r - 128 + 0.5 mm before the final up-down flip (row 0 of every
returned image is the most positive y). MLC (design section 3): 52 leaf pairs of 5 mm, leaf j
covering y in [-130 + 5 j, -125 + 5 j) mm. The leaf grid is the MLC's extent in 1 mm rows: the
imager's 256 rows plus two rows beyond it on each side.
"""

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
