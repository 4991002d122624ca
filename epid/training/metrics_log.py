"""Per-epoch metrics beside the checkpoint: ``metrics.csv`` (one row per epoch) and ``losses.png``.

matplotlib (through ``epid.evaluation.plots``) is imported on first plot, so ranks that never plot do not load it.

The training history (kept in the checkpoint) is the source of truth; ``MetricsLog.restart``
rewrites the CSV from it when a run resumes, so a crash between writing a checkpoint and
appending its row never leaves the CSV out of step with the checkpoint.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epid.models.losses import LOSS_TERMS

CSV_NAME = "metrics.csv"
PLOT_NAME = "losses.png"
SCALAR_SERIES = ("gamma_pass", "lr", "samples_per_s", "train_samples", "epoch_s", "elapsed_s", "steps",
                 "nonfinite_steps", "world_size")
COLUMNS = (
    "epoch",
    *(f"train_{term}" for term in LOSS_TERMS),
    *(f"val_{term}" for term in LOSS_TERMS),
    *SCALAR_SERIES,
)


def empty_history() -> dict[str, Any]:
    """A history with no epoch: per-term train/val lists plus one list per scalar series."""
    return {
        "train": {term: [] for term in LOSS_TERMS},
        "val": {term: [] for term in LOSS_TERMS},
        **{name: [] for name in SCALAR_SERIES},
    }


def restored_history(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's history with every series of this version: a series the checkpoint's writer
    did not record yet (such as ``train_samples``) is NaN for the epochs it holds."""
    history = empty_history()
    history.update(saved)
    epochs = len(history["train"]["total"])
    for name in SCALAR_SERIES:
        if not history[name] and epochs:
            history[name] = [math.nan] * epochs
    return history


def append_epoch(history: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Add one epoch to ``history``; ``record`` has "train"/"val" term dicts and the scalar series."""
    for split in ("train", "val"):
        for term in LOSS_TERMS:
            history[split].setdefault(term, []).append(float(record[split][term]))
    for name in SCALAR_SERIES:
        history.setdefault(name, []).append(record[name])


def history_rows(history: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One CSV row per epoch of ``history`` (epochs numbered from 1); missing values are NaN."""
    epochs = len(history["train"]["total"])
    rows = []
    for index in range(epochs):
        row: dict[str, Any] = {"epoch": index + 1}
        for split in ("train", "val"):
            for term in LOSS_TERMS:
                row[f"{split}_{term}"] = _at(history[split].get(term, []), index)
        for name in SCALAR_SERIES:
            row[name] = _at(history.get(name, []), index)
        rows.append(row)
    return rows


def _at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else math.nan


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


class MetricsLog:
    """``metrics.csv`` and ``losses.png`` in ``directory`` (the checkpoint's folder)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.csv_path = self.directory / CSV_NAME
        self.plot_path = self.directory / PLOT_NAME

    def restart(self, history: Mapping[str, Any]) -> None:
        """Rewrite the CSV with a header and one row per epoch already in ``history``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        temporary = self.csv_path.with_name(f".{CSV_NAME}.{os.getpid()}.tmp")
        with open(temporary, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(COLUMNS)
            for row in history_rows(history):
                writer.writerow(_format(row[column]) for column in COLUMNS)
        os.replace(temporary, self.csv_path)

    def append(self, history: Mapping[str, Any]) -> None:
        """Append the last epoch of ``history`` as a row (the file stays tail -f friendly)."""
        if not self.csv_path.is_file():
            self.restart(history)
            return
        row = history_rows(history)[-1]
        with open(self.csv_path, "a", newline="") as handle:
            csv.writer(handle).writerow(_format(row[column]) for column in COLUMNS)
            handle.flush()
            os.fsync(handle.fileno())

    def plot(self, history: Mapping[str, Any], best_epoch: int = 0) -> None:
        """Redraw ``losses.png`` (``epid.evaluation.plots.losses_figure``): train and validation per loss term
        (log scale), gamma pass rate, learning rate and samples/s. ``best_epoch`` (1-based,
        0 = none) is marked on every panel. The file is replaced atomically."""
        from epid.evaluation import plots

        self.directory.mkdir(parents=True, exist_ok=True)
        title = f"Training history: {self.directory}"
        plots.save_figure(plots.losses_figure(history, best_epoch or None, title), self.plot_path)
