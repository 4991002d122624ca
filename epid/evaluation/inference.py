"""Per-sample evaluation of a forward/inverse model pair on synthetic samples.

The steps are separate so that several checkpoints can be judged on the same frames:

1. ``select_samples``: a deterministic choice of samples (dataset ID, sample index);
2. ``synthesise_samples``: their control-point parameters and EPID frames, rendered once;
3. ``predict``: both models in batches under ``torch.inference_mode``;
4. ``epid.evaluation.gamma.gamma_maps`` and ``sample_metrics``: gamma of the forward prediction against
   the measured (synthetic) frame, and the inverse model's leaf, jaw and MU errors.

Sample ``s`` of a dataset pairs control point ``s + 1`` (prev) with ``s + 2`` (curr); the
forward model predicts frame ``s + 2``. Layouts follow ``epid.data.dataset.Batch``: leaves
``(S, 104)`` = [prev 52, curr 52] in mm, scalars ``(S, 5)`` = [MU curr, jaw_1 prev,
jaw_1 curr, jaw_2 prev, jaw_2 curr] in MU and mm, frames ``(S, 1, 256, 256)``.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
from torch import Tensor

from epid.config.load import VARIABLE_OF_FIELD, Config
from epid.core.errors import InputError
from epid.data.dataset import assemble_batch
from epid.data.windows import Window, num_samples, split_range
from epid.evaluation.gamma import gamma_pass_rate
from epid.models.families import predict_frames
from epid.models.losses import point_x_jaws
from epid.reconstruction import estimate as estimate_module
from epid.synthesis.frames import render_frames
from epid.synthesis.geometry import STRIPS, StripGrid, strip_grid
from epid.synthesis.kernel import kernel_from_config
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.physics import LIMITS, PRESETS, Physics, physics_of
from epid.synthesis.sequences import (
    JAW_1_MIN_MM,
    JAW_2_MAX_MM,
    PATTERNS,
    behind_x_jaws,
    generate_control_points,
    leaf_band,
    pattern_for,
)

if TYPE_CHECKING:
    from epid.dicom.plan import PlanBeam

SAMPLE_SPLITS = ("val", "train", "all")
T = TypeVar("T")
BATCH_FIELDS = ("leaf_a", "leaf_b", "scalars", "leaf_weight_a", "leaf_weight_b", "epid_prev", "epid_curr")
SYNTHESIS_VARIABLES = {
    field: VARIABLE_OF_FIELD[field].name for field in ("control_points", "kernel", "noise_std", "noise_seed")
}


@dataclass(frozen=True)
class SampleRef:
    """One sample: ``sample`` pairs control point ``sample + 1`` (prev) with ``sample + 2`` (curr)."""

    dataset_id: int
    sample: int
    pattern: str


@dataclass(frozen=True)
class SynthesisSettings:
    """How frames are synthesised, and where each setting came from (``sources``)."""

    control_points: int
    kernel: str
    noise_std: float
    noise_seed: int
    sources: Mapping[str, str]
    physics: Physics = Physics()
    mlc: MlcGeometry = LEGACY_GRID

    def describe(self) -> str:
        """One line listing each setting with its source."""
        kernel = self.kernel or "built-in"
        return (
            f"{self.control_points} control points ({self.sources['control_points']}), "
            f"kernel {kernel} ({self.sources['kernel']}), "
            f"noise std {self.noise_std:g} ({self.sources['noise_std']}), "
            f"noise seed {self.noise_seed} ({self.sources['noise_seed']}), "
            f"physics {self.physics.describe()} ({self.sources.get('physics', 'default')})"
            + ("" if self.mlc == LEGACY_GRID else f", MLC {self.mlc.name} ({self.sources.get('mlc', 'default')})")
        )


@dataclass
class SampleSet:
    """Selected samples with their parameters and frames (CPU tensors; row i is ``refs[i]``).

    Fields follow ``epid.data.dataset.Batch``: leaf_a, leaf_b (S, 104) mm; scalars (S, 5), or (S, 9)
    with the X jaws of an MLC that has them;
    leaf_weight_a, leaf_weight_b (S, 104); epid_prev, epid_curr (S, 1, 256, 256); and the ``mlc``
    the arcs were synthesised on (what the estimates are reported as, ``reported_by_mlc``).
    """

    refs: list[SampleRef]
    leaf_a: Tensor
    leaf_b: Tensor
    scalars: Tensor
    leaf_weight_a: Tensor
    leaf_weight_b: Tensor
    epid_prev: Tensor
    epid_curr: Tensor
    mlc: MlcGeometry = LEGACY_GRID

    def __len__(self) -> int:
        return len(self.refs)

    def subset(self, rows: Sequence[int]) -> SampleSet:
        """The samples of ``rows``, in that order."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return SampleSet([self.refs[row] for row in rows],
                         **{name: getattr(self, name)[index] for name in BATCH_FIELDS}, mlc=self.mlc)


def reported_by_mlc(leaf_a: Tensor, leaf_b: Tensor, jaws: Tensor, mlc: MlcGeometry) -> tuple[Tensor, Tensor, Tensor]:
    """Estimated strip edges leaf_a, leaf_b (..., 52) mm and jaws (..., 2) [jaw_1, jaw_2] mm (CPU) as
    they are reported on ``mlc``: one position per leaf (``MlcGeometry.tied``: a 10 mm leaf at the
    mean of its two strips) and, for an MLC without Y jaws, the jaws open over the strips' span, as
    its arcs are synthesised (nothing for the network or the fit to find). The legacy grid's as given."""
    if not mlc.identity:
        leaf_a, leaf_b = (torch.from_numpy(np.ascontiguousarray(value)).to(leaf_a.dtype)
                          for value in mlc.tied(leaf_a.numpy(), leaf_b.numpy()))
    if not mlc.y_jaws:
        jaws = torch.tensor([JAW_1_MIN_MM, JAW_2_MAX_MM], dtype=jaws.dtype).expand_as(jaws).clone()
    return leaf_a, leaf_b, jaws


@dataclass
class Predictions:
    """Model outputs for a ``SampleSet`` (CPU float32): forward ``epid`` (S, 1, 256, 256);
    inverse ``leaf_a``, ``leaf_b`` (S, 104) mm and ``scalars`` (S, 5), from the reconstruction
    ``reconstruction`` (``epid.reconstruction.estimate.METHODS``)."""

    epid: Tensor
    leaf_a: Tensor
    leaf_b: Tensor
    scalars: Tensor
    reconstruction: str = "network"

    def subset(self, rows: Sequence[int]) -> Predictions:
        """The predictions of ``rows``, in that order."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        return Predictions(*(getattr(self, name)[index] for name in ("epid", "leaf_a", "leaf_b", "scalars")),
                           reconstruction=self.reconstruction)


@dataclass(frozen=True)
class SampleMetrics:
    """Errors of one sample. Leaf errors average both banks and both control points; the jaw
    band is the target's open band of leaf pairs at each control point."""

    dataset_id: int
    pattern: str
    sample: int
    gamma_pass_percent: float
    leaf_mae_band_mm: float
    leaf_mae_mm: float
    jaw_mae_mm: float
    mu_abs_error: float
    forward_mse: float
    forward_mae: float
    curr_leaf_mae_band_mm: float
    mu_error_percent: float


METRIC_NAMES = tuple(f.name for f in fields(SampleMetrics))[3:]
METRIC_LABELS = {
    "gamma_pass_percent": "gamma pass (%)",
    "leaf_mae_band_mm": "leaf MAE in jaw band (mm)",
    "leaf_mae_mm": "leaf MAE overall (mm)",
    "jaw_mae_mm": "jaw MAE (mm)",
    "mu_abs_error": "MU abs error (MU)",
    "forward_mse": "forward MSE",
    "forward_mae": "forward MAE",
    "curr_leaf_mae_band_mm": "curr leaf MAE in jaw band (mm)",
    "mu_error_percent": "MU relative error (%)",
}


def split_samples(n_control_points: int, split: str) -> range:
    """Sample indices of ``split`` ("val", "train" or "all") of an arc of ``n_control_points``."""
    if split == "all":
        return range(num_samples(n_control_points))
    return split_range(n_control_points, split)


def select_samples(
    dataset_ids: Iterable[int],
    samples_per_dataset: int,
    seed: int,
    n_control_points: int,
    max_total: int | None = None,
    split: str = "val",
    run_length: int = 1,
) -> list[SampleRef]:
    """A deterministic choice of samples, sorted by dataset ID then sample index.

    Each dataset draws ``samples_per_dataset`` distinct samples (all of them if its split
    has fewer) from its ``split`` with a generator seeded by ``(seed, dataset_id)``, in runs of
    ``run_length`` consecutive samples (blocks of the split; a last run may be shorter), so a
    dataset's choice does not depend on which other datasets are selected. With
    ``max_total`` below the total, the datasets used are spread evenly over the sorted
    IDs (so over all patterns) and take their draws in turn until ``max_total``.
    """
    if split not in SAMPLE_SPLITS:
        raise ValueError(f"split must be one of {SAMPLE_SPLITS}, got {split!r}")
    if samples_per_dataset < 1:
        raise ValueError(f"samples per dataset must be at least 1, got {samples_per_dataset}")
    if run_length < 1:
        raise ValueError(f"run length must be at least 1, got {run_length}")
    candidates = np.asarray(split_samples(n_control_points, split))
    per_dataset = min(samples_per_dataset, len(candidates))
    run_length = min(run_length, per_dataset)
    blocks = candidates[:len(candidates) // run_length * run_length].reshape(-1, run_length)
    ids = sorted(set(dataset_ids))
    if max_total is not None and max_total < len(ids) * per_dataset:
        needed = min(len(ids), math.ceil(max_total / per_dataset))
        ids = [ids[k] for k in np.unique(np.round(np.linspace(0, len(ids) - 1, needed)).astype(int))]
    draws = []
    for dataset_id in ids:
        rng = np.random.default_rng([seed, dataset_id])
        chosen = candidates if run_length == 1 else blocks
        chosen = rng.choice(chosen, size=math.ceil(per_dataset / run_length), replace=False).reshape(-1)
        chosen = chosen[:per_dataset]
        draws.append([SampleRef(dataset_id, int(s), pattern_for(dataset_id)) for s in chosen])
    in_turn = [draw[k] for k in range(per_dataset) for draw in draws]
    if max_total is not None:
        in_turn = in_turn[:max_total]
    return sorted(in_turn, key=lambda ref: (ref.dataset_id, ref.sample))


def spread(items: Sequence[T], count: int) -> list[T]:
    """``count`` of ``items`` spread evenly: the middle item of each of ``count`` equal parts
    (all of them when there are not more than ``count``; none for ``count <= 0``)."""
    if count >= len(items):
        return list(items)
    return [items[(2 * j + 1) * len(items) // (2 * count)] for j in range(max(count, 0))]


def gamma_subset(dataset_ids: Sequence[int], n_control_points: int | Callable[[int], int],
                 count: int) -> list[tuple[int, int]]:
    """A fixed set of ``count`` validation samples ``(dataset_id, sample)`` for training's gamma pass rate.

    Spread over the sorted datasets (every ``len / count``-th dataset when there are more
    datasets than samples) and evenly inside each dataset's validation split; the same set
    for any world size. Fewer come back when the validation splits are shorter than asked.
    ``n_control_points``: of every arc, or a function giving each dataset's (plan arcs).
    """
    ids = sorted(dataset_ids)
    if count <= 0 or not ids:
        return []
    per_dataset: dict[int, int] = {}
    for k in range(count):
        dataset_id = ids[k * len(ids) // count]
        per_dataset[dataset_id] = per_dataset.get(dataset_id, 0) + 1

    def length(dataset_id: int) -> int:
        return n_control_points(dataset_id) if callable(n_control_points) else n_control_points

    return [(dataset_id, sample) for dataset_id, wanted in per_dataset.items()
            for sample in spread(split_range(length(dataset_id), "val"), wanted)]


def resolve_synthesis(checkpoint_config: Mapping[str, object], config: Config,
                      environ: Mapping[str, str] | None = None) -> SynthesisSettings:
    """Synthesis settings for evaluating a checkpoint.

    An ``EPID_*`` variable that is set (non-empty) wins; otherwise the checkpoint's own
    training config is used, so samples look like the ones the model was trained on;
    otherwise the built-in default. ``config`` is the validated ``load_config`` result of
    ``environ``.
    """
    environ = os.environ if environ is None else environ
    defaults = Config()
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for field_name, variable in SYNTHESIS_VARIABLES.items():
        if environ.get(variable, "").strip():
            values[field_name], sources[field_name] = getattr(config, field_name), variable
        elif field_name in checkpoint_config:
            values[field_name], sources[field_name] = checkpoint_config[field_name], "checkpoint"
        else:
            values[field_name], sources[field_name] = getattr(defaults, field_name), "default"
    physics, sources["physics"] = resolve_physics(checkpoint_config, config, environ)
    if environ.get("EPID_MLC", "").strip():
        mlc, sources["mlc"] = config.mlc_geometry, "EPID_MLC"
    else:
        mlc = trained_mlc(checkpoint_config)
        sources["mlc"] = "checkpoint" if "mlc_geometry" in checkpoint_config else "default"
    return SynthesisSettings(
        control_points=int(values["control_points"]), kernel=str(values["kernel"]),
        noise_std=float(values["noise_std"]), noise_seed=int(values["noise_seed"]), sources=sources,
        physics=physics, mlc=mlc,
    )


def resolve_physics(checkpoint_config: Mapping[str, object], config: Config,
                    environ: Mapping[str, str]) -> tuple[Physics, str]:
    """The physics to synthesise with and its source: the environment's when EPID_PHYSICS or a
    physics variable is set, else the checkpoint's training physics (its preset with the settings
    it holds; checkpoints from before the physics have neither), else ideal."""
    names = [VARIABLE_OF_FIELD[field].name for field in ("physics_preset", *LIMITS)]
    set_names = [name for name in names if environ.get(name, "").strip()]
    if set_names:
        return config.physics, set_names[0]
    settings = {name: float(checkpoint_config[name]) for name in LIMITS if name in checkpoint_config}
    preset = checkpoint_config.get("physics_preset")
    if settings or preset:
        return physics_of(str(preset) if preset in PRESETS else "ideal", **settings), "checkpoint"
    return Physics(), "default"


def trained_mlc(checkpoint_config: Mapping[str, object]) -> MlcGeometry:
    """The MLC a checkpoint was trained on (its config's ``mlc_geometry``); the legacy grid for a checkpoint from
    before MLCs were named."""
    trained = checkpoint_config.get("mlc_geometry")
    return MlcGeometry.from_dict(trained) if trained else LEGACY_GRID


def check_plan_mlc(beam: PlanBeam, checkpoint_config: Mapping[str, object], checkpoint_path: str) -> None:
    """InputError (one line naming both) when a plan's MLC is not the one the checkpoint was trained on. A
    checkpoint of the legacy grid (any checkpoint from before MLCs were named) learnt every strip on its
    own, so it takes a plan of any MLC the strips show."""
    geometry = trained_mlc(checkpoint_config)
    if geometry != LEGACY_GRID and geometry != beam.geometry:
        raise InputError(f"{beam.path}: beam {beam.beam_number} is on {beam.geometry.name} ({beam.mlc}), but "
                         f"checkpoint {checkpoint_path} was trained on {geometry.name} ({geometry.description}); "
                         "expected a checkpoint of the plan's MLC, or of the legacy grid")


def load_synthesis_kernel(settings: SynthesisSettings) -> np.ndarray:
    """The EPID response kernel of ``settings``; a missing file is an InputError naming its source."""
    probe = Config(kernel=settings.kernel)
    path, variable = probe.kernel_path, probe.kernel_variable
    if path and not os.path.isfile(path):
        where = "the checkpoint was trained with" if settings.sources["kernel"] == "checkpoint" else "EPID_KERNEL is"
        raise InputError(
            f"{where} kernel {settings.kernel!r} but there is no file {path!r} here; "
            "set EPID_KERNEL to that kernel's .mat file"
        )
    return kernel_from_config(path, variable)


def synthesise_samples(
    refs: Sequence[SampleRef],
    settings: SynthesisSettings,
    kernel: np.ndarray,
    device: torch.device | str = "cpu",
    progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
) -> SampleSet:
    """Generate the control points of each selected dataset once and render only the frames
    the samples need (no cache), on ``device``; the returned tensors are on the CPU.

    ``progress`` optionally wraps the loop over datasets (e.g. ``tqdm``).
    """
    ordered = sorted(refs, key=lambda ref: (ref.dataset_id, ref.sample))
    by_dataset: dict[int, list[int]] = {}
    for ref in ordered:
        by_dataset.setdefault(ref.dataset_id, []).append(ref.sample)
    batches = []
    dataset_ids: Iterable[int] = list(by_dataset)
    for dataset_id in progress(dataset_ids) if progress else dataset_ids:
        samples = by_dataset[dataset_id]
        control_points = generate_control_points(dataset_id, settings.control_points, settings.mlc)
        frame_indices = sorted({s + 1 for s in samples} | {s + 2 for s in samples})
        frames = render_frames(
            control_points, frame_indices, kernel, dataset_id=dataset_id,
            noise_std=settings.noise_std, noise_seed=settings.noise_seed, device=device, physics=settings.physics,
        ).float().cpu()
        position = {frame: k for k, frame in enumerate(frame_indices)}
        for s in samples:
            pair = frames[[position[s + 1], position[s + 2]]]
            batches.append(assemble_batch(control_points, Window(dataset_id, s, s + 1), pair))
    return SampleSet(
        refs=ordered, **{name: torch.cat([getattr(batch, name) for batch in batches]) for name in BATCH_FIELDS},
        mlc=settings.mlc,
    )


def predict(
    models: tuple[torch.nn.Module, torch.nn.Module],
    samples: SampleSet,
    device: torch.device | str = "cpu",
    batch_size: int = 16,
    reconstruction: str = "pair",
) -> Predictions:
    """Run the forward model on the target parameters and reconstruct the control points from
    the measured frames, ``batch_size`` samples at a time under ``torch.inference_mode``.

    ``models`` = (forward, inverse), already on ``device``; both are switched to eval mode.
    ``reconstruction`` ("network", "pair" or "arc", ``epid.reconstruction.estimate.METHODS``): the inverse
    network's estimate, refined per frame pair, or refined jointly over each run of consecutive
    samples of a dataset (``estimate_module.reconstruct_arc``; a run of one sample is refined as a
    pair). A model pair that cannot refine (``estimate_module.can_refine``) gives the network's
    estimate; ``Predictions.reconstruction`` names what was used. The estimates are reported on the
    samples' MLC (``reported_by_mlc``).
    """
    forward_model, inverse_model = models
    forward_model.eval()
    inverse_model.eval()
    used = estimate_module.method_used(forward_model, inverse_model, reconstruction)
    outputs: dict[str, list[Tensor]] = {"epid": [], "leaf_a": [], "leaf_b": [], "scalars": []}
    with torch.inference_mode():
        for start in range(0, len(samples), batch_size):
            window = slice(start, start + batch_size)

            def chunk(tensor: Tensor, window: slice = window) -> Tensor:
                return tensor[window].to(device)

            epid, _ = predict_frames(forward_model, chunk(samples.leaf_a), chunk(samples.leaf_b),
                                     chunk(samples.scalars), chunk(samples.epid_prev))
            outputs["epid"].append(epid.float().cpu())
            if used != "arc":
                estimate = estimate_module.pair_estimate(forward_model, inverse_model, chunk(samples.epid_prev),
                                                         chunk(samples.epid_curr), refine=used == "pair")
                for name, value in zip(("leaf_a", "leaf_b", "scalars"), estimate, strict=True):
                    outputs[name].append(value.float().cpu())
        if used == "arc":
            for name, value in zip(("leaf_a", "leaf_b", "scalars"),
                                   _arc_estimates(forward_model, inverse_model, samples, device), strict=True):
                outputs[name].append(value)
    values = {name: torch.cat(parts) for name, parts in outputs.items()}
    strips = values["leaf_a"].shape[-1] // 2
    for leaves, jaws in ((slice(None, strips), [1, 3]), (slice(strips, None), [2, 4])):
        values["leaf_a"][:, leaves], values["leaf_b"][:, leaves], values["scalars"][:, jaws] = reported_by_mlc(
            values["leaf_a"][:, leaves], values["leaf_b"][:, leaves], values["scalars"][:, jaws], samples.mlc)
    return Predictions(**values, reconstruction=used)


def sample_runs(refs: Sequence[SampleRef]) -> list[range]:
    """Rows of ``refs`` (sorted by dataset, then sample) grouped into runs of consecutive samples
    of one dataset."""
    runs: list[range] = []
    begin = 0
    for row in range(1, len(refs) + 1):
        if row == len(refs) or refs[row].dataset_id != refs[begin].dataset_id or \
                refs[row].sample != refs[row - 1].sample + 1:
            runs.append(range(begin, row))
            begin = row
    return runs


def _arc_estimates(forward_model: torch.nn.Module, inverse_model: torch.nn.Module, samples: SampleSet,
                   device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """(leaf_a, leaf_b (S, 104), scalars (S, 5)) of every sample, each run of consecutive samples
    reconstructed as one arc (its frames: the first sample's prev, then every sample's curr)."""
    leaf_a, leaf_b, scalars = [], [], []
    for run in sample_runs(samples.refs):
        rows = slice(run.start, run.stop)
        prev, curr = samples.epid_prev[rows].to(device), samples.epid_curr[rows].to(device)
        if len(run) == 1:
            estimate = estimate_module.pair_estimate(forward_model, inverse_model, prev, curr, refine=True)
            for values, part in zip((leaf_a, leaf_b, scalars), estimate, strict=True):
                values.append(part.float().cpu())
            continue
        arc = estimate_module.reconstruct_arc(forward_model, inverse_model, torch.cat([prev[:1, 0], curr[:, 0]]))
        for values, points in ((leaf_a, arc.leaf_a), (leaf_b, arc.leaf_b)):
            values.append(torch.cat([points[1:-1], points[2:]], 1).float().cpu())
        jaws = arc.jaws.float().cpu()
        scalars.append(torch.cat([arc.mu[1:, None].float().cpu(), jaws[1:-1, :1], jaws[2:, :1], jaws[1:-1, 1:],
                                  jaws[2:, 1:]], 1))
    return torch.cat(leaf_a), torch.cat(leaf_b), torch.cat(scalars)


def jaw_band(jaw_1: Tensor, jaw_2: Tensor, grid: StripGrid = STRIPS) -> Tensor:
    """Boolean (..., strips) mask of the strips of ``grid`` in the open jaw band ``[lo, hi)`` of
    ``epid.synthesis.sequences.leaf_band`` (jaws in mm, any leading shape)."""
    lo, hi = leaf_band(jaw_1.detach().cpu().numpy(), jaw_2.detach().cpu().numpy(), grid)
    leaf = np.arange(grid.count)
    return torch.from_numpy((leaf >= lo[..., None]) & (leaf < hi[..., None])).to(jaw_1.device)


def hidden_by_x_jaws(leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor) -> Tensor | None:
    """(S, 2, 2 x strips) bool [bank A, bank B] over the sample layout [prev, curr]: the leaves (S, 2 x
    strips) mm at or behind an X jaw of the scalars (``point_x_jaws``, ``behind_x_jaws``), whose edge
    the frames show instead; None for scalars without X jaws (S, 5)."""
    x_jaws = point_x_jaws(scalars)
    if x_jaws is None:
        return None
    half = leaf_a.shape[1] // 2
    parts = [behind_x_jaws(leaf_a[:, part].numpy(), leaf_b[:, part].numpy(), jaws.numpy()) > 0
             for jaws, part in zip(x_jaws, (slice(None, half), slice(half, None)), strict=True)]
    return torch.from_numpy(np.concatenate(parts, -1)).transpose(0, 1)


def sample_metrics(samples: SampleSet, predictions: Predictions, gamma: Tensor) -> list[SampleMetrics]:
    """Per-sample errors of ``predictions`` against ``samples`` (gamma maps from ``epid.evaluation.gamma.gamma_maps``).

    Forward: MSE and MAE over the 256 x 256 pixels of the curr frame, gamma pass rate.
    Inverse: leaf MAE (mm) over both banks and both control points, overall and inside the
    target jaw band (less the positions an X jaw hides, ``hidden_by_x_jaws``); jaw MAE (mm) over
    jaw_1 and jaw_2 at both control points; absolute MU error of the curr control point.
    """
    image_error = (predictions.epid - samples.epid_curr).flatten(1)
    forward_mse = image_error.square().mean(1)
    forward_mae = image_error.abs().mean(1)
    pass_percent = gamma_pass_rate(gamma)

    leaf_error = torch.cat([
        (predictions.leaf_a - samples.leaf_a).abs(), (predictions.leaf_b - samples.leaf_b).abs()
    ], dim=1)
    strips = samples.leaf_a.shape[-1] // 2
    grid = strip_grid(strips)
    band = torch.cat([
        jaw_band(samples.scalars[:, 1], samples.scalars[:, 3], grid),
        jaw_band(samples.scalars[:, 2], samples.scalars[:, 4], grid),
    ], dim=1).repeat(1, 2)
    hidden = hidden_by_x_jaws(samples.leaf_a, samples.leaf_b, samples.scalars)
    if hidden is not None:
        band = band & ~hidden.flatten(1)
    leaf_band = (leaf_error * band).sum(1) / band.sum(1).clamp(min=1)
    curr = torch.cat([torch.zeros(strips, dtype=torch.bool), torch.ones(strips, dtype=torch.bool)])
    curr_band = band & curr.repeat(2)
    curr_leaf_band = (leaf_error * curr_band).sum(1) / curr_band.sum(1).clamp(min=1)
    scalar_error = (predictions.scalars - samples.scalars[:, :predictions.scalars.shape[1]]).abs()

    records = []
    for i, ref in enumerate(samples.refs):
        records.append(SampleMetrics(
            dataset_id=ref.dataset_id, pattern=ref.pattern, sample=ref.sample,
            gamma_pass_percent=float(pass_percent[i]),
            leaf_mae_band_mm=float(leaf_band[i]) if band[i].any() else math.nan,
            leaf_mae_mm=float(leaf_error[i].mean()),
            jaw_mae_mm=float(scalar_error[i, 1:].mean()),
            mu_abs_error=float(scalar_error[i, 0]),
            forward_mse=float(forward_mse[i]), forward_mae=float(forward_mae[i]),
            curr_leaf_mae_band_mm=float(curr_leaf_band[i]) if curr_band[i].any() else math.nan,
            mu_error_percent=float(100 * scalar_error[i, 0] / samples.scalars[i, 0].clamp(min=1e-6)),
        ))
    return records


def by_pattern(records: Iterable[SampleMetrics]) -> dict[str, list[SampleMetrics]]:
    """Records grouped by pattern, in the order regular, semiregular, irregular (absent ones left out)."""
    groups: dict[str, list[SampleMetrics]] = {}
    for record in records:
        groups.setdefault(record.pattern, []).append(record)
    known = [p for p in PATTERNS if p in groups]
    return {pattern: groups[pattern] for pattern in known + sorted(set(groups) - set(known))}


def pattern_means(records: Sequence[SampleMetrics]) -> dict[str, dict[str, float]]:
    """Mean of every metric per pattern and over ``"all"`` samples (NaNs ignored), with ``"count"``."""
    groups = {**by_pattern(records), "all": list(records)}
    table = {}
    for name, group in groups.items():
        row = {"count": float(len(group))}
        for metric in METRIC_NAMES:
            values = np.array([getattr(record, metric) for record in group], dtype=float)
            row[metric] = float(np.nanmean(values)) if np.isfinite(values).any() else math.nan
        table[name] = row
    return table


def write_metrics_csv(path: str | Path, records: Iterable[SampleMetrics]) -> None:
    """One row per sample, columns of ``SampleMetrics`` (floats with 6 significant digits)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[f.name for f in fields(SampleMetrics)])
        writer.writeheader()
        for record in records:
            row = asdict(record)
            writer.writerow({key: f"{value:.6g}" if isinstance(value, float) else value for key, value in row.items()})
