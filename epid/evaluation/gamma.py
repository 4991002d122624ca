"""Gamma index (Low et al. 1998) between a reference and an evaluated dose image.

The search follows pymedphys' ``gamma_shell`` (version 0.41) point for point, so that results
agree with the implementation physicists use: around each reference point the evaluated image is
sampled, with bilinear interpolation, on circles ("shells") of increasing radius
``distance_mm / interp_fraction`` apart, each circle holding points at most that far apart
along its circumference. A point's search stops once the distance term alone cannot lower its
gamma any more, and at ``distance_mm * max_gamma`` at most. How all points of all images are
searched together, and the workspaces kept between calls, is ``epid.evaluation.gamma_search``.

``GammaCriteria`` holds one set of criteria; ``gamma_maps`` and ``gamma_pass_rate`` are the one
pipeline that gamma maps and pass rates come from; ``gamma_pass_rates`` gives the rates alone,
searching only as far as a pass needs (``PASS_MAX_GAMMA``): training's validation, the quality
figures and the plan QA use it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from epid.evaluation.gamma_search import (
    BLOCKS_PER_WORKER,
    CPU_WORKSPACES,
    ShellSearch,
    Workspace,
    one_thread_workers,
    workspaces_for,
)

DOSE_PERCENT = 3.0
DISTANCE_MM = 3.0
LOWER_PERCENT_CUTOFF = 10.0
MAX_GAMMA = 2.0
"""Default criteria: 3 %/3 mm global, 10 % lower cutoff, gamma reported up to 2."""
PASS_MAX_GAMMA = 1.0001
"""The cap a pass rate needs: a point passes (gamma <= 1) only through a sample within the
distance criterion, so the search can stop there; a point beyond it reads just above 1 and fails.
Half the search radius of ``MAX_GAMMA``, the same pass rates."""


@torch.inference_mode(False)  # worker threads do not inherit inference mode; kept buffers outlive it
@torch.no_grad()
def gamma_index(
    reference,
    evaluation,
    *,
    pixel_mm: float = 1.0,
    dose_percent: float = DOSE_PERCENT,
    distance_mm: float = DISTANCE_MM,
    lower_percent_cutoff: float = LOWER_PERCENT_CUTOFF,
    local: bool = False,
    max_gamma: float = MAX_GAMMA,
    interp_fraction: float = 10,
    global_normalisation=None,
) -> torch.Tensor:
    """Gamma index of ``evaluation`` against ``reference``, batched over leading dims.

    Args:
        reference: dose images (..., H, W), numpy array or torch tensor, on a square
            grid of ``pixel_mm``; each of its points is the centre of a search.
        evaluation: dose images broadcastable with ``reference``; interpolated and
            searched around each reference point. Non-finite values make gamma NaN
            at the points whose search reaches them.
        pixel_mm: grid pitch (mm) along both axes.
        dose_percent: dose criterion (%) of the global normalisation, or of the
            reference dose at the point when ``local``.
        distance_mm: distance-to-agreement criterion (mm).
        lower_percent_cutoff: reference points below this percentage of the global
            normalisation are not evaluated; they come out NaN.
        local: local gamma (dose criterion relative to the reference dose at the
            reference point) instead of global.
        max_gamma: the search radius is ``distance_mm * max_gamma``; gamma values
            above ``max_gamma`` are reported as ``max_gamma``. ``math.inf``: no cap,
            each point is searched until its gamma is settled.
        interp_fraction: the search step is ``distance_mm / interp_fraction`` (mm),
            radially and along each circle.
        global_normalisation: dose (units of the images) the percentages refer to,
            a scalar or one value per image (shape of the leading dims). Default:
            the maximum of each reference image.

    Returns:
        float32 tensor of the broadcast shape (..., H, W) on the inputs' device
        (CPU for numpy inputs): gamma per reference point, NaN where not evaluated
        (below the cutoff; for local gamma also where the reference dose is 0).

    Matches ``pymedphys.gamma(axes, reference, axes, evaluation, dose_percent,
    distance_mm, lower_percent_dose_cutoff=lower_percent_cutoff, interp_fraction=
    interp_fraction, max_gamma=max_gamma, local_gamma=local)`` with ``axes = (row
    coordinates, column coordinates)`` in mm: same search points, evaluated samples
    off the image ignored, points kept where ``reference >= cutoff``.
    """
    _check_options(
        pixel_mm, dose_percent, distance_mm, lower_percent_cutoff, max_gamma, interp_fraction
    )
    device = _device_of(reference, evaluation)
    workspaces = workspaces_for(device)
    with workspaces.inputs.lent() as inputs:
        reference_t, evaluation_t, shape = _as_image_stacks(reference, evaluation, device, inputs)
        normalisation = _normalisation(reference_t, global_normalisation, shape[:-2])
        threshold = torch.where(normalisation > 0, lower_percent_cutoff / 100 * normalisation, math.inf)
        counted = reference_t >= threshold[:, None, None]
        if local and lower_percent_cutoff == 0:
            counted &= reference_t != 0
        criterion = dose_percent / 100 * normalisation
        workers = torch.get_num_threads() if device.type == "cpu" else 1
        options = {"distance_mm": distance_mm, "interp_fraction": interp_fraction, "max_gamma": max_gamma,
                   "pixel_mm": pixel_mm}
        gamma = torch.empty(reference_t.shape, device=device)

        def search(images: slice, workers: int) -> None:
            ShellSearch(reference_t[images], evaluation_t[images], counted[images], criterion[images],
                        dose_percent if local else None, workspaces, workers).run(gamma[images], **options)

        images = reference_t.shape[0]
        if workers == 1 or images < BLOCKS_PER_WORKER * workers:
            search(slice(None), workers)
            return gamma.reshape(shape)
        # blocks of whole images, each searched start to end by one worker: the work on whole
        # images (the gamma at each point, the search set) runs side by side as well
        bounds = np.linspace(0, images, BLOCKS_PER_WORKER * workers + 1).round().astype(int).tolist()
        with one_thread_workers(workers) as pool:
            list(pool.map(lambda start, stop: search(slice(start, stop), 1), bounds[:-1], bounds[1:]))
    return gamma.reshape(shape)


def release_workspaces() -> None:
    """Frees the buffers that ``gamma_index`` keeps between calls on the CPU (at most
    ``_KEPT_BYTES``, 512 MiB; for 64 images of 256 x 256, about 200 MB)."""
    for pool in CPU_WORKSPACES.pools():
        pool.clear()


def gamma_pass_rate(gamma) -> torch.Tensor:
    """Percentage of evaluated points (not NaN) with gamma <= 1, over the last two dims.

    (pymedphys' ``calculate_pass_rate`` counts gamma < 1; the two differ only for
    points at exactly 1.)

    Args:
        gamma: (..., H, W) gamma values, NaN where not evaluated.

    Returns:
        float32 tensor of shape (...); NaN where no point was evaluated.
    """
    gamma = torch.as_tensor(gamma)
    evaluated = ~torch.isnan(gamma)
    count = evaluated.sum(dim=(-2, -1)).to(torch.float32)
    passed = (gamma <= 1).sum(dim=(-2, -1)).to(torch.float32)
    return torch.where(count > 0, 100 * passed / count, math.nan)


@dataclass(frozen=True)
class GammaCriteria:
    """Gamma criteria: dose difference in percent (of the reference maximum, or of the local
    reference dose when ``local``), distance to agreement in mm, lower dose cutoff in percent
    of the reference maximum, and the largest gamma reported."""

    dose_percent: float = DOSE_PERCENT
    distance_mm: float = DISTANCE_MM
    cutoff_percent: float = LOWER_PERCENT_CUTOFF
    local: bool = False
    max_gamma: float = MAX_GAMMA

    def describe(self) -> str:
        """Short label, e.g. ``3 %/3 mm global, cutoff 10 %``."""
        kind = "local" if self.local else "global"
        return f"{self.dose_percent:g} %/{self.distance_mm:g} mm {kind}, cutoff {self.cutoff_percent:g} %"

    def arguments(self) -> dict[str, float | bool]:
        """The criteria as ``gamma_index`` keyword arguments."""
        return {"dose_percent": self.dose_percent, "distance_mm": self.distance_mm,
                "lower_percent_cutoff": self.cutoff_percent, "local": self.local, "max_gamma": self.max_gamma}


DEFAULT_CRITERIA = GammaCriteria()


def gamma_maps(
    reference: torch.Tensor,
    evaluation: torch.Tensor,
    criteria: GammaCriteria = DEFAULT_CRITERIA,
    device: torch.device | str = "cpu",
    *,
    pixel_mm: float = 1.0,
    batch_size: int = 16,
) -> torch.Tensor:
    """Gamma of ``evaluation`` against ``reference`` (each (S, 1, H, W) or (S, H, W) on a grid of
    ``pixel_mm``, the EPID's 1 mm by default) under ``criteria``, computed on ``device``
    ``batch_size`` images at a time; (S, H, W) float32 on the CPU, NaN below the cutoff.
    ``gamma_pass_rate`` of the result gives each image's pass rate."""
    reference = reference.reshape(-1, *reference.shape[-2:])
    evaluation = evaluation.reshape(-1, *evaluation.shape[-2:])
    maps = [torch.empty(0, *reference.shape[-2:])]
    for start in range(0, reference.shape[0], batch_size):
        stop = start + batch_size
        gamma = gamma_index(reference[start:stop].to(device), evaluation[start:stop].to(device),
                            pixel_mm=pixel_mm, **criteria.arguments())
        maps.append(gamma.float().cpu())
    return torch.cat(maps)


def gamma_pass_rates(
    reference: torch.Tensor,
    evaluation: torch.Tensor,
    criteria: GammaCriteria = DEFAULT_CRITERIA,
    device: torch.device | str = "cpu",
    *,
    pixel_mm: float = 1.0,
    batch_size: int = 16,
) -> torch.Tensor:
    """The pass rate (%, (S,), NaN where no point is above the cutoff) of each image of
    ``evaluation`` against ``reference`` under ``criteria``: ``gamma_pass_rate`` of ``gamma_maps``,
    the search stopped at the distance criterion (``PASS_MAX_GAMMA``)."""
    capped = dataclasses.replace(criteria, max_gamma=PASS_MAX_GAMMA)
    return gamma_pass_rate(gamma_maps(reference, evaluation, capped, device, pixel_mm=pixel_mm, batch_size=batch_size))


def _check_options(
    pixel_mm: float,
    dose_percent: float,
    distance_mm: float,
    lower_percent_cutoff: float,
    max_gamma: float,
    interp_fraction: float,
) -> None:
    finite_positive = {
        "pixel_mm": pixel_mm,
        "dose_percent": dose_percent,
        "distance_mm": distance_mm,
        "interp_fraction": interp_fraction,
    }
    for name, value in finite_positive.items():
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}: expected a finite number > 0")
    if not max_gamma > 0:
        raise ValueError(f"max_gamma={max_gamma!r}: expected a number > 0 or math.inf")
    if not (math.isfinite(lower_percent_cutoff) and lower_percent_cutoff >= 0):
        raise ValueError(
            f"lower_percent_cutoff={lower_percent_cutoff!r}: expected a finite number >= 0"
        )


def _device_of(*values) -> torch.device:
    """The device of the first torch tensor among ``values``; the CPU if none is one."""
    return next((t.device for t in values if isinstance(t, torch.Tensor)), torch.device("cpu"))


def _as_tensor(values, device: torch.device, workspace: Workspace | None = None, name: str = "") -> torch.Tensor:
    """``values`` (array-like or tensor) as a float32 tensor on ``device``. Values of another
    dtype are converted into buffer ``name`` of ``workspace`` when one is given."""
    if not isinstance(values, torch.Tensor):
        array = np.asarray(values)
        values = torch.from_numpy(array if array.flags.writeable else array.copy())
    values = values.detach().to(device)
    if values.dtype == torch.float32:
        return values
    if workspace is None:
        return values.float()
    return workspace.matrix(name, 1, values.numel()).view(values.shape).copy_(values)


def _as_image_stacks(
    reference, evaluation, device: torch.device, workspace: Workspace
) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
    """Both inputs broadcast, as float32 (images, H, W) tensors on ``device``; inputs of
    another dtype are converted into buffers of ``workspace``.

    Also returns the broadcast shape (..., H, W).
    """
    reference_t, evaluation_t = torch.broadcast_tensors(
        _as_tensor(reference, device, workspace, "reference"), _as_tensor(evaluation, device, workspace, "evaluation")
    )
    if reference_t.ndim < 2:
        raise ValueError(f"image shape {tuple(reference_t.shape)}: expected (..., H, W)")
    shape = reference_t.shape
    height, width = shape[-2:]
    return (
        reference_t.reshape(-1, height, width),
        evaluation_t.reshape(-1, height, width),
        shape,
    )


def _normalisation(
    reference: torch.Tensor, global_normalisation, leading_shape: torch.Size
) -> torch.Tensor:
    """Global normalisation dose per image, shape (images,)."""
    if global_normalisation is None:
        return reference.amax(dim=(-2, -1))
    normalisation = _as_tensor(global_normalisation, reference.device)
    return normalisation.expand(leading_shape).reshape(-1)


