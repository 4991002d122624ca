"""EPID frames: aperture masks, the response-kernel convolution and MU-weighted noisy frames.

Geometry (design section 4): a 256 x 256 grid at 1 mm pitch, pixel (r, c) centred at
x = c - 128 + 0.5, y = r - 128 + 0.5 mm before the final up-down flip, so row 0 of every
returned image is the most positive y. An aperture is open where jaw_1 <= y < jaw_2 and
leaf_a[j(y)] <= x < leaf_b[j(y)], with lower edges rounded down and upper edges rounded up
to whole millimetres (openings never shrink). Positions within ``EDGE_TOLERANCE_MM`` of a
whole millimetre count as that millimetre, so that float round-off in interpolated
positions cannot flip a pixel.

Masks and convolutions involve no Python loop over leaves or frames (only the noise is
drawn frame by frame, each frame from its own seed). Every pixel row lies in one leaf, so a
row of an aperture is a box [column start, column stop). With a separable kernel term
u v^T, the horizontal convolution of a box is the difference of two rows of a cumulative
table of v (``T[stop] - T[start]``), so a row of a frame, which sums the boxes of the 7
sub-apertures that its jaws let through, is one weighted bag of 14 table rows
(``embedding_bag``); the vertical convolution is one matrix product with the Toeplitz
matrix of u over the rows that any jaw opens. Kernels that are not close to a few
separable terms are applied by FFT to the rasterised masks instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.fft
import torch

from epid.devices import device_of, resolve_device
from epid.physics import BACKSCATTER_SIGMA_MM, Physics
from epid.sequences import LEAF_WIDTH_MM, MLC_Y_MIN_MM, NUM_LEAF_PAIRS, ControlPoints

GRID_SIZE = 256
FRAME_SHAPE = (GRID_SIZE, GRID_SIZE)
PIXEL_MM = 1.0
SUB_APERTURES = 7
"""Sub-apertures per frame, at t = 0, 1/6, ..., 1 between consecutive control points."""
EDGE_TOLERANCE_MM = 1e-4
"""Float32 positions are within 1e-5 mm of their 0.1 mm values; this absorbs that and round-off."""
MAX_SEPARABLE_RANK = 4
"""Kernels needing more separable terms than this are applied by FFT (faster beyond it on CPU)."""
SEPARABLE_TOLERANCE = 1e-6
"""Largest L1 norm of the dropped SVD terms, relative to the kernel's L1 norm."""
CHUNK_FRAMES = {"cpu": 32, "cuda": 512}
"""Frames rendered at once per device type (others: the CPU value). Bounds the working memory
(about 1 MB per frame); on the CPU small chunks also keep the band of open rows narrow."""

_ROWS_PER_LEAF = round(LEAF_WIDTH_MM / PIXEL_MM)
_LEAF_GRID_ROWS = NUM_LEAF_PAIRS * _ROWS_PER_LEAF
"""Rows of the leaf grid: y in [-130, 130) mm, two rows beyond the imager on each side."""
_LEAF_GRID_ORIGIN_MM = MLC_Y_MIN_MM
_GRID_ORIGIN_MM = -GRID_SIZE / 2 * PIXEL_MM
_LEAF_GRID_MARGIN = round((_GRID_ORIGIN_MM - _LEAF_GRID_ORIGIN_MM) / PIXEL_MM)
"""Leaf-grid rows below the imager's first row (and above its last)."""

Device = torch.device | str | None
IDEAL = Physics()


def rasterize(
    leaf_a: np.ndarray | torch.Tensor,
    leaf_b: np.ndarray | torch.Tensor,
    jaw_1: np.ndarray | torch.Tensor,
    jaw_2: np.ndarray | torch.Tensor,
    *,
    device: Device = None,
) -> torch.Tensor:
    """Aperture masks (..., 256, 256) float32 in {0, 1} for positions in mm.

    leaf_a, leaf_b: (..., 52); jaw_1, jaw_2: (...). Accepts numpy arrays or tensors; the
    result is on ``device``, else on the device of a tensor input, else on the CPU.
    """
    device = device_of(leaf_a, leaf_b, jaw_1, jaw_2) if device is None else resolve_device(device)
    leaf_a, leaf_b, jaw_1, jaw_2 = (_as_float64(v) for v in (leaf_a, leaf_b, jaw_1, jaw_2))
    batch_shape = np.broadcast_shapes(leaf_a.shape[:-1], leaf_b.shape[:-1], jaw_1.shape, jaw_2.shape)
    edges = _aperture_edges(
        np.broadcast_to(leaf_a, (*batch_shape, NUM_LEAF_PAIRS)).reshape(-1, 1, NUM_LEAF_PAIRS),
        np.broadcast_to(leaf_b, (*batch_shape, NUM_LEAF_PAIRS)).reshape(-1, 1, NUM_LEAF_PAIRS),
        np.broadcast_to(jaw_1, batch_shape).reshape(-1, 1),
        np.broadcast_to(jaw_2, batch_shape).reshape(-1, 1),
    )
    weights = np.ones(edges.row_start.shape, dtype=np.float32)
    masks = _mask_images(edges.to(device), torch.from_numpy(weights).to(device))
    return masks.reshape(*batch_shape, GRID_SIZE, GRID_SIZE)


def convolve(images: np.ndarray | torch.Tensor, kernel: np.ndarray | torch.Tensor) -> torch.Tensor:
    """'same' 2-D convolution of (..., H, W) images with a kernel, as scipy.signal.fftconvolve(mode="same").

    Runs on the device of ``images`` (numpy arrays on the CPU); float32 result.
    """
    images = images if isinstance(images, torch.Tensor) else torch.from_numpy(np.asarray(images))
    return renderer_for(kernel, images.device).convolve(images)


def render_frames(
    control_points: ControlPoints,
    frame_indices: Sequence[int] | np.ndarray | torch.Tensor,
    kernel: np.ndarray | torch.Tensor | FrameRenderer,
    *,
    dataset_id: int,
    noise_std: float = 0.005,
    noise_seed: int = 0,
    device: Device = None,
    physics: Physics | None = None,
) -> torch.Tensor:
    """EPID frames (F, 256, 256) float32 on ``device`` (CPU when None); see ``FrameRenderer.render``
    (``physics`` None is ideal, the legacy synthesis).

    ``kernel`` may be an array or tensor (its prepared form is cached per device) or a
    ``FrameRenderer``, which then decides the device when ``device`` is None.
    """
    if isinstance(kernel, FrameRenderer):
        renderer = kernel if device is None or torch.device(device) == kernel.device else kernel.to(device)
    else:
        renderer = renderer_for(kernel, resolve_device(device or "cpu"))
    return renderer.render(
        control_points, frame_indices, dataset_id=dataset_id, noise_std=noise_std, noise_seed=noise_seed,
        physics=physics,
    )


def frame_noise_seed(noise_seed: int, dataset_id: int, frame: int) -> int:
    """The 63-bit seed of one frame's noise, a splitmix64 hash of (noise_seed, dataset_id, frame)."""
    state = 0x243F6A8885A308D3
    for value in (noise_seed, dataset_id, frame):
        state = _splitmix64(state ^ (value & _MASK_64))
    return state >> 1


class FrameRenderer:
    """A kernel prepared for one device: convolves images and renders frames.

    The kernel is split by SVD into separable terms when at most ``MAX_SEPARABLE_RANK``
    of them reproduce it to ``SEPARABLE_TOLERANCE`` (the default kernel is exactly one
    term); otherwise its FFT is used. The preparation happens once per renderer; use
    ``renderer_for`` to share renderers between calls.
    """

    def __init__(self, kernel: np.ndarray | torch.Tensor, device: Device = None) -> None:
        self.kernel = _kernel_array(kernel)
        self.device = resolve_device(device or "cpu")
        vertical, horizontal = _separable_terms(self.kernel)
        self.rank = len(vertical)
        self.method = "separable" if self.rank else "fft"
        self._vertical = vertical
        self._horizontal = horizontal
        self._operators: dict[tuple[str, int, int], torch.Tensor] = {}
        self.chunk_frames = CHUNK_FRAMES.get(self.device.type, CHUNK_FRAMES["cpu"])

    def to(self, device: Device) -> FrameRenderer:
        """The same kernel prepared for another device."""
        return renderer_for(self.kernel, resolve_device(device or "cpu"))

    def convolve(self, images: torch.Tensor) -> torch.Tensor:
        """'same' convolution of (..., H, W) images (float32, on this renderer's device)."""
        images = images.to(self.device, torch.float32)
        height, width = images.shape[-2:]
        with _exact_float32(self.device):
            if self.method == "fft":
                return self._fft_convolve(images)
            result = None
            for term in range(self.rank):
                vertical = self._operator("vertical", term, height)
                horizontal_t = self._operator("horizontal_t", term, width)
                part = torch.matmul(vertical, torch.matmul(images, horizontal_t))
                result = part if result is None else result + part
            return result

    def render(
        self,
        control_points: ControlPoints,
        frame_indices: Sequence[int] | np.ndarray | torch.Tensor,
        *,
        dataset_id: int,
        noise_std: float = 0.005,
        noise_seed: int = 0,
        physics: Physics | None = None,
    ) -> torch.Tensor:
        """EPID frames (F, 256, 256) float32 on this renderer's device.

        Frame f (1 <= f < N) integrates the motion from CP f - 1 to CP f: the masks of 7
        sub-apertures at t = 0, 1/6, ..., 1 of the linear interpolation of leaves and jaws,
        summed, convolved with the kernel and scaled by MU_f / 7; plus Gaussian noise of std
        noise_std * MU_f / sqrt(7) drawn from a generator seeded by
        ``frame_noise_seed(noise_seed, dataset_id, f)``, so a frame is the same in any call
        or batch on the same kind of device (CPU and CUDA generators differ).

        ``physics`` other than ideal (``epid.physics``) replaces the binary masks by the
        fluence of a real MLC (``_physics_fluence``), adds the arm backscatter and mixes in the
        lag of the earlier frames before the noise; None is ideal.
        """
        physics = physics or IDEAL
        frames = _frame_indices(frame_indices, len(control_points))
        out = torch.empty((len(frames), GRID_SIZE, GRID_SIZE), dtype=torch.float32, device=self.device)
        generator = torch.Generator(device=self.device) if noise_std > 0 else None
        with _exact_float32(self.device):
            for start in range(0, len(frames), self.chunk_frames):
                chunk = frames[start : start + self.chunk_frames]
                mu = control_points.mu[chunk].astype(np.float64)
                target = out[start : start + len(chunk)]
                if physics.is_ideal:
                    edges = _frame_edges(control_points, chunk).to(self.device)
                    weights = np.repeat((mu / SUB_APERTURES)[:, None], SUB_APERTURES, axis=1).astype(np.float32)
                    self._render_chunk(edges, torch.from_numpy(weights).to(self.device), target)
                else:
                    self._render_recorded(control_points, chunk, physics, target)
                if generator is not None:
                    scales = (noise_std * mu / math.sqrt(SUB_APERTURES)).tolist()
                    _add_frame_noise(target, generator, noise_seed, dataset_id, chunk.tolist(), scales)
        return out

    def _render_recorded(self, control_points: ControlPoints, frames: np.ndarray, physics: Physics,
                         out: torch.Tensor) -> None:
        """Write the noiseless recorded frames (B, 256, 256) of ``frames`` into ``out``: each
        frame's signal plus the lag of the ``physics.lag_frames`` frames before it,
        R_f = (1 - lag) sum_k lag^k S_(f-k) over the frames f - k >= 1."""
        depth = physics.lag_frames
        needed = np.unique((frames[:, None] - np.arange(depth + 1)[None, :]).ravel())
        needed = needed[needed >= 1]
        signals = self._physics_signals(control_points, needed, physics)
        if depth == 0:
            out.copy_(signals)
            return
        lag = physics.lag_percent / 100.0
        position = {int(frame): row for row, frame in enumerate(needed)}
        out.zero_()
        for k in range(depth + 1):
            rows = [(row, position[int(frame) - k]) for row, frame in enumerate(frames) if frame - k >= 1]
            if rows:
                target, source = torch.tensor(rows, device=self.device).T
                out.index_add_(0, target, signals[source], alpha=(1.0 - lag) * lag**k)

    def _physics_signals(self, control_points: ControlPoints, frames: np.ndarray, physics: Physics) -> torch.Tensor:
        """Lag-free signals (F, 256, 256) of ``frames``: the fluence of ``_physics_fluence``
        through the kernel, plus the arm backscatter."""
        signals = torch.empty((len(frames), GRID_SIZE, GRID_SIZE), dtype=torch.float32, device=self.device)
        ramp = None
        if physics.backscatter_percent:
            rows = torch.arange(GRID_SIZE, device=self.device, dtype=torch.float32)
            ramp = (physics.backscatter_percent / 100.0 * 2.0 * (rows + 0.5) / GRID_SIZE)[:, None]
        for start in range(0, len(frames), self.chunk_frames):
            chunk = frames[start : start + self.chunk_frames]
            positions = [torch.from_numpy(v).to(self.device, torch.float32)
                         for v in _sub_aperture_positions(control_points, chunk)]
            mu = torch.from_numpy(control_points.mu[chunk].astype(np.float32)).to(self.device)
            fluence = _physics_fluence(*positions, mu, physics)
            target = signals[start : start + len(chunk)]
            target.copy_(self._convolve_leaf_grid(fluence))
            if ramp is not None:
                target.addcmul_(_backscatter_renderer(self.device).convolve_leaf_grid_separable(fluence), ramp)
        return signals

    def _convolve_leaf_grid(self, fluence: torch.Tensor) -> torch.Tensor:
        """(B, 260, 256) leaf-grid fluence (y ascending) -> (B, 256, 256) frames, final orientation."""
        if self.method == "fft":
            imager = fluence[:, _LEAF_GRID_MARGIN : _LEAF_GRID_MARGIN + GRID_SIZE].flip(-2)
            return self._fft_convolve(imager)
        return self.convolve_leaf_grid_separable(fluence)

    def convolve_leaf_grid_separable(self, fluence: torch.Tensor) -> torch.Tensor:
        """``_convolve_leaf_grid`` through the separable terms."""
        result = None
        for term in range(self.rank):
            vertical = self._operator("vertical_leaf_grid", term, GRID_SIZE)
            part = torch.matmul(vertical, torch.matmul(fluence, self._operator("horizontal_t", term, GRID_SIZE)))
            result = part if result is None else result.add_(part)
        return result

    def _render_chunk(self, edges: _ApertureEdges, weights: torch.Tensor, out: torch.Tensor) -> None:
        """Write the noiseless frames of one chunk into ``out`` (B, 256, 256)."""
        if self.method == "fft":
            out.copy_(self._fft_convolve(_mask_images(edges, weights)))
            return
        first_row, stop_row = edges.open_rows
        if stop_row <= first_row:
            out.zero_()
            return
        bags = _LeafGridBags(edges, weights, first_row, stop_row)
        for term in range(self.rank):
            rows = bags.rows(self._operator("cumulative", term, GRID_SIZE))
            vertical = self._operator("vertical_leaf_grid", term, GRID_SIZE)[:, first_row:stop_row]
            if term == 0:
                torch.matmul(vertical, rows, out=out)
            else:
                out.add_(torch.matmul(vertical, rows))

    def _operator(self, kind: str, term: int, size: int) -> torch.Tensor:
        key = (kind, term, size)
        operator = self._operators.get(key)
        if operator is None:
            operator = torch.from_numpy(
                np.ascontiguousarray(_build_operator(kind, self._vertical[term], self._horizontal[term], size))
            )
            operator = operator.to(self.device, torch.float32)
            self._operators[key] = operator
        return operator

    def _fft_convolve(self, images: torch.Tensor) -> torch.Tensor:
        height, width = images.shape[-2:]
        key = ("fft", height, width)
        spectrum = self._operators.get(key)
        kernel_h, kernel_w = self.kernel.shape
        centre_h, centre_w = (kernel_h - 1) // 2, (kernel_w - 1) // 2
        shape = (
            scipy.fft.next_fast_len(height + kernel_h - 1 - centre_h, real=True),
            scipy.fft.next_fast_len(width + kernel_w - 1 - centre_w, real=True),
        )
        if spectrum is None:
            kernel = torch.from_numpy(self.kernel).to(self.device, torch.float32)
            spectrum = torch.fft.rfft2(kernel, s=shape)
            self._operators[key] = spectrum
        product = torch.fft.rfft2(images, s=shape) * spectrum
        full = torch.fft.irfft2(product, s=shape)
        return full[..., centre_h : centre_h + height, centre_w : centre_w + width].contiguous()


_RENDERER_CACHE: OrderedDict[tuple[str, str], FrameRenderer] = OrderedDict()
_RENDERER_CACHE_SIZE = 8


def renderer_for(kernel: np.ndarray | torch.Tensor, device: Device = None) -> FrameRenderer:
    """A cached ``FrameRenderer`` for this kernel (by content) and device."""
    values = _kernel_array(kernel)
    device = resolve_device(device or "cpu")
    digest = hashlib.sha256(repr(values.shape).encode() + values.tobytes()).hexdigest()
    key = (digest, str(device))
    renderer = _RENDERER_CACHE.get(key)
    if renderer is None:
        renderer = FrameRenderer(values, device)
        _RENDERER_CACHE[key] = renderer
        if len(_RENDERER_CACHE) > _RENDERER_CACHE_SIZE:
            _RENDERER_CACHE.popitem(last=False)
    else:
        _RENDERER_CACHE.move_to_end(key)
    return renderer


@dataclass(frozen=True)
class _ApertureEdges:
    """Integer aperture edges of B apertures with S sub-apertures each (numpy or torch int64).

    col_start, col_stop: (B, S, 52) columns [start, stop) open in each leaf's rows, 0..256.
    row_start, row_stop: (B, S) rows [start, stop) of the leaf grid open between the jaws, 0..260.
    open_rows: (first, stop) rows of the leaf grid open in any sub-aperture.
    """

    col_start: np.ndarray | torch.Tensor
    col_stop: np.ndarray | torch.Tensor
    row_start: np.ndarray | torch.Tensor
    row_stop: np.ndarray | torch.Tensor
    open_rows: tuple[int, int]

    def to(self, device: torch.device) -> _ApertureEdges:
        """The edges as tensors on ``device``."""
        values = (self.col_start, self.col_stop, self.row_start, self.row_stop)
        return _ApertureEdges(*(torch.as_tensor(v).to(device) for v in values), self.open_rows)


class _LeafGridBags:
    """Rows [first_row, stop_row) of the leaf grid as weighted bags of cumulative-table rows.

    Row q lies in leaf q // 5; in sub-aperture s it is the box [start, stop) of that leaf,
    weighted by the sub-aperture's weight when the row is between its jaws. Through a
    cumulative table T (257, W) the box becomes T[stop] - T[start], so one row is a bag of
    2 S table rows with weights +w and -w, summed by ``embedding_bag`` without building the
    per-sub-aperture images.
    """

    def __init__(self, edges: _ApertureEdges, weights: torch.Tensor, first_row: int, stop_row: int) -> None:
        rows = torch.arange(first_row, stop_row, device=weights.device)
        leaf = rows // _ROWS_PER_LEAF
        inside = (rows[:, None] >= edges.row_start[:, None, :]) & (rows[:, None] < edges.row_stop[:, None, :])
        row_weight = inside.to(weights.dtype) * weights[:, None, :]
        col_stop = edges.col_stop.transpose(1, 2)[:, leaf]
        col_start = edges.col_start.transpose(1, 2)[:, leaf]
        self.batch, self.row_count = weights.shape[0], len(rows)
        self.indices = torch.stack([col_stop, col_start], dim=-1).view(self.batch * self.row_count, -1)
        self.weights = torch.stack([row_weight, -row_weight], dim=-1).view(self.batch * self.row_count, -1)

    def rows(self, cumulative: torch.Tensor) -> torch.Tensor:
        """(B, rows, W) weighted sums of boxes through the cumulative table (257, W)."""
        summed = torch.nn.functional.embedding_bag(
            self.indices, cumulative, per_sample_weights=self.weights, mode="sum"
        )
        return summed.view(self.batch, self.row_count, cumulative.shape[-1])


def _aperture_edges(leaf_a: np.ndarray, leaf_b: np.ndarray, jaw_1: np.ndarray, jaw_2: np.ndarray) -> _ApertureEdges:
    """Edges of apertures given in mm: leaves (B, S, 52), jaws (B, S), float64."""
    col_start = np.floor(leaf_a + EDGE_TOLERANCE_MM) - _GRID_ORIGIN_MM
    col_stop = np.ceil(leaf_b - EDGE_TOLERANCE_MM) - _GRID_ORIGIN_MM
    row_start = np.floor(jaw_1 + EDGE_TOLERANCE_MM) - _LEAF_GRID_ORIGIN_MM
    row_stop = np.ceil(jaw_2 - EDGE_TOLERANCE_MM) - _LEAF_GRID_ORIGIN_MM
    col_start = np.clip(col_start, 0, GRID_SIZE).astype(np.int64)
    col_stop = np.clip(col_stop, col_start, GRID_SIZE).astype(np.int64)
    row_start = np.clip(row_start, 0, _LEAF_GRID_ROWS).astype(np.int64)
    row_stop = np.clip(row_stop, row_start, _LEAF_GRID_ROWS).astype(np.int64)
    open_rows = (int(row_start.min(initial=_LEAF_GRID_ROWS)), int(row_stop.max(initial=0)))
    return _ApertureEdges(col_start, col_stop, row_start, row_stop, open_rows)


def _sub_aperture_positions(control_points: ControlPoints, frames: np.ndarray) -> tuple[np.ndarray, ...]:
    """leaf_a, leaf_b (F, 7, 52) and jaw_1, jaw_2 (F, 7) of the 7 sub-apertures of each frame,
    float64 mm: linear interpolation from CP f - 1 to CP f."""
    t = (np.arange(SUB_APERTURES, dtype=np.float64) / (SUB_APERTURES - 1))[None, :, None]

    def interpolate(values: np.ndarray) -> np.ndarray:
        before = values[frames - 1].astype(np.float64)
        after = values[frames].astype(np.float64)
        if before.ndim == 1:
            return before[:, None] + t[..., 0] * (after - before)[:, None]
        return before[:, None, :] + t * (after - before)[:, None, :]

    return tuple(interpolate(getattr(control_points, name)) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2"))


def _frame_edges(control_points: ControlPoints, frames: np.ndarray) -> _ApertureEdges:
    """Edges of the 7 sub-apertures of each frame."""
    return _aperture_edges(*_sub_aperture_positions(control_points, frames))


def cell_coverage(lower: torch.Tensor, upper: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Length (mm) of the opening [lower, upper] inside each 1 mm cell: (..., n) in [0, 1]."""
    low = torch.maximum(lower.unsqueeze(-1), centres - 0.5)
    high = torch.minimum(upper.unsqueeze(-1), centres + 0.5)
    return (high - low).clamp(0.0, 1.0)


Setting = float | torch.Tensor
"""A physical setting of ``aperture_fluence``: a number, or a 0-d tensor when it is learned."""


def aperture_fluence(leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaw_1: torch.Tensor, jaw_2: torch.Tensor,
                     weights: torch.Tensor, *, leaf_end_offset_a: Setting = 0.0, leaf_end_offset_b: Setting = 0.0,
                     jaw_edge_offset: Setting = 0.0, tongue_groove_mm: Setting = 0.0,
                     leaf_transmission: Setting = 0.0, interleaf_leakage: Setting = 0.0,
                     jaw_transmission: Setting = 0.0) -> torch.Tensor:
    """The fluence of B apertures on the leaf grid, (B, 260, 256), y ascending: the sum of the S
    sub-apertures of each (leaves (B, S, 52), jaws (B, S), mm) weighted by ``weights`` (B, S).

    A cell's fluence is the product of the jaws' and the leaves' transmission of it, each
    t + (1 - t) x its open fraction (exact, not rounded to the grid). Bank A's edges move by
    -``leaf_end_offset_a``, bank B's by +``leaf_end_offset_b`` and the jaws' by
    -/+``jaw_edge_offset`` (mm; positive widens). In the 1 mm rows on either side of a boundary
    between leaves, the part of the row inside the tongue-and-groove strip (``tongue_groove_mm``
    wide, centred on the boundary) is open only where both leaves are, and closed leaves transmit
    ``interleaf_leakage`` on top of ``leaf_transmission``. Transmissions are fractions. Serves the
    synthesis (``epid.physics`` settings as numbers) and the aperture models (learned tensors).
    """
    device, batch, sub_apertures = leaf_a.device, leaf_a.shape[0], leaf_a.shape[1]
    columns = torch.arange(GRID_SIZE, device=device, dtype=torch.float32) + (_GRID_ORIGIN_MM + 0.5)
    rows = torch.arange(_LEAF_GRID_ROWS, device=device, dtype=torch.float32) + (_LEAF_GRID_ORIGIN_MM + 0.5)
    leaf_open = cell_coverage(leaf_a - leaf_end_offset_a, leaf_b + leaf_end_offset_b, columns).transpose(1, 2)
    jaw_open = cell_coverage(jaw_1 - jaw_edge_offset, jaw_2 + jaw_edge_offset, rows)  # (B, S, 260)
    jaw_fluence = (jaw_transmission + (1.0 - jaw_transmission) * jaw_open) * weights[:, :, None]
    jaw_fluence = jaw_fluence.view(batch, sub_apertures, NUM_LEAF_PAIRS, _ROWS_PER_LEAF).permute(0, 2, 3, 1)
    first_open, last_open = leaf_open, leaf_open  # (B, 52, S, 256): of a leaf's first and last rows
    if isinstance(tongue_groove_mm, torch.Tensor) or tongue_groove_mm > 0:
        strip = (torch.as_tensor(tongue_groove_mm, device=device) / 2.0).clamp(0.0, 1.0)  # share of a row
        both = torch.minimum(leaf_open[:, :-1], leaf_open[:, 1:])
        first_open = torch.cat([leaf_open[:, :1], leaf_open[:, 1:] + strip * (both - leaf_open[:, 1:])], 1)
        last_open = torch.cat([leaf_open[:, :-1] + strip * (both - leaf_open[:, :-1]), leaf_open[:, -1:]], 1)
    open_fluence = torch.cat([  # (B, 52, 5, 256): sum over the sub-apertures of jaws x open fraction
        torch.matmul(jaw_fluence[:, :, :1], first_open),
        torch.matmul(jaw_fluence[:, :, 1:-1], leaf_open),
        torch.matmul(jaw_fluence[:, :, -1:], last_open),
    ], 2).view(batch, _LEAF_GRID_ROWS, GRID_SIZE)
    boundary = torch.zeros((_LEAF_GRID_ROWS, 1), device=device)
    boundary[_ROWS_PER_LEAF - 1 : _LEAF_GRID_ROWS - 1 : _ROWS_PER_LEAF] = 1.0
    boundary[_ROWS_PER_LEAF :: _ROWS_PER_LEAF] = 1.0
    closed = leaf_transmission + interleaf_leakage * boundary  # (260, 1)
    return open_fluence * (1.0 - closed) + jaw_fluence.sum(-1).reshape(batch, _LEAF_GRID_ROWS, 1) * closed


def _physics_fluence(leaf_a: torch.Tensor, leaf_b: torch.Tensor, jaw_1: torch.Tensor, jaw_2: torch.Tensor,
                     mu: torch.Tensor, physics: Physics) -> torch.Tensor:
    """The fluence (B, 260, 256) of B frames with ``physics``: the 7 sub-apertures (leaves
    (B, 7, 52), jaws (B, 7), mm) of each frame averaged and scaled by its MU (B,)."""
    weights = (mu / SUB_APERTURES)[:, None].expand(-1, SUB_APERTURES)
    return aperture_fluence(
        leaf_a, leaf_b, jaw_1, jaw_2, weights,
        leaf_end_offset_a=physics.leaf_end_offset_mm, leaf_end_offset_b=physics.leaf_end_offset_mm,
        tongue_groove_mm=physics.tongue_groove_mm, leaf_transmission=physics.leaf_transmission_percent / 100.0,
        interleaf_leakage=physics.interleaf_leakage_percent / 100.0,
        jaw_transmission=physics.jaw_transmission_percent / 100.0,
    )


@functools.cache
def _backscatter_renderer(device: torch.device) -> FrameRenderer:
    """The arm backscatter's blur: an isotropic Gaussian of ``BACKSCATTER_SIGMA_MM``, sum 1."""
    offsets = np.arange(-(GRID_SIZE - 1), GRID_SIZE, dtype=np.float64)
    profile = np.exp(-0.5 * (offsets / BACKSCATTER_SIGMA_MM) ** 2)
    profile /= profile.sum()
    return FrameRenderer(np.outer(profile, profile), device)


def _mask_images(edges: _ApertureEdges, weights: torch.Tensor) -> torch.Tensor:
    """(B, 256, 256) weighted sums of the masks of each aperture's sub-apertures, final orientation."""
    device = weights.device
    columns = torch.arange(GRID_SIZE, device=device)
    cumulative = (columns[None, :] < torch.arange(GRID_SIZE + 1, device=device)[:, None]).to(torch.float32)
    rows = _LeafGridBags(edges, weights, _LEAF_GRID_MARGIN, _LEAF_GRID_MARGIN + GRID_SIZE).rows(cumulative)
    return rows.flip(-2)


def _build_operator(kind: str, vertical: np.ndarray, horizontal: np.ndarray, size: int) -> np.ndarray:
    """float64 operators of one separable term (kernel ~ vertical ⊗ horizontal), scipy 'same' alignment.

    vertical: (size, size) T with T[i, j] = vertical[i - j + cv], so T @ X convolves columns.
    horizontal_t: (size, size) H^T with H^T[j, i] = horizontal[i - j + ch], so X @ H^T convolves rows.
    cumulative: (size + 1, size) running sums of the rows of H^T; row b sums input columns < b.
    vertical_leaf_grid: (256, 260) vertical convolution from leaf-grid rows (y ascending) to
    output rows of the final, flipped image.
    """
    if kind == "vertical":
        return _toeplitz(vertical, size, size)
    if kind == "horizontal_t":
        return _toeplitz(horizontal, size, size).T
    if kind == "cumulative":
        horizontal_t = _toeplitz(horizontal, size, size).T
        return np.concatenate([np.zeros((1, size)), np.cumsum(horizontal_t, axis=0)])
    if kind == "vertical_leaf_grid":
        image_rows = _toeplitz(vertical, GRID_SIZE, GRID_SIZE)
        operator = np.zeros((GRID_SIZE, _LEAF_GRID_ROWS))
        operator[:, _LEAF_GRID_MARGIN : _LEAF_GRID_MARGIN + GRID_SIZE] = image_rows[:, ::-1]
        return operator
    raise ValueError(f"unknown operator {kind!r}")


def _toeplitz(taps: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """T[i, j] = taps[i - j + centre] (0 outside), centre = (len(taps) - 1) // 2."""
    offsets = np.arange(rows)[:, None] - np.arange(cols)[None, :] + (len(taps) - 1) // 2
    valid = (offsets >= 0) & (offsets < len(taps))
    return np.where(valid, taps[np.clip(offsets, 0, len(taps) - 1)], 0.0)


def _separable_terms(kernel: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Vertical and horizontal factors of the fewest SVD terms within ``SEPARABLE_TOLERANCE``
    (L1 norm of the remainder relative to the kernel's); empty lists when more than
    ``MAX_SEPARABLE_RANK`` would be needed."""
    left, singular, right = (v.numpy() for v in _single_threaded_svd(torch.from_numpy(kernel)))
    scale = np.abs(kernel).sum()
    approximation = np.zeros_like(kernel)
    for rank in range(1, min(MAX_SEPARABLE_RANK, len(singular)) + 1):
        term = rank - 1
        approximation += singular[term] * np.outer(left[:, term], right[term])
        if np.abs(kernel - approximation).sum() <= SEPARABLE_TOLERANCE * scale:
            root = np.sqrt(singular[:rank])
            return list((left[:, :rank] * root).T), list(right[:rank] * root[:, None])
    return [], []


def _single_threaded_svd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SVD of a small matrix on one thread: with several LAPACK threads on a busy machine it
    takes seconds instead of milliseconds (the threads wait on each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.linalg.svd(matrix, full_matrices=False)
    finally:
        torch.set_num_threads(threads)


def _kernel_array(kernel: np.ndarray | torch.Tensor) -> np.ndarray:
    """A kernel as a 2-D float64 numpy array, cropped to the offsets that reach a 256 grid."""
    values = kernel.detach().cpu().numpy() if isinstance(kernel, torch.Tensor) else np.asarray(kernel)
    values = values.astype(np.float64)
    if values.ndim != 2 or values.size == 0 or not np.isfinite(values).all():
        raise ValueError(f"kernel of shape {values.shape}: expected a non-empty finite 2-D array")
    return _crop_to_reach(values)


def _crop_to_reach(kernel: np.ndarray) -> np.ndarray:
    """Drop kernel elements more than 255 pixels from the centre: they never reach a 256 grid."""
    slices = []
    for length in kernel.shape:
        centre = (length - 1) // 2
        slices.append(slice(max(centre - (GRID_SIZE - 1), 0), min(centre + GRID_SIZE, length)))
    return np.ascontiguousarray(kernel[tuple(slices)])


def _frame_indices(frame_indices: Sequence[int] | np.ndarray | torch.Tensor, n_control_points: int) -> np.ndarray:
    if isinstance(frame_indices, torch.Tensor):
        frame_indices = frame_indices.detach().cpu().numpy()
    frames = np.asarray(frame_indices)
    if frames.ndim != 1 or (frames.size and frames.dtype.kind not in "iu"):
        raise ValueError(f"frame_indices of shape {frames.shape} and dtype {frames.dtype}: expected 1-D integers")
    frames = frames.astype(np.int64)
    if frames.size and (frames.min() < 1 or frames.max() >= n_control_points):
        raise ValueError(
            f"frame indices {frames.min()}..{frames.max()}: expected 1..{n_control_points - 1} "
            "(frame f integrates control points f - 1 to f)"
        )
    return frames


def _add_frame_noise(
    frames: torch.Tensor,
    generator: torch.Generator,
    noise_seed: int,
    dataset_id: int,
    frame_numbers: list[int],
    scales: list[float],
) -> None:
    """Add N(0, scale^2) noise to each frame, drawn from its own seeded generator.

    The draws run frame by frame (one seed each); the scaling and the addition run once
    for all frames, since small parallel operations are slow on a busy CPU.
    """
    noise = torch.empty_like(frames)
    for frame_noise, number in zip(noise, frame_numbers, strict=True):
        generator.manual_seed(frame_noise_seed(noise_seed, dataset_id, number))
        frame_noise.normal_(generator=generator)
    frames.addcmul_(noise, torch.tensor(scales, dtype=frames.dtype, device=frames.device).view(-1, 1, 1))


_MASK_64 = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    state = (state + 0x9E3779B97F4A7C15) & _MASK_64
    state = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    state = ((state ^ (state >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return state ^ (state >> 31)


@contextlib.contextmanager
def _exact_float32(device: torch.device) -> Iterator[None]:
    """No autocast and no TF32 inside: frames must not depend on the caller's precision settings."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _as_float64(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.float64)
