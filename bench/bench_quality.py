"""Model quality on arcs the model never trained on, after a wall-clock training budget.

From scratch, trains the chosen model family with the project's default recipe (every EPID_*
variable at its default for that family) for ``--minutes`` of wall clock, frame synthesis and
the quality curve's evaluations included, on the dataset IDs that are multiples of 4 only;
then evaluates on dataset IDs that are 2 mod 4 only: ``--eval-samples`` samples per dataset,
drawn over the whole arc (seeded), from ``--eval-datasets`` datasets spread over all three
patterns. The learning-rate schedule is laid out for the number of optimizer steps the budget
allows at the step rate of a short calibration run (its time counts in the budget); a time
limit stops training at the budget in any case. Training and evaluation frames share the
synthesis physics (``--physics``, EPID_PHYSICS) and response kernel (``--kernel``, EPID_KERNEL).

Writes to ``--output-dir`` (default ``quality_output``):

* ``checkpoint.pth``: an ordinary training checkpoint (``inference_visualize.py`` and
  ``compare_checkpoints.py`` read it);
* ``quality.json``: every figure of ``epid.evaluation.quality`` overall and per pattern (the inverse
  figures of each reconstruction of ``--reconstructions``: the network's estimate refined per
  frame pair, or jointly over the run of frames, ``epid.reconstruction.estimate``), with the budget,
  device, machine, samples seen, steps, the model, the physics (preset and settings), the
  kernel and the curve;
* ``quality.png``: quality against training time (gamma pass rate at 3 %/2 mm and curr leaf
  MAE in the jaw band on a fixed subset of the evaluation samples, the models' network
  estimates, before training and at every epoch end), with the final evaluation marked;

and prints the table. Run from the repository root:

    python -m bench.bench_quality                          # 20 minutes, default model
    python -m bench.bench_quality --model legacy --output-dir quality_legacy
    python -m bench.bench_quality --physics realistic --output-dir quality_realistic
    python -m bench.radial_kernel radial.mat               # a measured-looking, non-separable kernel
    python -m bench.bench_quality --kernel radial.mat --output-dir quality_radial
    python -m bench.kernel_family kernels                  # responses from sharp to broad, one elongated
    python -m bench.bench_quality --physics realistic --reconstructions network,arc \\
        --kernels built-in,kernels/sharp.mat,kernels/broad.mat --output-dir sweep   # one row per kernel
    python -m bench.bench_quality --table sweep/built-in sweep/broad              # the table of finished runs
    python -m bench.bench_quality --smoke                  # seconds: tiny model, short arcs
    python -m bench.bench_quality --combine quality_output quality_legacy --output-dir both
    python -m bench.bench_quality --reevaluate --physics realistic --output-dir quality_realistic
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# isort: off
import epid  # noqa: F401  (first: sets the OpenMP wait policy of training before torch loads)
# isort: on

import numpy as np
import torch

from epid.config.load import Config, load_config
from epid.core.cli import prepare_output_dir, run_main
from epid.core.devices import resolve_device
from epid.core.errors import InputError
from epid.core.memory import keep_freed_memory
from epid.core.tables import format_table
from epid.evaluation import comparison_plots, inference, plots, quality
from epid.models import families
from epid.models.checkpoint import build_models_from_checkpoint, load_checkpoint
from epid.reconstruction import estimate
from epid.synthesis.kernel import kernel_figures, kernel_from_config
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import PRESETS
from epid.synthesis.sequences import DEFAULT_CONTROL_POINTS
from epid.training.loop import launch

PROGRAM = "python -m bench.bench_quality"
TRAIN_RANGE = "0:640:4"
EVAL_IDS = tuple(range(2, 640, 4))
CURVE_EPOCHS = 10
CURVE_SAMPLES_PER_DATASET = 2
CALIBRATION_SAMPLES = 80
PLAN_MARGIN = 0.95
CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
BUILT_IN = "built-in"
SMOKE = {"minutes": 0.6, "size": "tiny", "control_points": 66, "eval_datasets": 12, "eval_samples": 4}


@dataclass
class Curve:
    """Quality at the end of every epoch: training minutes, samples seen and the figures."""

    minutes: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    gamma_3_2mm: list[float] = field(default_factory=list)
    curr_leaf_mae_mm: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[float]]:
        return {"minutes": self.minutes, "samples_seen": self.samples, "gamma_3_2mm_mean": self.gamma_3_2mm,
                "curr_leaf_mae_mm": self.curr_leaf_mae_mm}


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROGRAM, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0, help="training budget, wall clock (default 20)")
    parser.add_argument("--output-dir", default="quality_output")
    parser.add_argument("--model", default=families.DEFAULT_FAMILY, choices=sorted(families.FAMILIES),
                        help=f"model family (default {families.DEFAULT_FAMILY})")
    parser.add_argument("--size", default="full", help="model size preset (default full)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--seed", type=int, default=0, help="EPID_SEED of the run (default 0)")
    parser.add_argument("--control-points", type=int, default=DEFAULT_CONTROL_POINTS)
    parser.add_argument("--physics", default="ideal", choices=sorted(PRESETS),
                        help="synthesis physics of training and evaluation (EPID_PHYSICS; default ideal)")
    parser.add_argument("--kernel", default="", metavar="FILE.mat[:variable]",
                        help="EPID response kernel of training and evaluation (EPID_KERNEL; default built-in)")
    parser.add_argument("--mlc", default="legacy", choices=[name for name, geometry in MLC_GEOMETRIES.items()
                                                             if geometry.modelled],
                        help="MLC of training and evaluation (EPID_MLC; default legacy)")
    parser.add_argument("--eval-datasets", type=int, default=16, help="held-out datasets evaluated (>= 12)")
    parser.add_argument("--eval-samples", type=int, default=8,
                        help="samples per held-out dataset, consecutive (one run of frames; default 8)")
    parser.add_argument("--reconstructions", default="pair,arc",
                        help="how the inverse figures reconstruct the control points, comma-separated of "
                             f"{', '.join(estimate.METHODS)} (default pair,arc; the last is the headline)")
    parser.add_argument("--reevaluate", action="store_true",
                        help="train nothing: evaluate OUTPUT_DIR/checkpoint.pth again (same arguments as its "
                             "run), keeping the training figures of OUTPUT_DIR/quality.json")
    parser.add_argument("--smoke", action="store_true", help="a run of seconds: tiny model, short arcs")
    parser.add_argument("--kernels", metavar="FILE.mat,...",
                        help="a sweep: one run per kernel (comma-separated .mat files, 'built-in' for the "
                             "built-in one; python -m bench.kernel_family writes a family), each into "
                             "OUTPUT_DIR/<kernel name>, then one table row per kernel (OUTPUT_DIR/kernels.txt)")
    parser.add_argument("--table", nargs="+", metavar="DIR",
                        help="train nothing: the per-kernel table of these finished runs' output folders")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="train nothing: draw the runs of these output folders on one figure, "
                             "OUTPUT_DIR/quality.png")
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes}: expected a number > 0")
    if args.eval_datasets < 12 or args.eval_datasets * args.eval_samples < 48:
        parser.error("expected at least 12 evaluation datasets and 48 samples in all")
    args.reconstructions = [name.strip() for name in args.reconstructions.split(",") if name.strip()]
    unknown = [name for name in args.reconstructions if name not in estimate.METHODS]
    if unknown or not args.reconstructions:
        parser.error(f"--reconstructions {','.join(args.reconstructions)}: expected some of "
                     f"{', '.join(estimate.METHODS)}")
    args.kernel_list = [name.strip() for name in (args.kernels or "").split(",") if name.strip()]
    if args.kernels is not None and not args.kernel_list:
        parser.error("--kernels: expected comma-separated .mat files (or built-in)")
    for option, kernel in [("--kernel", args.kernel)] + [("--kernels", name) for name in args.kernel_list]:
        if args.combine or args.table or kernel == BUILT_IN:
            continue
        try:
            load_kernel_of(Config(kernel=kernel))
        except InputError as error:
            raise InputError(f"{option} {kernel!r}: {error}") from None
    return args


def load_kernel_of(config: Config) -> np.ndarray:
    """The kernel EPID_KERNEL names (``--kernel``); a bad file is a one-line InputError."""
    return kernel_from_config(config.kernel_path, config.kernel_variable)


def synthesis_label(physics: str, kernel: str) -> str:
    """How a run's frames were synthesised, for titles and tables: 'ideal physics, built-in kernel'."""
    kernel_name = "built-in kernel" if kernel in ("", "built-in") else f"kernel {Path(kernel).name}"
    return f"{physics} physics, {kernel_name}"


def training_environment(args: argparse.Namespace, output: Path, steps_per_epoch: int, epochs: int,
                         minutes: float) -> dict[str, str]:
    """The EPID_* variables of the benchmark's run into ``output``; everything else stays at the
    family's recipe or the variable's default."""
    return {
        "EPID_MODEL": args.model, "EPID_MODEL_SIZE": args.size, "EPID_DEVICE": args.device,
        "EPID_SEED": str(args.seed), "EPID_CONTROL_POINTS": str(args.control_points),
        "EPID_DATASET_RANGE": TRAIN_RANGE, "EPID_CHECKPOINT_PATH": str(output / "checkpoint.pth"),
        "EPID_EPOCHS": str(epochs), "EPID_STEPS_PER_EPOCH": str(steps_per_epoch),
        "EPID_TIME_LIMIT": f"{minutes:.4g}", "EPID_VAL_STEPS": "2", "EPID_GAMMA_SAMPLES": "8",
        "EPID_PROGRESS": "0", "EPID_PHYSICS": args.physics, "EPID_KERNEL": args.kernel,
        "EPID_MLC": args.mlc,
    }


def evaluation_set(args: argparse.Namespace) -> inference.SampleSet:
    """The held-out samples (IDs 2 mod 4; one run of consecutive samples per dataset, so that the
    arc reconstruction has its frames), synthesised once with the run's kernel and physics and the
    default noise."""
    ids = inference.spread(list(EVAL_IDS), args.eval_datasets)
    refs = inference.select_samples(ids, args.eval_samples, seed=args.seed, n_control_points=args.control_points,
                                    split="all", run_length=args.eval_samples)
    settings = inference.SynthesisSettings(control_points=args.control_points, kernel=args.kernel, noise_std=0.005,
                                           noise_seed=0, sources={}, physics=PRESETS[args.physics],
                                           mlc=MLC_GEOMETRIES[args.mlc])
    return inference.synthesise_samples(refs, settings, load_kernel_of(Config(kernel=args.kernel)))


def curve_subset(samples: inference.SampleSet) -> inference.SampleSet:
    """The first samples of every dataset: the curve's fixed subset."""
    seen: dict[int, int] = {}
    rows = []
    for row, ref in enumerate(samples.refs):
        seen[ref.dataset_id] = seen.get(ref.dataset_id, 0) + 1
        if seen[ref.dataset_id] <= CURVE_SAMPLES_PER_DATASET:
            rows.append(row)
    return samples.subset(rows)


def measure_step_seconds(args: argparse.Namespace, output: Path, observer: CurveObserver,
                         device: torch.device) -> tuple[float, float]:
    """Seconds per optimizer step of this recipe here and seconds of one curve evaluation.

    The steps are timed in a real training run of two epochs of about ``CALIBRATION_SAMPLES``
    samples each (frame synthesis, the models placed and run as training runs them, AdamW), from
    the second epoch's rate (the first pays for start-up), its checkpoint then removed; the curve
    evaluation is the observer's on freshly initialised models: the curve's first point.
    """
    recipe = load_config(training_environment(args, output / "calibration", 1, 2, args.minutes))
    steps = math.ceil(CALIBRATION_SAMPLES / (recipe.batch_size * recipe.grad_accum))
    probe = load_config(training_environment(args, output / "calibration", steps, 2, args.minutes))
    torch.manual_seed(probe.seed)
    model = families.CrossModel(*families.build_models(probe.model_size, probe.model, probe.mlc_geometry)).to(device)
    started = time.perf_counter()
    observer(0, model.forward_model, model.inverse_model, 0)  # network estimates, as during training
    observer_seconds = time.perf_counter() - started
    if launch(probe) != 0:
        raise RuntimeError("the calibration run failed")
    history = load_checkpoint(probe.checkpoint_path)["history"]
    shutil.rmtree(output / "calibration")
    return probe.batch_size * probe.grad_accum / history["samples_per_s"][-1], observer_seconds


def planned_steps(seconds_left: float, step_seconds: float, observer_seconds: float) -> int:
    """Optimizer steps that fit in ``seconds_left``: every epoch end costs about one and a half
    curve evaluations (the curve's, validation and the checkpoint), and a margin of
    ``PLAN_MARGIN`` keeps the learning-rate decay's end inside the budget on a machine whose speed
    varies; the time limit stops the run at the budget in any case."""
    training_seconds = seconds_left - CURVE_EPOCHS * 1.5 * observer_seconds
    return max(CURVE_EPOCHS, int(PLAN_MARGIN * training_seconds / step_seconds))


class CurveObserver:
    """Evaluates the network estimates on the curve subset at every epoch end (rank 0)."""

    def __init__(self, subset: inference.SampleSet, device: torch.device, started: float) -> None:
        self.subset, self.device, self.started = subset, device, started
        self.curve = Curve()

    def __call__(self, epoch: int, forward_model: torch.nn.Module, inverse_model: torch.nn.Module,
                 samples_seen: int) -> None:
        predictions = inference.predict((forward_model, inverse_model), self.subset, self.device,
                                        reconstruction="network")
        report = quality.assess(self.subset, predictions, device=self.device, criteria=("3%/2mm",))
        figures = report.groups[quality.ALL]
        self.curve.minutes.append((time.perf_counter() - self.started) / 60)
        self.curve.samples.append(samples_seen)
        self.curve.gamma_3_2mm.append(figures[quality.gamma_key("3%/2mm", "mean")])
        self.curve.curr_leaf_mae_mm.append(figures["curr_leaf_mae_mm"])
        print(f"[quality] epoch {epoch}: {self.curve.minutes[-1]:.1f} min, {samples_seen} samples, gamma 3 %/2 mm "
              f"{self.curve.gamma_3_2mm[-1]:.1f} %, curr leaf MAE {self.curve.curr_leaf_mae_mm[-1]:.2f} mm "
              "(network estimates)", flush=True)


def count_stopped_epoch(checkpoint: dict, observer: CurveObserver, device: torch.device, grad_accum: int) -> int:
    """Where the time limit stopped an epoch part way: the curve gets its last point, from the final
    weights and the samples of the stopped epoch added; returns that epoch's optimizer steps (0 when
    the run ended at an epoch's end)."""
    stopped = checkpoint.get("interrupted")
    if not stopped:
        return 0
    forward_model, inverse_model = build_models_from_checkpoint(checkpoint, device)
    seen = observer.curve.samples[-1] if observer.curve.samples else 0
    observer(stopped["epoch"], forward_model, inverse_model, seen + int(sum(stopped["rank_train_samples"])))
    return int(stopped["batches_done"]) // grad_accum


def machine(device: torch.device) -> str:
    """The machine in words: the GPU, or the CPU model, its vector features and cores."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    features = [name for name in CPU_FEATURES if name in flags] or ["no AVX2"]
    return f"{model} ({', '.join(features)}), {os.cpu_count()} cores, torch {torch.__version__}"


def combine(folders: list[str], output: Path) -> None:
    """One figure of the runs whose output folders are given (their ``quality.json``), by model."""
    runs = {}
    for folder in folders:
        path = Path(folder) / "quality.json"
        if not path.is_file():
            raise InputError(f"--combine {folder!r}: no quality.json there (expected an output folder of this bench)")
        written = json.loads(path.read_text())
        label = synthesis_label(written.get("physics", "ideal"), written.get("kernel", "built-in"))
        runs[f"{written['model']} {written['size']}, {label}"] = written
    first = next(iter(runs.values()))
    title = (f"{first['budget_minutes']:g} min on {first['device']} ({first['machine']}), seed {first['seed']}, "
             "held-out arcs")
    plots.save_figure(comparison_plots.quality_figure(runs, title), output / "quality.png")
    print(f"{PROGRAM}: wrote {output / 'quality.png'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    keep_freed_memory()  # as inference_visualize.py reconstructs
    output = prepare_output_dir(args.output_dir)
    if args.combine:
        combine(args.combine, output)
        return 0
    if args.table:
        print(kernel_table([Path(folder) for folder in args.table]))
        return 0
    if args.kernel_list:
        return sweep(args, output)
    return run_bench(args, output)


def sweep(args: argparse.Namespace, output: Path) -> int:
    """One run per kernel of ``--kernels``, each into OUTPUT_DIR/<kernel name>, then the table."""
    folders = []
    for kernel in args.kernel_list:
        folder = output / (BUILT_IN if kernel == BUILT_IN else Path(kernel.split(":")[0]).stem)
        run_args = argparse.Namespace(**{**vars(args), "kernel": "" if kernel == BUILT_IN else kernel,
                                         "output_dir": str(folder)})
        status = run_bench(run_args, prepare_output_dir(folder))
        if status != 0:
            return status
        folders.append(folder)
    table = kernel_table(folders)
    (output / "kernels.txt").write_text(table + "\n")
    print(table)
    print(f"{PROGRAM}: wrote {output / 'kernels.txt'}")
    return 0


def kernel_table(folders: list[Path]) -> str:
    """One row per finished run (its ``quality.json``): the kernel and how broad it is, the physics,
    training samples, the forward model's gamma and the network's and the last reconstruction's
    leaf, jaw and MU figures on the held-out arcs."""
    rows = []
    for folder in folders:
        path = folder / "quality.json"
        if not path.is_file():
            raise InputError(f"--table {str(folder)!r}: no quality.json there (expected an output folder of this "
                             "bench)")
        written = json.loads(path.read_text())
        groups = written.get("reconstructions", {})
        network = groups.get("network", {}).get("all", {})
        last = groups.get(written.get("reconstruction", ""), {}).get("all", {})
        shape = written.get("kernel_figures") or figures_of_file(written.get("kernel", BUILT_IN))
        rows.append([
            Path(written.get("kernel", BUILT_IN)).name,
            f"{shape['fwhm_x_mm']:.1f} / {shape['fwhm_y_mm']:.1f}" if shape else "?",
            f"{shape['energy_radii_mm'][2]:.0f}" if shape else "?",
            written.get("physics", "ideal"), f"{written.get('samples_seen', 0)}",
            _figure(last.get("gamma_2_2mm_mean")),
            f"{_figure(network.get('curr_leaf_mae_mm'), 2)} / {_figure(network.get('curr_leaf_within_1mm'))}",
            f"{_figure(last.get('curr_leaf_mae_mm'), 2)} / {_figure(last.get('curr_leaf_within_1mm'))}",
            _figure(last.get("curr_jaw_mae_mm"), 2), _figure(last.get("mu_error_percent"), 2),
        ])
    header = ["kernel", "core FWHM x / y (mm)", "90 % radius (mm)", "physics", "training samples",
              "gamma 2%/2mm (%)", "network leaf MAE (mm) / within 1 mm (%)",
              "reconstruction leaf MAE (mm) / within 1 mm (%)", "jaw MAE (mm)", "MU error (%)"]
    return format_table(header, rows)


def figures_of_file(kernel: str) -> dict:
    """``kernel_figures`` of a run's kernel (runs written before quality.json held them), {} when
    its file is gone."""
    try:
        return dataclasses.asdict(kernel_figures(load_kernel_of(Config(kernel="" if kernel == BUILT_IN else kernel))))
    except InputError:
        return {}


def _figure(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run_bench(args: argparse.Namespace, output: Path) -> int:
    """Train for the budget and evaluate (or, with ``--reevaluate``, evaluate only) into ``output``."""
    if args.reevaluate:
        return evaluate_run(args, output, device=resolve_device(args.device),
                            context=json.loads(read_previous(output).read_text()))
    started = time.perf_counter()
    device = resolve_device(args.device)
    print(f"{PROGRAM}: {args.model} {args.size}, {args.minutes:g} min on {device} ({machine(device)}), "
          f"{synthesis_label(args.physics, args.kernel)}", flush=True)

    samples = evaluation_set(args)
    observer = CurveObserver(curve_subset(samples), device, started)
    step_seconds, observer_seconds = measure_step_seconds(args, output, observer, device)
    left = args.minutes * 60 - (time.perf_counter() - started)
    steps = planned_steps(left, step_seconds, observer_seconds)
    epochs = min(CURVE_EPOCHS, steps)
    config = load_config(training_environment(args, output, math.ceil(steps / epochs), epochs, left / 60))
    print(f"{PROGRAM}: {step_seconds:.3f} s per step and {observer_seconds:.1f} s per curve point measured: "
          f"{epochs} epochs of {config.steps_per_epoch} steps (batch {config.batch_size}) planned for the "
          f"{left / 60:.1f} min left", flush=True)

    status = launch(config, observer=observer)
    trained_minutes = (time.perf_counter() - started) / 60
    if status != 0:
        print(f"{PROGRAM}: training failed (status {status})", file=sys.stderr)
        return status

    checkpoint = load_checkpoint(output / "checkpoint.pth")
    stopped_steps = count_stopped_epoch(checkpoint, observer, device, config.grad_accum)
    history = checkpoint.get("history") or {}
    context = {
        "model": args.model, "size": args.size, "budget_minutes": args.minutes,
        "trained_minutes": round(trained_minutes, 2),
        "device": str(device), "machine": machine(device), "seed": args.seed, "control_points": args.control_points,
        "samples_seen": observer.curve.samples[-1] if observer.curve.samples else 0,
        "steps": int(sum(history.get("steps", []))) + stopped_steps,
        "epochs": int(checkpoint["epoch"]), "train_dataset_ids": TRAIN_RANGE,
        "config": checkpoint.get("config"), "curve": observer.curve.to_dict(),
        "physics": args.physics, "physics_settings": PRESETS[args.physics].to_dict(),
        "kernel": args.kernel or BUILT_IN, "mlc": args.mlc,
        "kernel_figures": dataclasses.asdict(kernel_figures(load_kernel_of(Config(kernel=args.kernel)))),
    }
    return evaluate_run(args, output, device, context, samples)


def read_previous(output: Path) -> Path:
    """OUTPUT_DIR/quality.json of an earlier run, which ``--reevaluate`` needs with its checkpoint."""
    previous = output / "quality.json"
    if not (previous.is_file() and (output / "checkpoint.pth").is_file()):
        raise InputError(f"--reevaluate: {output} holds no checkpoint.pth and quality.json of an earlier run")
    return previous


def evaluate_run(args: argparse.Namespace, output: Path, device: torch.device, context: dict,
                 samples: inference.SampleSet | None = None) -> int:
    """Evaluate OUTPUT_DIR/checkpoint.pth on the held-out samples with each of
    ``args.reconstructions``; write quality.json (``context`` and the figures of the last
    reconstruction, every reconstruction's under ``reconstructions``) and quality.png; print the
    tables."""
    samples = samples or evaluation_set(args)
    models = build_models_from_checkpoint(load_checkpoint(output / "checkpoint.pth"), device)
    label = synthesis_label(args.physics, args.kernel)
    reports, seconds = {}, {}
    for method in args.reconstructions:
        evaluated = time.perf_counter()
        predictions = inference.predict(models, samples, device, reconstruction=method)
        reports[predictions.reconstruction] = quality.assess(samples, predictions, device=device)
        seconds[predictions.reconstruction] = round(time.perf_counter() - evaluated, 1)
        print(f"{args.model} {args.size} on held-out arcs, {label}, reconstruction "
              f"{predictions.reconstruction} ({seconds[predictions.reconstruction]:.0f} s):")
        print(reports[predictions.reconstruction].table())
    headline = list(reports)[-1]
    context = {key: value for key, value in context.items() if key not in ("groups", "metrics", "reconstructions")}
    context.update({
        "evaluation_seconds": seconds, "reconstruction": headline,
        "reconstructions": {method: report.to_dict()["groups"] for method, report in reports.items()},
        "eval_dataset_ids": sorted({ref.dataset_id for ref in samples.refs}), "eval_samples": len(samples),
    })
    reports[headline].write_json(output / "quality.json", **context)
    written = json.loads((output / "quality.json").read_text())
    title = f"{args.model} {args.size}: {args.minutes:g} min on {device}, {label}, held-out arcs"
    plots.save_figure(comparison_plots.quality_figure({args.model: written}, title), output / "quality.png")
    print(f"{PROGRAM}: wrote {output / 'checkpoint.pth'}, {output / 'quality.json'}, {output / 'quality.png'}")
    return 0


if __name__ == "__main__":
    run_main(main, PROGRAM)
