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
* **evaluation** (``epid.evaluation.inference``) of every checkpoint on one shared, deterministic set
  of validation samples whose frames are synthesised once: forward MSE/MAE, gamma pass
  rate (mean and 5th percentile), inverse leaf MAE in the jaw band and overall, jaw MAE,
  MU error, overall and per pattern.

Results are printed as tables and written as ``comparison.csv`` (one row per checkpoint),
``comparison.json`` (everything), ``histories.png`` and ``metrics.png``. This module loads the
checkpoints and runs the comparison; ``epid.evaluation.histories`` summarises histories,
``epid.evaluation.weights_diff`` diffs weights, ``epid.evaluation.compare_report`` ranks, tabulates and writes, and
``epid.evaluation.plots`` draws the figures.
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from epid.config.load import Config, load_config
from epid.core.cli import prepare_output_dir
from epid.core.devices import resolve_device
from epid.core.errors import InputError
from epid.core.files import GLOB_CHARACTERS
from epid.core.tables import format_number, format_table
from epid.data.sharding import select_dataset_ids
from epid.evaluation import comparison_plots, inference, plots, quality
from epid.evaluation.compare_report import (
    EVALUATION_COLUMNS,
    Evaluation,
    config_table,
    evaluation_tables,
    evaluation_title,
    history_table,
    rankings,
    rankings_table,
    weight_tables,
    write_csv,
    write_json,
)
from epid.evaluation.gamma import DEFAULT_CRITERIA, GammaCriteria, gamma_maps
from epid.evaluation.histories import gamma_curve, summarize_histories, total_curves
from epid.evaluation.weights_diff import WeightDiff, diff_weights
from epid.models.checkpoint import CheckpointError, build_models_from_checkpoint, load_checkpoint

UNCOMPARED_KEYS = ("optimizer", "schedule", "scaler", "rng")  # dropped after loading: memory
DEFAULT_DATASET_RANGE = "0:640:80"


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
    for name, path in zip(display_names(paths), paths, strict=True):
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
    for the architecture, ``torch_version`` and ``format_version``, ``precision_trained`` (the
    autocast precision the run trained in, where the checkpoint records it: EPID_PRECISION=auto
    chooses per machine and run shape), and the derived
    ``global_batch`` (samples per optimizer step over all ranks) and ``effective_lr``
    (left out when the stored config does not rebuild a ``Config`` of this code version).
    """
    config = dict(payload.get("config") or {})
    fields = _flatten("", config)
    fields.update(_flatten("model.", payload.get("model_config") or {}))
    for key in ("torch_version", "format_version"):
        if key in payload:
            fields[key] = payload[key]
    if isinstance(payload.get("precision"), Mapping):
        fields["precision_trained"] = payload["precision"].get("name")
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


# --------------------------------------------------------------------------- evaluation


def synthesis_settings(checkpoints: Sequence[LoadedCheckpoint]) -> tuple[inference.SynthesisSettings, list[str]]:
    """Frame synthesis shared by all checkpoints: EPID_* variables, else the first checkpoint's
    training config. Also returns notes for checkpoints trained with other settings."""
    config = load_config()
    settings = inference.resolve_synthesis(checkpoints[0].payload.get("config") or {}, config)
    notes = []
    for checkpoint in checkpoints[1:]:
        own = inference.resolve_synthesis(checkpoint.payload.get("config") or {}, config)
        for key in inference.SYNTHESIS_VARIABLES:
            if getattr(own, key) != getattr(settings, key):
                notes.append(
                    f"{checkpoint.name} was trained with {key}={getattr(own, key)!r}; all checkpoints are "
                    f"evaluated with {getattr(settings, key)!r} (set {inference.SYNTHESIS_VARIABLES[key]} to choose)"
                )
        if own.physics != settings.physics:
            notes.append(
                f"{checkpoint.name} was trained with physics {own.physics.describe()}; all checkpoints are "
                f"evaluated with {settings.physics.describe()} (set EPID_PHYSICS or the physics variables to choose)"
            )
    return settings, notes


def evaluate_checkpoints(
    checkpoints: Sequence[LoadedCheckpoint],
    refs: list[inference.SampleRef],
    synthesis: inference.SynthesisSettings,
    device: torch.device,
    gamma_samples: int,
    criteria: GammaCriteria = DEFAULT_CRITERIA,
) -> Evaluation:
    """Synthesise the frames of ``refs`` once, then predict and score every checkpoint on them.

    Gamma is computed on ``gamma_samples`` samples spread over the set (the others get NaN).
    """
    started = time.perf_counter()
    kernel = inference.load_synthesis_kernel(synthesis)
    samples = inference.synthesise_samples(refs, synthesis, kernel, device)
    seconds = {"synthesis": time.perf_counter() - started}
    with_gamma = inference.spread(range(len(samples)), gamma_samples)
    records, reports, methods = {}, {}, {}
    for checkpoint in checkpoints:
        started = time.perf_counter()
        predictions = inference.predict(checkpoint.models, samples, device)
        gamma = torch.full(samples.epid_curr.shape[:1] + samples.epid_curr.shape[-2:], math.nan)
        rates = {name: torch.full((len(samples),), math.nan) for name in quality.QUALITY_CRITERIA}
        if with_gamma:
            gamma[with_gamma] = gamma_maps(
                samples.epid_curr[with_gamma], predictions.epid[with_gamma], criteria, device
            )
            subset = quality.pass_rates(samples.subset(with_gamma), predictions.subset(with_gamma), device)
            for name, rate in subset.items():
                rates[name][with_gamma] = rate
        records[checkpoint.name] = inference.sample_metrics(samples, predictions, gamma)
        reports[checkpoint.name] = quality.assess(samples, predictions, rates)
        methods[checkpoint.name] = predictions.reconstruction
        seconds[checkpoint.name] = time.perf_counter() - started
    return Evaluation(list(samples.refs), synthesis, criteria, len(with_gamma), records, seconds, reports, methods)


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
        self.history, self.common_epochs = summarize_histories({c.name: c.payload for c in self.checkpoints}, self.tail)
        self.differences = config_differences(self.checkpoints)
        reference = self.checkpoints[0] if self.checkpoints else None
        self.weight_diffs = [diff_weights(reference.name, reference.payload, other.name, other.payload)
                             for other in self.checkpoints[1:]]

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
            sections += [f"Quality of {name} (gamma on {self.evaluation.gamma_samples} samples):\n{report.table()}"
                         for name, report in self.evaluation.quality.items()]
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
                          "physics": synthesis.physics.to_dict(),
                          "sources": dict(synthesis.sources)},
            "gamma": evaluation.criteria.describe(),
            "gamma_samples": evaluation.gamma_samples,
            "seconds": evaluation.seconds,
            "reconstruction": evaluation.reconstruction,
            "metrics": self.summaries,
            "quality": {name: report.to_dict() for name, report in evaluation.quality.items()},
        }

    def write(self, output_dir: Path, settings: Mapping[str, Any], log_y: bool) -> list[Path]:
        """comparison.csv, comparison.json and the figures there are data for; returns their paths."""
        report = self.report(settings)
        written = [output_dir / "comparison.csv", output_dir / "comparison.json"]
        write_csv(written[0], report)
        write_json(written[1], report)
        if self.checkpoints:
            written.append(output_dir / "histories.png")
            curves = {c.name: (*total_curves(c.payload), gamma_curve(c.payload)) for c in self.checkpoints}
            plots.save_figure(comparison_plots.histories_figure(curves, log_y), written[-1])
        if self.summaries:
            written.append(output_dir / "metrics.png")
            figure = comparison_plots.metrics_figure(self.summaries, EVALUATION_COLUMNS,
                                                     evaluation_title(self.evaluation))
            plots.save_figure(figure, written[-1])
        return written


def compare(options: CompareOptions) -> int:
    """Run the comparison, print the tables, write the files; 1 if any checkpoint failed, else 0."""
    paths = expand_checkpoint_patterns(options.checkpoints)
    device = torch.device("cpu")
    if options.evaluate:
        device = resolve_device(options.device, given=f"--device {options.device!r}")
    dataset_ids = evaluation_dataset_ids(options) if options.evaluate else []
    output_dir = prepare_output_dir(options.output_dir)

    checkpoints, failures = load_checkpoints(paths, device, keep_models=options.evaluate)
    comparison = Comparison(paths, checkpoints, failures, options.tail)
    print(comparison.status_table())
    if options.evaluate and checkpoints:
        synthesis, notes = synthesis_settings(checkpoints)
        for note in notes:
            print(f"note: {note}")
        refs = inference.select_samples(dataset_ids, options.samples_per_dataset, options.seed,
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
