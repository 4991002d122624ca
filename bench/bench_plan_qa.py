"""The delivery QA of a two-arc plan end to end, as a clinic runs it: the commissioning and the QA
each one run of ``inference_visualize.py``, timed as whole processes.

In a scratch folder: the commissioning plans of ``bench.bench_error_detection`` (dataset IDs 5 and
85, tuning arcs, 41 control points over 120 deg, 150 MU, and the static fields of
``epid.evaluation.commission.field_plan``, as ``--export-field-plan`` writes them) and a two-arc
plan of held-out dataset IDs (``--arcs``, default 6 and 86: ``--control-points`` per arc over ``--arc-degrees``,
``--beam-mu`` each; arc 1 turns clockwise, arc 2 back counter-clockwise), each delivered by the
clinic simulation (``bench.clinic_delivery``, which shares no code with the models) as a cine
series of single-frame RT Images (the two-arc plan's frames naming their beam). Then

    inference_visualize.py --checkpoint CHECKPOINT --commission arc_005.dcm cine_005/ arc_085.dcm cine_085/ \
        fields.dcm cine_fields/
    inference_visualize.py --checkpoint commissioned.pth --plan two_arcs.dcm --frames cine_1/ cine_2/

the second ``--repeats`` times, and prints the wall clock of each (the QA's median), the frames,
the seconds per 1,500 frames against the target (60 s), and the plan's verdict table
(``epid.evaluation.qa_report.plan_table`` of ``qa_plan.json``). Run from the repository root:

    python -m bench.bench_plan_qa --checkpoint quality_sharp/checkpoint.pth
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.bench_error_detection import COMMISSIONING_IDS, arc_plan
from bench.bench_quality import machine as describe_machine
from bench.bench_reconstruct import chosen_arcs
from bench.clinic_delivery import ClinicPanel, PanelPhysics, write_cine
from epid.core.cli import run_main
from epid.core.errors import InputError
from epid.dicom.plan import Arc, read_plan, write_arcs
from epid.evaluation import qa_report
from epid.models.checkpoint import load_checkpoint
from epid.synthesis.sequences import generate_control_points

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS_PER_1500 = 60.0
START_DEG = 181.0


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_plan_qa", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="an aperture-family checkpoint (bench_quality's)")
    parser.add_argument("--arcs", default="6,86", help="dataset IDs of the plan's two arcs (default 6,86)")
    parser.add_argument("--control-points", type=int, default=178, help="control points per arc (default 178)")
    parser.add_argument("--arc-degrees", type=float, default=358.0, help="gantry span of each arc (default 358)")
    parser.add_argument("--beam-mu", type=float, default=300.0, help="MU of each arc (default 300)")
    parser.add_argument("--repeats", type=int, default=3, help="QA runs, the median quoted (default 3)")
    parser.add_argument("--output", default="plan_qa.json", help="figures as JSON")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    return args


def timed(*arguments: str) -> float:
    """Wall clock (s) of one ``inference_visualize.py`` run (its output kept back; on failure its end is
    printed and the bench stops)."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(ROOT / "inference_visualize.py"), *arguments], cwd=ROOT,
                            capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"inference_visualize.py {' '.join(arguments[:4])} ... failed:\n{result.stderr[-3000:]}")
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    args.arcs = chosen_arcs(args.arcs, set(load_checkpoint(args.checkpoint).get("dataset_ids") or []))
    if len(args.arcs) != 2:
        raise InputError(f"--arcs {','.join(map(str, args.arcs))}: expected the two dataset IDs of the plan's arcs")
    physics = PanelPhysics()
    panel = ClinicPanel(physics)
    results: dict = {"checkpoint": args.checkpoint, "machine": describe_machine(torch.device("cpu")), "arcs": args.arcs,
                     "control_points": args.control_points, "arc_degrees": args.arc_degrees, "beam_mu": args.beam_mu}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        commissioning = []
        small = argparse.Namespace(control_points=41, arc_degrees=120.0, beam_mu=150.0)
        for dataset_id in COMMISSIONING_IDS + (None,):
            beam = arc_plan(folder, dataset_id, small)
            cine = folder / ("cine_fields" if dataset_id is None else f"cine_{dataset_id:03d}")
            write_cine(panel.deliver(beam), cine, physics)
            commissioning += [beam.path, str(cine)]
        stop = (START_DEG + args.arc_degrees) % 360.0
        plan = folder / "two_arcs.dcm"
        write_arcs(plan, [Arc(generate_control_points(args.arcs[0], args.control_points), args.beam_mu, START_DEG,
                              stop, "CW"),
                          Arc(generate_control_points(args.arcs[1], args.control_points), args.beam_mu, stop,
                              START_DEG, "CC")], label="two arcs")
        frames = []
        for beam in read_plan(plan):
            started = time.perf_counter()
            paths = write_cine(panel.deliver(beam), folder / f"cine_{beam.beam_number}", physics,
                               beam=beam.beam_number)
            frames.append(len(paths))
            print(f"arc {beam.beam_number} ({args.arcs[beam.beam_number - 1]}): {len(paths)} cine frames, delivered "
                  f"in {time.perf_counter() - started:.0f} s", flush=True)
        commission_seconds = timed("--checkpoint", args.checkpoint, "--commission", *commissioning,
                                   "--output-dir", str(folder / "commissioned"))
        print(f"--commission on arcs {', '.join(map(str, COMMISSIONING_IDS))} and the static fields: "
              f"{commission_seconds:.1f} s", flush=True)
        qa = [str(folder / "commissioned" / "commissioned.pth"), "--plan", str(plan), "--frames",
              str(folder / "cine_1"), str(folder / "cine_2"), "--output-dir", str(folder / "qa"), "--device", "cpu"]
        runs = []
        for _ in range(args.repeats):
            runs.append(timed("--checkpoint", *qa))
            print(f"QA of the two-arc plan: {runs[-1]:.1f} s", flush=True)
        verdict = json.loads((folder / "qa" / "qa_plan.json").read_text())
    median = statistics.median(runs)
    per_1500 = median * 1500 / sum(frames)
    results.update(frames=frames, commission_seconds=commission_seconds, qa_seconds=runs, qa_seconds_median=median,
                   seconds_per_1500_frames=per_1500, plan=verdict)
    print(qa_report.plan_table(verdict))
    print(f"two-arc plan QA ({sum(frames)} cine frames, {results['machine']}): median {median:.1f} s of "
          f"{args.repeats}, {per_1500:.1f} s per 1,500 frames (target {TARGET_SECONDS_PER_1500:g} s: "
          f"{'met' if per_1500 <= TARGET_SECONDS_PER_1500 else 'MISSED'})")
    Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    run_main(main, "python -m bench.bench_plan_qa")
