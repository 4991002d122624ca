"""Figures that put runs or checkpoints side by side: training histories, metric tables as bars and
quality curves against training time."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib import ticker
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from epid.evaluation.compare_report import Column, best_in_columns
from epid.evaluation.plots import COMPARISON_MARKERS, epoch_line, new_figure

QUALITY_FIGSIZE = (13.0, 4.8)
QUALITY_PANELS = (  # (curve key, final key, axis label, target, target label)
    ("gamma_3_2mm_mean", "gamma_3_2mm_mean", "gamma pass rate 3 %/2 mm, mean (%)", 95.0, "TG-218 tolerance 95 %"),
    ("curr_leaf_mae_mm", "curr_leaf_mae_mm", "curr leaf MAE in the jaw band (mm)", 1.0, "TG-142 1 mm"),
)


def _comparison_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Colour, hollow marker and line width per checkpoint. Later checkpoints are drawn thinner
    and with smaller markers, so identical curves stay visible on top of each other."""
    return {
        name: {"color": f"C{i % 10}", "marker": COMPARISON_MARKERS[i % len(COMPARISON_MARKERS)],
               "markersize": max(4.0, 9.0 - 1.5 * i), "linewidth": max(1.0, 3.0 - 0.6 * i), "markerfacecolor": "none"}
        for i, name in enumerate(names)
    }


def histories_figure(curves: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]], log_y: bool) -> Figure:
    """Total loss per epoch of each checkpoint (``curves``: name -> (train, validation, gamma pass
    rate %) per epoch): validation solid, train dashed, best validation epoch starred; and, when
    recorded, the validation gamma pass rate."""
    with_gamma = any(gamma.size for _, _, gamma in curves.values())
    figure = new_figure((14 if with_gamma else 8, 5.5))
    axes = figure.subplots(1, 2 if with_gamma else 1, squeeze=False)[0]
    styles = _comparison_styles(list(curves))
    loss_axis = axes[0]
    for name, (train, val, _) in curves.items():
        style = styles[name]
        epoch_line(loss_axis, train, linestyle="--", alpha=0.7, **style)
        epoch_line(loss_axis, val, linestyle="-", label=name, **style)
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
        for name, (_, _, gamma) in curves.items():
            epoch_line(gamma_axis, gamma, linestyle="-", label=name, **styles[name])
        gamma_axis.set_title("Validation gamma pass rate (higher is better)", fontsize=11)
        gamma_axis.set_ylabel("gamma pass (%)")
        gamma_axis.legend(fontsize=8)
    for axis in axes:
        axis.set_xlabel("epoch")
        axis.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        axis.margins(x=0.08, y=0.1)
        axis.grid(True, which="both", alpha=0.3)
    return figure


def metrics_figure(summaries: Mapping[str, Mapping[str, Mapping[str, float]]], columns: Sequence[Column],
                   title: str) -> Figure:
    """One panel per evaluation metric (``columns``), bars per checkpoint grouped by sample group
    (all samples, then each pattern); the best bar of each group has a black edge. ``summaries``:
    checkpoint name -> group -> metric -> value (and the group's sample ``count``)."""
    names = list(summaries)
    groups = list(dict.fromkeys(group for table in summaries.values() for group in table))
    counts = [int(summaries[names[0]][group].get("count", 0)) for group in groups]
    styles = _comparison_styles(names)
    per_row = 4
    rows = math.ceil(len(columns) / per_row)
    figure = new_figure((4.4 * per_row, 3.6 * rows + 0.8))
    axes = figure.subplots(rows, per_row, squeeze=False).flatten()
    width = 0.8 / len(names)
    x = np.arange(len(groups))
    for axis, column in zip(axes, columns, strict=False):
        heights = np.array([[summaries[name][group].get(column.key, math.nan) for group in groups] for name in names])
        best = best_in_columns(heights, column.better)
        for i, name in enumerate(names):
            axis.bar(x - 0.4 + width * (i + 0.5), np.nan_to_num(heights[i], nan=0.0), width,
                     color=styles[name]["color"], linewidth=1.8,
                     edgecolor=["black" if flag else "none" for flag in best[i]])
        axis.set_xticks(x, [f"{group}\n({count})" for group, count in zip(groups, counts, strict=True)], fontsize=8)
        axis.set_title(f"{column.label} ({column.better} is better)", fontsize=9)
        axis.grid(True, axis="y", alpha=0.3)
    for axis in axes[len(columns):]:
        axis.set_visible(False)
    handles = [Patch(color=styles[name]["color"], label=name) for name in names]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.8, label="best in its group"))
    figure.suptitle(f"{title}\nx axis: sample group (number of samples)", fontsize=10)
    figure.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 7), fontsize=9)
    return figure


def quality_figure(runs: Mapping[str, Mapping[str, Any]], title: str) -> Figure:
    """Quality against training time of one or more benchmark runs (``quality.json`` contents by
    name): each run's curve (network estimates at epoch ends) and its final evaluation (star)."""
    figure = new_figure(QUALITY_FIGSIZE)
    figure.suptitle(title)
    for column, (curve_key, final_key, label, target, target_label) in enumerate(QUALITY_PANELS):
        axes = figure.add_subplot(1, len(QUALITY_PANELS), column + 1)
        for index, (name, run) in enumerate(runs.items()):
            colour = f"C{index}"
            curve = run.get("curve") or {}
            axes.plot(curve.get("minutes", []), curve.get(curve_key, []), "o-", color=colour, markersize=3,
                      label=f"{name}: during training")
            final = run["groups"]["all"].get(final_key, math.nan)
            axes.plot([run.get("trained_minutes", math.nan)], [final], "*", color=colour, markersize=14,
                      label=f"{name}: final, {final:.3g}")
        axes.axhline(target, color="0.4", linestyle=":", linewidth=1.2, label=target_label)
        axes.set_xlabel("training time (min, synthesis included)")
        axes.set_ylabel(label)
        if curve_key.endswith("_mm"):
            axes.set_yscale("log")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    return figure
