"""Gamma index speed: epid.evaluation.gamma on a batch of maps vs pymedphys.gamma map by map.

Builds 64 EPID-like reference maps (256 x 256 at 1 mm: MLC-shaped apertures
convolved with the broad EPID response kernel of design section 4) and evaluated
maps that are shifted, scaled, blurred and noisy copies of them, then times at
3 %/3 mm global gamma (10 % cutoff, max_gamma 2, interp_fraction 10):
  - epid.evaluation.gamma.gamma_index on the whole batch, on this CPU, for float32 and for
    float64 inputs (the same maps; gamma is computed in float32 either way);
  - pymedphys.gamma called once per map after its JIT warm-up, in a separate
    process, on an evenly spread subset of the maps (every k-th), extrapolated to
    the whole batch;
  - on a GPU when one is available, maps per second.
All CPU timings are taken side by side in each repeat; medians are reported, with
the CPU model, its vector features and the threads each library used. Both libraries are
timed in a steady state: pymedphys over its maps in a row, epid.evaluation.gamma as the median of
3 calls in a row (its first call after pymedphys's process has run finds cold caches).
epid.evaluation.gamma's first call, before it keeps any buffers, is timed too (release_workspaces
before each).
OMP_WAIT_POLICY defaults to PASSIVE here (for both libraries): on a machine shared
with other jobs, OpenMP threads that spin while waiting slow every parallel region
down many times over.

    python -m bench.bench_gamma [--maps 64] [--pymedphys-maps 16] [--repeats 3]
                                [--severity 1] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import multiprocessing
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch/numba start OpenMP

import numpy as np
import torch
from scipy.ndimage import convolve1d, gaussian_filter, shift

from epid.core.devices import cpu_features, cpu_model
from epid.evaluation.gamma import GammaCriteria, gamma_index, gamma_pass_rate, release_workspaces

CRITERIA = GammaCriteria()  # 3 %/3 mm global, 10 % cutoff, max_gamma 2
PERTURBATIONS = ("shift", "scale", "blur", "noise", "all")
INPUT_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def epid_kernel_1d(half_width: int = 64) -> np.ndarray:
    """Gaussian + Lorentzian line spread (sigma 2.183 mm, gamma 12.84 mm, w 0.7831)."""
    x = np.arange(-half_width, half_width + 1, dtype=np.float64)
    gauss = np.exp(-0.5 * (x / 2.183) ** 2)
    lorentz = 1 / (1 + (x / 12.84) ** 2)
    kernel = 0.7831 * gauss / gauss.sum() + (1 - 0.7831) * lorentz / lorentz.sum()
    return kernel / kernel.sum()


def epid_like_field(rng: np.random.Generator, size: int = 256) -> np.ndarray:
    """MLC-shaped aperture (5 mm leaf pairs between two jaws), convolved, times MU."""
    y = np.arange(size) - size / 2 + 0.5
    half = size / 2
    jaw_1 = rng.uniform(-0.8, 0.0) * half
    jaw_2 = min(jaw_1 + rng.uniform(0.4, 1.8) * half, 0.9 * half)
    centre = rng.uniform(-0.3, 0.3) * half
    aperture = np.zeros((size, size))
    for first_row in range(0, size, 5):
        if jaw_1 <= y[first_row] < jaw_2:
            leaf_a = centre - rng.uniform(0.05, 0.6) * half
            leaf_b = centre + rng.uniform(0.05, 0.6) * half
            aperture[first_row : first_row + 5, (y >= leaf_a) & (y < leaf_b)] = 1.0
    kernel = epid_kernel_1d()
    frame = convolve1d(convolve1d(aperture, kernel, axis=0, mode="constant"), kernel, axis=1, mode="constant")
    return frame * rng.uniform(5.0, 40.0)


def perturbed(
    reference: np.ndarray, rng: np.random.Generator, kind: str, severity: float = 1.0
) -> np.ndarray:
    """Shifted (<= 1.5 mm), scaled (+-3 %), blurred (sigma 0.5-1.5 mm) and/or noisy
    (0.5-1 % of the maximum) copy; ``severity`` multiplies these amplitudes."""
    evaluation = reference
    if kind in ("shift", "all"):
        evaluation = shift(evaluation, severity * rng.uniform(-1.5, 1.5, 2), order=1)
    if kind in ("scale", "all"):
        evaluation = evaluation * (1 + severity * rng.uniform(-0.03, 0.03))
    if kind in ("blur", "all"):
        evaluation = gaussian_filter(evaluation, severity * rng.uniform(0.5, 1.5))
    if kind in ("noise", "all"):
        noise_std = severity * rng.uniform(0.005, 0.01) * reference.max()
        evaluation = evaluation + rng.normal(0, noise_std, reference.shape)
    return evaluation


def make_maps(count: int, severity: float = 1.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` reference maps and their perturbed copies, cycling through PERTURBATIONS."""
    rng = np.random.default_rng(seed)
    references = np.stack([epid_like_field(rng) for _ in range(count)])
    kinds = [PERTURBATIONS[i % len(PERTURBATIONS)] for i in range(count)]
    evaluations = np.stack([perturbed(r, rng, k, severity) for r, k in zip(references, kinds, strict=True)])
    return references, evaluations


def _import_pymedphys() -> None:
    import pymedphys  # noqa: F401


def time_pymedphys(references: np.ndarray, evaluations: np.ndarray, threads: int) -> float:
    """Seconds for pymedphys.gamma on each map in turn (JIT warmed up first), its numba
    interpolation on ``threads`` threads."""
    import numba
    import pymedphys

    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))

    axes = tuple(np.arange(size, dtype=float) for size in references.shape[-2:])

    def run(reference: np.ndarray, evaluation: np.ndarray) -> None:
        pymedphys.gamma(
            axes, reference, axes, evaluation, CRITERIA.dose_percent, CRITERIA.distance_mm,
            lower_percent_dose_cutoff=CRITERIA.cutoff_percent, max_gamma=CRITERIA.max_gamma, interp_fraction=10,
        )

    run(references[0], evaluations[0])
    start = time.perf_counter()
    for reference, evaluation in zip(references, evaluations, strict=True):
        run(reference, evaluation)
    return time.perf_counter() - start


def time_torch(references: torch.Tensor, evaluations: torch.Tensor, calls: int = 3) -> float:
    """Seconds for epid.evaluation.gamma on the whole batch: the median of ``calls`` calls in a row
    (``calls`` 1 after release_workspaces: a first call, its buffers mapped afresh)."""
    times = []
    for _ in range(calls):
        if references.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        gamma_index(references, evaluations, **CRITERIA.arguments())
        if references.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_gamma", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--maps", type=int, default=64)
    parser.add_argument("--pymedphys-maps", type=int, default=16, help="maps timed with pymedphys (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--severity", type=float, default=1.0,
                        help="multiplies the shift, scale, blur and noise amplitudes (2: a poorer prediction)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    references, evaluations = make_maps(args.maps, args.severity)
    cpu_inputs = {name: torch.as_tensor(references, dtype=dtype) for name, dtype in INPUT_DTYPES.items()}
    cpu_evaluations = {name: torch.as_tensor(evaluations, dtype=dtype) for name, dtype in INPUT_DTYPES.items()}
    gamma = gamma_index(cpu_inputs["float32"], cpu_evaluations["float32"], **CRITERIA.arguments())
    rates = gamma_pass_rate(gamma)
    counted = (~torch.isnan(gamma)).float().mean().item()
    print(f"{args.maps} maps of {references.shape[-2]}x{references.shape[-1]} at 1 mm "
          f"(perturbation severity {args.severity:g}), 3 %/3 mm global, "
          f"10 % cutoff, max_gamma 2; {100 * counted:.0f} % of points above the cutoff; "
          f"pass rate median {rates.median():.1f} % (min {rates.min():.1f} %)")
    threads = torch.get_num_threads()
    print(f"CPU: {cpu_model()} ({cpu_features().text()}), {os.cpu_count()} logical cores; torch {torch.__version__}, "
          f"{threads} threads for both libraries, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")

    pymedphys_version = None
    if args.pymedphys_maps:
        try:
            pymedphys_version = importlib.metadata.version("pymedphys")
        except importlib.metadata.PackageNotFoundError:
            print("pymedphys not installed: CPU comparison skipped")
    every = max(1, args.maps // max(1, args.pymedphys_maps))
    subset = slice(0, args.maps, every)
    subset_count = len(range(args.maps)[subset])

    # pymedphys runs in its own process: numba's OpenMP threads and torch's would
    # otherwise share this one and slow each other down.
    torch_times = {name: [] for name in INPUT_DTYPES}
    first_call_times = {name: [] for name in INPUT_DTYPES}
    pymedphys_times = []
    pool = multiprocessing.get_context("spawn").Pool(1) if pymedphys_version else contextlib.nullcontext()
    with pool as worker:
        if pymedphys_version:
            worker.apply(_import_pymedphys)  # the worker starts (imports, JIT set-up) before any timing
        for _ in range(args.repeats):
            for name in INPUT_DTYPES:
                release_workspaces()
                first_call_times[name].append(time_torch(cpu_inputs[name], cpu_evaluations[name], calls=1))
                torch_times[name].append(time_torch(cpu_inputs[name], cpu_evaluations[name]))
            if pymedphys_version:
                subset_time = worker.apply(time_pymedphys, (references[subset], evaluations[subset], threads))
                pymedphys_times.append(subset_time * args.maps / subset_count)
    pymedphys_time = statistics.median(pymedphys_times) if pymedphys_times else None
    if pymedphys_time:
        print(f"pymedphys.gamma {pymedphys_version} (float64 maps), {args.maps} calls: {pymedphys_time:.2f} s, "
              f"extrapolated from {subset_count} of the {args.maps} maps (every {every}-th; "
              f"repeats {', '.join(f'{t:.2f}' for t in pymedphys_times)})")
    for name, times in torch_times.items():
        torch_time = statistics.median(times)
        speedup = f"; speedup (median over median) {pymedphys_time / torch_time:.1f}x" if pymedphys_time else ""
        print(f"epid.evaluation.gamma, CPU, batch of {args.maps}, {name} inputs: {torch_time:.3f} s "
              f"({args.maps / torch_time:.1f} maps/s; repeats {', '.join(f'{t:.3f}' for t in times)}){speedup}")
        first_call = statistics.median(first_call_times[name])
        speedup = f"; speedup {pymedphys_time / first_call:.1f}x" if pymedphys_time else ""
        print(f"  its first call (buffers not yet kept): {first_call:.3f} s{speedup}")

    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        for batch in (args.maps, 4 * args.maps):
            repeat = -(-batch // args.maps)
            gpu_references = cpu_inputs["float32"].to(gpu).repeat(repeat, 1, 1)[:batch]
            gpu_evaluations = cpu_evaluations["float32"].to(gpu).repeat(repeat, 1, 1)[:batch]
            time_torch(gpu_references, gpu_evaluations)
            repeats = max(3, args.repeats)
            gpu_time = statistics.median(time_torch(gpu_references, gpu_evaluations) for _ in range(repeats))
            print(f"epid.evaluation.gamma, {torch.cuda.get_device_name(gpu)}, batch of {batch}: "
                  f"{gpu_time * 1e3:.1f} ms "
                  f"({batch / gpu_time:.0f} maps/s)")
    else:
        print("no CUDA device: GPU timing skipped")


if __name__ == "__main__":
    main()
