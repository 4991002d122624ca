"""EPID frames: the response-kernel convolution, backscatter, lag and MU-weighted noisy frames.

Frame f (1 <= f < N) integrates the motion from control point f - 1 to f: the fluence of 7
sub-apertures (``epid.synthesis.fluence``), convolved with the detector response, scaled by MU,
with noise drawn per frame from its own seed. Row 0 of every returned image is the most positive
y (``epid.synthesis.geometry``).

Convolutions involve no Python loop over leaves or frames. With a separable kernel term u v^T,
the horizontal convolution of an aperture row's box is the difference of two rows of a
cumulative table of v, so a row of a frame is one weighted bag of table rows
(``fluence.LeafGridBags``); the vertical convolution is one matrix product with the Toeplitz
matrix of u over the rows that any jaw opens. Kernels that are not close to a few separable
terms are applied by FFT to the rasterised masks instead.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import scipy.fft
import torch

from epid.core.devices import Device, resolve_device
from epid.core.fft import cropped_irfft2, padded_rfft2
from epid.synthesis.fluence import (
    ApertureEdges,
    LeafGridBags,
    frame_edges,
    frame_positions,
    mask_images,
    physics_fluence,
)
from epid.synthesis.geometry import (
    GRID_SIZE,
    IMAGER_MARGIN,
    LEAF_GRID_ROWS,
    SUB_APERTURES,
)
from epid.synthesis.physics import BACKSCATTER_SIGMA_MM, Physics
from epid.synthesis.sequences import ControlPoints

MAX_SEPARABLE_RANK = 4
"""Kernels needing more separable terms than this are applied by FFT (faster beyond it on CPU)."""
SEPARABLE_TOLERANCE = 1e-6
"""Largest L1 norm of the dropped SVD terms, relative to the kernel's L1 norm."""
CHUNK_FRAMES = {"cpu": 32, "cuda": 512}
"""Frames rendered at once per device type (others: the CPU value). Bounds the working memory
(about 1 MB per frame); on the CPU small chunks also keep the band of open rows narrow."""


IDEAL = Physics()


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

        ``physics`` other than ideal (``epid.synthesis.physics``) replaces the binary masks by the
        fluence of a real MLC (``physics_fluence``), adds the arm backscatter and mixes in the
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
                    edges = frame_edges(control_points.folded_into_x_jaws(), chunk).to(self.device)
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
        """Lag-free signals (F, 256, 256) of ``frames``: the fluence of ``physics_fluence``
        through the kernel, plus the arm backscatter."""
        signals = torch.empty((len(frames), GRID_SIZE, GRID_SIZE), dtype=torch.float32, device=self.device)
        ramp = None
        if physics.backscatter_percent:
            rows = torch.arange(GRID_SIZE, device=self.device, dtype=torch.float32)
            ramp = (physics.backscatter_percent / 100.0 * 2.0 * (rows + 0.5) / GRID_SIZE)[:, None]
        for start in range(0, len(frames), self.chunk_frames):
            chunk = frames[start : start + self.chunk_frames]
            positions, layers = frame_positions(control_points, chunk, self.device)
            mu = torch.from_numpy(control_points.mu[chunk].astype(np.float32)).to(self.device)
            fluence = physics_fluence(*positions, mu, physics, **layers)
            target = signals[start : start + len(chunk)]
            target.copy_(self._convolve_leaf_grid(fluence))
            if ramp is not None:
                target.addcmul_(_backscatter_renderer(self.device).convolve_leaf_grid_separable(fluence), ramp)
        return signals

    def _convolve_leaf_grid(self, fluence: torch.Tensor) -> torch.Tensor:
        """(B, 260, 256) leaf-grid fluence (y ascending) -> (B, 256, 256) frames, final orientation."""
        if self.method == "fft":
            imager = fluence[:, IMAGER_MARGIN : IMAGER_MARGIN + GRID_SIZE].flip(-2)
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

    def _render_chunk(self, edges: ApertureEdges, weights: torch.Tensor, out: torch.Tensor) -> None:
        """Write the noiseless frames of one chunk into ``out`` (B, 256, 256)."""
        if self.method == "fft":
            out.copy_(self._fft_convolve(mask_images(edges, weights)))
            return
        first_row, stop_row = edges.open_rows
        if stop_row <= first_row:
            out.zero_()
            return
        bags = LeafGridBags(edges, weights, first_row, stop_row)
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
        product = padded_rfft2(images, shape) * spectrum
        return cropped_irfft2(product, shape, slice(centre_h, centre_h + height),
                              slice(centre_w, centre_w + width)).contiguous()


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


"""A physical setting of ``aperture_fluence``: a number, or a 0-d tensor when it is learned."""


@functools.cache
def _backscatter_renderer(device: torch.device) -> FrameRenderer:
    """The arm backscatter's blur: an isotropic Gaussian of ``BACKSCATTER_SIGMA_MM``, sum 1."""
    offsets = np.arange(-(GRID_SIZE - 1), GRID_SIZE, dtype=np.float64)
    profile = np.exp(-0.5 * (offsets / BACKSCATTER_SIGMA_MM) ** 2)
    profile /= profile.sum()
    return FrameRenderer(np.outer(profile, profile), device)


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
        operator = np.zeros((GRID_SIZE, LEAF_GRID_ROWS))
        operator[:, IMAGER_MARGIN : IMAGER_MARGIN + GRID_SIZE] = image_rows[:, ::-1]
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


