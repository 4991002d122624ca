"""Training histories stored in checkpoints: loss curves and their summaries.

A history holds per-epoch lists: ``train`` and ``val`` (one list per loss term) and scalar
series such as ``gamma_pass`` (``epid.training.metrics_log``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

TOTAL = "total"


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


def summarize_histories(
    payloads: Mapping[str, Mapping[str, Any]], tail: int
) -> tuple[dict[str, dict[str, float]], int]:
    """History summary per checkpoint name and the common epoch window they were computed on."""
    common = min((total_curves(payload)[1].size for payload in payloads.values()), default=0)
    return {name: summarize_history(payload, common, tail) for name, payload in payloads.items()}, common
