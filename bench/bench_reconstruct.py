"""Reconstruction speed and accuracy on held-out arcs: the inverse network alone, refined per
frame pair, and refined jointly over the arc (``epid.reconstruct``), side by side.

Takes a trained checkpoint (for example the ``checkpoint.pth`` that ``bench.bench_quality``
writes) and, for one held-out dataset of each pattern (an ID the checkpoint never trained on),
synthesises ``--frames`` consecutive frames from the start of the arc (the whole arc by
default: 2,049 frames) with the checkpoint's own kernel and physics, then reconstructs the
control points with each method and reports frames per second (wall clock, the network's
estimates included) and the leaf errors of control points 1..N inside the jaw band (design
section 10): MAE, RMS, share within 0.5 mm and 1 mm; jaw MAE and MU relative error.

    python -m bench.bench_reconstruct --checkpoint quality_output/checkpoint.pth
    python -m bench.bench_reconstruct --checkpoint quality_output/checkpoint.pth --frames 64 \\
        --methods pair,arc --output reconstruct.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from bench.bench_quality import machine
from epid import reconstruct
from epid.checkpoint import build_models_from_checkpoint, load_checkpoint
from epid.cli import run_main
from epid.config import load_config
from epid.devices import resolve_device
from epid.errors import InputError
from epid.evaluate import jaw_band, load_synthesis_kernel, resolve_synthesis
from epid.imaging import render_frames
from epid.sequences import NUM_DATASETS, PATTERNS, generate_control_points, pattern_for

PROGRAM = "python -m bench.bench_reconstruct"
TARGETS = {"cpu": 10.0, "cuda": 1000.0}
"""Frames per second the arc reconstruction aims at, per device type."""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a trained checkpoint (.pth)")
    parser.add_argument("--frames", type=int, default=2049, help="frames per arc from its start (default 2049)")
    parser.add_argument("--methods", default=",".join(reconstruct.METHODS),
                        help=f"comma-separated of {', '.join(reconstruct.METHODS)} (default all)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--output", default="", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    args.methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    if not args.methods or any(name not in reconstruct.METHODS for name in args.methods):
        parser.error(f"--methods {','.join(args.methods)}: expected some of {', '.join(reconstruct.METHODS)}")
    if args.frames < 2:
        parser.error(f"--frames {args.frames}: expected at least 2")
    return args


def held_out_arcs(trained: set[int]) -> list[int]:
    """One dataset ID of each pattern that the checkpoint did not train on (the first 2 mod 4 one
    where possible)."""
    chosen = []
    for pattern in PATTERNS:
        candidates = [i for i in range(NUM_DATASETS) if pattern_for(i) == pattern and i not in trained]
        if not candidates:
            raise InputError(f"--checkpoint: it trained on every {pattern} dataset; none is held out")
        chosen.append(next((i for i in candidates if i % 4 == 2), candidates[0]))
    return chosen


def reconstruct_frames(method: str, models: tuple[torch.nn.Module, torch.nn.Module], frames: torch.Tensor,
                       batch: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control points 1..N (leaf_a, leaf_b (N, 52), jaws (N, 2)) and MU (N,) of the recorded frames
    (N + 1, 256, 256) of control points 0..N, frame 0 (zeros) before the arc."""
    forward_model, inverse_model = models
    if method == "arc":
        arc = reconstruct.reconstruct_arc(forward_model, inverse_model, frames[1:], frame_before=frames[0])
        return arc.leaf_a[1:], arc.leaf_b[1:], arc.jaws[1:], arc.mu
    parts = []
    for begin in range(0, len(frames) - 1, batch):
        end = min(begin + batch, len(frames) - 1)
        parts.append(reconstruct.pair_estimate(forward_model, inverse_model, frames[begin:end, None],
                                               frames[begin + 1:end + 1, None], refine=method == "pair"))
    leaf_a, leaf_b, scalars = (torch.cat(values) for values in zip(*parts, strict=True))
    return leaf_a[:, 52:], leaf_b[:, 52:], scalars[:, [2, 4]], scalars[:, 0]


def errors(estimate: tuple[torch.Tensor, ...], truth: tuple[np.ndarray, ...]) -> dict[str, float]:
    """Leaf errors in the jaw band, jaw MAE (mm) and MU relative error (%) of control points 1..N."""
    leaf_a, leaf_b, jaws, mu = (t.float().cpu() for t in estimate)
    true_a, true_b, jaw_1, jaw_2, true_mu = (torch.from_numpy(np.asarray(t, dtype=np.float32)) for t in truth)
    band = jaw_band(jaw_1, jaw_2)
    leaf = torch.cat([(leaf_a - true_a)[band], (leaf_b - true_b)[band]]).abs()
    return {
        "leaf_mae_mm": float(leaf.mean()), "leaf_rms_mm": float(leaf.square().mean().sqrt()),
        "within_0.5mm": float(100 * (leaf <= 0.5).float().mean()),
        "within_1mm": float(100 * (leaf <= 1).float().mean()),
        "jaw_mae_mm": float((jaws - torch.stack([jaw_1, jaw_2], 1)).abs().mean()),
        "mu_error_percent": float(100 * ((mu - true_mu).abs() / true_mu.clamp_min(1e-6)).mean()),
        "leaves": int(leaf.numel()),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    device = resolve_device(args.device)
    checkpoint = load_checkpoint(args.checkpoint)
    models = build_models_from_checkpoint(checkpoint, device)
    settings = resolve_synthesis(checkpoint.get("config") or {}, load_config({}), environ={})
    kernel = load_synthesis_kernel(settings)
    arcs = held_out_arcs(set(checkpoint.get("dataset_ids") or []))
    count = min(args.frames, settings.control_points - 1)
    print(f"{PROGRAM}: {count} frames of held-out arcs {arcs} on {device} ({machine(device)}); "
          f"{settings.describe()}", flush=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for dataset_id in arcs:
        control_points = generate_control_points(dataset_id, settings.control_points)
        frames = render_frames(control_points, range(1, count + 1), kernel, dataset_id=dataset_id,
                               noise_std=settings.noise_std, noise_seed=settings.noise_seed, device=device,
                               physics=settings.physics).float()
        frames = torch.cat([torch.zeros_like(frames[:1]), frames])
        points = slice(1, count + 1)
        truth = (control_points.leaf_a[points], control_points.leaf_b[points], control_points.jaw_1[points],
                 control_points.jaw_2[points], control_points.mu[points])
        for method in args.methods:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            with torch.inference_mode():
                estimate = reconstruct_frames(reconstruct.method_used(*models, method), models, frames)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            figures = {**errors(estimate, truth), "frames_per_second": count / seconds, "seconds": seconds}
            results.setdefault(method, {})[f"{dataset_id} {pattern_for(dataset_id)}"] = figures
            print(f"  arc {dataset_id} ({pattern_for(dataset_id)}), {method}: {figures['frames_per_second']:.2f} "
                  f"frames/s, leaf MAE {figures['leaf_mae_mm']:.3f} mm, within 1 mm {figures['within_1mm']:.1f} %, "
                  f"jaw MAE {figures['jaw_mae_mm']:.3f} mm, MU error {figures['mu_error_percent']:.2f} %", flush=True)
    target = TARGETS[device.type if device.type in TARGETS else "cpu"]
    print(f"\n{'method':8} {'frames/s':>9} {'leaf MAE':>9} {'RMS':>6} {'<=0.5mm':>8} {'<=1mm':>7} {'jaw MAE':>8} "
          f"{'MU err':>7}   (all arcs; leaf figures weighted by leaves, frames/s over all frames)")
    summary = {}
    for method, per_arc in results.items():
        leaves = sum(f["leaves"] for f in per_arc.values())

        def mean(key: str, per_arc: dict = per_arc, leaves: int = leaves) -> float:
            return sum(f[key] * f["leaves"] for f in per_arc.values()) / leaves

        rms = math.sqrt(sum(f["leaf_rms_mm"] ** 2 * f["leaves"] for f in per_arc.values()) / leaves)
        rate = len(per_arc) * count / sum(f["seconds"] for f in per_arc.values())
        summary[method] = {"frames_per_second": rate, "leaf_mae_mm": mean("leaf_mae_mm"), "leaf_rms_mm": rms,
                           "within_0.5mm": mean("within_0.5mm"), "within_1mm": mean("within_1mm"),
                           "jaw_mae_mm": float(np.mean([f["jaw_mae_mm"] for f in per_arc.values()])),
                           "mu_error_percent": float(np.mean([f["mu_error_percent"] for f in per_arc.values()]))}
        row = summary[method]
        print(f"{method:8} {row['frames_per_second']:9.2f} {row['leaf_mae_mm']:8.3f}  {rms:6.2f} "
              f"{row['within_0.5mm']:7.1f}% {row['within_1mm']:6.1f}% {row['jaw_mae_mm']:8.3f} "
              f"{row['mu_error_percent']:6.2f}%")
    print(f"targets (arc): >= {target:g} frames/s on {device.type}, leaf MAE <= 0.3 mm, >= 99 % within 1 mm")
    if args.output:
        Path(args.output).write_text(json.dumps({
            "checkpoint": str(args.checkpoint), "device": str(device), "machine": machine(device),
            "frames_per_arc": count, "arcs": arcs, "synthesis": settings.describe(),
            "summary": summary, "per_arc": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main, PROGRAM)
