"""Real-plan speed: reading a whole-arc RT Plan and predicting all its frames on the CPU.

Writes the synthetic arc of one dataset ID (2,050 control points) as an RT Plan
(``epid.dicom.plan.write_plan``) in a temporary folder, then reports, as the median of --repeats
runs (wall clock, with the process's CPU time beside it):
  - ``read_plan`` of that file (target 1 s), and of a 180-control-point arc written on each
    built-in MLC the models take (target 0.5 s);
  - the forward model's prediction of its 2,049 frames on the CPU in batches of --batch-size
    (target 60 s, about the time a VMAT arc takes to deliver): the model of --checkpoint, or a
    freshly built default model when none is given (its weights are untrained, its speed is the
    trained model's). Each frame f is predicted from control points f - 1 and f without a
    recorded previous frame (the signal before any detector lag).
--frames predicts only the first frames of the arc, for a quick check.

    python -m bench.bench_dicom [--checkpoint quality_output/checkpoint.pth] [--repeats 3]
    python -m bench.bench_dicom --frames 64 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP

import numpy as np
import torch

from epid.core.cli import run_main
from epid.core.devices import cpu_features, cpu_model
from epid.dicom.plan import read_plan, write_plan
from epid.evaluation.inference import trained_mlc
from epid.models.checkpoint import build_models_from_checkpoint, load_checkpoint
from epid.models.families import DEFAULT_FAMILY, build_models
from epid.synthesis.mlc import LEGACY_GRID, MLC_GEOMETRIES, MlcGeometry
from epid.synthesis.sequences import (
    DEFAULT_CONTROL_POINTS,
    NUM_DATASETS,
    ControlPoints,
    generate_control_points,
    pattern_for,
)

PROGRAM = "python -m bench.bench_dicom"
READ_TARGET_S = 1.0
MLC_PLAN_CONTROL_POINTS = 180
MLC_READ_TARGET_S = 0.5
PREDICT_TARGET_S = 60.0


def median_seconds(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``run`` over ``repeats`` calls (seconds)."""
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu)


def frame_parameters(control_points: ControlPoints, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward model's inputs for frames 1..count: leaves (count, 104) = [CP f - 1, CP f] in mm
    and scalars (count, 5) = [MU of frame f, jaw_1 f - 1, jaw_1 f, jaw_2 f - 1, jaw_2 f]."""
    prev, curr = np.arange(count), np.arange(1, count + 1)
    cp = control_points

    def pair(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([values[prev], values[curr]], axis=1).astype(np.float32))

    scalars = np.stack([cp.mu[curr], cp.jaw_1[prev], cp.jaw_1[curr], cp.jaw_2[prev], cp.jaw_2[curr]], axis=1)
    return pair(cp.leaf_a), pair(cp.leaf_b), torch.from_numpy(scalars.astype(np.float32))


def predict_frames(forward_model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], batch_size: int) -> torch.Tensor:
    """Frames (count, 256, 256) predicted ``batch_size`` at a time under ``torch.inference_mode``."""
    leaf_a, leaf_b, scalars = inputs
    frames = []
    with torch.inference_mode():
        for start in range(0, len(scalars), batch_size):
            window = slice(start, start + batch_size)
            epid, _ = forward_model(leaf_a[window], leaf_b[window], scalars[window])
            frames.append(epid[:, 0])
    return torch.cat(frames)


def forward_model_of(checkpoint: str) -> tuple[torch.nn.Module, str, MlcGeometry]:
    """The forward model on the CPU in eval mode, where it came from and its MLC (the checkpoint's)."""
    if checkpoint:
        loaded = load_checkpoint(checkpoint)
        forward_model, _ = build_models_from_checkpoint(loaded, "cpu")
        return forward_model, f"checkpoint {checkpoint}", trained_mlc(loaded.get("config") or {})
    forward_model, _ = build_models()
    return (forward_model.eval(), f"a freshly built default model ({DEFAULT_FAMILY}, full size; no --checkpoint given)",
            LEGACY_GRID)


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default="", help="a trained checkpoint (.pth); default: an untrained model")
    parser.add_argument("--dataset-id", type=int, default=200, help="arc written as the plan (default 200)")
    parser.add_argument("--frames", type=int, default=DEFAULT_CONTROL_POINTS - 1,
                        help="frames predicted from the start of the arc (default all 2049)")
    parser.add_argument("--batch-size", type=int, default=64, help="frames per forward pass (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per timing; the median is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if not 1 <= args.frames <= DEFAULT_CONTROL_POINTS - 1:
        parser.error(f"--frames {args.frames}: expected 1..{DEFAULT_CONTROL_POINTS - 1}")
    if args.batch_size < 1:
        parser.error("--batch-size must be at least 1")
    if not 0 <= args.dataset_id < NUM_DATASETS:
        parser.error(f"--dataset-id {args.dataset_id}: expected 0..{NUM_DATASETS - 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} ({cpu_features().text()}), {os.cpu_count()} logical cores; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}", flush=True)
    forward_model, source, mlc = forward_model_of(args.checkpoint)
    arc = generate_control_points(args.dataset_id, DEFAULT_CONTROL_POINTS, mlc)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "arc.dcm"
        started = time.perf_counter()
        write_plan(path, arc, mlc=mlc)
        written = time.perf_counter() - started
        size = path.stat().st_size
        print(f"plan: dataset {args.dataset_id} ({pattern_for(args.dataset_id)}), {len(arc)} control points, "
              f"{size / 1e6:.1f} MB, written in {written:.2f} s", flush=True)
        (beam,) = read_plan(path)
        read_wall, read_cpu = median_seconds(lambda: read_plan(path), args.repeats)
    print(f"read_plan: {read_wall:.3f} s / {read_cpu:.3f} s CPU  (target {READ_TARGET_S:g} s)", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name, geometry in MLC_GEOMETRIES.items():
            if not geometry.modelled or geometry == LEGACY_GRID:
                continue
            path = Path(folder) / f"{name}.dcm"
            write_plan(path, generate_control_points(args.dataset_id, MLC_PLAN_CONTROL_POINTS, geometry), mlc=geometry)
            wall, cpu = median_seconds(lambda path=path: read_plan(path), args.repeats)
            print(f"read_plan, {MLC_PLAN_CONTROL_POINTS} control points on {name} ({geometry.description}): "
                  f"{wall:.3f} s / {cpu:.3f} s CPU  (target {MLC_READ_TARGET_S:g} s)", flush=True)

    print(f"forward model: {type(forward_model).__name__} from {source}", flush=True)
    inputs = frame_parameters(beam.control_points, args.frames)
    predict_frames(forward_model, tuple(x[: min(args.batch_size, args.frames)] for x in inputs), args.batch_size)
    predict_wall, predict_cpu = median_seconds(lambda: predict_frames(forward_model, inputs, args.batch_size),
                                               args.repeats)
    whole = predict_wall / args.frames * (DEFAULT_CONTROL_POINTS - 1)
    print(f"predict {args.frames} frames (batches of {args.batch_size}): {predict_wall:.2f} s / "
          f"{predict_cpu:.2f} s CPU, {predict_wall / args.frames * 1e3:.1f} ms per frame", flush=True)
    if args.frames < DEFAULT_CONTROL_POINTS - 1:
        print(f"  whole arc of {DEFAULT_CONTROL_POINTS - 1} frames at that rate: about {whole:.1f} s "
              f"(target {PREDICT_TARGET_S:g} s)")
    else:
        print(f"  target {PREDICT_TARGET_S:g} s")
    return 0


if __name__ == "__main__":
    run_main(main, PROGRAM)
