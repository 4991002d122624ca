"""Whole arcs reconstructed and scored: consecutive frames of one synthetic arc, the control
points reconstructed from them by the inverse network alone, per frame pair or jointly over the
arc (``epid.reconstruction.estimate``), and the errors a physicist checks (design section 10).

Control points are numbered as in the arc: frame k integrates the motion from CP k - 1 to CP k,
and an ``ArcSegment`` of frames first..last scores control points first..last.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from epid.data.windows import split_range
from epid.evaluation import plots
from epid.evaluation.inference import SynthesisSettings, jaw_band, reported_by_mlc
from epid.reconstruction import estimate as estimate_module
from epid.synthesis.frames import render_frames
from epid.synthesis.geometry import strip_grid
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.sequences import ControlPoints, behind_x_jaws, generate_control_points

X_JAW_EDGE_OPEN_MM = 1.0
"""A leaf pair hidden by an X jaw shows that jaw's edge where the plan opens it by more than this, mm."""
ERROR_KEYS = ("leaf_mae_mm", "leaf_rms_mm", "within_0.5mm", "within_1mm", "jaw_mae_mm", "mu_error_percent")
"""The figures of ``arc_errors``, in the order tables print them."""


@dataclass(frozen=True)
class ArcSegment:
    """Frames first..first + N - 1 of one arc and the control points they end on.

    frames: (N + 1, 256, 256) float32, the recorded frame before the first (zeros at the start
    of the arc) then the N frames. leaf_a, leaf_b: (N, 52) mm; jaw_1, jaw_2, mu: (N,) of control
    points first..first + N - 1 (mu of the frame that ends on each). behind_x_jaws: (2, N, 52)
    int8, for bank A's and B's leaves the X jaw (1: X1, 2: X2) that hides each, 0 where none does
    (``PlanBeam.behind_x_jaws``), and x_jaws: (N, 2) [X1, X2] mm the plan's X jaws at those
    control points; both None without X jaws.
    """

    dataset_id: int
    pattern: str
    first: int
    frames: Tensor
    leaf_a: np.ndarray
    leaf_b: np.ndarray
    jaw_1: np.ndarray
    jaw_2: np.ndarray
    mu: np.ndarray
    behind_x_jaws: np.ndarray | None = None
    x_jaws: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.mu)


VERIFIABLE_OPEN_SHARE = 0.5
"""Least share of a strip the Y jaws leave open for its leaves' errors to judge a delivery by. On the
error-free delivery of the irregular arc 165 (``bench_error_detection``'s panel, commissioned built-in
checkpoint), 192 of the 201 bank A positions more than 2 mm off lay in strips the upper jaw left 4 or 16 %
open, and flagged their leaves."""


@dataclass(frozen=True)
class LeafErrors:
    """Signed leaf errors of a reconstruction, reconstructed minus planned, (N, 52) mm per bank
    ("A", "B"), with ``band`` (N, 52): the pairs inside the jaw band, and ``behind_x_jaws`` (2, N, 52):
    the X jaw that hides each position (1: X1, 2: X2; 0 where none does, everywhere without X jaws).
    A hidden leaf's planned position is the jaw's edge (the plan's leaves are folded into the X
    jaws), so its error is the X jaw's, scored as the jaw's (``x_jaws``), never as the leaf's
    (``scored``). ``open_share`` (N, 52): the share of each strip the plan's Y jaws leave open.
    The band holds a strip at the upper jaw however little of it is open; what the jaw leaves of a
    strip under half open shows the jaw's edge more than the leaf's (``verifiable``)."""

    banks: dict[str, np.ndarray]
    band: np.ndarray
    behind_x_jaws: np.ndarray
    open_share: np.ndarray

    def scored(self) -> dict[str, np.ndarray]:
        """Per bank, the (N, 52) positions scored as leaves: in the band, not behind an X jaw."""
        return {bank: self.band & (hidden == 0) for bank, hidden in zip(self.banks, self.behind_x_jaws, strict=True)}

    def verifiable(self) -> dict[str, np.ndarray]:
        """Per bank, the (N, 52) scored positions whose strip the Y jaws leave at least
        ``VERIFIABLE_OPEN_SHARE`` open: the ones a delivery's errors are judged on
        (``epid.evaluation.delivery_errors``)."""
        shown = self.open_share >= VERIFIABLE_OPEN_SHARE
        return {bank: mask & shown for bank, mask in self.scored().items()}

    def scored_errors(self, strips: np.ndarray | None = None) -> np.ndarray:
        """The errors of every scored leaf position, bank A's then bank B's (1-D); of the strips
        ``strips`` (strips,) bool alone when given."""
        return np.concatenate([self.banks[bank][mask if strips is None else mask & strips]
                               for bank, mask in self.scored().items()])

    def x_jaw_edges(self, opening: np.ndarray) -> np.ndarray:
        """The errors (1-D) of the in-band positions an X jaw hides where the pair's ``opening`` (N, 52) mm
        (of the plan, folded) exceeds ``X_JAW_EDGE_OPEN_MM``: where the frames show that jaw's edge."""
        shown = self.band & (opening > X_JAW_EDGE_OPEN_MM)
        return np.concatenate([self.banks[bank][shown & (hidden > 0)]
                               for bank, hidden in zip(self.banks, self.behind_x_jaws, strict=True)])

    def x_jaws(self) -> dict[str, np.ndarray]:
        """Per X jaw ("X1", "X2"), the errors of the in-band leaf positions of both banks it hides
        (1-D; empty without X jaws)."""
        return {jaw: np.concatenate([self.banks[bank][self.band & (hidden == code)]
                                     for bank, hidden in zip(self.banks, self.behind_x_jaws, strict=True)])
                for code, jaw in ((1, "X1"), (2, "X2"))}


@dataclass(frozen=True)
class ArcEstimate:
    """Reconstructed control points of an ``ArcSegment``: leaf_a, leaf_b (N, 52), jaws (N, 2)
    [jaw_1, jaw_2] mm and mu (N,), CPU float32; ``method`` names how (``estimate_module.METHODS``);
    ``from_start``: the share of open leaf positions where the arc fit kept the network's estimate
    (``epid.reconstruction.fallback``; 0 for the other methods); ``signal_mu`` (N,): each frame's MU
    from its whole signal (``fallback.frame_misfits``), the arc fit's only; ``fitted`` (N, leaves) bool: the
    positions a fit placed, as an edge it renders as a leaf's (the arc fit's where it did not keep the
    network's estimate, every position of the pair method's; None for the network's estimate, whose
    positions an X jaw hides are that jaw's edge: ``losses.shown_leaves``)."""

    leaf_a: Tensor
    leaf_b: Tensor
    jaws: Tensor
    mu: Tensor
    method: str
    from_start: float = 0.0
    signal_mu: Tensor | None = None
    fitted: Tensor | None = None


def synthesise_segment(dataset_id: int, first: int, count: int, settings: SynthesisSettings,
                       kernel: np.ndarray, device: torch.device | str = "cpu") -> ArcSegment:
    """``count`` frames of dataset ``dataset_id`` from frame ``first`` (>= 1), synthesised with
    ``settings`` (kernel, noise, physics) as the models were trained; raises ValueError when the
    segment does not fit in the arc's ``settings.control_points``."""
    last = first + count - 1
    if first < 1 or count < 2 or last >= settings.control_points:
        raise ValueError(f"frames {first}..{last}: expected at least 2 frames inside 1..{settings.control_points - 1}")
    control_points = generate_control_points(dataset_id, settings.control_points, settings.mlc)
    indices = range(max(first - 1, 1), last + 1)
    frames = render_frames(control_points, indices, kernel, dataset_id=dataset_id, noise_std=settings.noise_std,
                           noise_seed=settings.noise_seed, device=device, physics=settings.physics).float().cpu()
    if first == 1:
        frames = torch.cat([torch.zeros_like(frames[:1]), frames])
    return _segment(control_points, first, frames)


def _segment(control_points: ControlPoints, first: int, frames: Tensor) -> ArcSegment:
    """The segment of ``frames`` from ``first``: the leaves as the frames show them (folded into the X
    jaws, which are scored as jaws where they hide a leaf)."""
    points = slice(first, first + len(frames) - 1)
    shown = control_points.folded_into_x_jaws()
    x_jaws = None if shown.x_jaws is None else np.array(shown.x_jaws[points])
    values = {name: np.array(getattr(shown, name)[points]) for name in ("leaf_a", "leaf_b", "jaw_1", "jaw_2", "mu")}
    return ArcSegment(
        dataset_id=control_points.dataset_id, pattern=control_points.pattern, first=first, frames=frames, **values,
        behind_x_jaws=None if x_jaws is None else behind_x_jaws(values["leaf_a"], values["leaf_b"], x_jaws),
        x_jaws=x_jaws,
    )


def reconstruct_segment(method: str, models: tuple[nn.Module, nn.Module], segment: ArcSegment,
                        device: torch.device | str = "cpu", batch: int = 16,
                        stages: estimate_module.Stages | None = None,
                        progress: Callable[[int], None] | None = None, mlc: MlcGeometry = LEGACY_GRID,
                        cine: bool = False) -> ArcEstimate:
    """The control points of ``segment`` by ``method`` ("network", "pair" or "arc"; a model pair
    that cannot refine gives the network's estimate, named in ``ArcEstimate.method``), under
    ``torch.inference_mode``; ``stages`` (default: the inverse model's) as
    ``estimate_module.reconstruct_arc`` (``cine``: the frames are a measured cine series). ``progress``
    is called with the number of frames each step
    finished. The leaves are estimated strip by strip and returned one per leaf of ``mlc``
    (``MlcGeometry.tied``: a 10 mm leaf at the mean of its two strips); an MLC without Y jaws has
    them open over the strips' span, as its arcs are synthesised."""
    forward_model, inverse_model = models
    used = estimate_module.method_used(forward_model, inverse_model, method)
    frames = segment.frames.to(device)
    with torch.inference_mode():
        if used == "arc":
            arc = estimate_module.reconstruct_arc(forward_model, inverse_model, frames[1:], frame_before=frames[0],
                                                  stages=stages, cine=cine, progress=progress)
            values = (arc.leaf_a[1:], arc.leaf_b[1:], arc.jaws[1:], arc.mu)
            from_start = arc.from_start
            signal_mu = None if arc.signal_mu is None else arc.signal_mu.float().cpu()
            fitted = None if arc.leaves_from_start is None else ~arc.leaves_from_start[1:].cpu()
        else:
            from_start, signal_mu = 0.0, None
            pairs = [(begin, min(begin + batch, len(segment))) for begin in range(0, len(segment), batch)]
            parts = []
            for begin, end in pairs:
                parts.append(estimate_module.pair_estimate(forward_model, inverse_model, frames[begin:end, None],
                                                           frames[begin + 1:end + 1, None], refine=used == "pair",
                                                           stages=stages))
                if progress is not None:
                    progress(end - begin)
            leaf_a, leaf_b, scalars = (torch.cat(part) for part in zip(*parts, strict=True))
            strips = leaf_a.shape[-1] // 2
            values = (leaf_a[:, strips:], leaf_b[:, strips:], scalars[:, [2, 4]], scalars[:, 0])
            fitted = torch.ones(values[0].shape, dtype=torch.bool) if used == "pair" else None
    leaf_a, leaf_b, jaws, mu = (value.float().cpu() for value in values)
    leaf_a, leaf_b, jaws = reported_by_mlc(leaf_a, leaf_b, jaws, mlc)
    if fitted is not None:  # a leaf over several strips is the fit's where all of them are
        fitted = reported_by_mlc(fitted.float(), fitted.float(), jaws, mlc)[0] == 1
    return ArcEstimate(leaf_a, leaf_b, jaws, mu, method=used, from_start=from_start, signal_mu=signal_mu,
                       fitted=fitted)


def read_hidden_edges(forward_model: nn.Module, segment: ArcSegment, estimate: ArcEstimate) -> ArcEstimate:
    """``estimate`` with the positions an X jaw of ``segment`` hides read as that jaw's edge where a fit
    placed them (``ArcEstimate.fitted``), for a model that renders X jaws (the aperture family); else
    ``estimate`` itself.

    A fit renders every strip edge as a leaf's; behind an X jaw the frames show the jaw's edge, and a
    leaf fitted to it stands its learned leaf-end offset inside it (``ApertureFluence``: bank A's edge at
    leaf_a - shift - offset_a, X1's at X1 - shift). So a hidden bank A position is read as X1 at leaf_a -
    offset_a, a hidden bank B one as X2 at leaf_b + offset_b (a pair closed behind a jaw shows no edge
    and is read alike). The network reads a hidden position as the jaw's edge already
    (``losses.shown_leaves``)."""
    hidden = segment.behind_x_jaws
    if hidden is None or segment.x_jaws is None or not getattr(forward_model, "renders_x_jaws", False):
        return estimate
    offset = forward_model.aperture.leaf_end_offset.detach().double().cpu().numpy()
    fitted = False if estimate.fitted is None else estimate.fitted.numpy()
    leaf_a, leaf_b = estimate.leaf_a.double().numpy(), estimate.leaf_b.double().numpy()
    leaf_a = np.where((hidden[0] == 1) & fitted, leaf_a - offset[0], leaf_a)
    leaf_b = np.where((hidden[1] == 2) & fitted, leaf_b + offset[1], leaf_b)
    return replace(estimate, leaf_a=torch.from_numpy(leaf_a).float(), leaf_b=torch.from_numpy(leaf_b).float())


def leaf_errors(estimate: ArcEstimate, segment: ArcSegment) -> LeafErrors:
    """The ``LeafErrors`` of ``estimate`` against the plan of ``segment``."""
    grid = strip_grid(segment.leaf_a.shape[-1])
    band = jaw_band(torch.from_numpy(segment.jaw_1), torch.from_numpy(segment.jaw_2), grid).numpy()
    hidden = np.zeros((2, *band.shape), np.int8) if segment.behind_x_jaws is None else segment.behind_x_jaws
    edges = grid.edges_mm
    open_mm = (np.minimum(segment.jaw_2[:, None], edges[1:]) - np.maximum(segment.jaw_1[:, None], edges[:-1]))
    return LeafErrors({"A": estimate.leaf_a.numpy() - segment.leaf_a, "B": estimate.leaf_b.numpy() - segment.leaf_b},
                      band, hidden, np.clip(open_mm / np.diff(edges), 0.0, 1.0))


def arc_errors(estimate: ArcEstimate, segment: ArcSegment, narrow: np.ndarray | None = None) -> dict[str, float]:
    """Leaf MAE, RMS and share within 0.5 mm and 1 mm (%) over the scored leaves of both banks
    (``LeafErrors.scored``), jaw MAE (mm), MU relative error (%, mean over frames) and ``leaves``
    (how many scored); with ``narrow`` (strips,) bool (``MlcGeometry.narrow_strips``) where any is
    set, the leaf MAE and share within 1 mm of those strips' leaves too (``narrow_leaf_mae_mm``,
    ``narrow_within_1mm``, ``narrow_leaves``); for a segment with X jaws, the MAE of the estimated edges
    where they show an X jaw's (``LeafErrors.x_jaw_edges``: ``x_jaw_mae_mm``, ``x_jaw_positions``; read as
    the jaw's by ``read_hidden_edges`` first)."""
    errors = leaf_errors(estimate, segment)
    leaf = torch.from_numpy(errors.scored_errors()).abs()
    jaws = torch.from_numpy(np.stack([segment.jaw_1, segment.jaw_2], 1))
    mu = torch.from_numpy(segment.mu)
    figures = {}
    if segment.x_jaws is not None:
        edges = np.abs(errors.x_jaw_edges(segment.leaf_b - segment.leaf_a))
        figures = {"x_jaw_mae_mm": float(edges.mean()) if edges.size else math.nan, "x_jaw_positions": int(edges.size)}
    if narrow is not None and narrow.any():
        fine = np.abs(errors.scored_errors(narrow))
        figures |= {"narrow_leaf_mae_mm": float(fine.mean()) if fine.size else math.nan,
                   "narrow_within_1mm": float(100 * (fine <= 1).mean()) if fine.size else math.nan,
                   "narrow_leaves": int(fine.size)}
    return figures | {
        "leaf_mae_mm": float(leaf.mean()), "leaf_rms_mm": float(leaf.square().mean().sqrt()),
        "within_0.5mm": float(100 * (leaf <= 0.5).float().mean()),
        "within_1mm": float(100 * (leaf <= 1).float().mean()),
        "jaw_mae_mm": float((estimate.jaws - jaws).abs().mean()),
        "mu_error_percent": float(100 * ((estimate.mu - mu).abs() / mu.clamp_min(1e-6)).mean()),
        "leaves": int(leaf.numel()), "from_start_percent": 100 * estimate.from_start,
    }


def pooled_errors(per_arc: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """``arc_errors`` of several arcs pooled: leaf figures weighted by the leaves scored (the narrow
    leaves' and the X jaws' by theirs), jaw and MU figures the mean over arcs."""
    leaves = sum(errors["leaves"] for errors in per_arc)
    pooled = _weighted(per_arc, "leaves", ("leaf_mae_mm", "within_0.5mm", "within_1mm"))
    pooled |= _weighted(per_arc, "narrow_leaves", ("narrow_leaf_mae_mm", "narrow_within_1mm"))
    pooled["leaf_rms_mm"] = math.sqrt(sum(errors["leaf_rms_mm"] ** 2 * errors["leaves"] for errors in per_arc) / leaves)
    for key in ("jaw_mae_mm", "mu_error_percent", "from_start_percent"):
        pooled[key] = float(np.mean([errors[key] for errors in per_arc]))
    pooled |= _weighted(per_arc, "x_jaw_positions", ("x_jaw_mae_mm",))
    pooled["leaves"] = leaves
    return pooled


def _weighted(per_arc: Sequence[Mapping[str, float]], count: str, keys: Sequence[str]) -> dict[str, float]:
    """The figures ``keys`` of the arcs that have ``count`` positions, weighted by them, and their total
    ``count``; empty where no arc has any."""
    total = sum(errors.get(count, 0) for errors in per_arc)
    if not total:
        return {}
    return {**{key: sum(errors[key] * errors[count] for errors in per_arc if errors.get(count)) / total
               for key in keys}, count: total}


def first_frame(split: str, n_control_points: int) -> int:
    """The first frame of a segment inside ``split``: frame 1 for "train" and "all"; for "val"
    the first curr frame of the validation samples (sample s pairs frames s + 1 and s + 2), so
    that no frame of the segment was a training sample's curr frame."""
    return split_range(n_control_points, "val").start + 2 if split == "val" else 1


def write_review(segment: ArcSegment, estimate: ArcEstimate, errors: Mapping[str, float], path: str | Path,
                 run_label: str) -> None:
    """``plots.arc_figure`` of one reconstructed segment, as a PNG at ``path``."""

    band = leaf_errors(estimate, segment).band
    true = {"leaf_a": segment.leaf_a, "leaf_b": segment.leaf_b, "jaw_1": segment.jaw_1, "jaw_2": segment.jaw_2,
            "mu": segment.mu}
    reconstructed = {"leaf_a": estimate.leaf_a.numpy(), "leaf_b": estimate.leaf_b.numpy(),
                     "jaw_1": estimate.jaws[:, 0].numpy(), "jaw_2": estimate.jaws[:, 1].numpy(),
                     "mu": estimate.mu.numpy()}
    control_points = np.arange(segment.first, segment.first + len(segment))
    title = (f"Dataset {segment.dataset_id} ({segment.pattern}), control points {control_points[0]}-"
             f"{control_points[-1]} reconstructed from their {len(segment)} frames ({estimate.method}); "
             f"jaw MAE {errors['jaw_mae_mm']:.2f} mm, MU error {errors['mu_error_percent']:.2f} %; {run_label}")
    plots.save_figure(plots.arc_figure(control_points, true, reconstructed, band, title), path)


def write_errors_csv(path: str | Path, rows: Sequence[Mapping[str, object]]) -> None:
    """One row per reconstructed segment: dataset, pattern, frames, method, seconds, ``ERROR_KEYS``."""
    columns = ("dataset_id", "pattern", "first_frame", "frames", "method", "seconds", *ERROR_KEYS)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})
