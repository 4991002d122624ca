"""Apertures and their fluence on the 1 mm grid: opaque masks (the ideal synthesis) and the
fluence of leaves and jaws with transmission, rounded leaf ends, tongue-and-groove and interleaf leakage.

An aperture is open where jaw_1 <= y < jaw_2 and leaf_a[j(y)] <= x < leaf_b[j(y)], with lower
edges rounded down and upper edges rounded up to whole millimetres (openings never shrink; a
closed pair, leaf_b <= leaf_a, stays closed wherever it closes).
Positions within ``EDGE_TOLERANCE_MM`` of a whole millimetre count as that millimetre, so that
float round-off in interpolated positions cannot flip a pixel. Every row of the strips' grid lies
in one strip, so a row of an aperture is a box [column start, column stop): ``LeafGridBags`` sums
the boxes of a frame's sub-apertures as weighted bags of rows of a cumulative table
(``embedding_bag``). A real MLC's fluence (``physics_fluence``) is rendered layer by layer
(``frame_positions``).

Leaf positions come on the strips of ``epid.synthesis.geometry.StripGrid``, the grid told by their
count (52 or 104): on the fine strips (2.5 mm) apertures and fluence are rendered on rows of
0.5 mm and each 1 mm row of the result is the mean of its two (exact coverage of each pixel row
by each leaf); jaws stay rounded to whole millimetres in the masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from epid.core.devices import Device, device_of, resolve_device
from epid.synthesis.geometry import (
    GRID_ORIGIN_MM,
    GRID_SIZE,
    IMAGER_MARGIN,
    LEAF_GRID_ROWS,
    MLC_Y_MIN_MM,
    ROWS_PER_LEAF,
    STRIPS,
    SUB_APERTURES,
    StripGrid,
    strip_grid,
)
from epid.synthesis.physics import Physics
from epid.synthesis.sequences import ControlPoints

Setting = float | torch.Tensor
"""A physics setting: one value, or one per sample (a tensor that broadcasts)."""
EDGE_TOLERANCE_MM = 1e-4
"""Float32 positions are within 1e-5 mm of their 0.1 mm values; this absorbs that and round-off."""


def rasterize(
    leaf_a: np.ndarray | torch.Tensor,
    leaf_b: np.ndarray | torch.Tensor,
    jaw_1: np.ndarray | torch.Tensor,
    jaw_2: np.ndarray | torch.Tensor,
    *,
    device: Device = None,
) -> torch.Tensor:
    """Aperture masks (..., 256, 256) float32 for positions in mm: in {0, 1} on the 52 strips; on
    the 104 fine strips a pixel row over two strips is the mean of their halves.

    leaf_a, leaf_b: (..., strips); jaw_1, jaw_2: (...). Accepts numpy arrays or tensors; the
    result is on ``device``, else on the device of a tensor input, else on the CPU.
    """
    device = device_of(leaf_a, leaf_b, jaw_1, jaw_2) if device is None else resolve_device(device)
    leaf_a, leaf_b, jaw_1, jaw_2 = (_as_float64(v) for v in (leaf_a, leaf_b, jaw_1, jaw_2))
    batch_shape = np.broadcast_shapes(leaf_a.shape[:-1], leaf_b.shape[:-1], jaw_1.shape, jaw_2.shape)
    strips = leaf_a.shape[-1]
    edges = _aperture_edges(
        np.broadcast_to(leaf_a, (*batch_shape, strips)).reshape(-1, 1, strips),
        np.broadcast_to(leaf_b, (*batch_shape, strips)).reshape(-1, 1, strips),
        np.broadcast_to(jaw_1, batch_shape).reshape(-1, 1),
        np.broadcast_to(jaw_2, batch_shape).reshape(-1, 1),
    )
    weights = np.ones(edges.row_start.shape, dtype=np.float32)
    masks = mask_images(edges.to(device), torch.from_numpy(weights).to(device))
    return masks.reshape(*batch_shape, GRID_SIZE, GRID_SIZE)


@dataclass(frozen=True)
class ApertureEdges:
    """Integer aperture edges of B apertures with S sub-apertures each (numpy or torch int64).

    col_start, col_stop: (B, S, strips) columns [start, stop) open in each strip's rows, 0..256.
    row_start, row_stop: (B, S) rows [start, stop) of ``grid`` open between the jaws, 0..grid.rows.
    open_rows: (first, stop) 1 mm rows of the leaf grid (0..260) open in any sub-aperture.
    """

    col_start: np.ndarray | torch.Tensor
    col_stop: np.ndarray | torch.Tensor
    row_start: np.ndarray | torch.Tensor
    row_stop: np.ndarray | torch.Tensor
    open_rows: tuple[int, int]
    grid: StripGrid = STRIPS

    def to(self, device: torch.device) -> ApertureEdges:
        """The edges as tensors on ``device``."""
        values = (self.col_start, self.col_stop, self.row_start, self.row_stop)
        return ApertureEdges(*(torch.as_tensor(v).to(device) for v in values), self.open_rows, self.grid)


class LeafGridBags:
    """The 1 mm rows [first_row, stop_row) of the leaf grid as weighted bags of cumulative-table rows.

    Row q of the strips' grid lies in strip q // 5; in sub-aperture s it is the box [start, stop)
    of that strip, weighted by the sub-aperture's weight when the row is between its jaws (on
    the fine strips, by half of it: a 1 mm row is the sum of two). Through a cumulative table T
    (257, W) the box becomes T[stop] - T[start], so one row is a bag of table rows with weights
    +w and -w, summed by ``embedding_bag`` without building the per-sub-aperture images.
    """

    def __init__(self, edges: ApertureEdges, weights: torch.Tensor, first_row: int, stop_row: int) -> None:
        per_pixel = edges.grid.rows_per_pixel
        rows = torch.arange(first_row * per_pixel, stop_row * per_pixel, device=weights.device)
        if per_pixel > 1:
            weights = weights / per_pixel
        leaf = rows // ROWS_PER_LEAF
        inside = (rows[:, None] >= edges.row_start[:, None, :]) & (rows[:, None] < edges.row_stop[:, None, :])
        row_weight = inside.to(weights.dtype) * weights[:, None, :]
        col_stop = edges.col_stop.transpose(1, 2)[:, leaf]
        col_start = edges.col_start.transpose(1, 2)[:, leaf]
        self.batch, self.row_count = weights.shape[0], stop_row - first_row
        bags = self.batch * self.row_count
        self.indices = torch.stack([col_stop, col_start], dim=-1).view(bags, -1)
        self.weights = torch.stack([row_weight, -row_weight], dim=-1).view(bags, -1)

    def rows(self, cumulative: torch.Tensor) -> torch.Tensor:
        """(B, rows, W) weighted sums of boxes through the cumulative table (257, W)."""
        summed = torch.nn.functional.embedding_bag(
            self.indices, cumulative, per_sample_weights=self.weights, mode="sum"
        )
        return summed.view(self.batch, self.row_count, cumulative.shape[-1])


def _aperture_edges(leaf_a: np.ndarray, leaf_b: np.ndarray, jaw_1: np.ndarray, jaw_2: np.ndarray) -> ApertureEdges:
    """Edges of apertures given in mm: leaves (B, S, strips), jaws (B, S), float64."""
    grid = strip_grid(leaf_a.shape[-1])
    col_start = np.floor(leaf_a + EDGE_TOLERANCE_MM) - GRID_ORIGIN_MM
    col_stop = np.ceil(leaf_b - EDGE_TOLERANCE_MM) - GRID_ORIGIN_MM
    row_start = np.floor(jaw_1 + EDGE_TOLERANCE_MM) - MLC_Y_MIN_MM
    row_stop = np.ceil(jaw_2 - EDGE_TOLERANCE_MM) - MLC_Y_MIN_MM
    col_start = np.clip(col_start, 0, GRID_SIZE).astype(np.int64)
    col_stop = np.where(leaf_b - leaf_a > EDGE_TOLERANCE_MM, np.clip(col_stop, col_start, GRID_SIZE), col_start)
    col_stop = col_stop.astype(np.int64)
    row_start = np.clip(row_start, 0, LEAF_GRID_ROWS).astype(np.int64)
    row_stop = np.clip(row_stop, row_start, LEAF_GRID_ROWS).astype(np.int64)
    open_rows = (int(row_start.min(initial=LEAF_GRID_ROWS)), int(row_stop.max(initial=0)))
    per_pixel = grid.rows_per_pixel
    return ApertureEdges(col_start, col_stop, row_start * per_pixel, row_stop * per_pixel, open_rows, grid)


def interpolated_positions(control_points: ControlPoints, frames: np.ndarray) -> tuple[np.ndarray, ...]:
    """leaf_a, leaf_b (F, 7, strips) and jaw_1, jaw_2 (F, 7) of the 7 sub-apertures of each frame,
    float64 mm: linear interpolation from CP f - 1 to CP f."""
    return tuple(_sub_apertures(values[frames - 1], values[frames])
                 for values in (getattr(control_points, name) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2")))


def _sub_apertures(before: np.ndarray, after: np.ndarray) -> np.ndarray:
    """Values (F, ...) at CP f - 1 and CP f -> (F, 7, ...) float64 at the 7 sub-apertures between them."""
    before, after = before.astype(np.float64), after.astype(np.float64)
    t = (np.arange(SUB_APERTURES, dtype=np.float64) / (SUB_APERTURES - 1)).reshape(1, -1, *([1] * (before.ndim - 1)))
    return before[:, None] + t * (after - before)[:, None]


def frame_edges(control_points: ControlPoints, frames: np.ndarray) -> ApertureEdges:
    """Edges of the 7 sub-apertures of each frame."""
    return _aperture_edges(*interpolated_positions(control_points, frames))


def cell_coverage(lower: torch.Tensor, upper: torch.Tensor, centres: torch.Tensor, width: float = 1.0) -> torch.Tensor:
    """Share of each cell (``width`` mm, 1 by default) that the opening [lower, upper] covers: (..., n) in [0, 1]."""
    low = torch.maximum(lower.unsqueeze(-1), centres - width / 2)
    high = torch.minimum(upper.unsqueeze(-1), centres + width / 2)
    if width == 1.0:
        return (high - low).clamp(0.0, 1.0)
    return (high - low).clamp(0.0, width) / width


def groove_shares(half_width_mm: Setting, grid: StripGrid) -> list[torch.Tensor]:
    """The share of each of ``grid``'s rows within 1 mm of a boundary between leaves (nearest first)
    that a tongue-and-groove strip reaching ``half_width_mm`` into each leaf covers (0-d tensors)."""
    half = torch.as_tensor(half_width_mm)
    return [(half - k * grid.row_mm).clamp(0.0, grid.row_mm) / grid.row_mm for k in range(grid.rows_per_pixel)]


def aperture_fluence(leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaw_1: torch.Tensor, jaw_2: torch.Tensor,
                     weights: torch.Tensor, *, leaf_end_offset_a: Setting = 0.0, leaf_end_offset_b: Setting = 0.0,
                     jaw_edge_offset: Setting = 0.0, tongue_groove_mm: Setting = 0.0,
                     leaf_transmission: Setting = 0.0, interleaf_leakage: Setting = 0.0,
                     jaw_transmission: Setting = 0.0, second_layer: tuple[torch.Tensor, torch.Tensor] | None = None,
                     interleaf: torch.Tensor | None = None,
                     x_jaws: tuple[torch.Tensor, torch.Tensor] | None = None, x_jaw_edge_offset: Setting | None = None,
                     x_jaw_transmission: Setting | None = None) -> torch.Tensor:
    """The fluence of B apertures on the leaf grid, (B, 260, 256), y ascending: the sum of the S
    sub-apertures of each (leaves (B, S, strips), jaws (B, S), mm) weighted by ``weights`` (B, S),
    rendered on the rows of the strips' grid (``StripGrid``: 0.5 mm for the fine strips, each 1 mm
    row the mean of its two).

    A cell's fluence is the product of the jaws' and the leaves' transmission of it, each
    t + (1 - t) x its open fraction (exact, not rounded to the grid). Bank A's edges move by
    -``leaf_end_offset_a``, bank B's by +``leaf_end_offset_b`` and the jaws' by
    -/+``jaw_edge_offset`` (mm; positive widens). In the 1 mm rows on either side of a boundary
    between leaves (every strip boundary, or those ``interleaf`` marks), the part of the row inside the
    tongue-and-groove strip (``tongue_groove_mm``
    wide, centred on the boundary) is open only where both leaves are (in each column, the smaller of
    the two leaves' open fractions: exact unless one leaf's bank A edge and its neighbour's bank B
    edge fall in the same column), and closed leaves transmit
    ``interleaf_leakage`` on top of ``leaf_transmission``. Transmissions are fractions. Serves the
    synthesis (``epid.synthesis.physics`` settings as numbers) and the aperture models (learned tensors).

    A second layer of leaves (``second_layer``: its edges over each strip, (B, S, strips) each) stacks
    its own transmission on the first's: a cell behind both layers transmits t squared. Where one
    layer alone is open the cell passes the other's transmission: that part, a transmission's share
    of the fluence (0.4 % under the realistic physics), is rendered without gradients for edges and
    jaws (the transmissions keep theirs), which halves a dual layer's forward and backward pass.
    ``interleaf`` (layers, strips - 1): which boundaries between strips are boundaries between leaves of
    each layer (``MlcGeometry.interleaf``; default every one, in one layer).

    ``x_jaws`` (X1, X2: (B, S) mm each, a beam with X jaws, one layer of leaves): jaws along x with
    their own edge offset and transmission (``x_jaw_edge_offset``, ``x_jaw_transmission``; None: the
    Y jaws'), whose transmission multiplies the leaves' and the Y jaws' at every point (exact over
    each cell: where a leaf end and an X jaw share a cell, the part both leave open is their
    openings' overlap).
    """
    device, batch, sub_apertures = leaf_a.device, leaf_a.shape[0], leaf_a.shape[1]
    grid = strip_grid(leaf_a.shape[-1])
    band = grid.rows_per_pixel  # the rows of a strip within 1 mm of its boundary, each side
    columns = torch.arange(GRID_SIZE, device=device, dtype=torch.float32) + (GRID_ORIGIN_MM + 0.5)
    rows = grid.row_centres(device)
    jaw_open = cell_coverage(jaw_1 - jaw_edge_offset, jaw_2 + jaw_edge_offset, rows, grid.row_mm)  # (B, S, rows)
    jaw_fluence = (jaw_transmission + (1.0 - jaw_transmission) * jaw_open) * weights[:, :, None]
    jaw_fluence = jaw_fluence.view(batch, sub_apertures, grid.count, ROWS_PER_LEAF).permute(0, 2, 3, 1)
    shares = None  # of the k-th row from a boundary inside the tongue-and-groove strip
    if isinstance(tongue_groove_mm, torch.Tensor) or tongue_groove_mm > 0:
        shares = groove_shares(torch.as_tensor(tongue_groove_mm, device=device) / 2.0, grid)
    tongue = None if interleaf is None else interleaf.amax(0).view(-1, 1, 1)  # (strips - 1, 1, 1)
    x_edge = jaw_edge_offset if x_jaw_edge_offset is None else x_jaw_edge_offset
    x_transmission = jaw_transmission if x_jaw_transmission is None else x_jaw_transmission

    def open_sum(lower: torch.Tensor, upper: torch.Tensor, within_x_jaws: bool = False) -> torch.Tensor:
        """(B, rows, 256) sum over the sub-apertures of jaws x the open fraction of leaf edges (B, S, strips),
        or with ``within_x_jaws`` of the part of the opening that the X jaws leave open too."""
        low, high = lower - leaf_end_offset_a, upper + leaf_end_offset_b
        if within_x_jaws:
            low = torch.maximum(low, (x_jaws[0] - x_edge)[..., None])
            high = torch.minimum(high, (x_jaws[1] + x_edge)[..., None])
        leaf_open = cell_coverage(low, high, columns).transpose(1, 2)  # (B, strips, S, 256)
        first_rows, last_rows = [leaf_open] * band, [leaf_open] * band  # k-th row from the lower / upper boundary
        if shares is not None:
            both = torch.minimum(leaf_open[:, :-1], leaf_open[:, 1:])
            for k, share in enumerate(shares):
                share = share if tongue is None else share * tongue
                first_rows[k] = torch.cat([leaf_open[:, :1], leaf_open[:, 1:] + share * (both - leaf_open[:, 1:])], 1)
                last_rows[k] = torch.cat([leaf_open[:, :-1] + share * (both - leaf_open[:, :-1]), leaf_open[:, -1:]], 1)
        return torch.cat([
            *(torch.matmul(jaw_fluence[:, :, k:k + 1], first_rows[k]) for k in range(band)),
            torch.matmul(jaw_fluence[:, :, band:-band], leaf_open),
            *(torch.matmul(jaw_fluence[:, :, -k - 1:ROWS_PER_LEAF - k], last_rows[k]) for k in reversed(range(band))),
        ], 2).view(batch, grid.rows, GRID_SIZE)

    layers = 1 if second_layer is None else 2
    if interleaf is None:
        interleaf = torch.ones((layers, grid.count - 1), device=device)
    boundary = torch.zeros((layers, grid.count, ROWS_PER_LEAF), device=device)
    boundary[:, :-1, -band:] = interleaf[..., None]
    boundary[:, 1:, :band] = interleaf[..., None]
    closed = leaf_transmission + interleaf_leakage * boundary.view(layers, grid.rows, 1)  # (layers, rows, 1)
    jaw_sum = jaw_fluence.sum(-1).reshape(batch, grid.rows, 1)
    if x_jaws is not None:
        if second_layer is not None:
            raise ValueError("X jaws are rendered for a single layer of leaves only")
        # a cell passes t_x + (1 - t_x) x its share the X jaws leave open, times the leaves' and Y jaws' own:
        # the leaves' open part splits into the part the X jaws leave open and the rest
        x_open = cell_coverage(x_jaws[0] - x_edge, x_jaws[1] + x_edge, columns)  # (B, S, 256)
        x_sum = torch.matmul(jaw_fluence.reshape(batch, grid.rows, sub_apertures), x_open)
        leaves = x_transmission * open_sum(leaf_a, leaf_b) + (1.0 - x_transmission) * open_sum(leaf_a, leaf_b, True)
        behind = x_transmission * jaw_sum + (1.0 - x_transmission) * x_sum
        fluence = leaves * (1.0 - closed[0]) + behind * closed[0]
    elif second_layer is None:
        fluence = open_sum(leaf_a, leaf_b) * (1.0 - closed[0]) + jaw_sum * closed[0]
    else:
        first, second = closed
        with torch.no_grad():
            only_first, only_second = open_sum(leaf_a, leaf_b), open_sum(*second_layer)
        fluence = (jaw_sum * (first * second) + only_first * ((1.0 - first) * second)
                   + only_second * (first * (1.0 - second))
                   + open_sum(torch.maximum(leaf_a, second_layer[0]), torch.minimum(leaf_b, second_layer[1]))
                   * ((1.0 - first) * (1.0 - second)))
    return grid.pixel_rows(fluence)


def layer_positions(control_points: ControlPoints, frames: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer of the control points' MLC, the edges of its leaves over each strip (leaf_a,
    leaf_b (F, 7, strips) float64 mm, ``MlcGeometry.layer_edges``) at the 7 sub-apertures of each
    frame: each leaf moves linearly from CP f - 1 to CP f."""
    mlc = control_points.mlc
    before = mlc.layer_edges(control_points.leaf_a[frames - 1], control_points.leaf_b[frames - 1])
    after = mlc.layer_edges(control_points.leaf_a[frames], control_points.leaf_b[frames])
    return [(_sub_apertures(start[0], end[0]), _sub_apertures(start[1], end[1]))
            for start, end in zip(before, after, strict=True)]


def frame_positions(control_points: ControlPoints, frames: np.ndarray,
                    device: torch.device) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The positions of ``frames`` (F,) at their 7 sub-apertures on ``device``: [leaf_a, leaf_b
    (F, 7, strips), jaw_1, jaw_2 (F, 7)] float32 mm, the leaves those of the first layer of the control
    points' MLC, and the rest of its layers as ``aperture_fluence`` takes them (``second_layer``,
    ``interleaf``; none for an MLC whose strips are its leaves), with the X jaws (``x_jaws``: X1, X2
    (F, 7) each) where the control points have them. A single layer's leaves are the strips' own
    positions; only a dual layer's are placed per layer (``layer_positions``)."""
    positions = [torch.from_numpy(v).to(device, torch.float32) for v in interpolated_positions(control_points, frames)]
    mlc = control_points.mlc
    layers: dict[str, Any] = {}
    if control_points.x_jaws is not None:
        x_jaws = torch.from_numpy(_sub_apertures(control_points.x_jaws[frames - 1], control_points.x_jaws[frames]))
        layers["x_jaws"] = tuple(x_jaws.to(device, torch.float32).unbind(-1))
    if mlc.identity:
        return positions, layers
    layers["interleaf"] = torch.from_numpy(mlc.interleaf).to(device)
    if len(mlc.layers) > 1:
        first, second = ([torch.from_numpy(v).to(device, torch.float32) for v in layer]
                         for layer in layer_positions(control_points, frames))
        positions[:2] = first
        layers["second_layer"] = tuple(second)
    return positions, layers


def physics_fluence(leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaw_1: torch.Tensor, jaw_2: torch.Tensor,
                    mu: torch.Tensor, physics: Physics, **layers: Any) -> torch.Tensor:
    """The fluence (B, 260, 256) of B frames with ``physics``: the 7 sub-apertures (leaves
    (B, 7, strips), jaws (B, 7), mm) of each frame averaged and scaled by its MU (B,); ``layers``: an
    MLC's further layers and leaf boundaries (``frame_positions``)."""
    weights = (mu / SUB_APERTURES)[:, None].expand(-1, SUB_APERTURES)
    return aperture_fluence(
        leaf_a, leaf_b, jaw_1, jaw_2, weights,
        leaf_end_offset_a=physics.leaf_end_offset_mm, leaf_end_offset_b=physics.leaf_end_offset_mm,
        tongue_groove_mm=physics.tongue_groove_mm, leaf_transmission=physics.leaf_transmission_percent / 100.0,
        interleaf_leakage=physics.interleaf_leakage_percent / 100.0,
        jaw_transmission=physics.jaw_transmission_percent / 100.0,
        x_jaw_transmission=physics.x_jaw_transmission_percent / 100.0, **layers,
    )


def mask_images(edges: ApertureEdges, weights: torch.Tensor) -> torch.Tensor:
    """(B, 256, 256) weighted sums of the masks of each aperture's sub-apertures, final orientation."""
    device = weights.device
    columns = torch.arange(GRID_SIZE, device=device)
    cumulative = (columns[None, :] < torch.arange(GRID_SIZE + 1, device=device)[:, None]).to(torch.float32)
    rows = LeafGridBags(edges, weights, IMAGER_MARGIN, IMAGER_MARGIN + GRID_SIZE).rows(cumulative)
    return rows.flip(-2)


def _as_float64(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.float64)
