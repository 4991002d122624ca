"""Predict chosen synthetic samples with a trained checkpoint and draw what a physicist
needs to judge them: one PNG per sample (measured and predicted EPID, gamma map,
difference, profiles, MLC/jaw panels, leaf weights, MU), losses.png from the training
history, summary.csv and summary.png with the per-sample errors by pattern.

Samples are synthesised as the checkpoint was trained: control points, kernel, noise
and physics come from the checkpoint's own config, unless EPID_CONTROL_POINTS, EPID_KERNEL,
EPID_NOISE_STD, EPID_NOISE_SEED or EPID_PHYSICS (or one physics variable) is set, which then
wins (the run prints which source each setting came from). Datasets: --dataset-range / --dataset-ids, else
EPID_DATASET_RANGE / EPID_DATASET_IDS, else the datasets the checkpoint was trained on.
Samples are drawn from the validation part of each arc unless --split says otherwise. The
control points are reconstructed from each frame pair (--reconstruction pair, the default), by
the inverse network alone (network) or jointly over consecutive frames (arc); the run and
quality.json say which was used. --arc reconstructs --arc-frames consecutive frames of each
arc instead (epid.reconstruction.estimate) and draws arc_<id>.png: the leaf error per leaf and control
point, the trajectories of the worst leaves, jaws and MU; arcs.csv holds the figures.

Real plans and images (DICOM): --plan predicts every frame of an RT Plan's beam (--beam N when
the plan has several treatment beams) and draws plan_frames.png; --export-frames writes the
prediction as a multi-frame RT Image. With --frames (RT Images or Varian XIM files of the
delivery: a cine series placed on the arc by gantry angle or MU, one integrated image, or frames
naming their control points; a panel's dark and flood images taken out by --dark-image and
--flood-image; measured units calibrated by --calibration) it also writes the delivery QA report
(epid.evaluation.plan_qa): gamma per frame (3 %/2 mm and 2 %/2 mm), the control points
reconstructed from the measured frames (--reconstruction, default arc) against the plan, TG-218
and TG-142 pass/fail, qa_summary.json, qa_frames.csv, qa_leaves.csv and figures; for a plan of
several beams given the images of all of them (each naming its beam), every beam's report in
beam_<n>/ and qa_plan.json. Without --plan, --export-plan and --export-frames write the synthetic
arc of one dataset ID (--dataset-ids N) as an RT Plan and its synthesised frames as an RT Image.
Frames are in the collimator's frame (x along the leaves' travel).

Examples:

  bash:        python inference_visualize.py --checkpoint runs/a/epid.pth --dataset-range 0:640:80
  PowerShell:  python .\\inference_visualize.py --checkpoint runs\\a\\epid.pth --dataset-ids 0,80,160
  whole arcs:  python inference_visualize.py --checkpoint runs/a/epid.pth --arc --arc-frames 64
  a plan:      python inference_visualize.py --checkpoint runs/a/epid.pth --plan RP.dcm --frames RI.dcm
  export:      python inference_visualize.py --dataset-ids 5 --export-plan arc5.dcm --export-frames arc5_frames.dcm
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from epid.config.load import Config, load_config
from epid.core.cli import prepare_output_dir, run_main
from epid.core.devices import resolve_device
from epid.core.errors import InputError
from epid.core.memory import keep_freed_memory
from epid.core.tables import format_table
from epid.data.sharding import select_dataset_ids
from epid.evaluation.gamma import GammaCriteria, gamma_maps
from epid.synthesis.geometry import FRAME_SHAPE
from epid.synthesis.sequences import NUM_DATASETS, PATTERNS, pattern_for

if TYPE_CHECKING:
    from epid.dicom.plan import PlanBeam
    from epid.dicom.series import MeasuredSeries, PanelCorrection
    from epid.evaluation.plots import Draw

PROGRAM = "inference_visualize.py"
PROGRESS_BAR_MIN_ITEMS = 8


def parse_arguments(argv: Sequence[str] | None, config: Config) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", default=config.checkpoint_path, metavar="PATH",
                        help="checkpoint to evaluate (default: EPID_CHECKPOINT_PATH = %(default)s)")
    selection = parser.add_mutually_exclusive_group()
    selection.add_argument("--dataset-range", default="", metavar="START:STOP[:STEP]",
                           help="dataset IDs as a Python-style range, e.g. 0:640:80")
    selection.add_argument("--dataset-ids", default="", metavar="ID,ID,...",
                           help="dataset IDs as a comma-separated list, e.g. 0,80,160")
    parser.add_argument("--samples-per-dataset", type=_positive_int, default=2, metavar="N",
                        help="samples drawn per dataset (default %(default)s)")
    parser.add_argument("--max-total-samples", type=_non_negative_int, default=64, metavar="N",
                        help="cap on all samples, spread evenly over the datasets; 0 = no cap (default %(default)s)")
    parser.add_argument("--split", choices=("val", "train", "all"), default="val",
                        help="part of each arc the samples come from (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seed of the sample choice (default %(default)s)")
    parser.add_argument("--device", default=config.device, metavar="DEVICE",
                        help="auto, cpu, cuda or cuda:N (default: EPID_DEVICE = %(default)s)")
    parser.add_argument("--batch-size", type=_positive_int, default=16, metavar="N",
                        help="samples per model call (default %(default)s)")
    parser.add_argument("--reconstruction", choices=("network", "pair", "arc"), default=None,
                        help="how control points are reconstructed from the frames: the inverse network alone, "
                             "refined per frame pair, or refined jointly over consecutive frames "
                             "(default: pair for samples, arc with --arc and --plan)")
    parser.add_argument("--arc", action="store_true",
                        help="instead of single samples, reconstruct --arc-frames consecutive frames of each "
                             "selected arc (one arc of each pattern when no datasets are named) and draw the leaf "
                             "error per leaf and control point, leaf trajectories, jaws and MU")
    parser.add_argument("--arc-frames", type=_arc_frames, default=64, metavar="N",
                        help="frames per arc with --arc, from the start of --split (default %(default)s)")
    parser.add_argument("--output-dir", default="inference_output", metavar="DIR",
                        help="folder for the PNGs and summary.csv (default %(default)s)")
    dicom = parser.add_argument_group("real plans and images (DICOM)")
    dicom.add_argument("--plan", metavar="PLAN.dcm",
                       help="predict every frame of this RT Plan's beam (plan_frames.png); with --frames, the "
                            "delivery QA report")
    dicom.add_argument("--beam", type=_positive_int, metavar="N",
                       help="beam number in --plan (needed when the plan has several treatment beams)")
    dicom.add_argument("--frames", nargs="+", metavar="RTIMAGE",
                       help="measured images of the delivery of --plan: RT Image or Varian XIM files, folders or "
                            "glob patterns: a cine series (frames placed on the arc by gantry angle, meterset weights "
                            "or the linac's MU counter), one integrated image of the beam, or frames naming their "
                            "control points")
    dicom.add_argument("--calibration", choices=("auto", "none", "fit", "commissioned", "image"), default="auto",
                       help="measured units to the models' units: none (frames already in them), fit (one "
                            "least-squares scale per delivery; it absorbs a global MU error), commissioned (the "
                            "scale a --commission run stored in the checkpoint), image (--calibration-image), "
                            "auto: none for frames naming their control points, else the calibration image where "
                            "one is given, else commissioned where the checkpoint has it, else fit "
                            "(default %(default)s)")
    dicom.add_argument("--calibration-image", metavar="RTIMAGE",
                       help="a measured image of an open reference field (--calibration-field, --calibration-mu) "
                            "on the same panel: the scale from the panel's units to the models'")
    dicom.add_argument("--calibration-field", type=_field_size, default=(100.0, 100.0), metavar="WxL",
                       help="the calibration field in mm at the isocentre, along the leaves x across them "
                            "(default 100x100)")
    dicom.add_argument("--calibration-mu", type=_positive_float, default=100.0, metavar="MU",
                       help="MU of the calibration image (default %(default)s)")
    dicom.add_argument("--dark-image", nargs="+", metavar="RTIMAGE",
                       help="images of the panel without beam (RT Images or XIM files, folders or glob patterns; "
                            "their mean): subtracted from every measured image, pixel by pixel, before it is "
                            "resampled")
    dicom.add_argument("--flood-image", nargs="+", metavar="RTIMAGE",
                       help="images of a flood field covering the panel (their mean, less the dark): every measured "
                            "image is divided by its gain relative to the panel's centre, pixel by pixel (this takes "
                            "the beam's off-axis profile out too, as a panel's flood calibration does)")
    dicom.add_argument("--commission", nargs="+", metavar="PLAN FRAMES",
                       help="commission the forward model: fit its physics and the panel's calibration to the "
                            "measured images of these plans (pairs of an RT Plan and its cine series: a folder, "
                            "glob or file); writes commissioned.pth, commissioning.json and commissioning.png "
                            "to --output-dir")
    dicom.add_argument("--commission-steps", type=_positive_int, metavar="N",
                       help="optimizer steps of --commission (default: epid.evaluation.commission.DEFAULT_STEPS, 300)")
    dicom.add_argument("--export-field-plan", metavar="FILE",
                       help="write static fields to commission on beside the VMAT plans (a closed MLC, centred "
                            "squares of 3 to 20 cm, 4 cm squares off the axis, two tongue-and-groove combs; "
                            "epid.evaluation.commission.field_plan) as an RT Plan to deliver and record, then give to "
                            "--commission")
    dicom.add_argument("--export-plan", metavar="FILE",
                       help="write the synthetic arc of the one selected dataset ID (--dataset-ids N) as an RT Plan")
    dicom.add_argument("--export-frames", metavar="FILE",
                       help="write frames as a multi-frame RT Image: the predicted frames of --plan, else the "
                            "synthesised frames of the one selected dataset ID")
    gamma = parser.add_argument_group("gamma criteria")
    default = GammaCriteria()
    gamma.add_argument("--gamma-dose-percent", type=_positive_float, default=default.dose_percent, metavar="PERCENT",
                       help="dose difference criterion, percent (default %(default)s)")
    gamma.add_argument("--gamma-distance-mm", type=_positive_float, default=default.distance_mm, metavar="MM",
                       help="distance to agreement criterion, mm (default %(default)s)")
    gamma.add_argument("--gamma-cutoff-percent", type=_non_negative_float, default=default.cutoff_percent,
                       metavar="PERCENT",
                       help="lower dose cutoff, percent of the measured maximum (default %(default)s)")
    gamma.add_argument("--gamma-local", action="store_true",
                       help="local gamma (dose criterion relative to the local measured dose)")
    return parser.parse_args(argv)


def _field_size(text: str) -> tuple[float, float]:
    """``WxL`` in mm, each in (0, 260]."""
    parts = text.lower().split("x")
    try:
        width, length = (float(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected WIDTHxLENGTH in mm, e.g. 100x100") from None
    if not (0 < width <= 260 and 0 < length <= 260):
        raise argparse.ArgumentTypeError(f"{text!r}: each side in (0, 260] mm")
    return width, length


def _bounded(kind: type, minimum: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number of ``kind`` at least ``minimum`` (or above it)."""
    expected = f"{'an integer' if kind is int else 'a number'} {'>=' if inclusive else '>'} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected}") from None
        if not math.isfinite(value) or not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"{text!r} is not {expected}")
        return value

    return parse


_positive_int = _bounded(int, 1)
_non_negative_int = _bounded(int, 0)
_positive_float = _bounded(float, 0, inclusive=False)
_non_negative_float = _bounded(float, 0)
_arc_frames = _bounded(int, 2)


def requested_dataset_ids(args: argparse.Namespace, config: Config) -> list[int] | None:
    """IDs from the arguments, else from EPID_DATASET_RANGE / EPID_DATASET_IDS; None if neither."""
    for name, range_spec, ids_spec in (
        ("--dataset-range", args.dataset_range, ""),
        ("--dataset-ids", "", args.dataset_ids),
        ("EPID_DATASET_RANGE", config.dataset_range, ""),
        ("EPID_DATASET_IDS", "", config.dataset_ids_spec),
    ):
        spec = range_spec or ids_spec
        if spec:
            try:
                return select_dataset_ids(range_spec, ids_spec)
            except ValueError as error:
                raise InputError(f"{name} {spec!r}: {error}") from None
    return None


def _stage(message: str) -> None:
    print(message, flush=True)


def _progress(items: Iterable, total: int, unit: str) -> Iterable:
    """``items`` behind a tqdm bar when there are many and stderr is a terminal."""
    if total < PROGRESS_BAR_MIN_ITEMS or not sys.stderr.isatty():
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, unit=unit, leave=False)


def load_models(path: str, device) -> tuple[dict, tuple]:
    """The checkpoint at ``path`` (weights only) and its (forward, inverse) models on ``device``."""
    from epid.models.checkpoint import CheckpointError, build_models_from_checkpoint, load_checkpoint

    checkpoint = load_checkpoint(path)
    try:
        models = build_models_from_checkpoint(checkpoint, device)
    except CheckpointError as error:
        raise InputError(f"checkpoint {path!r}: {error}") from None
    return checkpoint, models


@contextlib.contextmanager
def _counter(total: int | None, unit: str) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar's ``update`` while the block runs, when there are many items and stderr is a
    terminal; else None."""
    if (total is not None and total < PROGRESS_BAR_MIN_ITEMS) or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, unit=unit, leave=False) as bar:
        yield bar.update


def main(argv: Sequence[str] | None = None) -> int:
    config = load_config()
    args = parse_arguments(argv, config)
    keep_freed_memory()
    if args.export_field_plan:
        given = [name for name, value in (("--commission", args.commission), ("--plan", args.plan),
                                          ("--export-plan", args.export_plan), ("--export-frames", args.export_frames))
                 if value]
        if given:
            raise InputError(f"--export-field-plan: not with {given[0]} (it writes the field plan and nothing else)")
        return export_field_plan(args.export_field_plan)
    for name, value in (("--dark-image", args.dark_image), ("--flood-image", args.flood_image)):
        if value and not (args.frames or args.commission):
            raise InputError(f"{name}: only with --frames or --commission (it corrects measured images)")
    if args.commission:
        return commission_run(args)
    if args.plan or args.frames or args.beam is not None or args.export_plan or args.export_frames:
        return real_plans(args, config)
    dataset_ids = requested_dataset_ids(args, config)
    output_dir = prepare_output_dir(args.output_dir)
    if not os.path.isfile(args.checkpoint):
        raise InputError(f"--checkpoint {args.checkpoint!r}: no such file (train first, or pass --checkpoint)")
    device = resolve_device(args.device, given=f"--device {args.device!r}")

    from epid.evaluation import inference, plots, quality

    started = time.perf_counter()
    _stage(f"loading checkpoint {args.checkpoint}")
    checkpoint, models = load_models(args.checkpoint, device)
    settings = inference.resolve_synthesis(checkpoint.get("config") or {}, config)
    kernel = inference.load_synthesis_kernel(settings)
    if args.arc:
        return review_arcs(args, checkpoint, models, settings, kernel, dataset_ids, device, output_dir, started)
    if dataset_ids is None and (checkpoint.get("config") or {}).get("plans"):
        _stage("  the checkpoint was trained on RT Plan arcs (EPID_PLANS): evaluating on all synthetic dataset IDs")
        dataset_ids = list(range(NUM_DATASETS))
    if dataset_ids is None:
        dataset_ids = sorted(checkpoint.get("dataset_ids") or range(NUM_DATASETS))
    refs = inference.select_samples(
        dataset_ids, args.samples_per_dataset, args.seed, settings.control_points,
        max_total=args.max_total_samples or None, split=args.split,
    )
    criteria = GammaCriteria(
        dose_percent=args.gamma_dose_percent, distance_mm=args.gamma_distance_mm,
        cutoff_percent=args.gamma_cutoff_percent, local=args.gamma_local,
    )
    run_label = f"{Path(args.checkpoint).name}, epoch {checkpoint['epoch']}"
    _stage(f"  {run_label}, best epoch {checkpoint.get('best_epoch')}; device {device}")
    _stage(f"  synthesis: {settings.describe()}")

    used = len({ref.dataset_id for ref in refs})
    _stage(f"synthesising {len(refs)} samples ({args.split} split) from {used} datasets")
    samples = inference.synthesise_samples(
        refs, settings, kernel, device, progress=lambda ids: _progress(ids, used, "dataset")
    )
    _stage(f"predicting both directions (batches of {args.batch_size})")
    predictions = inference.predict(models, samples, device, args.batch_size,
                                    reconstruction=args.reconstruction or "pair")
    _stage(f"  control points reconstructed by: {predictions.reconstruction}")
    _stage(f"gamma {criteria.describe()}")
    gamma = gamma_maps(samples.epid_curr, predictions.epid, criteria, device, batch_size=args.batch_size)
    records = inference.sample_metrics(samples, predictions, gamma)
    _stage("quality figures (gamma 3 %/3 mm, 3 %/2 mm, 2 %/2 mm; leaves, jaws and MU of both control points)")
    report = quality.assess(samples, predictions, device=device)
    report.write_json(output_dir / "quality.json", checkpoint=str(args.checkpoint), epoch=checkpoint["epoch"],
                      split=args.split, synthesis=settings.describe(), reconstruction=predictions.reconstruction)

    _stage(f"writing {len(records)} sample figures, losses.png, summary.png and summary.csv to {output_dir}")
    inference.write_metrics_csv(output_dir / "summary.csv", records)
    plots.save_figure(plots.losses_figure(checkpoint.get("history") or {}, checkpoint.get("best_epoch"),
                                          f"Training history: {run_label}"), output_dir / "losses.png")
    plots.save_figure(plots.summary_figure(records, f"{len(records)} samples from {used} datasets; {run_label}; "
                                                    f"gamma {criteria.describe()}"), output_dir / "summary.png")
    for index in _progress(range(len(records)), len(records), "figure"):
        ref = samples.refs[index]
        figure = plots.sample_figure(samples, predictions, gamma[index].numpy(), records[index], index, criteria)
        plots.save_figure(figure, output_dir / f"dataset_{ref.dataset_id:03d}_sample_{ref.sample:04d}.png")

    print(pattern_table(inference.pattern_means(records)))
    print(f"Quality ({len(records)} samples; quality.json):\n{report.table()}")
    _stage(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def review_arcs(args: argparse.Namespace, checkpoint: dict, models: tuple, settings, kernel,
                dataset_ids: list[int] | None, device, output_dir: Path, started: float) -> int:
    """``--arc``: reconstruct consecutive frames of whole arcs, one figure per arc, arcs.csv and a table."""
    from epid.evaluation import arc_review

    if dataset_ids is None:
        plans = (checkpoint.get("config") or {}).get("plans")
        trained = sorted(checkpoint.get("dataset_ids") or []) if not plans else []
        trained = trained or range(NUM_DATASETS)
        dataset_ids = [next(i for i in trained if pattern_for(i) == pattern) for pattern in PATTERNS
                       if any(pattern_for(i) == pattern for i in trained)]
    first = arc_review.first_frame(args.split, settings.control_points)
    count = min(args.arc_frames, settings.control_points - first)
    if count < 2:
        raise InputError(f"--arc-frames {args.arc_frames}: the {args.split} part of an arc of "
                         f"{settings.control_points} control points has fewer than 2 frames from frame {first}")
    method = args.reconstruction or "arc"
    run_label = f"{Path(args.checkpoint).name}, epoch {checkpoint['epoch']}"
    _stage(f"  synthesis: {settings.describe()}")
    _stage(f"reconstructing frames {first}-{first + count - 1} of {len(dataset_ids)} arcs ({method})")
    rows = []
    for dataset_id in _progress(dataset_ids, len(dataset_ids), "arc"):
        segment = arc_review.synthesise_segment(dataset_id, first, count, settings, kernel, device)
        begun = time.perf_counter()
        estimate = arc_review.reconstruct_segment(method, models, segment, device, mlc=settings.mlc)
        seconds = time.perf_counter() - begun
        estimate = arc_review.read_hidden_edges(models[0], segment, estimate)
        errors = arc_review.arc_errors(estimate, segment)
        rows.append({"dataset_id": dataset_id, "pattern": segment.pattern, "first_frame": first, "frames": count,
                     "method": estimate.method, "seconds": seconds, **errors})
        arc_review.write_review(segment, estimate, errors, output_dir / f"arc_{dataset_id:03d}.png", run_label)
    arc_review.write_errors_csv(output_dir / "arcs.csv", rows)
    columns = (("frames/s", lambda row: f"{row['frames'] / row['seconds']:.2f}"),
               *((key, lambda row, key=key: f"{row[key]:.3f}") for key in arc_review.ERROR_KEYS))
    print(format_table(["dataset", "pattern", "method", *(title for title, _ in columns)],
                       [[str(row["dataset_id"]), row["pattern"], row["method"], *(form(row) for _, form in columns)]
                        for row in rows]))
    _stage(f"wrote {len(rows)} arc figures and arcs.csv to {output_dir}; done in {time.perf_counter() - started:.1f} s")
    return 0


def real_plans(args: argparse.Namespace, config: Config) -> int:
    """--plan (prediction, with --frames the QA report) or the export of a synthetic arc; every
    argument and input file is checked before a model is loaded or a file written."""
    for name, value in (("--beam", args.beam), ("--frames", args.frames)):
        if value is not None and not args.plan:
            raise InputError(f"{name}: needs --plan (the RT Plan the beam and frames belong to)")
    if args.export_plan and args.export_frames and Path(args.export_plan).absolute() == \
            Path(args.export_frames).absolute():
        raise InputError(f"--export-plan and --export-frames name the same file {args.export_plan!r}")
    inputs = {Path(path).absolute() for path in [args.plan or "", *(args.frames or [])] if path}
    for name, path in (("--export-plan", args.export_plan), ("--export-frames", args.export_frames)):
        if path and Path(path).absolute() in inputs:
            raise InputError(f"{name} {path!r}: is an input file of this run; expected a new file name")
        if path:
            _check_output_file(path, name)
    if args.plan:
        given = [name for name, value in (("--export-plan", args.export_plan), ("--arc", args.arc),
                                          ("--dataset-range", args.dataset_range),
                                          ("--dataset-ids", args.dataset_ids)) if value]
        if given:
            raise InputError(f"{given[0]}: not with --plan (the plan's beam is the arc)")
        return review_plan(args)
    return export_arc(args, config)


def commission_run(args: argparse.Namespace) -> int:
    """--commission: the forward model's physics and the panel's calibration fitted to measured
    images of plans (epid.evaluation.commission), written as a commissioned checkpoint."""
    from epid.dicom.series import read_series
    from epid.evaluation import commission, inference, plan_qa, plots
    from epid.models.checkpoint import save_checkpoint
    from epid.training.preflight import check_writable

    pairs = args.commission
    if len(pairs) % 2:
        raise InputError(f"--commission: {len(pairs)} names; expected pairs of an RT Plan and its measured images")
    given = [name for name, value in (("--plan", args.plan), ("--frames", args.frames), ("--arc", args.arc)) if value]
    if given:
        raise InputError(f"{given[0]}: not with --commission (its plans and images are given in pairs)")
    measurements, deliveries = [], []
    correction = panel_correction_of(args)
    for plan, frames in zip(pairs[::2], pairs[1::2], strict=True):
        series = read_series(frames, correction)
        measurements.append(commission.Measurement.of(select_beam(plan, None), series))
        deliveries.append((series, measurements[-1].placement))
    if not os.path.isfile(args.checkpoint):
        raise InputError(f"--checkpoint {args.checkpoint!r}: no such file (train first, or pass --checkpoint)")
    check_writable(Path(args.output_dir).absolute(), "--output-dir")
    steps = args.commission_steps or commission.DEFAULT_STEPS
    started = time.perf_counter()
    _stage(f"loading checkpoint {args.checkpoint}")
    checkpoint, (forward_model, inverse_model) = load_models(args.checkpoint, "cpu")
    commission.check_commissionable(forward_model, args.checkpoint)
    for measurement in measurements:
        inference.check_plan_mlc(measurement.beam, checkpoint.get("config") or {}, args.checkpoint)
    output_dir = prepare_output_dir(args.output_dir)
    for measurement in measurements:
        _stage(f"  beam {measurement.beam.beam_number} of {measurement.beam.path}: "
               f"{measurement.placement.describe()}")
    _stage(f"commissioning the forward model on {len(measurements)} plan(s): {steps} steps, then the transmissions, "
           "the lags and the panel's response by least squares")

    def report(step: int, loss: float) -> None:
        if step % 25 == 0 or step == steps:
            _stage(f"  step {step}/{steps}: loss {loss:.4g}")

    result = commission.commission(forward_model, measurements, steps, progress=report)
    commission.with_commissioned_lag(inverse_model, result.model)
    _stage("reading the commissioning plans' MU against their reconstruction (the MU reference)")
    mu_reference = plan_qa.commissioned_mu_reference((result.model, inverse_model),
                                                     commission.reference_deliveries(deliveries), result.scale)
    _stage(f"  MU reference {mu_reference:.4f}")
    payload = {**checkpoint, "forward_model": result.model.state_dict(), "inverse_model": inverse_model.state_dict(),
               "commissioning": {**{key: value for key, value in result.summary.items()
                                    if key not in ("parameters", "calibration_scale")},
                                 "calibration_scale": result.scale, "mu_reference": mu_reference,
                                 "source": str(args.checkpoint)}}
    save_checkpoint(output_dir / "commissioned.pth", payload)
    summary = {"checkpoint": str(args.checkpoint), **result.summary, "mu_reference": mu_reference}
    (output_dir / "commissioning.json").write_text(json.dumps(summary, indent=2) + "\n")
    plots.save_figure(plots.commissioning_figure(result.losses, result.summary), output_dir / "commissioning.png")
    rows = [[name, ", ".join(f"{v:.4g}" for v in item["before"]), ", ".join(f"{v:.4g}" for v in item["after"])]
            for name, item in result.summary["parameters"].items()]
    print(format_table(["parameter", "before", "after"], rows))
    print("by least squares after the steps: " + ", ".join(
        f"{name} {item['after_steps']:.4g} -> {item['least_squares']:.4g}"
        for name, item in result.summary["least_squares"].items()))
    for plan, before, after, output_before, output_after in zip(
            *(result.summary[key] for key in ("plans", "gamma_before", "gamma_after", "output_before", "output_after")),
            strict=True):
        print(f"{plan}: gamma 3 %/2 mm {before['3_2mm']:.2f} -> {after['3_2mm']:.2f} %, 2 %/2 mm "
              f"{before['2_2mm']:.2f} -> {after['2_2mm']:.2f} %; output of its runs of {commission.WINDOW} frames "
              f"{output_before['rms_percent']:.2f} -> {output_after['rms_percent']:.2f} % rms (worst "
              f"{output_after['worst_percent']:+.2f} % from frame {output_after['worst_first_frame'] + 1})")
    _stage(f"wrote commissioned.pth, commissioning.json and commissioning.png to {output_dir}; done in "
           f"{time.perf_counter() - started:.1f} s")
    return 0


def _check_output_file(path: str, argument: str) -> None:
    """``path`` is not a folder and its folder can be made and written in; nothing is created."""
    from epid.training.preflight import check_writable

    if os.path.isdir(path):
        raise InputError(f"{argument} {path!r}: a folder; expected a file name")
    check_writable(Path(path).absolute().parent, f"{argument} folder")


def select_beam(path: str, beam: int | None) -> PlanBeam:
    """The ``PlanBeam`` of ``--plan``: ``beam``, or the plan's only treatment beam."""
    from epid.dicom.plan import read_plan

    beams = read_plan(path, beam)
    if len(beams) > 1:
        listed = ", ".join(f"{item.beam_number} ({item.beam_name})" for item in beams)
        raise InputError(f"{path}: {len(beams)} treatment beams ({listed}); choose one with --beam")
    return beams[0]


def panel_correction_of(args: argparse.Namespace) -> PanelCorrection | None:
    """The panel's dark offset and flood-field gain from ``--dark-image`` and ``--flood-image``
    (epid.dicom.series.panel_correction), None without either; said in a line."""
    from epid.dicom.series import panel_correction

    correction = panel_correction(args.dark_image, args.flood_image)
    if correction is not None:
        given = "; ".join(f"{name} {len(files)} image(s), {files[0]}{' ...' if len(files) > 1 else ''}"
                          for name, files in correction.sources.items())
        _stage(f"panel correction ({correction.dark.shape[0]} x {correction.dark.shape[1]} pixels): {given}")
    return correction


def plan_deliveries(args: argparse.Namespace,
                    correction: PanelCorrection | None = None) -> list[tuple[PlanBeam, MeasuredSeries | None]]:
    """The beams of ``--plan`` to review, each with its measured series from ``--frames`` (None
    without; each frame corrected by ``correction``): ``--beam``, or the plan's only treatment beam,
    with its images among those given (images of other beams left aside, and said so); or, for a
    plan of several treatment beams whose images name their beams (``ReferencedBeamNumber``), every
    beam with its own images.
    InputError where a beam cannot be told or has no images."""
    from epid.dicom.plan import read_plan
    from epid.dicom.series import read_beam_series

    beams = read_plan(args.plan, args.beam)
    measured = read_beam_series(args.frames, correction) if args.frames else []
    if len(beams) == 1:
        if len(measured) <= 1:
            return [(beams[0], measured[0] if measured else None)]
        beam = beams[0]
        own = [series for series in measured if series.beam_number == beam.beam_number]
        others = ", ".join(f"{len(series)} of beam {series.beam_number}" for series in measured
                           if series.beam_number != beam.beam_number)
        if not own:
            raise InputError(f"--frames: no images of beam {beam.beam_number} ({beam.beam_name}) of {args.plan}, only "
                             f"images of other beams ({others})")
        _stage(f"  --frames: the {len(own[0])} frame(s) of beam {beam.beam_number}; left aside: {others}")
        return [(beam, own[0])]
    listed = ", ".join(f"{item.beam_number} ({item.beam_name})" for item in beams)
    if not args.frames or args.export_frames:
        raise InputError(f"{args.plan}: {len(beams)} treatment beams ({listed}); choose one with --beam"
                         + ("" if not args.frames else " (--export-frames writes one beam's frames)"))
    if measured[0].beam_number is None:
        raise InputError(f"{args.plan}: {len(beams)} treatment beams ({listed}) and the images of --frames name "
                         "none (ReferencedBeamNumber); choose one with --beam")
    by_number = {beam.beam_number: beam for beam in beams}
    for series in measured:
        if series.beam_number not in by_number:
            raise InputError(f"{series.sources[0]}: an image of beam {series.beam_number}, which is not a treatment "
                             f"beam of {args.plan} ({listed})")
    seen = {series.beam_number for series in measured}
    missing = [f"{beam.beam_number} ({beam.beam_name})" for beam in beams if beam.beam_number not in seen]
    if missing:
        raise InputError(f"--frames: no images of beam {', '.join(missing)} of {args.plan}; give the images of "
                         "every beam, or choose one with --beam")
    return [(by_number[series.beam_number], series) for series in measured]


def review_plan(args: argparse.Namespace) -> int:
    """--plan: predict the beam's frames; with --frames, the delivery QA report (epid.evaluation.plan_qa)
    of each beam measured, and for several beams qa_plan.json and their verdicts side by side. The
    figures are drawn by a worker process started before the frames are read."""
    from epid.core.background import BackgroundCalls
    from epid.evaluation import plots

    started = time.perf_counter()
    with BackgroundCalls() as background:
        _review_plan(args, functools.partial(background.call, plots.draw))
    _stage(f"done in {time.perf_counter() - started:.1f} s")
    return 0


def _review_plan(args: argparse.Namespace, draw: Draw) -> None:
    from epid.dicom.series import read_series
    from epid.evaluation import inference, plan_qa, qa_report, timeline
    from epid.training.preflight import check_writable

    correction = panel_correction_of(args)
    deliveries = plan_deliveries(args, correction)
    placements = []
    for beam, series in deliveries:
        placement = timeline.place_frames(beam, series) if series is not None else None
        if series is not None and not series.integrated:
            plan_qa.match_frames(placement.beam, plan_qa.placed_frames(series, placement))
        placements.append(placement)
    reference = read_series(args.calibration_image, correction) if args.calibration_image else None
    if reference is not None and len(reference) != 1:
        raise InputError(f"--calibration-image {args.calibration_image}: {len(reference)} frames; expected one image "
                         "of an open field")
    if not os.path.isfile(args.checkpoint):
        raise InputError(f"--checkpoint {args.checkpoint!r}: no such file (train first, or pass --checkpoint)")
    check_writable(Path(args.output_dir).absolute(), "--output-dir")
    device = resolve_device(args.device, given=f"--device {args.device!r}")

    _stage(f"loading checkpoint {args.checkpoint}")
    checkpoint, models = load_models(args.checkpoint, device)
    for beam, _ in deliveries:
        inference.check_plan_mlc(beam, checkpoint.get("config") or {}, args.checkpoint)
    output_dir = prepare_output_dir(args.output_dir)
    image = None if reference is None else plan_qa.calibration_image(models[0], reference, *args.calibration_field,
                                                                      args.calibration_mu, device)
    if len(deliveries) == 1:
        beam_review(args, checkpoint, models, deliveries[0], placements[0], image, device, output_dir, draw)
        return
    summaries = []
    for (beam, series), placement in zip(deliveries, placements, strict=True):
        folder = prepare_output_dir(output_dir / f"beam_{beam.beam_number}")
        _stage(f"beam {beam.beam_number} ({beam.beam_name}): {len(series)} measured frame(s), report in {folder}")
        summaries.append(beam_review(args, checkpoint, models, (beam, series), placement, image, device, folder, draw))
    plan = qa_report.write_plan_summary(args.plan, summaries, output_dir)
    print(qa_report.plan_table(plan))
    _stage(f"wrote qa_plan.json and a report per beam (beam_<n>/) to {output_dir}")


def beam_review(args: argparse.Namespace, checkpoint: dict, models: tuple,
                delivery: tuple[PlanBeam, MeasuredSeries | None], placement, image, device,
                output_dir: Path, draw: Draw) -> dict | None:
    """One beam of --plan: its predicted frames (plan_frames.png, --export-frames) and, with a
    measured series, its QA report in ``output_dir``, the figures through ``draw``; returns the
    report's summary (None without)."""
    from epid.dicom.image import write_frames
    from epid.evaluation import plan_qa, qa_report, timeline

    beam, series = delivery
    run_label = f"{Path(args.checkpoint).name}, epoch {checkpoint['epoch']}"
    frames = len(beam) - 1
    _stage(f"  beam {beam.beam_number} ({beam.beam_name}) of {args.plan}: {beam.machine}, {beam.mlc}, "
           f"{len(beam)} control points, {beam.beam_mu:g} MU, gantry {beam.gantry_deg[0]:g} -> "
           f"{beam.gantry_deg[-1]:g} deg, collimator {beam.collimator_deg:g} deg")
    cine = series is not None and not series.integrated and not placement.by_control_points
    predicted = None  # a cine series' plan_frames.png shows its own frames, which its QA predicts
    if not cine or args.export_frames:
        _stage(f"predicting its {frames} frames (batches of {args.batch_size})")
        with _counter(frames, "frame") as advance:
            predicted = plan_qa.predict_plan_frames(models[0], beam.control_points, device, args.batch_size, advance,
                                                    beam.x_jaws)
        if not cine:
            qa_report.write_plan_frames(predicted, beam, output_dir / "plan_frames.png", run_label, draw)
    if args.export_frames:
        write_frames(args.export_frames, predicted, plan_path=args.plan, beam=beam.beam_number,
                     description="predicted")
        _stage(f"  wrote the {frames} predicted frames as an RT Image: {args.export_frames}")
    if series is None:
        _stage(f"wrote plan_frames.png to {output_dir}")
        return None

    context = beam_context(args, checkpoint, series, placement)
    commissioning = checkpoint.get("commissioning") or {}
    if series.integrated:
        if placement.whole_beam:
            compared = predicted.sum(0, keepdim=True)  # the plan's frames, their lag carried as trained
        else:
            _stage("predicting the integrated image over its span of the beam")
            compared = timeline.predict_spans(models[0], placement, device, args.batch_size)
        measured_frames, calibration = plan_qa.calibrated_frames(series, placement, compared, args.calibration,
                                                                 commissioning.get("calibration_scale"), image)
        _stage(f"  calibration: {calibration['method']}, scale {calibration['scale']:.6g}")
        return integrated_report(args, beam, series, measured_frames, compared, {**context, "calibration": calibration},
                                 output_dir, draw)
    return frames_review(args, models, commissioning, series, placement, image, device, output_dir, run_label,
                         context, draw, None if cine else predicted)


def beam_context(args: argparse.Namespace, checkpoint: dict, series: MeasuredSeries, placement) -> dict:
    """What a beam's QA summary says first: the checkpoint and how the measured frames were placed
    (said here, with a warning where part of a field lies outside the grid)."""
    from epid.evaluation import plan_qa

    _stage(f"  {series.path}: {placement.describe()}")
    outside = float(series.outside_percent.max())
    if outside > plan_qa.OUTSIDE_WARNING_PERCENT:
        _stage(f"  warning: up to {outside:.1f} % of a measured frame's field signal lies outside the "
               f"{FRAME_SHAPE[0]} mm grid and is not compared")
    return {"checkpoint": str(args.checkpoint), "epoch": checkpoint["epoch"], "placement": placement.describe(),
            "dropped_frames": placement.dropped, "outside_grid_percent": round(outside, 3),
            "panel_correction": {"dark_image": args.dark_image, "flood_image": args.flood_image}}


def frames_review(args: argparse.Namespace, models: tuple, commissioning: dict, series: MeasuredSeries, placement,
                  image, device, output_dir: Path, run_label: str, context: dict, draw: Draw,
                  predicted: torch.Tensor | None = None) -> dict:
    """The QA report of measured frames (not an integrated image) in ``output_dir``, with the
    checkpoint's ``commissioning`` (calibration scale, MU reference) and ``predicted``, the plan's
    frames for frames that name their control points; a cine series' own frames are predicted over
    their spans and drawn as plan_frames.png. Returns the report's summary."""
    from epid.evaluation import plan_qa, qa_report

    if args.reconstruction == "pair" and not placement.by_control_points:
        _stage("  warning: --reconstruction pair reads a cine series' leaves from single frame pairs, ~2 mm off on a "
               "real panel's blur; arc (the default) takes them between the frames")
    qa, calibration = plan_qa.measured_qa(models, series, placement, args.calibration,
                                          commissioning.get("calibration_scale"),
                                          args.reconstruction or "arc", device, args.batch_size, _stage, image,
                                          predicted, commissioning.get("mu_reference", 1.0))
    if not placement.by_control_points:
        qa_report.write_series_frames(qa, output_dir / "plan_frames.png", run_label, draw)
    summary = qa_report.write_report(qa, output_dir, run_label, draw, **context, calibration=calibration)
    print(qa_report.verdict_table(summary))
    _stage(f"wrote plan_frames.png, qa_summary.json, qa_frames.csv, qa_leaves.csv, qa_leaf_errors.csv, qa_gamma.png, "
           f"qa_leaves.png and qa_worst_frame.png to {output_dir}")
    return summary


def integrated_report(args: argparse.Namespace, beam: PlanBeam, series, measured: torch.Tensor,
                      predicted: torch.Tensor, context: dict, output_dir: Path, draw: Draw) -> dict:
    """The QA of an integrated image: gamma against the beam's predicted integrated image,
    qa_summary.json and qa_integrated.png; returns the summary."""
    from epid.evaluation import plan_qa, qa_report

    gamma = plan_qa.frame_gamma(measured, predicted, "cpu")
    summary = {**context, **plan_qa.integrated_summary(beam, series.path, gamma)}
    (output_dir / "qa_summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    qa_report.write_integrated_figure(measured[0].numpy(), predicted[0].numpy(), gamma, beam,
                                      output_dir / "qa_integrated.png", f"{Path(args.checkpoint).name}", draw)
    rate = summary["gamma_3_2mm_integrated"]
    print(f"Integrated-image QA of beam {beam.beam_number}: 3 %/2 mm {rate:.2f} % (TG-218 tolerance "
          f"{plan_qa.TG218_TOLERANCE_PERCENT:g} %), 2 %/2 mm {summary['gamma_2_2mm_integrated']:.2f} %: "
          f"{'PASS' if summary['pass'] else 'FAIL'}")
    _stage(f"wrote plan_frames.png, qa_summary.json and qa_integrated.png to {output_dir}")
    return summary


def export_field_plan(path: str) -> int:
    """--export-field-plan: the commissioning fields (epid.evaluation.commission.field_plan) as an RT
    Plan of one beam over 120 degrees of gantry, 150 MU."""
    from epid.dicom.plan import write_plan
    from epid.evaluation import commission

    _check_output_file(path, "--export-field-plan")
    control_points = commission.field_plan()
    write_plan(path, control_points, beam_mu=150.0, gantry_start_deg=181.0, gantry_stop_deg=301.0,
               label="EPID fields")
    _stage(f"wrote the commissioning fields ({len(commission.FIELDS_MM)} fields, {len(control_points)} control "
           f"points, 150 MU) as an RT Plan: {path}")
    return 0


def export_arc(args: argparse.Namespace, config: Config) -> int:
    """--export-plan / --export-frames without --plan: the synthetic arc of one dataset ID as an
    RT Plan and its synthesised frames (settings of the checkpoint when it exists, else of the
    EPID_* variables) as an RT Image."""
    from epid.dicom.image import write_frames
    from epid.dicom.plan import write_plan
    from epid.evaluation import inference
    from epid.synthesis.frames import render_frames, renderer_for
    from epid.synthesis.sequences import generate_control_points

    dataset_ids = requested_dataset_ids(args, config)
    if dataset_ids is None or len(dataset_ids) != 1:
        given = "none" if dataset_ids is None else f"{len(dataset_ids)}"
        raise InputError(f"--export-plan / --export-frames without --plan: expected one dataset ID "
                         f"(e.g. --dataset-ids 5), got {given}")
    (dataset_id,) = dataset_ids
    device = resolve_device(args.device, given=f"--device {args.device!r}")
    saved = {}
    if os.path.isfile(args.checkpoint):
        from epid.models.checkpoint import load_checkpoint

        saved = load_checkpoint(args.checkpoint).get("config") or {}
    settings = inference.resolve_synthesis(saved, config)
    kernel = inference.load_synthesis_kernel(settings)
    control_points = generate_control_points(dataset_id, settings.control_points, settings.mlc)
    _stage(f"dataset {dataset_id} ({control_points.pattern}); synthesis: {settings.describe()}")
    if args.export_plan:
        write_plan(args.export_plan, control_points, label=f"EPID arc {dataset_id}", mlc=settings.mlc)
        _stage(f"  wrote its {len(control_points)} control points as an RT Plan: {args.export_plan}")
    if args.export_frames:
        count = len(control_points) - 1
        renderer = renderer_for(kernel, device)
        frames = []
        with _counter(count, "frame") as advance:
            for start in range(1, count + 1, args.batch_size):
                indices = np.arange(start, min(start + args.batch_size, count + 1))
                frames.append(render_frames(control_points, indices, renderer, dataset_id=dataset_id,
                                            noise_std=settings.noise_std, noise_seed=settings.noise_seed,
                                            device=device, physics=settings.physics).float().cpu())
                if advance is not None:
                    advance(len(indices))
        frames = torch.cat(frames)
        write_frames(args.export_frames, frames, plan_path=args.export_plan or None,
                     description=f"synthesised dataset {dataset_id}")
        _stage(f"  wrote its {count} synthesised frames as an RT Image: {args.export_frames}")
    return 0


def pattern_table(means: dict[str, dict[str, float]]) -> str:
    """Per-pattern means as an aligned text table."""
    columns = (
        ("n", "count", "{:.0f}"), ("gamma %", "gamma_pass_percent", "{:.1f}"),
        ("leaf band mm", "leaf_mae_band_mm", "{:.2f}"), ("leaf all mm", "leaf_mae_mm", "{:.2f}"),
        ("jaw mm", "jaw_mae_mm", "{:.2f}"), ("MU err", "mu_abs_error", "{:.2f}"),
        ("fwd MSE", "forward_mse", "{:.3g}"),
    )
    rows = [[pattern, *(form.format(row[key]) for _, key, form in columns)] for pattern, row in means.items()]
    return "Mean per pattern:\n" + format_table(["pattern", *(title for title, _, _ in columns)], rows)


if __name__ == "__main__":
    run_main(main, PROGRAM)
