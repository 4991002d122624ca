"""What a checkpoint comparison reports: its columns and ranks, text tables and files.

Columns say which quantities are compared and which direction is better; ``rankings`` ranks
the checkpoints on each; the tables print them (ranks in brackets) and ``write_json`` /
``write_csv`` write ``comparison.json`` and ``comparison.csv``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from epid.core.tables import format_number, format_table
from epid.evaluation import inference
from epid.evaluation.gamma import GammaCriteria
from epid.evaluation.weights_diff import WeightDelta, WeightDiff

LOWER, HIGHER = "lower", "higher"


@dataclass(frozen=True)
class Column:
    """A compared quantity: ``better`` is "lower", "higher" or None (shown, not ranked)."""

    key: str
    label: str
    better: str | None


HISTORY_COLUMNS = (
    Column("epochs", "epochs", None),
    Column("last_train_loss", "last train", LOWER),
    Column("last_val_loss", "last val", LOWER),
    Column("best_val_loss", "best val", LOWER),
    Column("best_epoch", "best epoch", None),
    Column("train_val_gap", "gap val-train", None),
    Column("mean_val_common", "mean val common", LOWER),
    Column("mean_val_tail", "mean val tail", LOWER),
    Column("slope_val_tail", "slope val tail /epoch", None),
    Column("last_gamma_pass", "last gamma pass %", HIGHER),
)
GAMMA_P5 = "gamma_pass_p5"
EVALUATION_COLUMNS = (
    Column("forward_mse", "forward MSE", LOWER),
    Column("forward_mae", "forward MAE", LOWER),
    Column("gamma_pass_percent", "gamma pass mean %", HIGHER),
    Column(GAMMA_P5, "gamma pass p5 %", HIGHER),
    Column("leaf_mae_band_mm", "leaf MAE band mm", LOWER),
    Column("leaf_mae_mm", "leaf MAE all mm", LOWER),
    Column("jaw_mae_mm", "jaw MAE mm", LOWER),
    Column("mu_abs_error", "MU MAE", LOWER),
)
ALL_SAMPLES = "all"


def rank(values: Mapping[str, float], better: str) -> dict[str, int | None]:
    """Competition ranks (1 = best, ties share the better rank); NaN gets None."""
    finite = {name: value for name, value in values.items() if math.isfinite(value)}
    sign = -1.0 if better == HIGHER else 1.0
    return {
        name: (1 + sum(sign * other < sign * finite[name] for other in finite.values()) if name in finite else None)
        for name in values
    }


@dataclass
class Evaluation:
    """Per-sample metrics of every checkpoint on one shared sample set."""

    refs: list[inference.SampleRef]
    synthesis: inference.SynthesisSettings
    criteria: GammaCriteria
    gamma_samples: int
    records: dict[str, list[inference.SampleMetrics]]
    seconds: dict[str, float]
    quality: dict[str, Any] = field(default_factory=dict)
    """``epid.evaluation.quality.QualityReport`` per checkpoint (gamma on the gamma samples only)."""
    reconstruction: dict[str, str] = field(default_factory=dict)
    """How each checkpoint's control points were reconstructed (``epid.reconstruction.estimate.METHODS``)."""

    def summary(self, name: str) -> dict[str, dict[str, float]]:
        """``group -> metric -> value`` for ``"all"`` and each pattern: the means (and
        ``count``) of ``inference.pattern_means`` plus the 5th percentile of the gamma pass rate."""
        records = self.records[name]
        means = inference.pattern_means(records)
        groups = {ALL_SAMPLES: records, **inference.by_pattern(records)}
        return {group: {**means[group], GAMMA_P5: _gamma_p5(members)} for group, members in groups.items()}


def _gamma_p5(records: Sequence[inference.SampleMetrics]) -> float:
    rates = np.array([record.gamma_pass_percent for record in records], dtype=float)
    rates = rates[np.isfinite(rates)]
    return float(np.percentile(rates, 5)) if rates.size else math.nan


def rankings(
    history: Mapping[str, Mapping[str, float]],
    evaluation: Mapping[str, Mapping[str, Mapping[str, float]]] | None,
) -> dict[str, dict[str, Any]]:
    """Ranks of every ranked column with values for at least one checkpoint.

    ``"history.<key>"`` from the history summaries, ``"evaluation.<key>"`` from the
    evaluation over all samples. Each entry: label, better ("lower" or "higher"),
    values and ranks per checkpoint name (1 = best).
    """
    sources = [("history", HISTORY_COLUMNS, history)]
    if evaluation:
        sources.append(("evaluation", EVALUATION_COLUMNS, {n: g[ALL_SAMPLES] for n, g in evaluation.items()}))
    result = {}
    for prefix, columns, rows in sources:
        for column in columns:
            values = {name: float(row.get(column.key, math.nan)) for name, row in rows.items()}
            if column.better is None or not any(math.isfinite(v) for v in values.values()):
                continue
            result[f"{prefix}.{column.key}"] = {
                "label": column.label, "better": column.better,
                "values": values, "ranks": rank(values, column.better),
            }
    return result


# --------------------------------------------------------------------------- tables


def _ranked_cell(value: float, ranks: Mapping[str, Any] | None, name: str) -> str:
    position = ranks["ranks"].get(name) if ranks else None
    return format_number(value) + (f" ({position})" if position is not None else "")


def _better_note(columns: Iterable[Column]) -> str:
    lower = [c.label for c in columns if c.better == LOWER]
    higher = [c.label for c in columns if c.better == HIGHER]
    parts = []
    if lower:
        parts.append("lower is better: " + ", ".join(lower))
    if higher:
        parts.append("higher is better: " + ", ".join(higher))
    return "(rank) after a value, 1 = best; " + "; ".join(parts)


def history_table(history: Mapping[str, Mapping[str, float]], ranked: Mapping[str, Any], common: int, tail: int) -> str:
    """History summary, one row per checkpoint, ranks in brackets."""
    columns = [c for c in HISTORY_COLUMNS if any(math.isfinite(row[c.key]) for row in history.values())]
    rows = [
        [name] + [_ranked_cell(row[c.key], ranked.get(f"history.{c.key}"), name) for c in columns]
        for name, row in history.items()
    ]
    title = (f"History (total loss; common window = epochs 1..{common}; tail = last {tail} epochs; "
             "gap = last val - last train; negative slope = still improving)")
    return "\n".join([title, format_table(["checkpoint", *(c.label for c in columns)], rows), _better_note(columns)])


def evaluation_title(evaluation: Evaluation) -> str:
    """What was evaluated, in one line."""
    datasets = len({ref.dataset_id for ref in evaluation.refs})
    methods = ", ".join(f"{name} {method}" for name, method in evaluation.reconstruction.items())
    return (f"Evaluation on {len(evaluation.refs)} validation samples of {datasets} datasets "
            f"(gamma {evaluation.criteria.describe()} on {evaluation.gamma_samples} of them; "
            f"control points reconstructed by: {methods or 'network'})")


def evaluation_tables(evaluation: Evaluation, summaries: Mapping[str, Any], ranked: Mapping[str, Any]) -> str:
    """Overall evaluation with ranks, then the same metrics per pattern."""
    patterns = [group for group in next(iter(summaries.values())) if group != ALL_SAMPLES]
    headers = ["checkpoint", *(c.label for c in EVALUATION_COLUMNS)]
    overall = [
        [name] + [_ranked_cell(groups[ALL_SAMPLES][c.key], ranked.get(f"evaluation.{c.key}"), name)
                  for c in EVALUATION_COLUMNS]
        for name, groups in summaries.items()
    ]
    lines = [
        evaluation_title(evaluation),
        f"Synthesis: {evaluation.synthesis.describe()}",
        format_table(headers, overall),
        _better_note(EVALUATION_COLUMNS),
    ]
    for pattern in patterns:
        count = sum(ref.pattern == pattern for ref in evaluation.refs)
        rows = [[name] + [format_number(groups[pattern][c.key]) for c in EVALUATION_COLUMNS]
                for name, groups in summaries.items()]
        lines += ["", f"Pattern {pattern} ({count} samples)", format_table(headers, rows)]
    return "\n".join(lines)


def rankings_table(ranked: Mapping[str, Any]) -> str:
    """One line per ranked column: direction, then checkpoints from best to worst."""
    rows = []
    for key, entry in ranked.items():
        order = sorted((r, n) for n, r in entry["ranks"].items() if r is not None)
        placed = ", ".join(f"{r}. {n} ({format_number(entry['values'][n])})" for r, n in order)
        rows.append([key, f"{entry['better']} is better", placed])
    return "Rankings (1 = best)\n" + format_table(["column", "direction", "checkpoints, best first"], rows)


def config_table(differences: Mapping[str, Mapping[str, Any]], names: Sequence[str]) -> str:
    """Config keys that differ, one column per checkpoint."""
    if not differences:
        return "Config: no differences"
    rows = [[key, *(format_number(values[name]) for name in names)] for key, values in differences.items()]
    return "Config differences ('-' = absent)\n" + format_table(["key", *names], rows)


def weight_tables(diff: WeightDiff) -> str:
    """Per-model and per-module weight differences of one pair, then unmatched tensors."""
    headers = ["tensors", "L2 diff", "relative change", "cosine"]

    def rows(groups: Mapping[str, WeightDelta]) -> list[list[str]]:
        return [[name, str(d.tensors), format_number(d.l2_difference), format_number(d.relative_change),
                 format_number(d.cosine)] for name, d in groups.items()]

    models = diff.totals("model")
    if not diff.unmatched and all(d.difference_sq == 0 for d in models.values()):
        tensors = sum(d.tensors for d in models.values())
        return f"Weights of {diff.other} against {diff.reference}: identical ({tensors} tensors)"
    lines = [
        f"Weights of {diff.other} against {diff.reference} (relative change = ||other - ref|| / ||ref||)",
        format_table(["model", *headers], rows(models)),
        "",
        format_table(["module", *headers], rows(diff.totals("module"))),
    ]
    if diff.unmatched:
        lines += ["", format_table(
            ["tensor", "status", "reference shape", "other shape"],
            [[f"{t.model}.{t.name}", t.status, str(t.reference_shape or "-"), str(t.other_shape or "-")]
             for t in diff.unmatched],
        )]
    return "\n".join(lines)


# --------------------------------------------------------------------------- files


def _plain(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None, tuples lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def write_json(path: Path, report: Mapping[str, Any]) -> None:
    """``report`` as indented JSON (NaN written as null)."""
    path.write_text(json.dumps(_plain(report), indent=2) + "\n")


def csv_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint (failed ones too): identity, history, overall and per-pattern
    evaluation (``<metric>_<pattern>``), weights against the reference, ranks (``rank_<key>``)."""
    weights = {diff["other"]: diff["models"] for diff in report["weight_diff"]}
    evaluation = (report["evaluation"] or {}).get("metrics", {})
    rows = []
    for checkpoint in report["checkpoints"]:
        name = checkpoint["name"]
        identity = ("name", "path", "status", "reason", "epoch", "run_id")
        row: dict[str, Any] = {key: checkpoint.get(key) for key in identity}
        row.update(report["history"].get(name, {}))
        for group, metrics in evaluation.get(name, {}).items():
            suffix = "" if group == ALL_SAMPLES else f"_{group}"
            row.update({f"{metric}{suffix}": value for metric, value in metrics.items() if metric != "count"})
        for model, delta in weights.get(name, {}).items():
            row.update({f"weights_{model}_{key}": delta[key] for key in ("l2_difference", "relative_change", "cosine")})
        for key, entry in report["rankings"].items():
            row[f"rank_{key.split('.', 1)[1]}"] = entry["ranks"].get(name)
        rows.append(row)
    return rows


def write_csv(path: Path, report: Mapping[str, Any]) -> None:
    """``csv_rows`` with the union of their columns (empty cell = not available)."""
    rows = csv_rows(report)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({key: ("" if _plain(value) is None else value) for key, value in row.items()})


def best_in_columns(values: np.ndarray, better: str) -> np.ndarray:
    """Boolean mask of the best value in each column of (checkpoints, groups) ``values``."""
    oriented = np.where(np.isfinite(values), values if better == LOWER else -values, np.inf)
    return np.isfinite(oriented) & (oriented == oriented.min(axis=0, keepdims=True))
