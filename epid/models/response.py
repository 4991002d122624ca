"""The detector response of the aperture family's forward model (``DetectorResponse``): a learned
2-D kernel (a separable mixture of Gaussians, isotropic Gaussians that make it non-separable, a
measured kernel's share when the run names one) and a broad backscatter term weighted along y,
applied by one FFT convolution from the leaf-grid fluence to the imager frame per MU; its adjoint
serves the reconstruction's gradient (``epid.reconstruction.descent``).

``ResponseFilter`` undoes a response as far as it can be undone: a Wiener filter that turns a frame
seen through the response K into the fluence seen through a small sampled Gaussian T, the sharpest
that the filter reproduces (``target_sigma``). The reconstruction's tracking reads every frame
through it (``epid.reconstruction.rows``), and the inverse network reads through the filter of a
broad measured response (``epid.models.aperture.LeafEdgeInverseModel.read_through``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import scipy.fft
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epid.core.fft import columns_fft, columns_ifft, cropped_irfft2, padded_rfft2, rows_irfft, rows_rfft
from epid.synthesis.geometry import GRID_SIZE, IMAGER_MARGIN, LEAF_GRID_ROWS, LEAF_WIDTH_MM, StripGrid

BROAD_START_WIDTH_MM = 32.0
"""Starting width of the forward model's broad (backscatter) term."""
MEASURED_START_SHARE = 0.98
"""Share of a measured kernel in the response at the start (``DetectorResponse.start_from``)."""


MIN_TARGET_SIGMA_MM = 2.0
"""Narrowest Gaussian the frames are seen through after the Wiener filter, mm: the width the
tracking was tuned with on responses as sharp as the built-in one."""


MAX_TARGET_SIGMA_MM = 16.0
"""Widest Gaussian the frames may be seen through, mm (a response broader than any panel's)."""


TARGET_FIDELITY = 0.05
"""Largest relative error (spectral L2 norm) of the Wiener filter's reproduction of T: W K - T
against T. On a 12 mm wide response the tracking's leaves came closest with T 4.0 mm wide (4.6 %;
4.5 mm at 2.2 % and 3.5 mm at 9.2 % were worse); on a 5 mm wide one 1.5 mm (6.6 %) beat 2 mm (1 %)
by a little, but ``MIN_TARGET_SIGMA_MM`` keeps the width the tracking was tuned with there."""


TARGET_STEP_MM = 0.1
"""Grid of the chosen width of T, mm (its tables are cached per width)."""


EDGE_PAD = 32
"""Rows and columns each frame is extended by (its edges repeated) before the Wiener filter."""


WIENER_FLOOR = 1e-4
"""Regularisation of the Wiener filter, relative to the response spectrum's peak power."""


IMAGER_ROWS = slice(IMAGER_MARGIN, IMAGER_MARGIN + GRID_SIZE)
"""The leaf-grid rows the imager sees, in leaf-grid order (y ascending)."""


def to_imager(leaf_grid: Tensor) -> Tensor:
    """(..., 260, W) leaf-grid rows (y ascending) -> (..., 256, W) imager rows (row 0 = most positive y)."""
    return leaf_grid[..., IMAGER_ROWS, :].flip(-2)


def to_leaf_grid(images: Tensor) -> Tensor:
    """(..., 256, W) imager rows -> (..., 260, W) leaf-grid rows, the rows beyond the imager zero."""
    return F.pad(images.flip(-2), (0, 0, IMAGER_MARGIN, IMAGER_MARGIN))


def gaussian_taps(log_width: Tensor, offsets: Tensor) -> Tensor:
    """Gaussians of widths exp(log_width) (K,) mm on ``offsets`` (n,) mm, each summing to 1: (K, n)."""
    gaussians = torch.exp(-0.5 * (offsets[None, :] / log_width.exp()[:, None]).square())
    return gaussians / gaussians.sum(-1, keepdim=True)


class ResponseProfile(nn.Module):
    """A learned 1-D response profile on the 1 mm grid, ``2 reach + 1`` taps: a mixture of
    Gaussians of learned widths (starting at ``widths_mm``) and weights, each normalised on the
    grid; at the start nearly all weight is on the Gaussian of width ``start_width_mm``."""

    def __init__(self, reach: int, widths_mm: tuple[float, ...], start_width_mm: float) -> None:
        super().__init__()
        self.log_width = nn.Parameter(torch.tensor([math.log(w) for w in widths_mm]))
        self.logits = nn.Parameter(torch.tensor([0.0 if w == start_width_mm else -6.0 for w in widths_mm]))
        self.register_buffer("offsets", torch.arange(-reach, reach + 1, dtype=torch.float32), persistent=False)

    def forward(self) -> Tensor:
        return (torch.softmax(self.logits, 0)[:, None] * gaussian_taps(self.log_width, self.offsets)).sum(0)


class DetectorResponse(nn.Module):
    """Learned response: (B, 260, 256) leaf-grid fluence -> (B, 256, 256) imager frame per MU
    (row 0 = most positive y), one FFT convolution with a 2-D kernel and a position-dependent
    broad term.

    The kernel is gain x (Ky Kx^T + sum_k c_k G_k G_k^T): a separable mixture (``ResponseProfile``
    per axis) plus isotropic 2-D Gaussians of learned widths and signed weights c_k (starting
    at 0), so it can be radially symmetric and not separable. Given a measured kernel M
    (``start_from``), the kernel is gain x (s M + (1 - s) mixture), the learned share s starting
    at ``MEASURED_START_SHARE``: the mixture is then a learned correction. The broad term is a wide
    isotropic Gaussian blur of the fluence (learned width, starting at 32 mm) weighted per row
    by b0 + b1 (row position, 0 at the top to 1 at the bottom), both starting at 0: backscatter
    from a support arm on one side of the panel.
    """

    def __init__(self, reach: int, widths_mm: tuple[float, ...], start_width_mm: float) -> None:
        super().__init__()
        self.profile_y = ResponseProfile(reach, widths_mm, start_width_mm)
        self.profile_x = ResponseProfile(reach, widths_mm, start_width_mm)
        self.log_gain = nn.Parameter(torch.zeros(()))
        self.radial_log_width = nn.Parameter(torch.tensor([math.log(w) for w in widths_mm]))
        self.radial_weight = nn.Parameter(torch.zeros(len(widths_mm)))
        self.broad_log_width = nn.Parameter(torch.tensor([math.log(BROAD_START_WIDTH_MM)]))
        self.broad_gain = nn.Parameter(torch.zeros(2))
        self.measured_logit = nn.Parameter(torch.zeros(()))
        self.register_buffer("measured", torch.zeros(2 * reach + 1, 2 * reach + 1))
        self.register_buffer("measured_present", torch.zeros(()))
        self.reach = reach
        self.fft_shape = response_fft_shape(reach)

    def kernel(self) -> Tensor:
        """The 2-D kernel without the gain, (2 reach + 1, 2 reach + 1), rows along y."""
        offsets = self.profile_y.offsets
        radial = gaussian_taps(self.radial_log_width, offsets)
        isotropic = torch.einsum("k,ki,kj->ij", self.radial_weight, radial, radial)
        mixture = torch.outer(self.profile_y(), self.profile_x()) + isotropic
        share = torch.sigmoid(self.measured_logit) * self.measured_present
        return share * self.measured + (1 - share) * mixture

    def start_from(self, kernel: Tensor) -> None:
        """Start the response as a measured kernel (2-D, odd sides, centred, rows along y): cut
        or zero-padded to the response's reach and normalised to sum 1; its share
        ``MEASURED_START_SHARE``."""
        centred = centred_kernel(kernel, self.reach)
        with torch.no_grad():
            self.measured.copy_(centred)
            self.measured_present.fill_(1.0)
            self.measured_logit.fill_(math.log(MEASURED_START_SHARE / (1 - MEASURED_START_SHARE)))

    def _spectrum(self, kernel: Tensor) -> Tensor:
        """rfft2 of a centred kernel on ``fft_shape`` (``kernel_spectrum``)."""
        return kernel_spectrum(kernel, self.fft_shape)

    def forward(self, fluence: Tensor) -> Tensor:
        """(B, 260, 256) leaf-grid fluence -> (B, 256, 256) imager frame: the image through the kernel
        plus the broad term's, each weighted per row. The weight commutes with the transform along x,
        so the two images are summed between the transforms along y and the one along x back."""
        fluence = fluence.float()
        with torch.autocast(fluence.device.type, enabled=False):
            spectrum = padded_rfft2(fluence, self.fft_shape)[:, None] * self._spectra()
            rows = columns_ifft(spectrum, self.fft_shape, IMAGER_ROWS)  # (B, 2, 256, ...) leaf-grid order
            weight = self.broad_weight(fluence.device).flip(0)[:, None]
            images = rows_irfft(rows[:, 0] + weight * rows[:, 1], self.fft_shape, slice(GRID_SIZE))
            return images.flip(-2)  # imager rows

    def adjoint(self, images: Tensor) -> Tensor:
        """(B, 256, 256) imager images -> (B, 260, 256) leaf-grid fluence: the transpose of ``forward``
        (the gradient of <images, forward(f)> with respect to f): one transform along x, the broad
        term's row weight applied to it, two along y, and one inverse."""
        images = images.float()
        with torch.autocast(images.device.type, enabled=False):
            rows = rows_rfft(to_leaf_grid(images), self.fft_shape)
            weight = to_leaf_grid(self.broad_weight(images.device)[:, None])
            spectra = columns_fft(torch.stack([rows, weight * rows], 1), self.fft_shape)
            spectrum = (spectra * self._spectra().conj()).sum(1)
            return cropped_irfft2(spectrum, self.fft_shape, slice(LEAF_GRID_ROWS), slice(GRID_SIZE))

    def broad_taps(self) -> Tensor:
        """The broad term's Gaussian along each axis, on the response's offsets (sum 1)."""
        return gaussian_taps(self.broad_log_width, self.profile_y.offsets)[0]

    def broad_weight(self, device: torch.device | str) -> Tensor:
        """(256,) the broad term's weight on each imager row, b0 + b1 x (row position, 0 at the top)."""
        rows = (torch.arange(GRID_SIZE, device=device, dtype=torch.float32) + 0.5) / GRID_SIZE
        return self.broad_gain[0] + self.broad_gain[1] * rows

    def _spectra(self) -> Tensor:
        """(2, ...) the spectra (``_spectrum``) of the kernel with its gain and of the broad term's blur."""
        broad_taps = self.broad_taps()
        return torch.stack([self._spectrum(self.kernel() * self.log_gain.exp()),
                            self._spectrum(torch.outer(broad_taps, broad_taps))])


def response_fft_shape(reach: int) -> tuple[int, int]:
    """The FFT shape of a response reaching ``reach`` mm each side: the leaf grid and the reach, no wrap."""
    return (scipy.fft.next_fast_len(LEAF_GRID_ROWS + reach, real=True),
            scipy.fft.next_fast_len(GRID_SIZE + reach, real=True))


def centred_kernel(kernel: Tensor, reach: int) -> Tensor:
    """A measured kernel (2-D, odd sides, centred, rows along y) cut or zero-padded to ``reach`` mm each
    side and normalised to sum 1: (2 reach + 1, 2 reach + 1) float64. Raises ValueError for another shape."""
    if kernel.ndim != 2 or kernel.shape[0] % 2 == 0 or kernel.shape[1] % 2 == 0:
        raise ValueError(f"a measured kernel must be 2-D with odd sides, got shape {tuple(kernel.shape)}")
    size = 2 * reach + 1
    centred = torch.zeros(size, size, dtype=torch.float64)
    half_y, half_x = min(kernel.shape[0] // 2, reach), min(kernel.shape[1] // 2, reach)
    cy, cx = kernel.shape[0] // 2, kernel.shape[1] // 2
    centred[reach - half_y:reach + half_y + 1, reach - half_x:reach + half_x + 1] = (
        torch.as_tensor(kernel, dtype=torch.float64)[cy - half_y:cy + half_y + 1, cx - half_x:cx + half_x + 1])
    return centred / centred.sum()


def kernel_spectrum(kernel: Tensor, fft_shape: tuple[int, int]) -> Tensor:
    """rfft2 of a centred kernel (2 reach + 1 square) on ``fft_shape``, wrapped so that its centre is at
    index (0, 0)."""
    reach = (kernel.shape[-1] - 1) // 2
    padded = F.pad(kernel, (0, fft_shape[1] - kernel.shape[1], 0, fft_shape[0] - kernel.shape[0]))
    return torch.fft.rfft2(torch.roll(padded, (-reach, -reach), (0, 1)))


@dataclass(frozen=True)
class ResponseFilter:
    """The Wiener filter W of a response K: a frame S seen through K becomes D = W S, the fluence seen
    through T, a sampled Gaussian ``target_sigma_mm`` wide (``target_sigma``). wiener: (H, W // 2 + 1)
    complex64 spectrum on the padded ``fft_shape``."""

    wiener: Tensor
    fft_shape: tuple[int, int]
    target_sigma_mm: float

    @classmethod
    def of(cls, spectrum: Tensor, fft_shape: tuple[int, int], device: torch.device | str = "cpu") -> ResponseFilter:
        """The filter of a response of ``spectrum`` (rfft2 of the kernel centred at (0, 0), float64, on
        ``fft_shape``), on ``device``."""
        sigma_mm = target_sigma(spectrum, fft_shape)
        wiener = _wiener(spectrum, _target_spectrum(sigma_mm, fft_shape))
        return cls(wiener.to(device, torch.complex64), tuple(fft_shape), sigma_mm)

    @classmethod
    def of_kernel(cls, kernel: Tensor, device: torch.device | str = "cpu") -> ResponseFilter:
        """The filter of a centred kernel (2 reach + 1 square, sum 1) on ``response_fft_shape(reach)``,
        built in float64 on the CPU outside any inference mode (so that it serves training too)."""
        with torch.inference_mode(False), torch.no_grad():
            fft_shape = response_fft_shape((kernel.shape[-1] - 1) // 2)
            return cls.of(kernel_spectrum(kernel.detach().double().cpu(), fft_shape), fft_shape, device)

    def broad(self, grid: StripGrid) -> bool:
        """Whether the filtered frames are seen through a Gaussian wider, relative to the strips of
        ``grid``, than ``MIN_TARGET_SIGMA_MM`` is to strips of 5 mm: a response broader than the
        tracking was tuned with."""
        return self.target_sigma_mm > MIN_TARGET_SIGMA_MM * grid.strip_mm / LEAF_WIDTH_MM

    def filtered_rows(self, signals: Tensor) -> Tensor:
        """Lag-free frames (..., 256, 256) -> D on the leaf grid's rows (..., 260, 256), y ascending.
        The frames are extended by ``EDGE_PAD`` rows and columns repeating their edges, so that the
        filter sees no step where the imager ends."""
        frames = signals.float().flip(-2)  # rows y ascending, as the leaf grid
        shape = frames.shape
        padded = F.pad(frames.reshape(-1, 1, *shape[-2:]), (EDGE_PAD,) * 4, mode="replicate").view(
            *shape[:-2], *(size + 2 * EDGE_PAD for size in shape[-2:]))
        first = EDGE_PAD - IMAGER_MARGIN
        return cropped_irfft2(padded_rfft2(padded, self.fft_shape) * self.wiener, self.fft_shape,
                              slice(first, first + LEAF_GRID_ROWS), slice(EDGE_PAD, EDGE_PAD + GRID_SIZE))


def target_sigma(spectrum: Tensor, fft_shape: tuple[int, int]) -> float:
    """The width (mm, on a ``TARGET_STEP_MM`` grid, at least ``MIN_TARGET_SIGMA_MM``) of the
    sharpest Gaussian T that the Wiener filter of a response of ``spectrum`` (rfft2 of the kernel
    centred at (0, 0), float64 on ``fft_shape``) reproduces within ``TARGET_FIDELITY``
    (``filter_error``): the error falls as T widens, so the width is bisected on the grid."""
    low, high = round(MIN_TARGET_SIGMA_MM / TARGET_STEP_MM), round(MAX_TARGET_SIGMA_MM / TARGET_STEP_MM)
    if filter_error(spectrum, low * TARGET_STEP_MM, fft_shape) <= TARGET_FIDELITY:
        return low * TARGET_STEP_MM
    while high - low > 1:
        middle = (low + high) // 2
        if filter_error(spectrum, middle * TARGET_STEP_MM, fft_shape) <= TARGET_FIDELITY:
            high = middle
        else:
            low = middle
    return round(high * TARGET_STEP_MM, 6)


def filter_error(spectrum: Tensor, sigma_mm: float, fft_shape: tuple[int, int]) -> float:
    """||W K - T|| / ||T|| over the spectrum: how far the Wiener filter W of the response K
    (``spectrum``) falls short of turning K into the Gaussian T of width ``sigma_mm``."""
    target = _target_spectrum(sigma_mm, fft_shape)
    achieved = _wiener(spectrum, target) * spectrum
    columns = torch.full((target.shape[-1],), 2.0, dtype=torch.float64)  # the half spectrum's mirrored columns
    columns[0] = 1.0
    if fft_shape[-1] % 2 == 0:
        columns[-1] = 1.0
    return float(((achieved - target).abs().square() * columns).sum().sqrt()
                 / (target.abs().square() * columns).sum().sqrt())


def _target_spectrum(sigma_mm: float, fft_shape: tuple[int, int]) -> Tensor:
    """rfft2 (float64) of T (outer product of ``target_taps``) centred at (0, 0) on ``fft_shape``."""
    taps, _ = target_taps(sigma_mm)
    return kernel_spectrum(torch.outer(taps, taps), fft_shape)


def _wiener(spectrum: Tensor, target_spectrum: Tensor) -> Tensor:
    """The Wiener filter from the response ``spectrum`` to ``target_spectrum`` (floor ``WIENER_FLOOR``)."""
    power = spectrum.abs().square()
    return target_spectrum * spectrum.conj() / (power + WIENER_FLOOR * power.max())


def target_taps(sigma_mm: float) -> tuple[Tensor, Tensor]:
    """T's taps (float64, offsets -reach..reach, sum 1, reach = ceil(4 sigma)) and their gram G(k),
    k = -2 reach..2 reach."""
    reach = math.ceil(4 * sigma_mm)
    offsets = torch.arange(-reach, reach + 1, dtype=torch.float64)
    taps = torch.exp(-0.5 * (offsets / sigma_mm) ** 2)
    taps = taps / taps.sum()
    gram = torch.nn.functional.conv1d(F.pad(taps, (2 * reach, 2 * reach))[None, None], taps[None, None])[0, 0]
    return taps, gram
