"""Model quality as a physicist judges it (design section 10), overall and per pattern.

Forward model: the gamma pass rate of the predicted curr frame against the measured one
(global, 10 % lower cutoff of the measured maximum) at 3 %/3 mm, 3 %/2 mm (AAPM TG-218:
95 % tolerance, 90 % action) and 2 %/2 mm; mean and 5th percentile over samples.

Inverse model, for the curr and the prev control point: the errors (predicted minus true, mm)
of the leaves inside that control point's jaw band (leaf pairs whose rows its jaws leave open,
``epid.synthesis.sequences.leaf_band``), both banks pooled over all samples: MAE, bias, RMS and the share
within 0.5 mm and 1 mm (AAPM TG-142 MLC tolerance: 1 mm); the jaw MAE (jaw_1 and jaw_2); and
the MU relative error of the curr control point, mean over samples in percent. On an MLC with
leaves narrower than 5 mm (HD120's 2.5 mm), the leaf figures of those leaves alone as well
(``narrow``: ``MlcGeometry.narrow_strips``).

``assess`` computes them from a ``SampleSet`` and its ``Predictions`` (``epid.evaluation.inference``);
``QualityReport`` holds them per group ("all" and each pattern) and writes JSON and tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from epid.core.tables import format_table
from epid.evaluation.gamma import GammaCriteria, gamma_pass_rates
from epid.evaluation.inference import Predictions, SampleSet, hidden_by_x_jaws, jaw_band
from epid.synthesis.geometry import strip_grid
from epid.synthesis.sequences import PATTERNS

ALL = "all"
QUALITY_CRITERIA = {
    "3%/3mm": GammaCriteria(dose_percent=3.0, distance_mm=3.0),
    "3%/2mm": GammaCriteria(dose_percent=3.0, distance_mm=2.0),
    "2%/2mm": GammaCriteria(dose_percent=2.0, distance_mm=2.0),
}
CONTROL_POINTS = ("curr", "prev")
GAMMA_PERCENTILE = 5.0


@dataclass(frozen=True)
class Metric:
    """One reported figure: its key, label, unit and whether higher is better."""

    key: str
    label: str
    unit: str
    higher_is_better: bool


def gamma_key(name: str, statistic: str) -> str:
    """The metric key of a criterion name of ``QUALITY_CRITERIA`` and ``mean`` or ``p5``:
    ``gamma_3_2mm_mean`` for 3 %/2 mm."""
    return f"gamma_{name.replace('%/', '_').replace('%', '')}_{statistic}"


def _metrics() -> tuple[Metric, ...]:
    items = []
    for name in QUALITY_CRITERIA:
        items.append(Metric(gamma_key(name, "mean"), f"gamma pass {name} mean", "%", True))
        items.append(Metric(gamma_key(name, "p5"), f"gamma pass {name} 5th percentile", "%", True))
    for point in CONTROL_POINTS:
        items += [
            Metric(f"{point}_leaf_mae_mm", f"{point} leaf MAE in band", "mm", False),
            Metric(f"{point}_leaf_bias_mm", f"{point} leaf bias in band", "mm", False),
            Metric(f"{point}_leaf_rms_mm", f"{point} leaf RMS in band", "mm", False),
            Metric(f"{point}_leaf_within_0.5mm", f"{point} leaves within 0.5 mm", "%", True),
            Metric(f"{point}_leaf_within_1mm", f"{point} leaves within 1 mm", "%", True),
            Metric(f"{point}_jaw_mae_mm", f"{point} jaw MAE", "mm", False),
            Metric(f"{point}_narrow_leaf_mae_mm", f"{point} leaf MAE in band, 2.5 mm leaves", "mm", False),
            Metric(f"{point}_narrow_leaf_within_1mm", f"{point} leaves within 1 mm, 2.5 mm leaves", "%", True),
        ]
    items.append(Metric("mu_error_percent", "MU relative error", "%", False))
    return tuple(items)


METRICS = _metrics()
NARROW_KEYS = frozenset(metric.key for metric in METRICS if "_narrow_" in metric.key)
"""The figures only an MLC with leaves narrower than 5 mm has (``MlcGeometry.narrow_strips``)."""
METRIC_BY_KEY = {metric.key: metric for metric in METRICS}


def pass_rates(samples: SampleSet, predictions: Predictions, device: torch.device | str = "cpu",
               criteria: Sequence[str] = tuple(QUALITY_CRITERIA)) -> dict[str, Tensor]:
    """Per criterion (names of ``QUALITY_CRITERIA``): the pass rate (%) of each sample's predicted frame (S,)."""
    return {
        name: gamma_pass_rates(samples.epid_curr, predictions.epid, QUALITY_CRITERIA[name], device)
        for name in criteria
    }


def leaf_errors(predicted_a: Tensor, predicted_b: Tensor, target_a: Tensor, target_b: Tensor, jaw_1: Tensor,
                jaw_2: Tensor, point: str, hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Signed errors (mm) of one control point's leaves, both banks, and their in-band mask.

    Leaves (S, 2 x strips) in the sample layout [prev, curr]; jaw_1, jaw_2 (S,) mm of that control
    point (``point``, "curr" or "prev"); ``hidden`` (S, 2, 2 x strips): the target positions an X jaw
    hides (``inference.hidden_by_x_jaws``), out of the mask (the jaw's edge, not a leaf's). Returns
    errors and mask, each (S, 2, strips) [bank A, bank B].
    """
    strips = predicted_a.shape[-1] // 2
    half = slice(strips, None) if point == "curr" else slice(None, strips)
    errors = torch.stack([predicted_a[:, half] - target_a[:, half], predicted_b[:, half] - target_b[:, half]], 1)
    band = jaw_band(jaw_1, jaw_2, strip_grid(strips)).unsqueeze(1).expand_as(errors)
    return errors, band if hidden is None else band & ~hidden[..., half]


def _jaw_columns(point: str) -> tuple[int, int]:
    """Columns of jaw_1 and jaw_2 of a control point in the scalars layout."""
    return (2, 4) if point == "curr" else (1, 3)


def leaf_statistics(errors: np.ndarray) -> dict[str, float]:
    """MAE, bias, RMS (mm) and shares within 0.5 mm and 1 mm (%) of a flat array of errors."""
    if errors.size == 0:
        return {"mae_mm": math.nan, "bias_mm": math.nan, "rms_mm": math.nan, "within_0.5mm": math.nan,
                "within_1mm": math.nan}
    magnitude = np.abs(errors)
    return {
        "mae_mm": float(magnitude.mean()), "bias_mm": float(errors.mean()),
        "rms_mm": float(np.sqrt((errors**2).mean())),
        "within_0.5mm": float(100 * (magnitude <= 0.5).mean()), "within_1mm": float(100 * (magnitude <= 1.0).mean()),
    }


def _group_metrics(samples: SampleSet, predictions: Predictions, rates: Mapping[str, Tensor],
                   rows: np.ndarray) -> dict[str, float]:
    values: dict[str, float] = {"samples": float(len(rows))}
    for name, rate in rates.items():
        chosen = rate.numpy()[rows]
        chosen = chosen[np.isfinite(chosen)]
        values[gamma_key(name, "mean")] = float(chosen.mean()) if chosen.size else math.nan
        values[gamma_key(name, "p5")] = float(np.percentile(chosen, GAMMA_PERCENTILE)) if chosen.size else math.nan
    index = torch.from_numpy(rows)
    target, predicted = samples.scalars[index], predictions.scalars[index]
    hidden = hidden_by_x_jaws(samples.leaf_a[index], samples.leaf_b[index], target)
    for point in CONTROL_POINTS:
        first, second = _jaw_columns(point)
        errors, band = leaf_errors(predictions.leaf_a[index], predictions.leaf_b[index], samples.leaf_a[index],
                                   samples.leaf_b[index], target[:, first], target[:, second], point, hidden)
        statistics = leaf_statistics(errors[band].numpy())
        for name, value in statistics.items():
            values[f"{point}_leaf_{name}"] = value
        narrow = torch.from_numpy(samples.mlc.narrow_strips)
        if bool(narrow.any()):
            statistics = leaf_statistics(errors[band & narrow].numpy())
            values[f"{point}_narrow_leaf_mae_mm"] = statistics["mae_mm"]
            values[f"{point}_narrow_leaf_within_1mm"] = statistics["within_1mm"]
        jaw_error = (predicted[:, [first, second]] - target[:, [first, second]]).abs()
        values[f"{point}_jaw_mae_mm"] = float(jaw_error.mean()) if len(rows) else math.nan
    mu_error = (predicted[:, 0] - target[:, 0]).abs() / target[:, 0].clamp_min(1e-6)
    values["mu_error_percent"] = float(100 * mu_error.mean()) if len(rows) else math.nan
    return values


@dataclass
class QualityReport:
    """Quality figures per group ("all", then each pattern present): ``groups[group][key]``, keys
    of ``METRICS`` plus ``samples``."""

    groups: dict[str, dict[str, float]]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": self.groups, "metrics": {m.key: {"label": m.label, "unit": m.unit} for m in METRICS}}

    def table(self, keys: Sequence[str] | None = None) -> str:
        """A text table: one row per metric, one column per group."""
        keys = [key for key in (keys or [m.key for m in METRICS]) if key in self.groups[ALL]]
        header = ["metric", *self.groups]
        rows = [[f"{METRIC_BY_KEY[key].label} ({METRIC_BY_KEY[key].unit})",
                 *(f"{self.groups[group].get(key, math.nan):.3g}" for group in self.groups)] for key in keys]
        rows.append(["samples", *(f"{self.groups[group]['samples']:.0f}" for group in self.groups)])
        return format_table(header, rows)

    def write_json(self, path: str | Path, **context: Any) -> None:
        """The report and ``context`` (budget, device, model, ...) as one JSON object."""
        Path(path).write_text(json.dumps({**context, **self.to_dict()}, indent=2, allow_nan=True) + "\n")


def assess(samples: SampleSet, predictions: Predictions, rates: Mapping[str, Tensor] | None = None,
           device: torch.device | str = "cpu", criteria: Sequence[str] = tuple(QUALITY_CRITERIA)) -> QualityReport:
    """Every quality figure of ``predictions`` against ``samples``, over all samples and per pattern.

    ``rates``: the pass rates of ``pass_rates`` when already computed; otherwise they are computed
    for ``criteria`` (names of ``QUALITY_CRITERIA``; figures of the others are left out).
    """
    rates = pass_rates(samples, predictions, device, criteria) if rates is None else rates
    patterns = np.array([ref.pattern for ref in samples.refs])
    groups = {ALL: _group_metrics(samples, predictions, rates, np.arange(len(samples)))}
    for pattern in PATTERNS:
        rows = np.flatnonzero(patterns == pattern)
        if rows.size:
            groups[pattern] = _group_metrics(samples, predictions, rates, rows)
    return QualityReport(groups)
