"""Reconstruction speed and accuracy on held-out arcs: the inverse network alone, refined per
frame pair, and refined jointly over the arc (``epid.reconstruction.estimate``), side by side.

Takes a trained checkpoint (for example the ``checkpoint.pth`` that ``bench.bench_quality``
writes) and, for one held-out dataset of each pattern (an ID the checkpoint never trained on),
synthesises ``--frames`` consecutive frames from the start of the arc (the whole arc by
default: 2,049 frames) with the checkpoint's own kernel and physics (EPID_KERNEL, where set, names
the kernel's file when it has moved; no other variable applies), then reconstructs the
control points with each method and reports frames per second (wall clock, the network's
estimates included) and the leaf errors of control points 1..N inside the jaw band (design
section 10): MAE, RMS, share within 0.5 mm and 1 mm; jaw MAE and MU relative error; how often the
arc fit kept the network's estimate (``epid.reconstruction.fallback``). It also predicts each arc's
frames from its control points alone, each frame after the model's own prediction of the frame
before (``epid.evaluation.plan_qa.predict_plan_frames``), and gives their gamma pass rate at
2 %/2 mm against the synthesised frames.

    python -m bench.bench_reconstruct --checkpoint quality_output/checkpoint.pth
    python -m bench.bench_reconstruct --checkpoint quality_output/checkpoint.pth --frames 300 \\
        --arcs 6,86,166,326,406,486 --methods network,arc --output reconstruct.json
    python -m bench.bench_reconstruct --checkpoint quality_output/checkpoint.pth --frames 64 \\
        --methods pair,arc --stages 6:0.5,0.8:0.1 --output estimate_module.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from bench.bench_quality import machine
from epid.config.load import load_config
from epid.core.cli import run_main
from epid.core.devices import resolve_device
from epid.core.errors import InputError
from epid.core.memory import keep_freed_memory
from epid.evaluation.arc_review import (
    ArcSegment,
    arc_errors,
    pooled_errors,
    read_hidden_edges,
    reconstruct_segment,
    synthesise_segment,
)
from epid.evaluation.gamma import GammaCriteria, gamma_pass_rates
from epid.evaluation.inference import SynthesisSettings, load_synthesis_kernel, resolve_synthesis
from epid.evaluation.plan_qa import predict_plan_frames
from epid.models.checkpoint import build_models_from_checkpoint, load_checkpoint
from epid.reconstruction import estimate as estimate_module
from epid.synthesis.sequences import NUM_DATASETS, PATTERNS, ControlPoints, generate_control_points, pattern_for

PROGRAM = "python -m bench.bench_reconstruct"
TARGETS = {"cpu": 10.0, "cuda": 1000.0}
"""Frames per second the arc reconstruction aims at, per device type."""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a trained checkpoint (.pth)")
    parser.add_argument("--frames", type=int, default=2049, help="frames per arc from its start (default 2049)")
    parser.add_argument("--methods", default=",".join(estimate_module.METHODS),
                        help=f"comma-separated of {', '.join(estimate_module.METHODS)} (default all)")
    parser.add_argument("--stages", default="", metavar="RANGE:STEP,...",
                        help="leaf tracking stages of pair and arc, mm: each control point searched within "
                             "+-RANGE on a STEP grid, stage after stage (default: the inverse model's own)")
    parser.add_argument("--arcs", default="", metavar="ID,...",
                        help="dataset IDs of the arcs (default: one held-out arc of each pattern, 2 mod 4); "
                             "each must be one the checkpoint did not train on")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--output", default="", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    args.methods = [name.strip() for name in args.methods.split(",") if name.strip()]
    if not args.methods or any(name not in estimate_module.METHODS for name in args.methods):
        parser.error(f"--methods {','.join(args.methods)}: expected some of {', '.join(estimate_module.METHODS)}")
    if args.frames < 2:
        parser.error(f"--frames {args.frames}: expected at least 2")
    args.stages = parse_stages(parser, args.stages) if args.stages else None
    return args


def parse_stages(parser: argparse.ArgumentParser, text: str) -> estimate_module.Stages:
    """'8:0.5,1:0.1' -> ((8.0, 0.5), (1.0, 0.1)); a parser error unless each is RANGE >= 0 : STEP > 0."""
    try:
        stages = tuple(tuple(float(value) for value in part.split(":")) for part in text.split(","))
        if any(len(stage) != 2 or stage[0] < 0 or stage[1] <= 0 for stage in stages):
            raise ValueError(text)
    except ValueError:
        parser.error(f"--stages {text!r}: expected RANGE:STEP pairs in mm, comma-separated (range >= 0, step > 0)")
    return stages


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


def forward_gamma(forward_model: torch.nn.Module, segment: ArcSegment, settings: SynthesisSettings,
                  device: torch.device) -> float:
    """Mean gamma pass rate (%, 2 %/2 mm, global, 10 % cutoff) of the segment's frames predicted
    from its control points alone (as delivered, with their X jaws where they have them) against its
    synthesised frames (the segment starts at frame 1)."""
    points = generate_control_points(segment.dataset_id, settings.control_points, settings.mlc)
    stop = len(segment) + 1
    plan = ControlPoints(**{name: getattr(points, name)[:stop] for name in
                            ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu", "leaf_weight")},
                         dataset_id=points.dataset_id, pattern=points.pattern, mlc=points.mlc)
    x_jaws = None if points.x_jaws is None else points.x_jaws[:stop]
    predicted = predict_plan_frames(forward_model, plan, device, x_jaws=x_jaws)
    criteria = GammaCriteria(dose_percent=2.0, distance_mm=2.0, cutoff_percent=10.0)
    return float(gamma_pass_rates(segment.frames[1:], predicted, criteria, device).mean())


def chosen_arcs(text: str, trained: set[int]) -> list[int]:
    """The dataset IDs of ``--arcs``; InputError for one outside 0..639 or one the checkpoint trained on."""
    try:
        arcs = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--arcs {text!r}: expected comma-separated dataset IDs in 0..{NUM_DATASETS - 1}") from None
    wrong = [i for i in arcs if not 0 <= i < NUM_DATASETS or i in trained]
    if not arcs or wrong:
        raise InputError(f"--arcs {text!r}: expected held-out dataset IDs in 0..{NUM_DATASETS - 1} (the checkpoint "
                         f"trained on {wrong})" if wrong else f"--arcs {text!r}: expected dataset IDs")
    return arcs


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    keep_freed_memory()  # as inference_visualize.py reconstructs
    device = resolve_device(args.device)
    checkpoint = load_checkpoint(args.checkpoint)
    models = build_models_from_checkpoint(checkpoint, device)
    moved_kernel = {"EPID_KERNEL": os.environ["EPID_KERNEL"]} if os.environ.get("EPID_KERNEL", "").strip() else {}
    settings = resolve_synthesis(checkpoint.get("config") or {}, load_config(moved_kernel), environ=moved_kernel)
    kernel = load_synthesis_kernel(settings)
    trained = set(checkpoint.get("dataset_ids") or [])
    arcs = chosen_arcs(args.arcs, trained) if args.arcs else held_out_arcs(trained)
    count = min(args.frames, settings.control_points - 1)
    print(f"{PROGRAM}: {count} frames of held-out arcs {arcs} on {device} ({machine(device)}); "
          f"{settings.describe()}", flush=True)
    stages = (args.stages or estimate_module.stages_of(models[1])) if estimate_module.can_refine(*models) else None
    print(f"leaf tracking stages (range, step mm): {stages or 'none (the pair cannot refine)'}", flush=True)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for dataset_id in arcs:
        segment = synthesise_segment(dataset_id, 1, count, settings, kernel, device)
        gamma_percent = forward_gamma(models[0], segment, settings, device)
        results.setdefault("forward", {})[f"{dataset_id} {segment.pattern}"] = {"gamma_2_2mm_percent": gamma_percent}
        print(f"  arc {dataset_id} ({segment.pattern}): frames predicted from the plan alone, gamma 2 %/2 mm "
              f"{gamma_percent:.2f} %", flush=True)
        for method in args.methods:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            estimate = reconstruct_segment(method, models, segment, device, stages=args.stages, mlc=settings.mlc)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - started
            estimate = read_hidden_edges(models[0], segment, estimate)
            figures = {**arc_errors(estimate, segment, settings.mlc.narrow_strips),
                       "frames_per_second": count / seconds, "seconds": seconds}
            results.setdefault(method, {})[f"{dataset_id} {segment.pattern}"] = figures
            print(f"  arc {dataset_id} ({segment.pattern}), {estimate.method}: {figures['frames_per_second']:.2f} "
                  f"frames/s, leaf MAE {figures['leaf_mae_mm']:.3f} mm, within 1 mm {figures['within_1mm']:.2f} %, "
                  f"jaw MAE {figures['jaw_mae_mm']:.3f} mm, MU error {figures['mu_error_percent']:.2f} %, "
                  f"network kept at {figures['from_start_percent']:.2f} % of open leaves", flush=True)
    target = TARGETS[device.type if device.type in TARGETS else "cpu"]
    print(f"\n{'method':8} {'frames/s':>9} {'leaf MAE':>9} {'RMS':>6} {'<=0.5mm':>8} {'<=1mm':>8} {'jaw MAE':>8} "
          f"{'MU err':>7} {'kept':>6}   (all arcs; leaf figures weighted by leaves, frames/s over all frames; "
          "kept: open leaves where the fit kept the network's estimate)")
    forward = results.pop("forward")
    summary = {"forward": {"gamma_2_2mm_percent": float(sum(f["gamma_2_2mm_percent"] for f in forward.values())
                                                        / len(forward))}}
    for method, per_arc in results.items():
        row = summary[method] = {
            **pooled_errors(list(per_arc.values())),
            "frames_per_second": len(per_arc) * count / sum(f["seconds"] for f in per_arc.values()),
        }
        print(f"{method:8} {row['frames_per_second']:9.2f} {row['leaf_mae_mm']:8.3f}  {row['leaf_rms_mm']:6.2f} "
              f"{row['within_0.5mm']:7.1f}% {row['within_1mm']:7.2f}% {row['jaw_mae_mm']:8.3f} "
              f"{row['mu_error_percent']:6.2f}% {row['from_start_percent']:5.2f}%")
        if "x_jaw_positions" in row:
            print(f"{'':8} X jaws, the edges where they hide a leaf: MAE {row['x_jaw_mae_mm']:.3f} mm "
                  f"({row['x_jaw_positions']} positions)")
        if "narrow_leaves" in row:
            print(f"{'':8} leaves narrower than 5 mm alone: leaf MAE {row['narrow_leaf_mae_mm']:.3f} mm, within 1 mm "
                  f"{row['narrow_within_1mm']:.2f} % ({row['narrow_leaves']} positions)")
    print("forward model, frames from the plan alone: gamma 2 %/2 mm "
          f"{summary['forward']['gamma_2_2mm_percent']:.2f} % (mean over arcs)")
    results["forward"] = forward
    print(f"targets (arc): >= {target:g} frames/s on {device.type}, leaf MAE <= 0.3 mm, >= 99 % within 1 mm")
    if "arc" in summary:
        arc = summary["arc"]
        verdicts = {"frames/s": arc["frames_per_second"] >= target, "leaf MAE": arc["leaf_mae_mm"] <= 0.3,
                    "within 1 mm": arc["within_1mm"] >= 99.0}
        print("arc: " + ", ".join(f"{name} {'met' if met else 'MISSED'}" for name, met in verdicts.items()))
    if args.output:
        Path(args.output).write_text(json.dumps({
            "checkpoint": str(args.checkpoint), "device": str(device), "machine": machine(device),
            "frames_per_arc": count, "arcs": arcs, "synthesis": settings.describe(),
            "summary": summary, "per_arc": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main, PROGRAM)
