"""End-to-end training throughput of ``generate_and_train.py`` against the model-only step rate.

Sections (each runs the real entry script as a subprocess, two epochs of ``--steps`` optimizer
steps; the second epoch is measured, the first pays for warm-up):

The models are those of ``--model`` (default: the default family), trained with its recipe.

* ``cpu``: 1 rank, full size, per-rank batch 8, every CPU thread. Reports the training
  samples/s (frame synthesis, forward, backward, optimizer, per-step agreement included) and
  the same step without the data path (one batch reused, same precision and threads, in this
  process), and their ratio, medians of ``--repeats`` alternated runs. Targets: >= 25
  samples/s and >= 80 % of the model-only rate.
* ``gloo``: 2 ranks x 1 thread (gloo, DistributedDataParallel) against 1 rank x 2 threads on
  the same two datasets and the same global batch of 8.
* ``gpu`` (skipped without CUDA): 1 rank, batch 128: samples/s, share of the step spent
  waiting for data (target < 5 %) and peak GPU memory.

    python -m bench.bench_train                    # every section that can run here
    python -m bench.bench_train --sections cpu --steps 10
    python -m bench.bench_train --model legacy
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# isort: off
import epid  # noqa: F401  (first: sets the OpenMP wait policy of training before torch loads)
# isort: on

import torch

from bench.bench_models import (  # the step as bench_models times it
    TrainingStep,
    Variant,
    synchronize,
)
from epid.config.load import epid_data, load_config
from epid.core.devices import resolve_device, resolve_precision
from epid.models import families
from epid.models.families import DEFAULT_FAMILY, FAMILIES
from epid.training import side_by_side
from epid.training.distributed import available_cpus, tune_host_allocator

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIMING = re.compile(r"^\[TIMING\]\[train\] epoch 2 steps \S+: data_wait (\S+) h2d (\S+) compute (\S+) iter (\S+)",
                    re.MULTILINE)
PEAK = re.compile(r"peak GPU memory (\S+) GiB")


def run_training(variables: dict[str, str], steps: int, workdir: Path) -> dict[str, float]:
    """Two epochs of ``steps`` steps through generate_and_train.py; figures of the second epoch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPID_") and k not in LAUNCH_VARIABLES}
    checkpoint = workdir / f"run_{time.monotonic_ns()}" / "epid.pth"
    env.update(
        EPID_EPOCHS="2", EPID_STEPS_PER_EPOCH=str(steps), EPID_GAMMA_SAMPLES="0", EPID_PROGRESS="0",
        EPID_CHECKPOINT_PATH=str(checkpoint), PYTHONPATH=str(ROOT),
    )
    env.update(variables)
    result = subprocess.run([sys.executable, str(ROOT / "generate_and_train.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"training run failed ({variables}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    with open(checkpoint.parent / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    figures = {"samples_per_s": float(rows[-1]["samples_per_s"])}
    timing = TIMING.search(result.stdout)
    if timing:
        data_wait, h2d, compute, iteration = (float(v) for v in timing.groups())
        figures.update(data_wait_ms=data_wait, h2d_ms=h2d, compute_ms=compute, iter_ms=iteration,
                       data_wait_share=data_wait / iteration)
    peak = PEAK.findall(result.stdout)
    if peak:
        figures["peak_gib"] = float(peak[-1])
    return figures


def model_only_rate(variables: dict[str, str], steps: int, warmup: int = 3) -> float:
    """Samples/s of the training step on one reused real batch (no synthesis), in this process,
    with the models placed and run as a single training rank runs them (``bench_models.TrainingStep``)."""
    tune_host_allocator()  # as in every training rank
    config = load_config({"EPID_PROGRESS": "0", **variables})
    device = resolve_device(config.device)  # as training's rank 0
    threads = config.threads or available_cpus()
    torch.set_num_threads(threads)
    data = epid_data(config, config.dataset_ids[:1])
    batch = data.make_batch(data.windows("train", config.batch_size)[0], device)
    dtype = resolve_precision(config.precision, device)
    side = side_by_side.used_for(device, threads, families.family(config.model).inverse_model, distributed=False,
                                 compiled=False)
    step = TrainingStep(Variant("training", None if dtype == torch.float32 else dtype, side, False),
                        config.model_size, device, config.model)
    times = []
    try:
        for index in range(warmup + steps):
            synchronize(device)
            start = time.perf_counter()
            step(batch)
            synchronize(device)
            if index >= warmup:
                times.append(time.perf_counter() - start)
    finally:
        step.close()
    return len(batch) / statistics.median(times)


def cpu_section(steps: int, workdir: Path, repeats: int, model: str) -> None:
    variables = {"EPID_MODEL": model, "EPID_DEVICE": "cpu", "EPID_BATCH_SIZE": "8", "EPID_DATASET_IDS": "0,80,160,240"}
    runs, model_rates = [], []
    for _ in range(repeats):  # alternated, so that load from other processes affects both alike
        runs.append(run_training(variables, steps, workdir))
        model_rates.append(model_only_rate(variables, steps))
    end_to_end = sorted(runs, key=lambda figures: figures["samples_per_s"])[len(runs) // 2]
    model_only = statistics.median(model_rates)
    ratio = end_to_end["samples_per_s"] / model_only
    print(f"[cpu] 1 rank x {available_cpus()} threads, {model} full, batch 8: "
          f"{end_to_end['samples_per_s']:.1f} samples/s end to end (target >= 25), "
          f"model-only {model_only:.1f} samples/s, ratio {100 * ratio:.0f} % (target >= 80 %)", flush=True)
    if "iter_ms" in end_to_end:
        print(f"[cpu]   per step: data_wait {end_to_end['data_wait_ms']:.1f} ms, "
              f"compute {end_to_end['compute_ms']:.1f} ms, "
              f"iter {end_to_end['iter_ms']:.1f} ms", flush=True)


def gloo_section(steps: int, workdir: Path, repeats: int, model: str) -> None:
    shared = {"EPID_MODEL": model, "EPID_DEVICE": "cpu", "EPID_DATASET_IDS": "0,80", "EPID_BACKEND": "gloo"}
    two_ranks, one_rank = [], []
    for _ in range(repeats):
        two_ranks.append(run_training({**shared, "EPID_WORLD_SIZE": "2", "EPID_BATCH_SIZE": "4", "EPID_THREADS": "1"},
                                      steps, workdir)["samples_per_s"])
        one_rank.append(run_training({**shared, "EPID_WORLD_SIZE": "1", "EPID_BATCH_SIZE": "8", "EPID_THREADS": "2"},
                                     steps, workdir)["samples_per_s"])
    print(f"[gloo] global batch 8, {model} full: 2 ranks x 1 thread {statistics.median(two_ranks):.1f} samples/s, "
          f"1 rank x 2 threads {statistics.median(one_rank):.1f} samples/s (medians of {repeats})", flush=True)


def gpu_section(steps: int, workdir: Path, repeats: int, model: str) -> None:
    if not torch.cuda.is_available():
        print("[gpu] skipped: CUDA is not available", flush=True)
        return
    figures = run_training({"EPID_MODEL": model, "EPID_DEVICE": "cuda", "EPID_BATCH_SIZE": "128",
                            "EPID_DATASET_IDS": "0,80,160,240"},
                           steps, workdir)
    share = figures.get("data_wait_share", float("nan"))
    print(f"[gpu] {torch.cuda.get_device_name(0)}, 1 rank, batch 128: {figures['samples_per_s']:.1f} samples/s, "
          f"data_wait {100 * share:.1f} % of the step (target < 5 %), "
          f"peak memory {figures.get('peak_gib', float('nan')):.1f} GiB", flush=True)


SECTIONS = {"cpu": cpu_section, "gloo": gloo_section, "gpu": gpu_section}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_train", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per measured epoch")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternated repetitions of the CPU measurements (medians)")
    parser.add_argument("--model", default=DEFAULT_FAMILY, choices=sorted(FAMILIES),
                        help=f"model family, trained with its recipe (default {DEFAULT_FAMILY})")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as workdir:
        for name in args.sections:
            SECTIONS[name](args.steps, Path(workdir), args.repeats, args.model)


if __name__ == "__main__":
    main()
