"""Host memory of the training data path for many dataset IDs.

Builds the data of all 640 IDs (N = 2050 control points each), generates their control
points, renders a few batch windows and prints the control-point bytes, the peak
resident set size of the process and the legacy figure (every frame of every dataset
held as float32) for comparison.

    python -m bench.bench_memory [--datasets 640] [--control-points 2050] [--windows 3]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch

from epid.data.dataset import EpidData
from epid.data.windows import epoch_windows
from epid.synthesis.geometry import GRID_SIZE
from epid.synthesis.sequences import DEFAULT_CONTROL_POINTS

MB = 1e6
TARGET_BYTES = 2e9


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def legacy_bytes_per_dataset(n_control_points: int) -> int:
    """All N - 1 frames of a dataset as float32, as the legacy scripts held them."""
    return (n_control_points - 1) * GRID_SIZE * GRID_SIZE * 4


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=640, help="IDs 0..datasets-1")
    parser.add_argument("--control-points", type=int, default=DEFAULT_CONTROL_POINTS)
    parser.add_argument("--windows", type=int, default=3, help="batch windows to render")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    baseline = peak_rss_bytes()
    data = EpidData(range(args.datasets), control_points=args.control_points)
    started = time.perf_counter()
    data.prepare()
    generation_s = time.perf_counter() - started
    cp_bytes = data.control_point_bytes()
    print(f"control points: {args.datasets} datasets x {args.control_points} CPs generated in "
          f"{generation_s:.1f} s ({1e3 * generation_s / args.datasets:.1f} ms per dataset)")
    print(f"control-point bytes: {cp_bytes / MB:.1f} MB ({cp_bytes / MB / args.datasets:.2f} MB per dataset)")

    windows = epoch_windows(data.windows("train", args.batch_size), order="shuffled", seed=0, epoch=1)
    started = time.perf_counter()
    for window in windows[: args.windows]:
        batch = data.make_batch(window, args.device)
        del batch
    render_s = time.perf_counter() - started
    print(f"rendered {args.windows} windows of {args.batch_size} samples in {render_s:.1f} s")

    peak = peak_rss_bytes()
    legacy = legacy_bytes_per_dataset(args.control_points)
    print(f"peak RSS: {peak / MB:.0f} MB (before building the data: {baseline / MB:.0f} MB, "
          f"torch {torch.__version__}); target <= {TARGET_BYTES / MB:.0f} MB: "
          f"{'met' if peak <= TARGET_BYTES else 'NOT met'}")
    print(f"legacy: {legacy / MB:.0f} MB per dataset, {args.datasets * legacy / 1e9:.0f} GB "
          f"for {args.datasets} datasets")


if __name__ == "__main__":
    main()
