"""Figures for judging predictions: one page per sample, training losses, metric summaries.

Figures are ``matplotlib.figure.Figure`` objects on their own Agg canvas, never pyplot, so
nothing depends on a display, on the global backend or on global figure state. Image axes are physical: x and
y in mm at the EPID plane, y up (row 0 of a frame is the most positive y).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps, ticker
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from epid.evaluation.gamma import GammaCriteria
from epid.evaluation.inference import METRIC_LABELS, Predictions, SampleMetrics, SampleSet, by_pattern
from epid.synthesis.geometry import GRID_SIZE, PIXEL_MM, STRIPS, strip_grid

DPI = 100
SAMPLE_FIGSIZE = (17.0, 14.0)
LOSSES_WIDTH_IN = 16.0
LOSSES_ROW_HEIGHT_IN = 3.3
EXTRA_SERIES = {  # history series beside the loss terms: (legend label, panel title, log scale)
    "gamma_pass": ("val", "gamma pass (%), validation", False),
    "lr": ("lr", "learning rate", True),
    "samples_per_s": ("train", "training samples/s", False),
}
SUMMARY_FIGSIZE = (15.0, 9.0)
MARKED_EPOCHS = 30
COMPARISON_MARKERS = "osD^vP"
HALF_FIELD_MM = GRID_SIZE * PIXEL_MM / 2
PIXEL_CENTRES_MM = (np.arange(GRID_SIZE) + 0.5) * PIXEL_MM - HALF_FIELD_MM
TARGET_STYLE = {"color": "black", "linestyle": "-", "linewidth": 1.4}
PREDICTED_STYLE = {"color": "tab:red", "linestyle": "--", "linewidth": 1.4}
JAW_TARGET_STYLE = {"color": "tab:green", "linestyle": "-", "linewidth": 1.6}
JAW_PREDICTED_STYLE = {"color": "tab:green", "linestyle": "--", "linewidth": 1.6}
APERTURE_COLOUR = "0.85"
BELOW_CUTOFF_COLOUR = "white"
PREV_WEIGHT_STYLE = {"color": "0.55", "linestyle": "-", "linewidth": 2.5}
CURR_WEIGHT_STYLE = {"color": "tab:blue", "linestyle": "--", "linewidth": 1.5}
PATTERN_COLOURS = {"regular": "tab:blue", "semiregular": "tab:orange", "irregular": "tab:purple"}
SUMMARY_METRICS = (
    "gamma_pass_percent", "leaf_mae_band_mm", "leaf_mae_mm", "jaw_mae_mm", "mu_abs_error", "forward_mse",
)
MLC_MARGIN_MM = 8.0
IMAGE_EXTENT = (-HALF_FIELD_MM, HALF_FIELD_MM, -HALF_FIELD_MM, HALF_FIELD_MM)


def new_figure(figsize: tuple[float, float]) -> Figure:
    """An empty figure (inches) with constrained layout on an Agg canvas."""
    figure = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def save_figure(figure: Figure, path: str | Path) -> None:
    """Write ``figure`` as a PNG at the module DPI (fixed pixel size, no tight cropping), through a
    temporary file in the same folder: a viewer or a crash never sees a half-written image."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(temporary, format="png", dpi=DPI)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


Draw = Callable[..., None]
"""A way to draw a figure, ``draw(build, path, *args, **kwargs)``: the module's ``draw`` (now), or
the same queued on an ``epid.core.background.BackgroundCalls``."""


def draw(build: Callable[..., Figure], path: str | Path, *args: Any, **kwargs: Any) -> None:
    """Draw ``build(*args, **kwargs)`` and write it to ``path`` (``save_figure``) now."""
    save_figure(build(*args, **kwargs), path)


# --------------------------------------------------------------------------- one sample


def _row_of(y_mm: float) -> int:
    """Frame row whose centre is nearest ``y_mm`` (row 0 is the most positive y)."""
    return int(np.clip(math.floor(HALF_FIELD_MM - y_mm / PIXEL_MM), 0, GRID_SIZE - 1))


def _column_of(x_mm: float) -> int:
    """Frame column whose centre is nearest ``x_mm``."""
    return int(np.clip(math.floor(HALF_FIELD_MM + x_mm / PIXEL_MM), 0, GRID_SIZE - 1))


def field_centre(leaf_a: np.ndarray, leaf_b: np.ndarray, jaw_1: float, jaw_2: float) -> tuple[float, float]:
    """(x, y) in mm through which the profiles run: y halfway between the jaws, x halfway
    between the two banks of the strip at that y (one position per strip and bank, mm)."""
    y = (jaw_1 + jaw_2) / 2
    pair = int(np.clip(np.searchsorted(strip_grid(len(leaf_a)).edges_mm, y, side="right") - 1, 0, len(leaf_a) - 1))
    return float((leaf_a[pair] + leaf_b[pair]) / 2), float(y)


def _image_axes(axes: Axes, title: str) -> None:
    axes.set_title(title, fontsize=11)
    axes.set_xlabel("x (mm)")
    axes.set_ylabel("y (mm)")


def _mlc_panel(axes: Axes, target: Mapping[str, np.ndarray | float], predicted: Mapping[str, np.ndarray | float],
               title: str) -> None:
    """Leaf positions as steps along y, one per strip (both banks), and jaws as horizontal lines."""
    strip_edges = strip_grid(len(target["leaf_a"])).edges_mm
    band = (strip_edges[1:] > target["jaw_1"]) & (strip_edges[:-1] < target["jaw_2"])
    edges = np.clip(strip_edges, target["jaw_1"], target["jaw_2"])
    axes.fill_betweenx(
        np.repeat(edges, 2)[1:-1], np.repeat(target["leaf_a"], 2), np.repeat(target["leaf_b"], 2),
        where=np.repeat(band, 2), color=APERTURE_COLOUR, linewidth=0,
    )
    for values, style in ((target, TARGET_STYLE), (predicted, PREDICTED_STYLE)):
        for bank in ("leaf_a", "leaf_b"):
            axes.stairs(values[bank], strip_edges, orientation="horizontal", baseline=None, **style)
    for values, style in ((target, JAW_TARGET_STYLE), (predicted, JAW_PREDICTED_STYLE)):
        for jaw in ("jaw_1", "jaw_2"):
            axes.axhline(values[jaw], **style)
    positions = np.concatenate(
        [np.ravel(values[bank]) for values in (target, predicted) for bank in ("leaf_a", "leaf_b")]
    )
    jaws = np.array([values[jaw] for values in (target, predicted) for jaw in ("jaw_1", "jaw_2")])
    axes.set_xlim(*_limits(positions, -HALF_FIELD_MM - MLC_MARGIN_MM, HALF_FIELD_MM + MLC_MARGIN_MM))
    axes.set_ylim(*_limits(jaws, strip_edges[0], strip_edges[-1]))
    axes.set_aspect("equal")
    axes.set_title(title, fontsize=11)
    axes.set_xlabel("x (mm)")
    axes.set_ylabel("y (mm)")


def _limits(values: np.ndarray, low: float, high: float) -> tuple[float, float]:
    """Axis limits covering [low, high] and every finite value (so off-scale predictions show)."""
    finite = values[np.isfinite(values)]
    if finite.size:
        low, high = min(low, float(finite.min()) - MLC_MARGIN_MM), max(high, float(finite.max()) + MLC_MARGIN_MM)
    return low, high


def _cp_values(leaf_a: np.ndarray, leaf_b: np.ndarray, scalars: np.ndarray, half: int) -> dict[str, np.ndarray | float]:
    """Leaves and jaws of the prev (``half`` 0) or curr (1) control point of one sample."""
    strips = len(leaf_a) // 2
    leaves = slice(half * strips, (half + 1) * strips)
    return {
        "leaf_a": leaf_a[leaves], "leaf_b": leaf_b[leaves],
        "jaw_1": float(scalars[1 + half]), "jaw_2": float(scalars[3 + half]),
    }


def sample_figure(samples: SampleSet, predictions: Predictions, gamma: np.ndarray,
                  record: SampleMetrics, index: int, criteria: GammaCriteria) -> Figure:
    """One page for sample ``index``: measured and predicted curr frame on one colour scale,
    gamma map, difference, prev and curr MLC/jaw panels (target solid, predicted dashed),
    leaf weights, MU, and row and column profiles through the field centre.

    ``gamma`` is this sample's (256, 256) gamma map (NaN below the cutoff or where not computed).
    """
    ref = samples.refs[index]
    measured = samples.epid_curr[index, 0].numpy()
    predicted = predictions.epid[index, 0].numpy()
    target_scalars = samples.scalars[index].numpy()
    predicted_scalars = predictions.scalars[index].numpy()
    targets = [_cp_values(samples.leaf_a[index].numpy(), samples.leaf_b[index].numpy(), target_scalars, half)
               for half in (0, 1)]
    predicted_cps = [_cp_values(predictions.leaf_a[index].numpy(), predictions.leaf_b[index].numpy(),
                                predicted_scalars, half) for half in (0, 1)]

    figure = new_figure(SAMPLE_FIGSIZE)
    figure.suptitle(
        f"Dataset {ref.dataset_id} ({ref.pattern}), sample {ref.sample}: "
        f"prev CP {ref.sample + 1}, curr CP {ref.sample + 2}\n"
        f"gamma {criteria.describe()}: {record.gamma_pass_percent:.1f} % pass  |  "
        f"leaf MAE {record.leaf_mae_band_mm:.2f} mm in jaw band, {record.leaf_mae_mm:.2f} mm overall  |  "
        f"jaw MAE {record.jaw_mae_mm:.2f} mm  |  MU error {record.mu_abs_error:.2f}",
        fontsize=14,
    )
    figure.legend(handles=_legend_handles(), loc="outside lower center", ncol=5, fontsize=11, frameon=False)
    rows = figure.add_gridspec(3, 1, height_ratios=(0.85, 1.0, 0.55))
    top = rows[0].subgridspec(1, 4)
    middle = rows[1].subgridspec(1, 4, width_ratios=(1.0, 1.0, 0.42, 0.5))
    bottom = rows[2].subgridspec(1, 2)

    curr = targets[1]
    x_centre, y_centre = field_centre(curr["leaf_a"], curr["leaf_b"], curr["jaw_1"], curr["jaw_2"])
    row, column = _row_of(y_centre), _column_of(x_centre)
    _image_row(figure, [figure.add_subplot(top[0, k]) for k in range(4)], measured, predicted, gamma, criteria,
               ("Measured (synthetic) EPID, curr", "Predicted EPID (forward model)",
                f"Gamma {criteria.dose_percent:g} %/{criteria.distance_mm:g} mm: "
                f"{record.gamma_pass_percent:.1f} % pass"),
               (row, column))

    mlc_axes = [figure.add_subplot(middle[0, k]) for k in range(2)]
    for half, axes in enumerate(mlc_axes):
        name = ("Prev", "Curr")[half]
        _mlc_panel(axes, targets[half], predicted_cps[half], f"{name} CP {ref.sample + 1 + half}: MLC and jaws")
    _weights_panel(figure.add_subplot(middle[0, 2], sharey=mlc_axes[1]),
                   samples.leaf_weight_a[index].numpy())
    _mu_panel(figure.add_subplot(middle[0, 3]), float(target_scalars[0]), float(predicted_scalars[0]))

    row_axes = figure.add_subplot(bottom[0, 0])
    _profile_panel(row_axes, measured[row, :], predicted[row, :], "x (mm)",
                   f"Row profile at y = {PIXEL_CENTRES_MM[::-1][row]:.1f} mm")
    column_axes = figure.add_subplot(bottom[0, 1], sharey=row_axes)
    _profile_panel(column_axes, measured[::-1, column], predicted[::-1, column], "y (mm)",
                   f"Column profile at x = {PIXEL_CENTRES_MM[column]:.1f} mm")
    return figure


def _image_row(figure: Figure, axes: Sequence[Axes], measured: np.ndarray, predicted: np.ndarray,
               gamma: np.ndarray, criteria: GammaCriteria, titles: tuple[str, str, str],
               profiles: tuple[int, int] | None = None) -> None:
    """Measured and predicted frames (shared scale, one colour bar), gamma map, difference;
    ``titles`` of the two frames and the gamma map; ``profiles`` (row, column) dotted on the frames."""
    top = max(float(measured.max()), float(predicted.max()), 1e-12)
    for panel, image, title in ((axes[0], measured, titles[0]), (axes[1], predicted, titles[1])):
        shown = panel.imshow(image, extent=IMAGE_EXTENT, origin="upper", cmap="viridis", vmin=0, vmax=top)
        if profiles is not None:
            panel.axhline(PIXEL_CENTRES_MM[::-1][profiles[0]], color="white", linestyle=":", linewidth=1)
            panel.axvline(PIXEL_CENTRES_MM[profiles[1]], color="white", linestyle=":", linewidth=1)
        _image_axes(panel, title)
    figure.colorbar(shown, ax=list(axes[:2]), shrink=0.85,
                    label="signal (a.u.); dotted: profiles" if profiles is not None else "signal (a.u.)")
    shown = axes[2].imshow(gamma, extent=IMAGE_EXTENT, origin="upper", cmap=_gamma_colours(),
                           vmin=0, vmax=criteria.max_gamma)
    _image_axes(axes[2], titles[2])
    figure.colorbar(shown, ax=axes[2], shrink=0.85, label=f"gamma (white: below {criteria.cutoff_percent:g} % cutoff)")

    difference = predicted - measured
    limit = max(float(np.abs(difference).max()), 1e-12)
    shown = axes[3].imshow(difference, extent=IMAGE_EXTENT, origin="upper", cmap="RdBu_r", vmin=-limit, vmax=limit)
    _image_axes(axes[3], "Difference, predicted - measured")
    figure.colorbar(shown, ax=axes[3], shrink=0.85, label="signal (a.u.)")


def _gamma_colours() -> ListedColormap:
    """Blues for passing gamma (0 to 1, darker is better), reds for failing (1 to the cap),
    with a sharp step at 1 so the pass/fail boundary reads at a glance."""
    passing = colormaps["Blues"](np.linspace(0.9, 0.25, 128))
    failing = colormaps["Reds"](np.linspace(0.35, 0.95, 128))
    return ListedColormap(np.vstack([passing, failing]), name="gamma").with_extremes(bad=BELOW_CUTOFF_COLOUR)


def _legend_handles() -> list[Line2D | Patch]:
    return [
        Line2D([], [], label="target / measured", **TARGET_STYLE),
        Line2D([], [], label="predicted", **PREDICTED_STYLE),
        Line2D([], [], label="jaws, target", **JAW_TARGET_STYLE),
        Line2D([], [], label="jaws, predicted", **JAW_PREDICTED_STYLE),
        Patch(color=APERTURE_COLOUR, label="target aperture"),
    ]


def _weights_panel(axes: Axes, leaf_weight: np.ndarray) -> None:
    """Loss weight of each strip (2 x strips values: prev, curr) as steps along y."""
    strips = len(leaf_weight) // 2
    for half, style in ((0, PREV_WEIGHT_STYLE), (1, CURR_WEIGHT_STYLE)):
        weights = leaf_weight[half * strips:(half + 1) * strips]
        axes.stairs(weights, strip_grid(strips).edges_mm, orientation="horizontal", baseline=None,
                    label=("prev", "curr")[half], **style)
    axes.set_xlim(0, 1.1)
    axes.set_xticks([0, 0.5, 1])
    axes.set_title("Leaf weights", fontsize=11)
    axes.set_xlabel("loss weight")
    axes.tick_params(labelleft=False)
    axes.legend(loc="center left", fontsize=9)


def _mu_panel(axes: Axes, target: float, predicted: float) -> None:
    bars = axes.bar(["target", "predicted"], [target, predicted], color=["0.3", "tab:red"], width=0.6)
    axes.bar_label(bars, labels=[f"{target:.1f}", f"{predicted:.1f}"], padding=3, fontsize=11)
    axes.set_ylim(0, max(target, predicted, 1.0) * 1.2)
    axes.set_title("MU, curr CP", fontsize=11)
    axes.set_ylabel("MU")


def _profile_panel(axes: Axes, measured: np.ndarray, predicted: np.ndarray, label: str, title: str) -> None:
    axes.plot(PIXEL_CENTRES_MM, measured, **TARGET_STYLE)
    axes.plot(PIXEL_CENTRES_MM, predicted, **PREDICTED_STYLE)
    axes.set_xlim(-HALF_FIELD_MM, HALF_FIELD_MM)
    axes.set_xlabel(label)
    axes.set_ylabel("signal (a.u.)")
    axes.set_title(title, fontsize=11)
    axes.grid(alpha=0.3)


# --------------------------------------------------------------------------- losses


def losses_figure(history: Mapping[str, object], best_epoch: int | None, title: str) -> Figure:
    """Train and validation curves of every loss term (log scale) from a checkpoint history,
    plus the gamma pass rate, learning rate and training samples/s when recorded; the best
    epoch is marked."""
    train = dict(history.get("train", {}) or {})
    val = dict(history.get("val", {}) or {})
    terms = list(dict.fromkeys([*train, *val]))
    extras = [name for name in EXTRA_SERIES if _has_finite(history.get(name))]
    panels = len(terms) + len(extras)
    columns = 4
    rows = max(1, math.ceil(panels / columns))
    figure = new_figure((LOSSES_WIDTH_IN, LOSSES_ROW_HEIGHT_IN * rows + 0.8))
    figure.suptitle(f"{title}\nlosses on a log scale; dotted line: best validation epoch", fontsize=13)
    axes_grid = figure.subplots(rows, columns, squeeze=False).ravel()
    for axes, term in zip(axes_grid, terms, strict=False):
        _curve(axes, {"train": train.get(term), "val": val.get(term)}, log=True)
        axes.set_title(term, fontsize=11)
        _mark_best(axes, best_epoch)
    for axes, name in zip(axes_grid[len(terms):], extras, strict=False):
        label, title, log = EXTRA_SERIES[name]
        _curve(axes, {label: history[name]}, log=log)
        axes.set_title(title, fontsize=11)
        _mark_best(axes, best_epoch)
    for axes in axes_grid[panels:]:
        axes.set_visible(False)
    if panels == 0:
        axes_grid[0].set_visible(True)
        axes_grid[0].text(0.5, 0.5, "no history in checkpoint", ha="center", va="center")
    return figure


def _has_finite(values: Sequence[float] | None) -> bool:
    return bool(values) and bool(np.isfinite(np.asarray(values, dtype=float)).any())


def _curve(axes: Axes, series: Mapping[str, Sequence[float] | None], log: bool) -> None:
    """Per-epoch series (epochs from 1) on one axes; log y when ``log`` and any value is positive."""
    shown = []
    for name, values in series.items():
        if not values:
            continue
        y = np.asarray(values, dtype=float)
        epoch_line(axes, y, markersize=4, label=name)
        shown.append(y)
    epochs = max((len(y) for y in shown), default=1)
    if epochs < 5:
        axes.set_xlim(0.5, epochs + 0.5)
    axes.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, min_n_ticks=1))
    values = np.concatenate(shown) if shown else np.array([])
    positive = values[np.isfinite(values) & (values > 0)]
    if log and positive.size:
        _log_axis(axes, positive)
    axes.set_xlabel("epoch")
    axes.grid(alpha=0.3, which="both")
    if shown:
        axes.legend(fontsize=8)


def epoch_line(axes: Axes, values: np.ndarray, marker: str = "o", **style: Any) -> None:
    """One per-epoch series, epochs numbered from 1; a marker per epoch while they are few enough
    (``MARKED_EPOCHS``) to tell apart."""
    axes.plot(np.arange(1, len(values) + 1), values, marker=marker if len(values) <= MARKED_EPOCHS else None, **style)


def _log_axis(axes: Axes, positive: np.ndarray) -> None:
    """Log y; within one decade the ticks are plain numbers (a log locator would label only
    crowded minor ticks there)."""
    axes.set_yscale("log", nonpositive="mask")
    low, high = float(positive.min()), float(positive.max())
    if low == high:
        axes.set_ylim(low / 2, high * 2)
    if high < 10 * low:
        axes.yaxis.set_major_locator(ticker.MaxNLocator(5))
        axes.yaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:.3g}"))
        axes.yaxis.set_minor_locator(ticker.NullLocator())


def _mark_best(axes: Axes, best_epoch: int | None) -> None:
    if best_epoch:
        axes.axvline(best_epoch, color="tab:green", linestyle=":", linewidth=1.2)
        axes.annotate(f"best {best_epoch}", xy=(best_epoch, 1), xycoords=("data", "axes fraction"),
                      xytext=(3, -12), textcoords="offset points", fontsize=8, color="tab:green")


# --------------------------------------------------------------------------- summary


def summary_figure(records: Sequence[SampleMetrics], title: str) -> Figure:
    """Distribution of each metric by pattern: box plot with every sample drawn on top."""
    groups = by_pattern(records)
    figure = new_figure(SUMMARY_FIGSIZE)
    figure.suptitle(title, fontsize=13)
    axes_grid = figure.subplots(2, 3).ravel()
    jitter = np.random.default_rng(0)
    for axes, metric in zip(axes_grid, SUMMARY_METRICS, strict=True):
        values = [np.array([getattr(r, metric) for r in group], dtype=float) for group in groups.values()]
        finite = [v[np.isfinite(v)] for v in values]
        positions = np.arange(1, len(groups) + 1)
        axes.boxplot([v if v.size else [np.nan] for v in finite], positions=positions, widths=0.5,
                     showfliers=False, showmeans=True, medianprops={"color": "black"},
                     meanprops={"marker": "D", "markerfacecolor": "white", "markeredgecolor": "black"})
        for position, pattern, v in zip(positions, groups, finite, strict=True):
            axes.scatter(position + jitter.uniform(-0.12, 0.12, v.size), v, s=18, alpha=0.75,
                         color=PATTERN_COLOURS.get(pattern, "tab:gray"), zorder=3)
        axes.set_xticks(positions, [f"{pattern}\n(n={len(group)})" for pattern, group in groups.items()])
        axes.set_title(METRIC_LABELS[metric], fontsize=11)
        axes.grid(alpha=0.3, axis="y")
    return figure


# --------------------------------------------------------------------------- whole arcs

ARC_FIGSIZE = (17.0, 13.0)
ARC_ERROR_LIMIT_MM = 2.0
ARC_TRACKED_LEAVES = 3
ARC_LEAF_COLOURS = ("tab:blue", "tab:orange", "tab:purple")


def arc_figure(control_points: np.ndarray, true: Mapping[str, np.ndarray], reconstructed: Mapping[str, np.ndarray],
               band: np.ndarray, title: str, labels: tuple[str, str] = ("true", "reconstructed"),
               mlc_leaves: Sequence[str] | None = None) -> Figure:
    """A reconstructed arc at a glance.

    ``control_points`` (N,) numbers the control points; ``true`` and ``reconstructed`` map
    leaf_a, leaf_b (N, strips), jaw_1, jaw_2 (N,) in mm and mu (N,) in MU; ``band`` (N, strips) marks
    the leaves inside the jaws (the scored ones). Top: signed leaf error (reconstructed - true) per
    leaf and control point for each bank, leaves outside the jaws grey, colours saturating at
    +-2 mm; middle: trajectories of the three in-band leaves of each bank with the largest error
    (named by strip and, with ``mlc_leaves``, ``MlcGeometry.leaf_labels``, by the MLC's own leaf);
    bottom: jaws and MU along the arc. ``labels`` names the two sources in the legends.
    """
    figure = new_figure(ARC_FIGSIZE)
    figure.suptitle(title, fontsize=13)
    grid = figure.subplots(3, 2, height_ratios=(1.3, 1.0, 0.8))
    extent = (control_points[0] - 0.5, control_points[-1] + 0.5, *STRIPS.edges_mm[[0, -1]])  # every grid's span
    colours = colormaps["RdBu_r"].with_extremes(bad="0.8")
    for column, bank in enumerate(("leaf_a", "leaf_b")):
        error = np.where(band, reconstructed[bank] - true[bank], np.nan)
        image = grid[0, column].imshow(np.ma.masked_invalid(error.T), origin="lower", aspect="auto", extent=extent,
                                       cmap=colours, vmin=-ARC_ERROR_LIMIT_MM, vmax=ARC_ERROR_LIMIT_MM,
                                       interpolation="nearest")
        scored = np.abs(error[band])
        within = 100 * float((scored <= 1).mean()) if scored.size else math.nan
        grid[0, column].set_title(f"bank {bank[-1].upper()}: {labels[1]} - {labels[0]} (mm); in-band MAE "
                                  f"{scored.mean() if scored.size else math.nan:.2f} mm, {within:.1f} % within 1 mm",
                                  fontsize=11)
        grid[0, column].set_xlabel("control point")
        grid[0, column].set_ylabel("leaf pair centre y (mm)")
        figure.colorbar(image, ax=grid[0, column], shrink=0.9, label="mm (grey: outside the jaws)")
        _trajectory_panel(grid[1, column], control_points, true[bank], reconstructed[bank], error, bank, labels,
                          mlc_leaves)
    for name, colour in (("jaw_1", "tab:green"), ("jaw_2", "tab:olive")):
        grid[2, 0].plot(control_points, true[name], color=colour, linestyle="-", label=f"{name} {labels[0]}")
        grid[2, 0].plot(control_points, reconstructed[name], color=colour, linestyle="--", label=f"{name} {labels[1]}")
    grid[2, 0].set_title("jaws (mm)", fontsize=11)
    grid[2, 1].plot(control_points, true["mu"], **TARGET_STYLE, label=labels[0])
    grid[2, 1].plot(control_points, reconstructed["mu"], **PREDICTED_STYLE, label=labels[1])
    grid[2, 1].set_title("MU of the frame ending on each control point", fontsize=11)
    for axes in grid[2]:
        axes.set_xlabel("control point")
        axes.legend(fontsize=8, ncol=2)
        axes.grid(alpha=0.3)
    return figure


def _trajectory_panel(axes: Axes, control_points: np.ndarray, true: np.ndarray, reconstructed: np.ndarray,
                      error: np.ndarray, bank: str, labels: tuple[str, str],
                      mlc_leaves: Sequence[str] | None = None) -> None:
    """Positions of the in-band leaves of one bank with the largest absolute error, true solid,
    reconstructed dashed; CPs where a leaf is outside the jaws are left out."""
    worst = np.argsort(-np.nan_to_num(np.abs(error), nan=-1.0).max(axis=0))[:ARC_TRACKED_LEAVES]
    for leaf, colour in zip(worst, ARC_LEAF_COLOURS, strict=False):
        if not np.isfinite(error[:, leaf]).any():
            continue
        inside = np.isfinite(error[:, leaf])
        name = f"leaf {leaf}" if mlc_leaves is None else f"leaf {leaf} (MLC {mlc_leaves[leaf]})"
        axes.plot(control_points, np.where(inside, true[:, leaf], np.nan), color=colour, linestyle="-",
                  label=f"{name} {labels[0]}")
        axes.plot(control_points, np.where(inside, reconstructed[:, leaf], np.nan), color=colour, linestyle="--",
                  label=f"{name} {labels[1]}")
    axes.set_title(f"bank {bank[-1].upper()}: leaves with the largest error (mm along x)", fontsize=11)
    axes.set_xlabel("control point")
    axes.legend(fontsize=8, ncol=2)
    axes.grid(alpha=0.3)


# --------------------------------------------------------------------------- plans and delivery QA

PLAN_FRAMES_FIGSIZE = (17.0, 8.6)
PLAN_FRAMES_SHOWN = 7
QA_GAMMA_FIGSIZE = (15.0, 5.5)
QA_FRAME_FIGSIZE = (19.0, 5.0)


def plan_frames_figure(frames: np.ndarray, names: Sequence[str], integrated: np.ndarray, integrated_name: str,
                       title: str) -> Figure:
    """A beam's predicted frames at a glance: the integrated image (the sum of the frames, its panel
    titled ``integrated_name``) and up to ``PLAN_FRAMES_SHOWN`` frames (K, 256, 256), each titled by
    ``names`` (K,), on one colour scale."""
    figure = new_figure(PLAN_FRAMES_FIGSIZE)
    figure.suptitle(title, fontsize=13)
    axes = figure.subplots(2, 4).ravel()
    shown = axes[0].imshow(integrated, extent=IMAGE_EXTENT, origin="upper", cmap="viridis", vmin=0)
    _image_axes(axes[0], integrated_name)
    figure.colorbar(shown, ax=axes[0], shrink=0.85, label="signal (a.u.)")
    top = max(float(frames.max()), 1e-12)
    for panel, frame, name in zip(axes[1:], frames, names, strict=False):
        shown = panel.imshow(frame, extent=IMAGE_EXTENT, origin="upper", cmap="viridis", vmin=0, vmax=top)
        _image_axes(panel, name)
    figure.colorbar(shown, ax=list(axes[1:]), shrink=0.85, label="signal (a.u.)")
    for panel in axes[1 + len(frames):]:
        panel.set_visible(False)
    return figure


def qa_gamma_figure(control_points: np.ndarray, pass_rates: Mapping[str, np.ndarray], integrated: Mapping[str, float],
                    limits: tuple[float, float], title: str) -> Figure:
    """Gamma pass rate (%) of each frame along the arc, one line per criterion (keys like
    ``3_2mm``), with the tolerance and action levels ``limits`` and, in the legend, the
    pass rate of the arc-integrated image."""
    figure = new_figure(QA_GAMMA_FIGSIZE)
    figure.suptitle(title, fontsize=13)
    axes = figure.subplots()
    tolerance, action = limits
    for (key, rates), marker in zip(pass_rates.items(), COMPARISON_MARKERS, strict=False):
        name = key.replace("_", " %/", 1).replace("mm", " mm")
        finite = rates[np.isfinite(rates)]
        summary = f"mean {finite.mean():.1f} %, min {finite.min():.1f} %" if finite.size else "no frame evaluated"
        axes.plot(control_points, rates, marker=marker, markersize=3, linewidth=1,
                  label=f"{name}: {summary}; integrated image {integrated[key]:.1f} %")
    axes.axhline(tolerance, color="tab:orange", linestyle="--", linewidth=1, label=f"tolerance {tolerance:g} %")
    axes.axhline(action, color="tab:red", linestyle=":", linewidth=1, label=f"action {action:g} %")
    axes.set_xlabel("control point the frame ends on")
    axes.set_ylabel("gamma pass rate (%)")
    rates = np.concatenate([np.asarray(values, dtype=float) for values in pass_rates.values()])
    lowest = float(rates[np.isfinite(rates)].min()) if np.isfinite(rates).any() else 100.0
    axes.set_ylim(min(action - 5.0, lowest - 2.0), 101.0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=9, loc="lower left")
    return figure


def qa_frame_figure(measured: np.ndarray, predicted: np.ndarray, gamma: np.ndarray, criteria: GammaCriteria,
                    title: str) -> Figure:
    """One measured frame against its prediction (256, 256 each): both on one scale, the gamma
    map under ``criteria`` (white below the cutoff) and the difference."""
    figure = new_figure(QA_FRAME_FIGSIZE)
    figure.suptitle(title, fontsize=13)
    _image_row(figure, figure.subplots(1, 4), measured, predicted, gamma, criteria,
               ("Measured frame", "Predicted frame", f"Gamma {criteria.describe()}"))
    return figure


def commissioning_figure(losses: Sequence[float], summary: Mapping[str, Any]) -> Figure:
    """Commissioning at a glance: the loss of every step (log scale) and, per commissioning plan,
    the mean gamma pass rates before and after (``epid.evaluation.commission``'s summary)."""
    figure = new_figure((13, 4.5))
    figure.suptitle(f"Commissioning on {len(summary['plans'])} plan(s), {summary['steps']} steps; calibration "
                    f"{summary['calibration_scale']['before']:.4g} -> {summary['calibration_scale']['after']:.4g} "
                    "model units per panel unit", fontsize=12)
    loss_axes, gamma_axes = figure.subplots(1, 2)
    loss_axes.semilogy(np.arange(1, len(losses) + 1), losses, linewidth=1)
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("relative squared difference")
    loss_axes.grid(alpha=0.3)
    keys = list(summary["gamma_before"][0]) if summary["gamma_before"] else []
    positions = np.arange(len(summary["plans"]))
    width = 0.8 / max(1, 2 * len(keys))
    for k, key in enumerate(keys):
        for j, (moment, values) in enumerate((("before", summary["gamma_before"]), ("after", summary["gamma_after"]))):
            offset = (2 * k + j - (2 * len(keys) - 1) / 2) * width
            gamma_axes.bar(positions + offset, [item[key] for item in values], width,
                           label=f"{key.replace('_', ' %/', 1).replace('mm', ' mm')} {moment}",
                           alpha=0.5 if moment == "before" else 1.0)
    gamma_axes.set_xticks(positions, [f"plan {i + 1}" for i in positions])
    gamma_axes.set_ylabel("mean gamma pass rate over the frames (%)")
    gamma_axes.set_ylim(0, 101)
    gamma_axes.legend(fontsize=8, loc="lower right")
    return figure
