"""Synthetic data engine speed and memory: control points, EPID frames, legacy convolution.

Measures, reporting medians over --repeats runs:
  - control-point generation of one dataset (2050 CPs) per pattern;
  - one full dataset end to end on the CPU: control points plus all 2049 frames with the
    default kernel and noise on (targets: 10 s, stretch 3 s), the same without noise, and
    the frames of one training batch window (129 frames for 128 samples);
  - the legacy path, a direct 261 x 261 'same' convolution (scipy.signal.convolve2d), on a
    few frames, and its per-frame ratio to ours (the legacy convolved each of the 7
    sub-frames of a frame);
  - one full dataset on CUDA when available (target 0.3 s);
  - frames on each MLC under the realistic physics (--mlc-frames of one dataset, the MLCs in
    turn within each repeat): ms per frame and the ratio to the legacy grid's, HD120 rendered on
    its fine strips (rows of 0.5 mm);
  - the host memory of the control points of every dataset ID: bytes held and the peak RSS
    of a fresh Python process (numpy and epid.synthesis.sequences only) that generates and keeps them all.
Wall times are printed with the CPU time of the process beside them (all threads): on a
busy machine the wall time grows while the CPU time stays put.
OMP_WAIT_POLICY defaults to PASSIVE here: on a machine shared with other jobs, OpenMP
threads that spin while waiting slow every parallel region down many times over.

    python -m bench.bench_synthesis [--repeats 3] [--threads 0] [--mlc-frames 256] [--memory-ids 640]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import numpy as np
import scipy.signal
import torch

from epid.synthesis.fluence import rasterize
from epid.synthesis.frames import FrameRenderer, render_frames, renderer_for
from epid.synthesis.kernel import default_kernel
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import PRESETS
from epid.synthesis.sequences import DEFAULT_CONTROL_POINTS, NUM_DATASETS, generate_control_points, pattern_for

BATCH_SAMPLES = 128


def median_seconds(
    run: Callable[[], object], repeats: int, synchronize: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``run`` over ``repeats`` calls (seconds)."""
    wall, cpu = [], []
    for _ in range(repeats):
        synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def bench_control_points(repeats: int) -> None:
    print(f"control points, one dataset of {DEFAULT_CONTROL_POINTS} CPs (wall / CPU):")
    for dataset_id in (0, 100, 200, 500):
        wall, cpu = median_seconds(lambda i=dataset_id: generate_control_points(i, DEFAULT_CONTROL_POINTS), repeats)
        print(f"  id {dataset_id:3d} ({pattern_for(dataset_id):11s}) {wall * 1e3:6.0f} ms / {cpu * 1e3:4.0f} ms")


def bench_cpu_dataset(dataset_id: int, repeats: int) -> float:
    """Print the CPU figures; return wall seconds per frame of a full dataset with noise."""
    kernel = default_kernel()
    start = time.perf_counter()
    FrameRenderer(kernel, "cpu").render(generate_control_points(dataset_id, 3), [1], dataset_id=dataset_id)
    print(f"kernel preparation (SVD, operators) and a first frame: {time.perf_counter() - start:.2f} s")
    renderer_for(kernel, "cpu")
    frames = np.arange(1, DEFAULT_CONTROL_POINTS)

    def full_dataset(noise_std: float) -> torch.Tensor:
        control_points = generate_control_points(dataset_id, DEFAULT_CONTROL_POINTS)
        return render_frames(control_points, frames, kernel, dataset_id=dataset_id, noise_std=noise_std)

    with_noise = median_seconds(lambda: full_dataset(0.005), repeats)
    without_noise = median_seconds(lambda: full_dataset(0.0), repeats)
    control_points = generate_control_points(dataset_id, DEFAULT_CONTROL_POINTS)
    window = np.arange(1, BATCH_SAMPLES + 2) + 700
    batch = median_seconds(lambda: render_frames(control_points, window, kernel, dataset_id=dataset_id), repeats)
    print(
        f"CPU, {torch.get_num_threads()} torch threads, dataset {dataset_id} ({pattern_for(dataset_id)}), wall / CPU:"
    )
    print(
        f"  full dataset, {len(frames)} frames, noise on:  {with_noise[0]:6.2f} s / {with_noise[1]:5.2f} s"
        "  (target 10 s, stretch 3 s)"
    )
    print(f"  full dataset, noise off:                 {without_noise[0]:6.2f} s / {without_noise[1]:5.2f} s")
    print(
        f"  one batch window ({len(window)} frames):         {batch[0]:6.2f} s / {batch[1]:5.2f} s"
        f"  ({batch[0] / len(window) * 1e3:.1f} ms per frame)"
    )
    return with_noise[0] / len(frames)


def frame_masks(dataset_id: int, count: int) -> np.ndarray:
    """Summed sub-aperture masks (count, 256, 256) of frames spread over a dataset."""
    control_points = generate_control_points(dataset_id, DEFAULT_CONTROL_POINTS)
    frames = np.linspace(1, DEFAULT_CONTROL_POINTS - 1, count).astype(int)
    positions = (control_points.leaf_a, control_points.leaf_b, control_points.jaw_1, control_points.jaw_2)
    sums = np.zeros((count, 256, 256))
    for t in np.arange(7) / 6:
        at = [v[frames - 1].astype(np.float64) * (1 - t) + v[frames].astype(np.float64) * t for v in positions]
        sums += rasterize(*at).numpy()
    return sums


def bench_legacy(dataset_id: int, count: int, ours_per_frame: float) -> None:
    kernel = default_kernel()
    images = frame_masks(dataset_id, count)
    ours = renderer_for(kernel, "cpu").convolve(torch.from_numpy(images)).numpy()
    seconds, agreement = [], []
    for image, fast in zip(images, ours, strict=True):
        start = time.perf_counter()
        direct = scipy.signal.convolve2d(image, kernel, mode="same")
        seconds.append(time.perf_counter() - start)
        agreement.append(np.abs(direct - fast).max() / np.abs(direct).max())
    per_frame = 7 * statistics.median(seconds)
    print(f"legacy direct 261 x 261 'same' convolution (scipy.signal.convolve2d), {count} frame(s):")
    print(
        f"  {statistics.median(seconds):.2f} s per sub-frame -> {per_frame:.1f} s per frame of 7 sub-frames, "
        f"{per_frame * (DEFAULT_CONTROL_POINTS - 1) / 3600:.1f} h per dataset"
    )
    print(
        f"  ours: {ours_per_frame * 1e3:.2f} ms per frame (full pipeline, noise on); "
        f"per-frame ratio {per_frame / ours_per_frame:,.0f}x; "
        f"our convolution agrees to {max(agreement):.1e} of the maximum"
    )


def bench_cuda(dataset_id: int, repeats: int) -> None:
    if not torch.cuda.is_available():
        print("CUDA: not available here")
        return
    device = torch.device("cuda")
    kernel = default_kernel()
    control_points = generate_control_points(dataset_id, DEFAULT_CONTROL_POINTS)
    frames = np.arange(1, DEFAULT_CONTROL_POINTS)
    renderer = renderer_for(kernel, device)
    renderer.render(control_points, frames[:64], dataset_id=dataset_id)
    wall, _ = median_seconds(
        lambda: renderer.render(control_points, frames, dataset_id=dataset_id), repeats, torch.cuda.synchronize
    )
    print(f"CUDA ({torch.cuda.get_device_name(device)}): full dataset, noise on: {wall:.3f} s  (target 0.3 s)")


def bench_mlcs(dataset_id: int, count: int, repeats: int) -> None:
    """ms per frame of ``count`` frames of one dataset on each MLC, realistic physics, noise on."""
    kernel, physics = default_kernel(), PRESETS["realistic"]
    names = ("legacy", "millennium120", "halcyon", "hd120")
    arcs = {name: generate_control_points(dataset_id, count + 1, MLC_GEOMETRIES[name]) for name in names}
    frames = np.arange(1, count + 1)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for name in names:  # warm-up: operators, caches
        render_frames(arcs[name], frames[:8], kernel, dataset_id=dataset_id, physics=physics)
    for _ in range(repeats):
        for name in names:
            start = time.perf_counter()
            render_frames(arcs[name], frames, kernel, dataset_id=dataset_id, physics=physics)
            seconds[name].append(time.perf_counter() - start)
    legacy = statistics.median(seconds["legacy"])
    print(f"frames on each MLC, realistic physics, {count} frames of dataset {dataset_id}, noise on "
          f"(median of {repeats}):")
    for name in names:
        grid = MLC_GEOMETRIES[name].grid
        median = statistics.median(seconds[name])
        print(f"  {name:13s} {grid.count:3d} strips of {grid.strip_mm:3g} mm: {median / count * 1e3:6.2f} ms per frame"
              f"  ({median / legacy:.2f}x the legacy grid)")


_GENERATE_ALL = """
import json, resource, sys, time
from epid.synthesis.sequences import generate_control_points


def peak_rss_bytes():
    # VmHWM belongs to this program's own address space; ru_maxrss would also count the
    # benchmark process this one was forked from (Linux keeps it across fork and exec).
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


ids = json.loads(sys.argv[1])
before = peak_rss_bytes()
start = time.perf_counter()
kept = [generate_control_points(i) for i in ids]
seconds = time.perf_counter() - start
held = sum(cp.nbytes for cp in kept)
print(json.dumps({"held": held, "before": before, "peak": peak_rss_bytes(), "seconds": seconds}))
"""


def bench_memory(count: int) -> None:
    dataset_ids = list(range(NUM_DATASETS))[:count]
    root = str(Path(__file__).resolve().parents[1])
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    completed = subprocess.run(
        [sys.executable, "-c", _GENERATE_ALL, json.dumps(dataset_ids)],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    )
    figures = json.loads(completed.stdout)
    mib = 1024 * 1024
    held, peak = figures["held"], figures["peak"]
    print(
        f"control points of {len(dataset_ids)} dataset IDs, generated in {figures['seconds']:.0f} s in a fresh process:"
    )
    print(f"  arrays held: {held:,} bytes ({held / mib:.0f} MiB, {held / len(dataset_ids) / mib:.2f} MiB per ID)")
    print(f"  peak RSS:    {peak:,} bytes ({peak / mib:.0f} MiB; {figures['before'] / mib:.0f} MiB after imports)")
    print("  (legacy: all frames in host RAM, 537 MB per dataset, 344 GB for 640; target 2 GB)")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_synthesis", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per timing; the median is reported")
    parser.add_argument("--dataset-id", type=int, default=200, help="dataset rendered in full (default 200)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--direct-frames", type=int, default=1, help="frames for the legacy convolution (0: skip)")
    parser.add_argument("--mlc-frames", type=int, default=256, help="frames per MLC for the MLC figure (0: skip)")
    parser.add_argument("--memory-ids", type=int, default=NUM_DATASETS, help="IDs for the memory figure (0: skip)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
    bench_control_points(args.repeats)
    per_frame = bench_cpu_dataset(args.dataset_id, args.repeats)
    if args.direct_frames > 0:
        bench_legacy(args.dataset_id, args.direct_frames, per_frame)
    bench_cuda(args.dataset_id, args.repeats)
    if args.mlc_frames > 0:
        bench_mlcs(args.dataset_id, args.mlc_frames, args.repeats)
    if args.memory_ids > 0:
        bench_memory(args.memory_ids)


if __name__ == "__main__":
    main()
