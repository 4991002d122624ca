"""Side-by-side comparison of checkpoints: stored histories, weights, configs and evaluation.

What is compared:

* **histories** stored in each checkpoint (total loss per epoch): last and best values,
  the train/validation gap, the mean over the epochs every run has, and the mean and
  slope of the last ``tail`` epochs;
* **weights** of every checkpoint against the first one (the reference), per tensor, per
  module (first component of the parameter name) and per model: L2 norm of the
  difference, change relative to the reference norm, cosine similarity, tensors missing
  on one side or with different shapes;
* **configs**: the training settings that differ (batch size, world size, learning rate,
  kernel, model sizes, ...), plus the global batch and effective learning rate they imply;
* **evaluation** (``epid.evaluate``) of every checkpoint on one shared, deterministic set
  of validation samples whose frames are synthesised once: forward MSE/MAE, gamma pass
  rate (mean and 5th percentile), inverse leaf MAE in the jaw band and overall, jaw MAE,
  MU error, overall and per pattern.

Results are printed as tables and written as ``comparison.csv`` (one row per checkpoint),
``comparison.json`` (everything), ``histories.png`` and ``metrics.png``.
"""

from __future__ import annotations

import csv
import glob
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from torch import Tensor

from epid import evaluate
from epid.checkpoint import (
    CheckpointError,
    build_models_from_checkpoint,
    load_checkpoint,
)
from epid.cli import prepare_output_dir
from epid.config import Config, load_config
from epid.devices import resolve_device
from epid.errors import InputError
from epid.gamma import DEFAULT_CRITERIA, GammaCriteria, gamma_maps
from epid.sharding import select_dataset_ids

MODEL_STATES = {"forward": "forward_model", "inverse": "inverse_model"}
UNCOMPARED_KEYS = ("optimizer", "scheduler", "scaler", "rng")  # dropped after loading: memory
DEFAULT_DATASET_RANGE = "0:640:80"
GLOB_CHARACTERS = re.compile(r"[*?[]")
TOTAL = "total"
LOWER, HIGHER = "lower", "higher"


# --------------------------------------------------------------------------- columns and ranks


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


# --------------------------------------------------------------------------- input


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that loaded and whose models were rebuilt (``models`` kept only when evaluating)."""

    name: str
    path: str
    payload: dict[str, Any]
    models: tuple[torch.nn.Module, torch.nn.Module] | None = None


@dataclass(frozen=True)
class Failure:
    """A checkpoint left out of the comparison, with the reason."""

    name: str
    path: str
    reason: str


def expand_checkpoint_patterns(patterns: Sequence[str]) -> list[str]:
    """Checkpoint paths from paths and glob patterns (expanded here, as PowerShell does not).

    A pattern that matches nothing is kept as given (it is then reported as unreadable);
    duplicates are dropped, first occurrence kept. Raises InputError when no file exists.
    """
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if GLOB_CHARACTERS.search(pattern) else []
        paths.extend(matches or [pattern])
    unique = list(dict.fromkeys(paths))
    if not any(os.path.isfile(path) for path in unique):
        raise InputError(f"no checkpoint file matches {' '.join(patterns)!r}")
    return unique


def display_names(paths: Sequence[str]) -> list[str]:
    """Shortest unique trailing parts of ``paths`` (``b.pth``, or ``run_a/epid.pth`` when needed)."""
    parts = [Path(os.path.normpath(path)).parts for path in paths]
    depth = 1
    while True:
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names) or depth >= max(len(p) for p in parts):
            return names
        depth += 1






def load_checkpoints(
    paths: Sequence[str], device: torch.device, keep_models: bool
) -> tuple[list[LoadedCheckpoint], list[Failure]]:
    """Load every checkpoint and rebuild its models on ``device``; failures are collected, not raised."""
    loaded, failures = [], []
    for name, path in zip(display_names(paths), paths):
        try:
            payload = load_checkpoint(path)
            models = build_models_from_checkpoint(payload, device)
        except CheckpointError as error:
            failures.append(Failure(name, path, str(error)))
            continue
        for unused in UNCOMPARED_KEYS:
            payload.pop(unused, None)
        loaded.append(LoadedCheckpoint(name, path, payload, models if keep_models else None))
    return loaded, failures


# --------------------------------------------------------------------------- histories


def total_curves(payload: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) total loss per epoch from a checkpoint's history (NaN where absent)."""
    history = payload.get("history") or {}
    train = np.asarray((history.get("train") or {}).get(TOTAL, []), dtype=float)
    val = np.asarray((history.get("val") or {}).get(TOTAL, []), dtype=float)
    return train, val


def gamma_curve(payload: Mapping[str, Any]) -> np.ndarray:
    """Validation gamma pass rate (%) per epoch, empty when the run did not record it."""
    history = payload.get("history") or {}
    return np.asarray(history.get("gamma_pass") or [], dtype=float)


def _last(values: np.ndarray) -> float:
    return float(values[-1]) if values.size else math.nan


def _nanmean(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else math.nan


def _slope(values: np.ndarray) -> float:
    """Least-squares slope per epoch of the finite values (NaN with fewer than two)."""
    epochs = np.arange(values.size, dtype=float)
    keep = np.isfinite(values)
    if keep.sum() < 2:
        return math.nan
    return float(np.polyfit(epochs[keep], values[keep], 1)[0])


def summarize_history(payload: Mapping[str, Any], common_epochs: int, tail: int) -> dict[str, float | int]:
    """The HISTORY_COLUMNS of one checkpoint.

    ``common_epochs``: the epoch window every compared run has (means over epochs
    1..common_epochs); ``tail``: how many final epochs the tail mean and slope use.
    Best epoch is 1-based. The gap is last validation minus last train loss.
    """
    train, val = total_curves(payload)
    finite_val = np.where(np.isfinite(val), val, np.inf)
    best = int(np.argmin(finite_val)) if np.isfinite(finite_val).any() else None
    return {
        "epochs": max(train.size, val.size),
        "last_train_loss": _last(train),
        "last_val_loss": _last(val),
        "best_val_loss": float(val[best]) if best is not None else math.nan,
        "best_epoch": best + 1 if best is not None else math.nan,
        "train_val_gap": _last(val) - _last(train),
        "mean_val_common": _nanmean(val[:common_epochs]) if common_epochs > 0 else math.nan,
        "mean_val_tail": _nanmean(val[-tail:]),
        "slope_val_tail": _slope(val[-tail:]),
        "last_gamma_pass": _last(gamma_curve(payload)),
    }


def summarize_histories(checkpoints: Sequence[LoadedCheckpoint], tail: int) -> tuple[dict[str, dict[str, float]], int]:
    """History summary per checkpoint name and the common epoch window they were computed on."""
    lengths = [total_curves(c.payload)[1].size for c in checkpoints]
    common = min(lengths, default=0)
    return {c.name: summarize_history(c.payload, common, tail) for c in checkpoints}, common


# --------------------------------------------------------------------------- configs


def _flatten(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(f"{name}.", value))
        else:
            flat[name] = list(value) if isinstance(value, tuple) else value
    return flat


def config_fields(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Training settings of a checkpoint as flat ``key -> value``.

    The resolved config's keys as they are, ``model.forward.*`` / ``model.inverse.*``
    for the architecture, ``torch_version`` and ``format_version``, and the derived
    ``global_batch`` (samples per optimizer step over all ranks) and ``effective_lr``
    (left out when the stored config does not rebuild a ``Config`` of this code version).
    """
    config = dict(payload.get("config") or {})
    fields = _flatten("", config)
    fields.update(_flatten("model.", payload.get("model_config") or {}))
    for key in ("torch_version", "format_version"):
        if key in payload:
            fields[key] = payload[key]
    try:
        resolved = Config.from_dict(config)
        fields["global_batch"] = resolved.global_batch
        fields["effective_lr"] = resolved.effective_lr
    except (TypeError, ValueError, KeyError):
        pass
    return fields


def config_differences(checkpoints: Sequence[LoadedCheckpoint]) -> dict[str, dict[str, Any]]:
    """Keys whose values are not the same in every checkpoint: ``key -> {name: value}`` (None = absent)."""
    per_checkpoint = {c.name: config_fields(c.payload) for c in checkpoints}
    keys = list(dict.fromkeys(key for fields in per_checkpoint.values() for key in fields))
    differences = {}
    for key in keys:
        values = {name: fields.get(key) for name, fields in per_checkpoint.items()}
        if len({json.dumps(value, sort_keys=True) for value in values.values()}) > 1:
            differences[key] = values
    return differences


# --------------------------------------------------------------------------- weights


@dataclass
class WeightDelta:
    """Sums over one or more same-shape tensor pairs (reference ``a``, other ``b``), float64."""

    difference_sq: float = 0.0
    reference_sq: float = 0.0
    other_sq: float = 0.0
    dot: float = 0.0
    tensors: int = 0
    elements: int = 0

    @classmethod
    def of(cls, reference: Tensor, other: Tensor) -> WeightDelta:
        a = reference.detach().double().flatten()
        b = other.detach().double().flatten()
        return cls(
            difference_sq=float((b - a).square().sum()), reference_sq=float(a.square().sum()),
            other_sq=float(b.square().sum()), dot=float(a.dot(b)), tensors=1, elements=a.numel(),
        )

    def add(self, other: WeightDelta) -> None:
        self.difference_sq += other.difference_sq
        self.reference_sq += other.reference_sq
        self.other_sq += other.other_sq
        self.dot += other.dot
        self.tensors += other.tensors
        self.elements += other.elements

    @property
    def l2_difference(self) -> float:
        """||b - a||_2."""
        return math.sqrt(self.difference_sq)

    @property
    def relative_change(self) -> float:
        """||b - a|| / ||a|| (0 for two zero tensors, NaN for a change from zero)."""
        if self.reference_sq > 0:
            return self.l2_difference / math.sqrt(self.reference_sq)
        return 0.0 if self.difference_sq == 0 else math.nan

    @property
    def cosine(self) -> float:
        """a.b / (||a|| ||b||) (1 for two zero tensors, NaN when only one is zero)."""
        if self.reference_sq > 0 and self.other_sq > 0:
            return max(-1.0, min(1.0, self.dot / math.sqrt(self.reference_sq * self.other_sq)))
        return 1.0 if self.reference_sq == self.other_sq == 0 else math.nan

    def to_dict(self) -> dict[str, float]:
        return {
            "l2_difference": self.l2_difference, "relative_change": self.relative_change,
            "cosine": self.cosine, "tensors": self.tensors, "elements": self.elements,
        }


@dataclass(frozen=True)
class TensorDiff:
    """One state-dict entry: ``status`` is "compared", "missing in reference",
    "missing in other" or "shape mismatch"; ``delta`` only when compared."""

    model: str
    name: str
    status: str
    reference_shape: tuple[int, ...] | None
    other_shape: tuple[int, ...] | None
    delta: WeightDelta | None

    @property
    def module(self) -> str:
        """``model.first_name_component``, e.g. ``forward.encoder``."""
        return f"{self.model}.{self.name.split('.')[0]}"

    def to_dict(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "model": self.model, "name": self.name, "status": self.status,
            "reference_shape": list(self.reference_shape) if self.reference_shape is not None else None,
            "other_shape": list(self.other_shape) if self.other_shape is not None else None,
        }
        if self.delta is not None:
            row.update(self.delta.to_dict())
        return row


@dataclass
class WeightDiff:
    """Weights of ``other`` against ``reference``: per tensor, per module and per model."""

    reference: str
    other: str
    tensors: list[TensorDiff] = field(default_factory=list)

    def totals(self, key: str) -> dict[str, WeightDelta]:
        """Compared tensors summed per ``"model"`` or per ``"module"``, in state-dict order."""
        groups: dict[str, WeightDelta] = {}
        for tensor in self.tensors:
            group = groups.setdefault(tensor.model if key == "model" else tensor.module, WeightDelta())
            if tensor.delta is not None:
                group.add(tensor.delta)
        return groups

    @property
    def unmatched(self) -> list[TensorDiff]:
        """Tensors missing on one side or with different shapes."""
        return [t for t in self.tensors if t.status != "compared"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference, "other": self.other,
            "models": {name: delta.to_dict() for name, delta in self.totals("model").items()},
            "modules": {name: delta.to_dict() for name, delta in self.totals("module").items()},
            "unmatched": [t.to_dict() for t in self.unmatched],
            "tensors": [t.to_dict() for t in self.tensors],
        }


def diff_state_dicts(model: str, reference: Mapping[str, Tensor], other: Mapping[str, Tensor]) -> list[TensorDiff]:
    """Per-tensor differences of two state dicts of one model, reference order then extra keys."""
    diffs = []
    for name in list(reference) + [name for name in other if name not in reference]:
        a, b = reference.get(name), other.get(name)
        shape_a = tuple(a.shape) if a is not None else None
        shape_b = tuple(b.shape) if b is not None else None
        if a is None:
            status = "missing in reference"
        elif b is None:
            status = "missing in other"
        elif shape_a != shape_b:
            status = "shape mismatch"
        else:
            status = "compared"
        delta = WeightDelta.of(a, b) if status == "compared" else None
        diffs.append(TensorDiff(model, name, status, shape_a, shape_b, delta))
    return diffs


def diff_weights(reference: LoadedCheckpoint, other: LoadedCheckpoint) -> WeightDiff:
    """Forward and inverse model weights of ``other`` against ``reference``."""
    diff = WeightDiff(reference.name, other.name)
    for model, key in MODEL_STATES.items():
        diff.tensors.extend(diff_state_dicts(model, reference.payload[key], other.payload[key]))
    return diff


# --------------------------------------------------------------------------- evaluation


@dataclass
class Evaluation:
    """Per-sample metrics of every checkpoint on one shared sample set."""

    refs: list[evaluate.SampleRef]
    synthesis: evaluate.SynthesisSettings
    criteria: GammaCriteria
    gamma_samples: int
    records: dict[str, list[evaluate.SampleMetrics]]
    seconds: dict[str, float]

    def summary(self, name: str) -> dict[str, dict[str, float]]:
        """``group -> metric -> value`` for ``"all"`` and each pattern: the means (and
        ``count``) of ``evaluate.pattern_means`` plus the 5th percentile of the gamma pass rate."""
        records = self.records[name]
        means = evaluate.pattern_means(records)
        groups = {ALL_SAMPLES: records, **evaluate.by_pattern(records)}
        return {group: {**means[group], GAMMA_P5: _gamma_p5(members)} for group, members in groups.items()}


def _gamma_p5(records: Sequence[evaluate.SampleMetrics]) -> float:
    rates = np.array([record.gamma_pass_percent for record in records], dtype=float)
    rates = rates[np.isfinite(rates)]
    return float(np.percentile(rates, 5)) if rates.size else math.nan


def synthesis_settings(checkpoints: Sequence[LoadedCheckpoint]) -> tuple[evaluate.SynthesisSettings, list[str]]:
    """Frame synthesis shared by all checkpoints: EPID_* variables, else the first checkpoint's
    training config. Also returns notes for checkpoints trained with other settings."""
    config = load_config()
    settings = evaluate.resolve_synthesis(checkpoints[0].payload.get("config") or {}, config)
    notes = []
    for checkpoint in checkpoints[1:]:
        own = evaluate.resolve_synthesis(checkpoint.payload.get("config") or {}, config)
        for key in evaluate.SYNTHESIS_VARIABLES:
            if getattr(own, key) != getattr(settings, key):
                notes.append(
                    f"{checkpoint.name} was trained with {key}={getattr(own, key)!r}; all checkpoints are "
                    f"evaluated with {getattr(settings, key)!r} (set {evaluate.SYNTHESIS_VARIABLES[key]} to choose)"
                )
    return settings, notes


def evaluate_checkpoints(
    checkpoints: Sequence[LoadedCheckpoint],
    refs: list[evaluate.SampleRef],
    synthesis: evaluate.SynthesisSettings,
    device: torch.device,
    gamma_samples: int,
    criteria: GammaCriteria = DEFAULT_CRITERIA,
) -> Evaluation:
    """Synthesise the frames of ``refs`` once, then predict and score every checkpoint on them.

    Gamma is computed on ``gamma_samples`` samples spread over the set (the others get NaN).
    """
    started = time.perf_counter()
    kernel = evaluate.load_synthesis_kernel(synthesis)
    samples = evaluate.synthesise_samples(refs, synthesis, kernel, device)
    seconds = {"synthesis": time.perf_counter() - started}
    with_gamma = evaluate.spread(range(len(samples)), gamma_samples)
    records = {}
    for checkpoint in checkpoints:
        started = time.perf_counter()
        predictions = evaluate.predict(checkpoint.models, samples, device)
        gamma = torch.full(samples.epid_curr.shape[:1] + samples.epid_curr.shape[-2:], math.nan)
        if with_gamma:
            gamma[with_gamma] = gamma_maps(
                samples.epid_curr[with_gamma], predictions.epid[with_gamma], criteria, device
            )
        records[checkpoint.name] = evaluate.sample_metrics(samples, predictions, gamma)
        seconds[checkpoint.name] = time.perf_counter() - started
    return Evaluation(list(samples.refs), synthesis, criteria, len(with_gamma), records, seconds)


# --------------------------------------------------------------------------- rankings


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


def format_number(value: Any) -> str:
    """Compact text for a table cell: '-' for None/NaN, 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _format_value(value)
    if not math.isfinite(value):
        return "-" if math.isnan(value) else str(value)
    if float(value).is_integer() and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def _format_value(value: Any) -> str:
    """Config values: short lists in full, long integer lists as count and bounds."""
    if isinstance(value, list) and len(value) > 6:
        return f"[{len(value)} items: {value[0]} .. {value[-1]}]"
    return str(value)


NUMERIC_CELL = re.compile(r"^(-|[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?|[-+]?inf)( \(\d+\))?$")


def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """Plain-text table: numbers (optionally followed by a rank in brackets) right-aligned,
    text left-aligned."""
    rows = [list(headers), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(headers))]
    numeric = [all(NUMERIC_CELL.match(row[i]) for row in rows[1:]) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if right else cell.ljust(w) for cell, w, right in zip(row, widths, numeric)]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])


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
    return (f"Evaluation on {len(evaluation.refs)} validation samples of {datasets} datasets "
            f"(gamma {evaluation.criteria.describe()} on {evaluation.gamma_samples} of them)")


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


# --------------------------------------------------------------------------- figures


def _styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Colour, hollow marker and line width per checkpoint. Later checkpoints are drawn thinner
    and with smaller markers, so identical curves stay visible on top of each other."""
    markers = "osD^vP"
    return {
        name: {"color": f"C{i % 10}", "marker": markers[i % len(markers)],
               "markersize": max(4.0, 9.0 - 1.5 * i), "linewidth": max(1.0, 3.0 - 0.6 * i)}
        for i, name in enumerate(names)
    }


def _curve(axis: Any, values: np.ndarray, style: Mapping[str, Any], linestyle: str, **kwargs: Any) -> None:
    """One per-epoch curve; markers only while epochs are few enough to tell apart."""
    marker = style["marker"] if values.size <= 40 else None
    axis.plot(np.arange(1, values.size + 1), values, linestyle=linestyle, color=style["color"], marker=marker,
              markersize=style["markersize"], linewidth=style["linewidth"], markerfacecolor="none", **kwargs)


def plot_histories(checkpoints: Sequence[LoadedCheckpoint], path: Path, log_y: bool) -> None:
    """``histories.png``: total loss per epoch (validation solid, train dashed, best validation
    epoch starred) and, when recorded, the validation gamma pass rate."""
    with_gamma = any(gamma_curve(c.payload).size for c in checkpoints)
    figure = Figure(figsize=(14 if with_gamma else 8, 5.5), layout="constrained")
    axes = figure.subplots(1, 2 if with_gamma else 1, squeeze=False)[0]
    styles = _styles([c.name for c in checkpoints])
    loss_axis = axes[0]
    for checkpoint in checkpoints:
        train, val = total_curves(checkpoint.payload)
        style = styles[checkpoint.name]
        _curve(loss_axis, train, style, "--", alpha=0.7)
        _curve(loss_axis, val, style, "-", label=checkpoint.name)
        if np.isfinite(val).any():
            best = int(np.nanargmin(np.where(np.isfinite(val), val, np.nan)))
            loss_axis.plot(best + 1, val[best], "*", color=style["color"], markersize=17, markeredgecolor="black",
                           zorder=5)
            loss_axis.annotate(f"best {val[best]:.3g} @ {best + 1}", (best + 1, val[best]), xytext=(0, 11),
                               textcoords="offset points", ha="center", fontsize=8, color=style["color"])
    loss_axis.set_title("Total loss per epoch (lower is better)", fontsize=11)
    loss_axis.set_ylabel("total loss" + (" (log scale)" if log_y else ""))
    if log_y:
        loss_axis.set_yscale("log")
    handles, _ = loss_axis.get_legend_handles_labels()
    handles += [Line2D([], [], color="black", linestyle="-", label="validation"),
                Line2D([], [], color="black", linestyle="--", label="train"),
                Line2D([], [], color="white", marker="*", markersize=13, markeredgecolor="black",
                       markerfacecolor="0.6", label="best validation")]
    loss_axis.legend(handles=handles, fontsize=8)
    if with_gamma:
        gamma_axis = axes[1]
        for checkpoint in checkpoints:
            _curve(gamma_axis, gamma_curve(checkpoint.payload), styles[checkpoint.name], "-", label=checkpoint.name)
        gamma_axis.set_title("Validation gamma pass rate (higher is better)", fontsize=11)
        gamma_axis.set_ylabel("gamma pass (%)")
        gamma_axis.legend(fontsize=8)
    for axis in axes:
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.margins(x=0.08, y=0.1)
        axis.grid(True, which="both", alpha=0.3)
    figure.savefig(path, dpi=110)


def plot_metrics(summaries: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path, title: str) -> None:
    """``metrics.png``: one panel per evaluation metric, bars per checkpoint grouped by sample
    group (all samples, then each pattern); the best bar of each group has a black edge."""
    names = list(summaries)
    groups = list(dict.fromkeys(group for table in summaries.values() for group in table))
    counts = [int(summaries[names[0]][group].get("count", 0)) for group in groups]
    styles = _styles(names)
    columns = 4
    rows = math.ceil(len(EVALUATION_COLUMNS) / columns)
    figure = Figure(figsize=(4.4 * columns, 3.6 * rows + 0.8), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    width = 0.8 / len(names)
    x = np.arange(len(groups))
    for axis, column in zip(axes, EVALUATION_COLUMNS):
        heights = np.array([[summaries[name][group].get(column.key, math.nan) for group in groups] for name in names])
        best = best_in_columns(heights, column.better)
        for i, name in enumerate(names):
            axis.bar(x - 0.4 + width * (i + 0.5), np.nan_to_num(heights[i], nan=0.0), width,
                     color=styles[name]["color"], linewidth=1.8,
                     edgecolor=["black" if flag else "none" for flag in best[i]])
        axis.set_xticks(x, [f"{group}\n({count})" for group, count in zip(groups, counts)], fontsize=8)
        axis.set_title(f"{column.label} ({column.better} is better)", fontsize=9)
        axis.grid(True, axis="y", alpha=0.3)
    for axis in axes[len(EVALUATION_COLUMNS):]:
        axis.set_visible(False)
    handles = [Patch(color=styles[name]["color"], label=name) for name in names]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.8, label="best in its group"))
    figure.suptitle(f"{title}\nx axis: sample group (number of samples)", fontsize=10)
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 7), fontsize=9)
    figure.savefig(path, dpi=110)


def best_in_columns(values: np.ndarray, better: str) -> np.ndarray:
    """Boolean mask of the best value in each column of (checkpoints, groups) ``values``."""
    oriented = np.where(np.isfinite(values), values if better == LOWER else -values, np.inf)
    return np.isfinite(oriented) & (oriented == oriented.min(axis=0, keepdims=True))


# --------------------------------------------------------------------------- the whole comparison


@dataclass(frozen=True)
class CompareOptions:
    """What ``compare_checkpoints.py`` was asked (see its ``--help``)."""

    checkpoints: Sequence[str]
    dataset_range: str = ""
    dataset_ids: str = ""
    samples_per_dataset: int = 8
    seed: int = 0
    device: str = "auto"
    output_dir: str = "comparison_output"
    gamma_samples: int = 64
    tail: int = 10
    log_y: bool = False
    evaluate: bool = True


def evaluation_dataset_ids(options: CompareOptions) -> list[int]:
    """Dataset IDs to evaluate on (``DEFAULT_DATASET_RANGE`` when none is given); InputError if bad."""
    range_spec = options.dataset_range
    if not range_spec and not options.dataset_ids:
        range_spec = DEFAULT_DATASET_RANGE
    try:
        return select_dataset_ids(range_spec, options.dataset_ids)
    except ValueError as error:
        flags = (("--dataset-range", options.dataset_range), ("--dataset-ids", options.dataset_ids))
        given = " and ".join(f"{flag} {value!r}" for flag, value in flags if value)
        raise InputError(f"{given}: {error}") from None


@dataclass
class Comparison:
    """Everything compared, ready to print and write."""

    paths: list[str]
    checkpoints: list[LoadedCheckpoint]
    failures: list[Failure]
    tail: int
    history: dict[str, dict[str, float]] = field(init=False)
    common_epochs: int = field(init=False)
    differences: dict[str, dict[str, Any]] = field(init=False)
    weight_diffs: list[WeightDiff] = field(init=False)
    evaluation: Evaluation | None = None
    summaries: dict[str, dict[str, dict[str, float]]] | None = None

    def __post_init__(self) -> None:
        self.history, self.common_epochs = summarize_histories(self.checkpoints, self.tail)
        self.differences = config_differences(self.checkpoints)
        self.weight_diffs = [diff_weights(self.checkpoints[0], other) for other in self.checkpoints[1:]]

    def add_evaluation(self, evaluation: Evaluation) -> None:
        self.evaluation = evaluation
        self.summaries = {c.name: evaluation.summary(c.name) for c in self.checkpoints}

    @property
    def rankings(self) -> dict[str, dict[str, Any]]:
        return rankings(self.history, self.summaries)

    def entries(self) -> list[dict[str, Any]]:
        """Name, path, status (ok / failed), reason, epoch and run ID of every checkpoint, in argument order."""
        by_path = {c.path: {"name": c.name, "path": c.path, "status": "ok", "reason": None,
                            "epoch": c.payload.get("epoch"), "run_id": c.payload.get("run_id")}
                   for c in self.checkpoints}
        by_path.update({f.path: {"name": f.name, "path": f.path, "status": "failed", "reason": f.reason,
                                 "epoch": None, "run_id": None} for f in self.failures})
        return [by_path[path] for path in self.paths]

    def status_table(self) -> str:
        rows = [[e["name"], e["status"], format_number(e["epoch"]), e["path"]] for e in self.entries()]
        lines = [format_table(["checkpoint", "status", "epoch", "path"], rows)]
        lines += [f"not compared: {f.name}: {f.reason}" for f in self.failures]
        return "\n".join(lines)

    def tables(self) -> str:
        """History, config, weight, evaluation and ranking tables (empty when nothing loaded)."""
        if not self.checkpoints:
            return ""
        ranked = self.rankings
        sections = [history_table(self.history, ranked, self.common_epochs, self.tail),
                    config_table(self.differences, [c.name for c in self.checkpoints])]
        sections += [weight_tables(diff) for diff in self.weight_diffs]
        if self.evaluation is not None:
            sections.append(evaluation_tables(self.evaluation, self.summaries, ranked))
        sections.append(rankings_table(ranked))
        return "\n\n".join(sections)

    def report(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The content of comparison.json."""
        return {
            "settings": {**settings, "common_epochs": self.common_epochs,
                         "reference": self.checkpoints[0].name if self.checkpoints else None},
            "checkpoints": self.entries(),
            "history": self.history,
            "evaluation": self._evaluation_report() if self.evaluation is not None else None,
            "rankings": self.rankings,
            "config_differences": self.differences,
            "weight_diff": [diff.to_dict() for diff in self.weight_diffs],
        }

    def _evaluation_report(self) -> dict[str, Any]:
        evaluation, synthesis = self.evaluation, self.evaluation.synthesis
        return {
            "samples": [{"dataset_id": r.dataset_id, "sample": r.sample, "pattern": r.pattern}
                        for r in evaluation.refs],
            "synthesis": {"control_points": synthesis.control_points, "kernel": synthesis.kernel,
                          "noise_std": synthesis.noise_std, "noise_seed": synthesis.noise_seed,
                          "sources": dict(synthesis.sources)},
            "gamma": evaluation.criteria.describe(),
            "gamma_samples": evaluation.gamma_samples,
            "seconds": evaluation.seconds,
            "metrics": self.summaries,
        }

    def write(self, output_dir: Path, settings: Mapping[str, Any], log_y: bool) -> list[Path]:
        """comparison.csv, comparison.json and the figures there are data for; returns their paths."""
        report = self.report(settings)
        written = [output_dir / "comparison.csv", output_dir / "comparison.json"]
        write_csv(written[0], report)
        write_json(written[1], report)
        if self.checkpoints:
            written.append(output_dir / "histories.png")
            plot_histories(self.checkpoints, written[-1], log_y)
        if self.summaries:
            written.append(output_dir / "metrics.png")
            plot_metrics(self.summaries, written[-1], evaluation_title(self.evaluation))
        return written


def compare(options: CompareOptions) -> int:
    """Run the comparison, print the tables, write the files; 1 if any checkpoint failed, else 0."""
    paths = expand_checkpoint_patterns(options.checkpoints)
    device = resolve_device(options.device, given=f"--device {options.device!r}") if options.evaluate else torch.device("cpu")
    dataset_ids = evaluation_dataset_ids(options) if options.evaluate else []
    output_dir = prepare_output_dir(options.output_dir)

    checkpoints, failures = load_checkpoints(paths, device, keep_models=options.evaluate)
    comparison = Comparison(paths, checkpoints, failures, options.tail)
    print(comparison.status_table())
    if options.evaluate and checkpoints:
        synthesis, notes = synthesis_settings(checkpoints)
        for note in notes:
            print(f"note: {note}")
        refs = evaluate.select_samples(dataset_ids, options.samples_per_dataset, options.seed,
                                       synthesis.control_points)
        comparison.add_evaluation(evaluate_checkpoints(checkpoints, refs, synthesis, device, options.gamma_samples))
        timing = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in comparison.evaluation.seconds.items())
        print(f"Evaluation on {device}: {timing}")
    print("\n" + comparison.tables())

    settings = {
        "output_dir": str(output_dir), "device": str(device), "evaluate": options.evaluate,
        "dataset_ids": dataset_ids, "samples_per_dataset": options.samples_per_dataset, "seed": options.seed,
        "gamma_samples": options.gamma_samples, "tail": options.tail,
    }
    written = comparison.write(output_dir, settings, options.log_y)
    print("\nWrote " + ", ".join(str(path) for path in written))
    if failures:
        print(f"{len(failures)} of {len(paths)} checkpoint(s) could not be compared: "
              + ", ".join(f.name for f in failures), file=sys.stderr)
        return 1
    return 0
