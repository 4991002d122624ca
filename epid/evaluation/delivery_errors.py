"""Delivery errors found in a reconstruction: the figures and flags of the QA report beside gamma.

From the leaves reconstructed at a beam's control points (the plan's, or a measured series'
timeline's) against the plan, inside the jaw band (``epid.evaluation.arc_review.LeafErrors``):

- per bank: the mean and spread of reconstructed minus planned over its leaves that no X jaw
  hides; the bank is flagged when its mean lies ``BANK_FLAG_MM`` or more from 0 (a systematic
  shift of the bank);
- per X jaw (a beam with X jaws): the same over the leaf positions it hides, whose edge in the
  image is the jaw's (the plan's leaves are folded into the X jaws), flagged alike;
- per leaf: mean, spread, largest error; a leaf is flagged where its error exceeds
  ``LEAF_FLAG_MM`` at ``LEAF_FLAG_RUN`` or more consecutive control points (a stuck or
  lagging leaf), with the control points and gantry angles of each such run;
- MU: the total delivered against planned, flagged beyond ``MU_FLAG_PERCENT`` (meaningful only
  when the frames' calibration does not absorb it: a commissioned checkpoint's);
- frames: those whose 3 %/2 mm gamma pass rate is below the TG-218 tolerance, with their gantry
  angle.

Any flag of a bank, X jaw, leaf or the MU fails the QA verdict (``criterion``); the frames below the
tolerance are gamma's own criterion there.

A single position beyond 1 mm is not flagged: the reconstruction has an error of its own
(``leaf_within_1mm_percent`` reports it); the flags look for what persists. Every figure here is over
the positions whose strip the Y jaws leave at least half open (``LeafErrors.verifiable``): of a strip
the upper jaw covers all but a sliver of, the frames show the jaw's edge, not the leaf's.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from epid.evaluation.arc_review import LeafErrors

BANK_FLAG_MM = 0.5
LEAF_FLAG_MM = 2.0
LEAF_FLAG_RUN = 8
MU_FLAG_PERCENT = 1.0
LISTED = 20
"""At most this many flagged leaves or frames are listed in the summary (all are counted)."""
LEAF_ERROR_COLUMNS = ("bank", "leaf", "mlc_leaf", "leaf_y_mm", "positions", "mean_mm", "sd_mm", "max_abs_mm", "flagged",
                      "flagged_control_points", "flagged_gantry_deg")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(first, last) index of every run of True in ``mask`` (1-D)."""
    padded = np.concatenate([[False], mask, [False]])
    changes = np.flatnonzero(np.diff(padded.astype(np.int8)))
    return [(int(start), int(stop) - 1) for start, stop in zip(changes[::2], changes[1::2], strict=True)]


def _stats(values: np.ndarray) -> tuple[float, float]:
    return (float(values.mean()), float(values.std())) if values.size else (math.nan, math.nan)


def leaf_table(errors: LeafErrors, points: np.ndarray, gantry_deg: np.ndarray,
               leaf_y_mm: np.ndarray, mlc_leaves: Sequence[str]) -> list[dict[str, Any]]:
    """One row per bank and strip (``LEAF_ERROR_COLUMNS``) of the S control points ``points`` and their
    gantry angles: the figures of its verifiable positions (``LeafErrors.verifiable``); ``mlc_leaves`` names
    the MLC's own leaf over each strip (``MlcGeometry.leaf_labels``)."""
    rows = []
    masks = errors.verifiable()
    for bank, error in errors.banks.items():
        for leaf in range(error.shape[1]):
            scored = masks[bank][:, leaf]
            values = error[scored, leaf]
            mean, spread = _stats(values)
            large = scored & (np.abs(error[:, leaf]) > LEAF_FLAG_MM)
            runs = [(a, b) for a, b in _runs(large) if b - a + 1 >= LEAF_FLAG_RUN]
            rows.append({
                "bank": bank, "leaf": leaf, "mlc_leaf": mlc_leaves[leaf], "leaf_y_mm": float(leaf_y_mm[leaf]),
                "positions": int(values.size),
                "mean_mm": mean, "sd_mm": spread,
                "max_abs_mm": float(np.abs(values).max()) if values.size else math.nan,
                "flagged": int(bool(runs)),
                "flagged_control_points": " ".join(f"{points[a]}-{points[b]}" for a, b in runs),
                "flagged_gantry_deg": " ".join(f"{gantry_deg[a]:.1f}-{gantry_deg[b]:.1f}" for a, b in runs),
            })
    return rows


def error_summary(errors: LeafErrors, leaves: list[dict[str, Any]],
                  mu_total_error_percent: float, frame_rates: np.ndarray, frame_points: np.ndarray,
                  frame_gantry_deg: np.ndarray, tolerance_percent: float) -> dict[str, Any]:
    """The report's ``delivery_errors``: per bank {mean_mm, sd_mm, positions, flagged} over its verifiable
    positions, the same per X jaw over the positions it hides (a beam with X jaws), the flagged
    leaves (at most ``LISTED``, with ``flagged_leaves`` counting all), the MU flag, the frames below
    the gamma tolerance (at most ``LISTED``, ``flagged_frames`` counting all) and ``flagged``: any."""
    masks = errors.verifiable()
    banks = {bank: _edge(error[masks[bank]]) for bank, error in errors.banks.items()}
    x_jaws = {jaw: _edge(values) for jaw, values in errors.x_jaws().items() if values.size}
    flagged_leaves = [{key: row[key] for key in ("bank", "leaf", "mlc_leaf", "mean_mm", "flagged_control_points",
                                                 "flagged_gantry_deg")} for row in leaves if row["flagged"]]
    low = np.flatnonzero(np.isfinite(frame_rates) & (frame_rates < tolerance_percent))
    frames = [{"control_point": int(frame_points[i]), "gantry_deg": round(float(frame_gantry_deg[i]), 2),
               "gamma_3_2mm_percent": round(float(frame_rates[i]), 2)} for i in low[:LISTED]]
    mu_flag = bool(math.isfinite(mu_total_error_percent) and abs(mu_total_error_percent) > MU_FLAG_PERCENT)
    return _json_safe({
        "thresholds": {"bank_mean_mm": BANK_FLAG_MM, "leaf_mm": LEAF_FLAG_MM, "leaf_run_control_points": LEAF_FLAG_RUN,
                       "mu_total_percent": MU_FLAG_PERCENT, "frame_gamma_3_2mm_percent": tolerance_percent},
        "banks": banks, "x_jaws": x_jaws, "flagged_leaves": len(flagged_leaves), "leaves": flagged_leaves[:LISTED],
        "mu_total_error_percent": mu_total_error_percent, "mu_flagged": mu_flag,
        "flagged_frames": int(low.size), "frames": frames,
        "flagged": _flag_count(banks, x_jaws, len(flagged_leaves), mu_flag) > 0,
    })


def criterion(summary: dict[str, Any]) -> dict[str, Any]:
    """The QA verdict's criterion on ``error_summary``'s flags: {rule, value (the flags: banks and X jaws,
    leaves, MU), limit (0), pass}. Gamma and the leaves' share within 1 mm average an error over the arc
    and the field: a bank 1 mm off or one leaf stuck may pass them, while its flag persists."""
    flags = _flag_count(summary["banks"], summary["x_jaws"], summary["flagged_leaves"], summary["mu_flagged"])
    return {"rule": (f"no delivery error flagged: a bank or X jaw >= {BANK_FLAG_MM:g} mm off on average, a leaf "
                     f"beyond {LEAF_FLAG_MM:g} mm at {LEAF_FLAG_RUN} control points in a row, the total MU beyond "
                     f"{MU_FLAG_PERCENT:g} %"),
            "value": flags, "limit": 0, "pass": flags == 0}


def _flag_count(banks: dict[str, dict[str, Any]], x_jaws: dict[str, dict[str, Any]], flagged_leaves: int,
                mu_flagged: bool) -> int:
    """The delivery errors flagged: each flagged bank and X jaw, each flagged leaf, the MU."""
    edges = [*banks.values(), *x_jaws.values()]
    return sum(bool(edge["flagged"]) for edge in edges) + flagged_leaves + int(mu_flagged)


def _edge(errors: np.ndarray) -> dict[str, Any]:
    """Mean, spread and count of one bank's or jaw's errors (1-D), flagged where the mean lies
    ``BANK_FLAG_MM`` or more from 0."""
    mean, spread = _stats(errors)
    return {"mean_mm": mean, "sd_mm": spread, "positions": int(errors.size),
            "flagged": bool(math.isfinite(mean) and abs(mean) >= BANK_FLAG_MM)}


def _json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite (nested in dicts and lists) as None."""
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_leaf_table(path: Path, rows: list[dict[str, Any]]) -> None:
    """``qa_leaf_errors.csv``: ``leaf_table``'s rows (floats with 4 decimals)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=LEAF_ERROR_COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.4f}" if isinstance(value, float) else value for key, value in row.items()})
