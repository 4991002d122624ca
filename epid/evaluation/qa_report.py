"""The delivery QA's report files (``epid.evaluation.plan_qa``'s ``PlanQA``), written by ``write_report``
to a folder:

- ``qa_summary.json``: the keys of ``plan_qa.SUMMARY_KEYS`` (see ``plan_qa.summarise``);
- ``qa_frames.csv``: one row per measured frame, columns ``FRAME_COLUMNS``;
- ``qa_leaves.csv``: one row per strip (``leaf``: its index on the models' strips; ``mlc_leaf``: the
  MLC's own leaf over it, numbered from 1 in the plan's order, one per layer joined by "/", empty
  beyond its leaves), bank and reconstructed control point (long form), columns ``LEAF_COLUMNS``;
- ``qa_leaf_errors.csv``: per bank and strip (with its ``mlc_leaf``), the reconstructed-minus-planned figures
  and flags;
- ``qa_gamma.png`` (pass rates over the arc), ``qa_leaves.png`` (leaf error per leaf and
  control point, the worst leaves' trajectories, jaws, MU) and ``qa_worst_frame.png`` (the
  frame of lowest 3 %/2 mm pass rate: measured, predicted, gamma, difference).

Also the integrated image's figure, the plan's predicted frames, the verdict as text, and for a
plan of several beams ``qa_plan.json`` (``write_plan_summary``) and their verdicts side by side.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor

from epid.core.tables import format_table
from epid.dicom.plan import PlanBeam
from epid.evaluation import arc_review, delivery_errors, plots
from epid.evaluation.plan_qa import (
    GAMMA_CRITERIA,
    TG218_ACTION_PERCENT,
    TG218_CRITERION,
    TG218_TOLERANCE_PERCENT,
    FrameGamma,
    PlanQA,
    leaf_error_rows,
    summarise,
)
from epid.evaluation.plots import Draw

FRAME_COLUMNS = (
    "control_point", "gantry_deg", "mu_planned", "mu_reconstructed", "gamma_3_2mm_percent", "gamma_2_2mm_percent",
    "passes_3_2mm", "leaves_scored", "leaf_mae_mm", "leaf_max_mm", "jaw_1_planned_mm", "jaw_1_reconstructed_mm",
    "jaw_2_planned_mm", "jaw_2_reconstructed_mm",
)
LEAF_COLUMNS = (
    "control_point", "gantry_deg", "bank", "leaf", "mlc_leaf", "leaf_y_mm", "in_band", "behind_x_jaw", "planned_mm",
    "reconstructed_mm", "error_mm",
)


def frame_rows(qa: PlanQA) -> list[dict[str, Any]]:
    """One row per measured frame (``FRAME_COLUMNS``); the reconstruction's columns are empty for
    a frame whose control point was not reconstructed."""
    cp, estimate = qa.beam.control_points, qa.estimate
    errors = arc_review.leaf_errors(estimate, qa.segment)
    masks = errors.scored()
    scored_row = {int(point): row for row, point in enumerate(qa.scored_points())}
    rows = []
    for index, point in enumerate(qa.points.tolist()):
        row: dict[str, Any] = {
            "control_point": point, "gantry_deg": float(qa.beam.gantry_deg[point]), "mu_planned": float(cp.mu[point]),
            "gamma_3_2mm_percent": qa.gamma.pass_rates["3_2mm"][index],
            "gamma_2_2mm_percent": qa.gamma.pass_rates["2_2mm"][index],
            "passes_3_2mm": int(qa.gamma.pass_rates["3_2mm"][index] >= TG218_TOLERANCE_PERCENT),
            "jaw_1_planned_mm": float(cp.jaw_1[point]), "jaw_2_planned_mm": float(cp.jaw_2[point]),
        }
        if point in scored_row:
            r = scored_row[point]
            scored = np.abs(np.concatenate([error[r][masks[bank][r]] for bank, error in errors.banks.items()]))
            row.update({
                "mu_reconstructed": float(estimate.mu[r]), "leaves_scored": int(scored.size),
                "leaf_mae_mm": float(scored.mean()) if scored.size else math.nan,
                "leaf_max_mm": float(scored.max()) if scored.size else math.nan,
                "jaw_1_reconstructed_mm": float(estimate.jaws[r, 0]),
                "jaw_2_reconstructed_mm": float(estimate.jaws[r, 1]),
            })
        rows.append(row)
    return rows


def write_csv(path: Path, columns: tuple[str, ...], rows: list[Mapping[str, Any]]) -> None:
    """Rows as CSV (floats with 6 significant digits, missing values empty)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})


def write_leaves_csv(path: Path, qa: PlanQA) -> None:
    """``qa_leaves.csv``: every leaf of both banks at every reconstructed control point, with the X
    jaw (X1, X2) that hides it, if any (its error is then the jaw's)."""
    segment, estimate = qa.segment, qa.estimate
    errors = arc_review.leaf_errors(estimate, segment)
    band, hidden = errors.band, dict(zip("AB", errors.behind_x_jaws, strict=True))
    geometry = qa.beam.geometry
    centres, mlc_leaves = geometry.grid.centres_mm, geometry.leaf_labels
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(LEAF_COLUMNS)
        for row, point in enumerate(qa.scored_points().tolist()):
            gantry = f"{float(qa.beam.gantry_deg[point]):.6g}"
            for bank, planned, reconstructed in (("A", segment.leaf_a, estimate.leaf_a), ("B", segment.leaf_b,
                                                                                          estimate.leaf_b)):
                values = reconstructed[row].numpy()
                for leaf, centre in enumerate(centres):
                    plan_mm, rec_mm = float(planned[row, leaf]), float(values[leaf])
                    writer.writerow([point, gantry, bank, leaf, mlc_leaves[leaf], f"{centre:g}", int(band[row, leaf]),
                                     ("", "X1", "X2")[hidden[bank][row, leaf]], f"{plan_mm:.6g}", f"{rec_mm:.6g}",
                                     f"{rec_mm - plan_mm:.6g}"])


def write_report(qa: PlanQA, output_dir: str | Path, run_label: str, draw: Draw = plots.draw,
                 **context: Any) -> dict[str, Any]:
    """Write the report files (module docstring) to ``output_dir``, the figures through ``draw``
    (``plots.draw``, or one that queues it on a worker); ``context`` (e.g. the checkpoint and its
    epoch) goes into the summary first. Returns the summary."""
    output = Path(output_dir)
    summary = {**context, **summarise(qa)}
    (output / "qa_summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    write_csv(output / "qa_frames.csv", FRAME_COLUMNS, frame_rows(qa))
    write_leaves_csv(output / "qa_leaves.csv", qa)
    delivery_errors.write_leaf_table(output / "qa_leaf_errors.csv", leaf_error_rows(qa))
    label = f"beam {qa.beam.beam_number} ({qa.beam.beam_name}) of {Path(qa.beam.path).name}; {run_label}"
    draw(plots.qa_gamma_figure, output / "qa_gamma.png", qa.points, qa.gamma.pass_rates, qa.gamma.integrated,
         (TG218_TOLERANCE_PERCENT, TG218_ACTION_PERCENT), f"Gamma per frame over the arc, {label}")
    _write_leaf_figure(qa, summary, output / "qa_leaves.png", label, draw)
    worst = qa.gamma.worst
    draw(plots.qa_frame_figure, output / "qa_worst_frame.png", qa.measured.frames[worst], qa.predicted[worst].numpy(),
         qa.gamma.worst_map, GAMMA_CRITERIA[TG218_CRITERION],
         f"Frame of lowest 3 %/2 mm pass rate: control point {int(qa.points[worst])} "
         f"({qa.gamma.pass_rates[TG218_CRITERION][worst]:.1f} % pass), {label}")
    return summary


def write_integrated_figure(measured: np.ndarray, predicted: np.ndarray, gamma: FrameGamma, beam: PlanBeam,
                            path: Path, run_label: str, draw: Draw = plots.draw) -> None:
    """``qa_integrated.png``: the measured and predicted integrated images of the beam, their gamma
    map (3 %/2 mm) and difference."""
    rate = gamma.integrated[TG218_CRITERION]
    draw(plots.qa_frame_figure, path, measured, predicted, gamma.worst_map, GAMMA_CRITERIA[TG218_CRITERION],
         f"Integrated image of beam {beam.beam_number} ({beam.beam_name}) of {Path(beam.path).name}: {rate:.1f} % "
         f"pass at 3 %/2 mm; {run_label}")


def write_plan_frames(predicted: Tensor, beam: PlanBeam, path: str | Path, run_label: str,
                      draw: Draw = plots.draw) -> None:
    """``plots.plan_frames_figure`` of a beam's predicted frames (N - 1, 256, 256) as a PNG at ``path``."""
    shown = _spread(len(predicted))
    names = [f"Frame ending on control point {point}, gantry {float(beam.gantry_deg[point]):.1f} deg"
             for point in (shown + 1).tolist()]
    title = f"Predicted frames of beam {beam.beam_number} ({beam.beam_name}) of {Path(beam.path).name}; {run_label}"
    draw(plots.plan_frames_figure, path, predicted[shown].numpy(), names, predicted.sum(0).numpy(),
         f"Sum of all {len(predicted)} frames", title)


def write_series_frames(qa: PlanQA, path: str | Path, run_label: str, draw: Draw = plots.draw) -> None:
    """``plots.plan_frames_figure`` of the predictions of a measured cine series' frames
    (``PlanQA.predicted``, each over its span of the plan) as a PNG at ``path``."""
    shown = _spread(len(qa.predicted))
    names = [f"Frame {index + 1} of the series, gantry {float(qa.beam.gantry_deg[qa.points[index]]):.1f} deg"
             for index in shown.tolist()]
    title = (f"Predicted frames of the measured series of beam {qa.beam.beam_number} ({qa.beam.beam_name}) of "
             f"{Path(qa.beam.path).name}; {run_label}")
    draw(plots.plan_frames_figure, path, qa.predicted[shown].numpy(), names, qa.predicted.sum(0).numpy(),
         f"Sum of the {len(qa.predicted)} predicted frames", title)


def _spread(frames: int) -> np.ndarray:
    """Indices of up to ``plots.PLAN_FRAMES_SHOWN`` frames spread evenly over ``frames``."""
    return np.unique(np.linspace(0, frames - 1, plots.PLAN_FRAMES_SHOWN).round().astype(int))


def _shown(value: float | None, form: str | None = None) -> str:
    """A figure as text in ``form`` (by default a whole number as it is, else with 2 decimals), "n/a"
    where there is none."""
    if value is None:
        return "n/a"
    return (form or ("{:d}" if isinstance(value, int) else "{:.2f}")).format(value)


def verdict_table(summary: Mapping[str, Any]) -> str:
    """The QA verdict as text: one row per criterion, the leaf, jaw and MU figures, the overall result."""
    rows = [[name, item["rule"], _shown(item["value"]), "PASS" if item["pass"] else "FAIL"]
            for name, item in summary["criteria"].items()]
    return (f"Delivery QA of beam {summary['beam']} ({summary['frames']} frames, reconstruction "
            f"{summary['reconstruction']}):\n{format_table(['criterion', 'rule', 'value', 'result'], rows)}\n"
            f"  leaf MAE {_shown(summary['leaf_mae_mm'])} mm, max {_shown(summary['leaf_max_mm'])} mm; jaw MAE "
            f"{_shown(summary['jaw_mae_mm'])} mm; total MU {_shown(summary['mu_total_error_percent'], '{:+.2f} %')}\n"
            f"  {_flags_line(summary['delivery_errors'])}\n"
            f"  overall: {'PASS' if summary['pass'] else 'FAIL'}")


PLAN_COLUMNS = ("beam", "beam_name", "report", "frames", "gamma_3_2mm_mean", "gamma_3_2mm_integrated",
                "leaf_mae_mm", "leaf_within_1mm_percent", "mu_total_error_percent", "pass")
"""What ``qa_plan.json`` keeps of each beam's summary (None where that beam's kind of QA has no such figure)."""


def write_plan_summary(plan: str, summaries: Sequence[Mapping[str, Any]], output_dir: str | Path) -> dict[str, Any]:
    """``qa_plan.json`` in ``output_dir`` for the QA of a plan of several beams, each reported in
    ``beam_<n>/``: the plan, each beam's ``PLAN_COLUMNS`` and ``pass`` (every beam passes). Returns it."""
    beams = [{key: summary.get(key) for key in PLAN_COLUMNS} | {"report": f"beam_{summary['beam']}"}
             for summary in summaries]
    plan_summary = {"plan": plan, "beams": beams, "pass": all(beam["pass"] for beam in beams)}
    (Path(output_dir) / "qa_plan.json").write_text(json.dumps(plan_summary, indent=2, allow_nan=False) + "\n")
    return plan_summary


def plan_table(plan_summary: Mapping[str, Any]) -> str:
    """The verdict of a plan of several beams as text: one row per beam, then the plan's result."""
    rows = [[f"{beam['beam']} ({beam['beam_name']})", _shown(beam["frames"]), _shown(beam["gamma_3_2mm_mean"]),
             _shown(beam["gamma_3_2mm_integrated"]), _shown(beam["leaf_mae_mm"]),
             _shown(beam["mu_total_error_percent"], "{:+.2f}"), "PASS" if beam["pass"] else "FAIL"]
            for beam in plan_summary["beams"]]
    header = ["beam", "frames", "3 %/2 mm mean", "3 %/2 mm integrated", "leaf MAE mm", "total MU %", "result"]
    return (f"QA of plan {plan_summary['plan']} ({len(rows)} beams):\n{format_table(header, rows)}\n"
            f"  plan: {'PASS' if plan_summary['pass'] else 'FAIL'}")


def _flags_line(errors: Mapping[str, Any]) -> str:
    """The delivery errors in one line: each bank's mean and spread, the flagged leaves, MU and frames."""
    banks = "; ".join(f"bank {name} {item['mean_mm']:+.2f} +- {item['sd_mm']:.2f} mm"
                      f"{' FLAGGED' if item['flagged'] else ''}" for name, item in errors["banks"].items()
                      if item["mean_mm"] is not None and math.isfinite(item["mean_mm"]))
    leaves = ", ".join(f"{leaf['bank']}{leaf['leaf']} (MLC leaf {leaf['mlc_leaf']}; control points "
                       f"{leaf['flagged_control_points']})"
                       for leaf in errors["leaves"][:5])
    return (f"delivery errors: {banks or 'no leaf scored'}; flagged leaves: {errors['flagged_leaves']}"
            f"{' (' + leaves + ')' if leaves else ''}; MU {'FLAGGED' if errors['mu_flagged'] else 'ok'}; frames below "
            f"the gamma tolerance: {errors['flagged_frames']}")


def _write_leaf_figure(qa: PlanQA, summary: Mapping[str, Any], path: Path, label: str, draw: Draw) -> None:
    segment, estimate = qa.segment, qa.estimate
    planned = {name: getattr(segment, name) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu")}
    reconstructed = {"leaf_a": estimate.leaf_a.numpy(), "leaf_b": estimate.leaf_b.numpy(),
                     "jaw_1": estimate.jaws[:, 0].numpy(), "jaw_2": estimate.jaws[:, 1].numpy(),
                     "mu": estimate.mu.numpy()}
    band = arc_review.leaf_errors(estimate, segment).band
    verdict = "passes" if summary["criteria"]["leaf_1mm"]["pass"] else "fails"
    mu_error = summary["mu_total_error_percent"]
    mu_text = "no MU planned" if mu_error is None else f"total MU {mu_error:+.2f} %"
    title = (f"Control points reconstructed from the measured frames ({estimate.method}) against the plan: "
             f"TG-142 leaf check {verdict}; jaw MAE {summary['jaw_mae_mm']:.2f} mm, {mu_text}\n{label}")
    draw(plots.arc_figure, path, qa.scored_points(), planned, reconstructed, band, title,
         labels=("plan", "reconstructed"), mlc_leaves=qa.beam.geometry.leaf_labels)
