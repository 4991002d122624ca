"""The EPID response kernel: the built-in measured-profile model or a user's MATLAB file.

Kernels are 2-D float64 arrays on the 1 mm pixel grid, odd-sized along both axes so that
the centre element is the zero offset, and normalised to sum 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.io

from epid.core.errors import InputError

DEFAULT_KERNEL_SIZE = 261
GAUSSIAN_WEIGHT = 0.7831
GAUSSIAN_SIGMA_MM = 2.183
LORENTZIAN_GAMMA_MM = 12.84


class KernelError(InputError):
    """A kernel file or variable that cannot be used; the message names the file and the problem."""


def default_kernel(size: int = DEFAULT_KERNEL_SIZE) -> np.ndarray:
    """The measured-profile model kernel, (size, size) float64 summing to 1.

    Separable isotropic mixture k(x) = w G(x; sigma) + (1 - w) L(x; gamma) with
    w = 0.7831, sigma = 2.183 mm (Gaussian G) and gamma = 12.84 mm (Lorentzian L, half
    width at half maximum), each normalised to sum 1 on the 1 mm grid; the 2-D kernel is
    the outer product of the 1-D profile with itself.
    """
    if size < 1 or size % 2 == 0:
        raise ValueError(f"size={size}: expected a positive odd number of pixels")
    x_mm = np.arange(size, dtype=np.float64) - (size - 1) / 2
    gaussian = np.exp(-0.5 * (x_mm / GAUSSIAN_SIGMA_MM) ** 2)
    lorentzian = 1.0 / (1.0 + (x_mm / LORENTZIAN_GAMMA_MM) ** 2)
    profile = GAUSSIAN_WEIGHT * gaussian / gaussian.sum() + (1.0 - GAUSSIAN_WEIGHT) * lorentzian / lorentzian.sum()
    return np.outer(profile, profile)


RADIAL_WEIGHTS = (0.5, 0.3, 0.2)
"""Weights of ``radial_kernel``'s Gaussian, exponential and Cauchy components."""
RADIAL_EXPONENTIAL_MM = 4.0


@dataclass(frozen=True)
class ResponseShape:
    """A radially built, measured-looking response: a Gaussian core of ``core_sigma_mm`` along x
    (``aspect`` times that along y), an exponential scatter of length ``scatter_mm`` and a Cauchy
    (optical glare) tail of width ``tail_mm``, weighted ``weights`` (core, scatter, tail)."""

    core_sigma_mm: float = GAUSSIAN_SIGMA_MM
    scatter_mm: float = RADIAL_EXPONENTIAL_MM
    tail_mm: float = LORENTZIAN_GAMMA_MM
    weights: tuple[float, float, float] = RADIAL_WEIGHTS
    aspect: float = 1.0


RESPONSE_FAMILY: dict[str, ResponseShape] = {
    "sharp": ResponseShape(core_sigma_mm=0.85, scatter_mm=1.5, tail_mm=9.0, weights=(0.6, 0.3, 0.1)),
    "radial": ResponseShape(),
    "broad": ResponseShape(core_sigma_mm=5.6, scatter_mm=6.0, tail_mm=20.0, weights=(0.45, 0.35, 0.2)),
    "broadest": ResponseShape(core_sigma_mm=7.4, scatter_mm=9.0, tail_mm=34.0, weights=(0.4, 0.4, 0.2)),
    "elongated": ResponseShape(core_sigma_mm=3.4, scatter_mm=5.0, tail_mm=16.0, weights=(0.5, 0.3, 0.2),
                               aspect=1.5),
}
"""Responses from the sharpest to the broadest plausible (README, Model quality): ``broad`` has
a core about 12 mm wide at half maximum with 90 % of its energy within about 32 mm, like a
measured panel's; ``elongated`` has rows and columns that differ (a core 1.5 times longer
along y)."""


def radial_kernel(size: int = DEFAULT_KERNEL_SIZE) -> np.ndarray:
    """A radially symmetric, measured-looking kernel, (size, size) float64 summing to 1, not
    separable (as measured EPID kernels are not): ``response_kernel`` of the default
    ``ResponseShape``.

    k(r) = 0.5 G(r; sigma) + 0.3 exp(-r / 4 mm) + 0.2 (1 + (r / gamma)^2)^(-3/2), r = sqrt(x^2 + y^2)
    mm, each component normalised to sum 1 on the grid (sigma and gamma as ``default_kernel``):
    a sharp primary, a short scatter and a long optical-glare tail. At size 261 its second
    singular value is 6.5 % of the first (a separable kernel has none).
    """
    return response_kernel(ResponseShape(), size)


def response_kernel(shape: ResponseShape, size: int = DEFAULT_KERNEL_SIZE) -> np.ndarray:
    """The kernel of ``shape``, (size, size) float64 summing to 1, rows along y; each component
    normalised to sum 1 on the grid before weighting."""
    if size < 1 or size % 2 == 0:
        raise ValueError(f"size={size}: expected a positive odd number of pixels")
    x_mm = np.arange(size, dtype=np.float64) - (size - 1) / 2
    radius = np.hypot(x_mm[:, None], x_mm[None, :])
    core_radius = radius if shape.aspect == 1.0 else np.hypot(x_mm[:, None] / shape.aspect, x_mm[None, :])
    components = (
        np.exp(-0.5 * (core_radius / shape.core_sigma_mm) ** 2),
        np.exp(-radius / shape.scatter_mm),
        (1.0 + (radius / shape.tail_mm) ** 2) ** -1.5,
    )
    return sum(weight * part / part.sum() for weight, part in zip(shape.weights, components, strict=True))


@dataclass(frozen=True)
class KernelFigures:
    """How broad a kernel is: the full width at half maximum of its central row and column (mm),
    the radii holding 50, 80, 90 and 99 % of its energy (mm) and its second singular value as a
    share of the first (0 for a separable kernel)."""

    fwhm_x_mm: float
    fwhm_y_mm: float
    energy_radii_mm: tuple[float, float, float, float]
    singular_ratio: float


def kernel_figures(kernel: np.ndarray) -> KernelFigures:
    """``KernelFigures`` of an odd-sized 2-D kernel on the 1 mm grid."""
    kernel = np.asarray(kernel, dtype=np.float64)
    centre_y, centre_x = (length // 2 for length in kernel.shape)
    y_mm = np.arange(kernel.shape[0]) - centre_y
    x_mm = np.arange(kernel.shape[1]) - centre_x
    radius = np.hypot(y_mm[:, None], x_mm[None, :]).ravel()
    order = np.argsort(radius, kind="stable")
    energy = np.cumsum(kernel.ravel()[order]) / kernel.sum()
    radii = tuple(float(radius[order][min(np.searchsorted(energy, share), len(order) - 1)])
                  for share in (0.5, 0.8, 0.9, 0.99))
    singular = np.linalg.svd(kernel, compute_uv=False)
    return KernelFigures(_fwhm(kernel[centre_y]), _fwhm(kernel[:, centre_x]), radii,
                         float(singular[1] / singular[0]) if len(singular) > 1 else 0.0)


def _fwhm(profile: np.ndarray) -> float:
    """Full width at half maximum (mm) of a 1-D profile peaking at its centre, edges interpolated."""
    centre = len(profile) // 2
    half = profile[centre] / 2
    above = np.flatnonzero(profile >= half)
    low, high = above[0], above[-1]
    last = len(profile) - 1
    left = low - (profile[low] - half) / (profile[low] - profile[low - 1]) if low > 0 else float(low)
    right = high + (profile[high] - half) / (profile[high] - profile[high + 1]) if high < last else float(high)
    return float(right - left)


def load_kernel(path: str | Path, variable: str | None = None) -> np.ndarray:
    """A kernel from a MATLAB .mat file (v4 to v7; scipy.io.loadmat), validated and normalised to sum 1.

    ``variable`` names the array in the file; when None, the file must hold exactly one
    2-D numeric array with at least two rows and two columns. The kernel must be 2-D, real,
    finite and have a positive sum. An axis of even length has no centre pixel: it is
    resampled onto the pixel-centred grid by linear interpolation at the half-pixel points
    (averages of neighbouring pairs), which adds one element and keeps the kernel's centre
    where it was. Raises KernelError naming the file, the variable and what is expected.
    """
    path = Path(path)
    if not path.is_file():
        raise KernelError(f"kernel file {str(path)!r} does not exist; expected a MATLAB .mat file")
    contents = _read_mat(path)
    name = _choose_variable(path, contents, variable)
    kernel = _validated(path, name, contents[name])
    for axis in (0, 1):
        if kernel.shape[axis] % 2 == 0:
            kernel = _to_odd_length(kernel, axis)
    return kernel / kernel.sum()


def kernel_from_config(path: str, variable: str | None = None) -> np.ndarray:
    """The kernel named by EPID_KERNEL's parts: the default kernel when ``path`` is empty."""
    return default_kernel() if not path else load_kernel(path, variable)


def _read_mat(path: Path) -> dict[str, object]:
    try:
        contents = scipy.io.loadmat(path)
    except NotImplementedError:
        raise KernelError(
            f"kernel file {str(path)!r} is a MATLAB v7.3 (HDF5) file; expected v7 or older (save it with -v7)"
        ) from None
    except Exception as error:  # noqa: BLE001  scipy raises ValueError, TypeError, OSError, ... for non-MAT content
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise KernelError(f"kernel file {str(path)!r} is not a readable MATLAB .mat file ({reason})") from None
    return {key: value for key, value in contents.items() if not key.startswith("__")}


def _choose_variable(path: Path, contents: dict[str, object], variable: str | None) -> str:
    if variable is not None:
        if variable not in contents:
            available = ", ".join(sorted(contents)) or "none"
            raise KernelError(
                f"kernel file {str(path)!r} has no variable {variable!r} (variables: {available}); "
                "expected path.mat:variable naming a 2-D array"
            )
        return variable
    candidates = sorted(
        key
        for key, value in contents.items()
        if isinstance(value, np.ndarray) and value.ndim == 2 and min(value.shape) >= 2 and _is_numeric(value)
    )
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        found = ", ".join(f"{key} {_describe(value)}" for key, value in sorted(contents.items())) or "no variables"
        raise KernelError(f"kernel file {str(path)!r} holds no 2-D numeric array ({found}); expected one kernel matrix")
    listed = ", ".join(f"{key} {_describe(contents[key])}" for key in candidates)
    raise KernelError(f"kernel file {str(path)!r} holds several 2-D arrays ({listed}); name one as path.mat:variable")


def _validated(path: Path, name: str, value: object) -> np.ndarray:
    where = f"kernel {str(path)!r} variable {name!r}"
    if not isinstance(value, np.ndarray) or not _is_numeric(value):
        raise KernelError(f"{where} is {_describe(value)}; expected a real numeric 2-D array")
    if value.ndim != 2 or value.size == 0:
        raise KernelError(f"{where} has shape {value.shape}; expected a non-empty 2-D array")
    kernel = value.astype(np.float64)
    bad = int(np.count_nonzero(~np.isfinite(kernel)))
    if bad:
        raise KernelError(f"{where} has {bad} non-finite values (NaN or Inf); expected finite values")
    total = float(kernel.sum())
    if not total > 0.0:
        raise KernelError(f"{where} sums to {total:g}; expected a positive sum")
    return kernel


def _is_numeric(value: np.ndarray) -> bool:
    return value.dtype.kind in "biuf"


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"({value.dtype} {'x'.join(map(str, value.shape))})"
    return f"({type(value).__name__})"


def _to_odd_length(kernel: np.ndarray, axis: int) -> np.ndarray:
    """Values at the integer offsets between the half-pixel samples of an even-length axis."""
    pad = [(0, 0), (0, 0)]
    pad[axis] = (1, 1)
    padded = np.pad(kernel, pad)
    first = np.take(padded, np.arange(padded.shape[axis] - 1), axis=axis)
    second = np.take(padded, np.arange(1, padded.shape[axis]), axis=axis)
    return 0.5 * (first + second)
