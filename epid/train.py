"""Cross-training of the forward and inverse models: ``launch`` and the per-rank training loop.

``launch(config)`` checks everything a rank would trip over (device, kernel file, checkpoint
folder, the checkpoint to resume) in the launching process, so bad input exits with status 2 before any
rank starts, then runs ``run_rank`` on every rank (``epid.distributed``).

Placement of the models: DistributedDataParallel across ranks; on a single CPU rank with two
or more threads, the forward and inverse models run side by side on their own threads
(``epid.side_by_side``).

One epoch on one rank:

* training: the rank's training windows (contiguous samples of one dataset, ``epid.dataset``)
  in sequential or shuffled order. Every rank takes the same number of optimizer steps: the
  largest window count of any rank (capped by EPID_STEPS_PER_EPOCH), rounded up to whole
  EPID_GRAD_ACCUM groups; a rank with fewer windows goes round its list again from the start.
  Gradients are all-reduced once per optimizer step (``no_sync`` on the other micro-batches).
  After each step the ranks agree, in one small all-reduce, whether any rank saw a non-finite
  loss (then every rank skips the step) and whether any rank received SIGINT / SIGTERM (then
  every rank stops after that step and rank 0 writes a checkpoint that resumes mid-epoch);
* validation: every validation window of the rank once (no collectives inside), and the
  forward model's gamma pass rate (3 %/3 mm global, 10 % cutoff) on a fixed subset of
  EPID_GAMMA_SAMPLES validation samples spread over the selected datasets;
* one all-reduce of the loss sums (weighted by sample counts), sample counts, gamma sums,
  step counts and stop flags; rank 0 decides early stopping and broadcasts it, steps the
  learning-rate schedule, writes the checkpoint(s), ``metrics.csv`` and ``losses.png`` and
  prints the epoch line.

Learning rate: AdamW at EPID_LR (scaled by EPID_LR_SCALING), linear warm-up over
EPID_WARMUP_EPOCHS, then cosine annealing with warm restarts (T0 = 10 epochs, T_mult = 2,
eta_min = 1e-6), one schedule step per epoch (``learning_rate``).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import random
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from epid import distributed, evaluate, metrics_log, sharding, side_by_side
from epid.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    best_path,
    build_models_from_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from epid.cli import prepare_output_dir
from epid.config import Config, describe, rank_report
from epid.dataset import (
    Batch,
    BatchLoader,
    EpidData,
    Window,
    epoch_windows,
    steps_per_epoch,
)
from epid.devices import autocast, resolve_device, resolve_precision
from epid.distributed import RankContext, StopSignal
from epid.errors import InputError
from epid.families import CrossModel, build_models
from epid.gamma import gamma_maps, gamma_pass_rate
from epid.losses import LOSS_TERMS, cross_training_loss

RESTART_PERIOD_EPOCHS = 10
RESTART_PERIOD_FACTOR = 2
MIN_LR = 1e-6
PROGRESS_LINES_PER_EPOCH = 10
PROGRESS_LINES_MIN_STEPS = 100
NUM_TERMS = len(LOSS_TERMS)


# --------------------------------------------------------------------------- launch


def launch(config: Config) -> int:
    """Train as ``config`` says on every rank of this node; return the process exit status.

    0: finished, stopped early, or stopped by SIGINT / SIGTERM with a checkpoint written;
    1: a rank failed or the run stopped on non-finite losses. Raises InputError (exit 2)
    before any rank starts when the device, kernel or checkpoint to resume cannot work.
    """
    notes = check_inputs(config)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this; rank 0 reports
        for note in notes:
            print(note, flush=True)
    return distributed.launch(run_rank, config)


def check_inputs(config: Config) -> list[str]:
    """Validate what every rank would otherwise find out on its own; return resume notes."""
    distributed.check_launch(config)
    check_kernel(config)
    resolve_precision(config.precision, resolve_device(config.device))
    check_checkpoint_folder(config)
    if not config.resume:
        return []
    return resume_notes(config, load_checkpoint(config.checkpoint_path))


def check_kernel(config: Config) -> None:
    """Load EPID_KERNEL once here so a bad .mat file is one error line, not one per rank."""
    if not config.kernel_path:
        return
    from epid.kernel import kernel_from_config

    try:
        kernel_from_config(config.kernel_path, config.kernel_variable)
    except InputError:
        raise
    except (ValueError, OSError, KeyError) as error:
        raise InputError(f"EPID_KERNEL={config.kernel!r}: {error}") from None


def check_checkpoint_folder(config: Config) -> None:
    """Create the checkpoint's folder and make sure files can be written there (before any epoch runs)."""
    prepare_output_dir(str(Path(config.checkpoint_path).parent), argument="EPID_CHECKPOINT_PATH folder")


def resume_notes(config: Config, checkpoint: dict[str, Any]) -> list[str]:
    """Check that ``checkpoint`` can continue under ``config``; describe what changes.

    Raises CheckpointError when the model size differs, the models do not rebuild, or the
    checkpoint already reached EPID_EPOCHS.
    """
    path = config.checkpoint_path
    saved = checkpoint.get("config") or {}
    if saved.get("model_size", config.model_size) != config.model_size:
        raise CheckpointError(
            f"checkpoint {path!r} holds EPID_MODEL_SIZE={saved['model_size']!r} models; "
            f"EPID_MODEL_SIZE={config.model_size!r} cannot resume it (use the same size)"
        )
    build_models_from_checkpoint(checkpoint)
    if "optimizer" not in checkpoint or "scheduler" not in checkpoint:
        raise CheckpointError(f"checkpoint {path!r} has no optimizer/scheduler state; it cannot be resumed")
    epoch = int(checkpoint["epoch"])
    if epoch >= config.epochs:
        raise CheckpointError(
            f"checkpoint {path!r} already completed {epoch} epoch(s); set EPID_EPOCHS above {epoch} to continue"
        )
    notes = [f"Resuming {path} after epoch {epoch} (run {checkpoint.get('run_id', '?')})"]
    saved_world = int(checkpoint.get("world_size", config.world_size))
    if saved_world != config.world_size:
        notes.append(f"  world size changes from {saved_world} to {config.world_size} rank(s)")
    if list(checkpoint.get("dataset_ids", config.dataset_ids)) != list(config.dataset_ids):
        notes.append(f"  dataset selection changes ({len(checkpoint['dataset_ids'])} -> {len(config.dataset_ids)} datasets)")
    for name in ("batch_size", "grad_accum", "control_points"):
        if name in saved and saved[name] != getattr(config, name):
            notes.append(f"  {name} changes from {saved[name]} to {getattr(config, name)}")
    saved_lr = _saved_base_lr(checkpoint)
    if saved_lr is not None and not math.isclose(saved_lr, config.effective_lr, rel_tol=1e-9):
        notes.append(f"  base learning rate changes from {saved_lr:.3g} to {config.effective_lr:.3g} (schedule position kept)")
    return notes


def _saved_base_lr(checkpoint: dict[str, Any]) -> float | None:
    base_lrs = (checkpoint.get("scheduler") or {}).get("base_lrs")
    return float(base_lrs[0]) if base_lrs else None


# --------------------------------------------------------------------------- settings


def learning_rate(epoch_index: int, base_lr: float, warmup_epochs: int = 0) -> float:
    """Learning rate of the 0-based epoch ``epoch_index``.

    Warm-up: ``base_lr * (e + 1) / (warmup_epochs + 1)`` for ``e < warmup_epochs``. Then
    cosine annealing with warm restarts, as ``torch.optim.lr_scheduler.
    CosineAnnealingWarmRestarts(T_0=10, T_mult=2, eta_min=1e-6)`` stepped once per epoch:
    ``eta_min + (base_lr - eta_min) * (1 + cos(pi * T_cur / T_i)) / 2``.
    """
    if epoch_index < warmup_epochs:
        return base_lr * (epoch_index + 1) / (warmup_epochs + 1)
    position = epoch_index - warmup_epochs
    period = RESTART_PERIOD_EPOCHS
    while position >= period:
        position -= period
        period *= RESTART_PERIOD_FACTOR
    return MIN_LR + (base_lr - MIN_LR) * (1 + math.cos(math.pi * position / period)) / 2


# --------------------------------------------------------------------------- models


def _to_cpu(value: Any) -> Any:
    """Tensors of a nested container as contiguous CPU copies (checkpoints load on any machine)."""
    if isinstance(value, Tensor):
        return value.detach().cpu().contiguous()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(item) for item in value)
    return value


def seed_rngs(seed: int) -> None:
    """Seed torch's, numpy's and Python's global generators, so that a run and its resumed copy
    hold the same generator states (``rng_state``)."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """Random generator states as tensors and lists (weights_only-loadable)."""
    numpy_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states ``rng_state`` saved (CUDA only when the device count matches)."""
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


# --------------------------------------------------------------------------- timing


class PhaseClock:
    """Time marks: wall clock on the CPU, CUDA events on a GPU (read after a synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0


@dataclass
class PhaseTimes:
    """Accumulated milliseconds per phase over ``count`` iterations."""

    data_wait: float = 0.0
    h2d: float = 0.0
    compute: float = 0.0
    iter: float = 0.0
    count: int = 0

    def add(self, data_wait: float, h2d: float, compute: float, iteration: float) -> None:
        self.data_wait += data_wait
        self.h2d += h2d
        self.compute += compute
        self.iter += iteration
        self.count += 1

    def line(self, kind: str, epoch: int, first: int, last: int, total: int, unit: str) -> str:
        """``[TIMING][kind]`` line with mean ms per ``unit`` over iterations ``first..last`` of ``total``."""
        n = max(self.count, 1)
        other = max(self.iter - self.data_wait - self.h2d - self.compute, 0.0)
        parts = " ".join(
            f"{name} {value / n:.2f}"
            for name, value in (("data_wait", self.data_wait), ("h2d", self.h2d), ("compute", self.compute),
                                ("iter", self.iter), ("other", other))
        )
        plural = {"step": "steps", "batch": "batches"}.get(unit, unit)
        return f"[TIMING][{kind}] epoch {epoch} {plural} {first}-{last}/{total}: {parts} (ms per {unit})"


class TimingReport:
    """``[TIMING]`` lines: every EPID_TIMING_EVERY iterations (and at the end of the epoch), at
    most EPID_TIMING_MAX per epoch; EPID_TIMING_EVERY=0 gives one line for the whole epoch."""

    def __init__(self, kind: str, epoch: int, total: int, unit: str, config: Config, enabled: bool) -> None:
        self.kind, self.epoch, self.total, self.unit = kind, epoch, total, unit
        self.every = config.timing_every
        self.most = config.timing_max if enabled else 0
        self.printed = 0
        self.window = PhaseTimes()
        self.first = 1

    def record(self, done: int, data_wait: float, h2d: float, compute: float, iteration: float) -> None:
        """Add iteration ``done`` (1-based) and print a line when one is due."""
        self.window.add(data_wait, h2d, compute, iteration)
        due = done == self.total or (self.every > 0 and done % self.every == 0)
        if not due:
            return
        if self.printed < self.most:
            print(self.window.line(self.kind, self.epoch, self.first, done, self.total, self.unit), flush=True)
            self.printed += 1
        self.window, self.first = PhaseTimes(), done + 1


@dataclass
class StepMarks:
    """Time marks of one optimizer step: per micro-batch (start, fetched, copied, backward done),
    the mark after the optimizer step, and the step's wall time (ms)."""

    micro: list[tuple[Any, Any, Any, Any]]
    stepped: Any
    wall_ms: float

    def phases(self, clock: PhaseClock) -> tuple[float, float, float, float]:
        """(data_wait, h2d, compute, iter) in ms; compute includes the optimizer step."""
        data_wait = sum(clock.ms(start, fetched) for start, fetched, _, _ in self.micro)
        h2d = sum(clock.ms(fetched, copied) for _, fetched, copied, _ in self.micro)
        compute = sum(clock.ms(copied, done) for _, _, copied, done in self.micro)
        compute += clock.ms(self.micro[-1][3], self.stepped)
        return data_wait, h2d, compute, self.wall_ms


# --------------------------------------------------------------------------- epoch results


@dataclass
class TrainPass:
    """What one rank's training pass of an epoch leaves: device sums and host counters."""

    sums: Tensor
    samples: Tensor
    seconds: float = 0.0
    steps: int = 0
    nonfinite_steps: int = 0
    batches_done: int = 0
    interrupted: bool = False
    aborted: bool = False


@dataclass
class EpochTotals:
    """Epoch figures over all ranks (after the all-reduce)."""

    train: dict[str, float]
    val: dict[str, float]
    train_samples: int
    val_samples: int
    gamma_pass: float
    gamma_count: int
    steps_per_rank: list[int]
    stop_requested: bool


@dataclass
class RunState:
    """Progress kept in checkpoints."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    epoch: int = 0
    history: dict[str, Any] = field(default_factory=metrics_log.empty_history)
    best_val_loss: float = math.inf
    best_epoch: int = 0
    interrupted: dict[str, Any] | None = None


# --------------------------------------------------------------------------- the rank


def run_rank(context: RankContext, config: Config) -> int:
    """Train on one rank until the last epoch, early stopping, a stop signal or a failure."""
    stop = StopSignal().install()
    try:
        return Trainer(context, config, stop).run()
    finally:
        stop.restore()


class Trainer:
    """Models, optimizer, data and progress of one rank."""

    def __init__(self, context: RankContext, config: Config, stop: StopSignal) -> None:
        self.context = context
        self.config = config
        self.stop = stop
        self.device = context.device
        self.is_main = context.is_main
        self.amp_dtype = resolve_precision(config.precision, self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        checkpoint = load_checkpoint(config.checkpoint_path) if config.resume else None
        self._build_models(checkpoint)
        self._build_data()
        self.state = RunState()
        if checkpoint is not None:
            self._restore(checkpoint)
        self.metrics = metrics_log.MetricsLog(Path(config.checkpoint_path).parent)

    # ----------------------------------------------------------------- setup

    def _build_models(self, checkpoint: dict[str, Any] | None) -> None:
        config = self.config
        seed_rngs(config.seed)
        if checkpoint is None:
            forward_model, inverse_model = build_models(config.model_size)
        else:
            forward_model, inverse_model = build_models_from_checkpoint(checkpoint)
        self.model = CrossModel(forward_model, inverse_model).place(self.device)
        self.compiled = torch.compile(self.model) if config.compile else self.model
        self.ddp: DistributedDataParallel | None = None
        self.side_by_side: side_by_side.SideBySide | None = None
        self.step_model: Callable[..., Any] = self.compiled
        self.eval_model: Callable[..., Any] = self.compiled
        if self.context.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            # the models' only buffers are constant index tables: nothing to broadcast each step
            self.ddp = DistributedDataParallel(
                self.compiled, device_ids=device_ids, gradient_as_bucket_view=True, broadcast_buffers=False
            )
            self.step_model = self.ddp
        elif side_by_side.used_for(self.device, self.context.threads, distributed=False, compiled=config.compile):
            self.side_by_side = side_by_side.SideBySide(self.model, self.context.threads)
            self.step_model = self.eval_model = self.side_by_side
        self.step_backward = (self.side_by_side or self.model).backward
        self.base_lr = config.effective_lr
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.base_lr, weight_decay=config.weight_decay,
            fused=True,
        )
        base_lr, warmup = self.base_lr, config.warmup_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda epoch: learning_rate(epoch, base_lr, warmup) / base_lr
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)

    def _build_data(self) -> None:
        config, context = self.config, self.context
        self.dataset_ids = config.rank_dataset_ids(context.rank)
        self.data = EpidData.from_config(config, self.dataset_ids)
        self.loader = BatchLoader(
            self.data, self.device, num_workers=config.num_workers, pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor,
        )
        self.copy_batches = config.num_workers > 0 and self.device.type != "cpu"
        self.train_windows = self.data.windows("train", config.batch_size)
        shares = sharding.assign_all_ranks(config.dataset_ids, context.world_size, config.dataset_shuffle, config.dataset_seed)
        batches = steps_per_epoch(
            [len(ids) for ids in shares], n_control_points=config.control_points, batch_size=config.batch_size,
            max_batches=config.steps_per_epoch * config.grad_accum,
        )
        self.steps = math.ceil(batches / config.grad_accum)
        self.batches = self.steps * config.grad_accum
        self.val_windows = self._capped(self.data.windows("val", config.batch_size))
        own = set(self.dataset_ids)
        self.gamma_items = [
            item for item in evaluate.gamma_subset(config.dataset_ids, config.control_points, config.gamma_samples)
            if item[0] in own
        ]
        self.gamma_inputs: dict[str, Tensor] | None = None

    def _capped(self, windows: list[Window]) -> list[Window]:
        """Validation windows; with EPID_STEPS_PER_EPOCH, at most that many batches, evenly spread."""
        cap = self.config.steps_per_epoch * self.config.grad_accum
        if not cap or len(windows) <= cap:
            return windows
        return [windows[i * len(windows) // cap] for i in range(cap)]

    def _restore(self, checkpoint: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self._match_optimizer_layout()
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        self.scheduler.base_lrs = [self.base_lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.base_lr
            group["lr"] = learning_rate(self.scheduler.last_epoch, self.base_lr, self.config.warmup_epochs)
        if self.scaler.is_enabled() and checkpoint.get("scaler"):
            self.scaler.load_state_dict(checkpoint["scaler"])
        if checkpoint.get("rng"):
            set_rng_state(checkpoint["rng"])
        history = metrics_log.empty_history()
        history.update(checkpoint.get("history") or {})
        self.state = RunState(
            run_id=str(checkpoint.get("run_id") or uuid.uuid4().hex),
            epoch=int(checkpoint["epoch"]),
            history=history,
            best_val_loss=float(checkpoint.get("best_val_loss", math.inf)),
            best_epoch=int(checkpoint.get("best_epoch", 0)),
            interrupted=checkpoint.get("interrupted"),
        )

    def _match_optimizer_layout(self) -> None:
        """Give loaded moment tensors their parameter's memory format (checkpoints store them contiguous)."""
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                state = self.optimizer.state.get(parameter, {})
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.shape == parameter.shape:
                        state[key] = torch.empty_like(parameter, dtype=value.dtype).copy_(value)

    # ----------------------------------------------------------------- run

    def run(self) -> int:
        """Every remaining epoch; the rank's exit status."""
        try:
            return self._run_epochs()
        finally:
            if self.side_by_side is not None:
                self.side_by_side.close()

    def _run_epochs(self) -> int:
        self._print_start()
        if self.is_main:
            self.metrics.restart(self.state.history)
        started = time.perf_counter()
        for epoch in range(self.state.epoch + 1, self.config.epochs + 1):
            epoch_started = time.perf_counter()
            train = self._train_epoch(epoch)
            if train.aborted:
                return self._abort_nonfinite(epoch)
            if train.interrupted:
                self._save_interrupted(epoch, train)
                distributed.barrier()
                return 0
            val_sums, val_samples, gamma = self._validate(epoch)
            totals = self._reduce(train, val_sums, val_samples, gamma)
            stop_early = self._decide_early_stop(epoch, totals)
            self._finish_epoch(epoch, train, totals, time.perf_counter() - epoch_started)
            if totals.stop_requested:
                self._print_stop(epoch, by_signal=True)
                distributed.barrier()
                return 0
            if stop_early:
                self._print_stop(epoch, by_signal=False)
                break
        distributed.barrier()
        if self.is_main:
            print(f"Training finished after {self.state.epoch} epoch(s) in {_clock(time.perf_counter() - started)}; "
                  f"best validation loss {self.state.best_val_loss:.4e} at epoch {self.state.best_epoch}", flush=True)
        return 0

    def _print_start(self) -> None:
        config, context = self.config, self.context
        if self.is_main:
            print("Resolved configuration:", flush=True)
            print(describe(config), flush=True)
            print("Dataset IDs per rank:", flush=True)
            print(rank_report(config), flush=True)
            print(
                f"Every rank takes {self.steps} optimizer step(s) of {config.grad_accum} batch(es) per epoch "
                f"(the largest rank share; ranks with fewer batch windows repeat their first windows)",
                flush=True,
            )
        precision = str(self.amp_dtype).removeprefix("torch.")
        threads = f"{context.threads} thread(s)"
        if self.side_by_side is not None:
            threads += " (forward and inverse models side by side on {} + {})".format(*self.side_by_side.threads)
        line = (
            f"rank {context.rank}/{context.world_size} (local {context.local_rank}): pid {os.getpid()}, "
            f"device {self.device}, backend {context.backend or 'none'}, {threads}, "
            f"precision {precision}, {len(self.dataset_ids)} dataset(s), {len(self.train_windows)} training and "
            f"{len(self.val_windows)} validation window(s), {len(self.gamma_items)} gamma sample(s)"
        )
        lines = distributed.gather_objects(line)  # printed together by rank 0: one block, never interleaved
        if self.is_main:
            print("\n".join(lines), flush=True)

    # ----------------------------------------------------------------- training

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.amp_dtype)

    def _resume_point(self, epoch: int) -> tuple[int, TrainPass]:
        """Batches already done in ``epoch`` by an interrupted run, and its carried sums."""
        fresh = TrainPass(sums=torch.zeros(NUM_TERMS, device=self.device), samples=torch.zeros((), device=self.device))
        saved, self.state.interrupted = self.state.interrupted, None
        if not saved or saved.get("epoch") != epoch:
            return 0, fresh
        if saved.get("plan") != self._plan():
            if self.is_main:
                print(f"Epoch {epoch} was interrupted under another batch plan; it restarts from its first batch", flush=True)
            return 0, fresh
        rank = self.context.rank
        fresh.sums += torch.tensor(saved["rank_train_sums"][rank], device=self.device)
        fresh.samples += float(saved["rank_train_samples"][rank])
        if self.is_main:
            print(f"Epoch {epoch} continues after batch {saved['batches_done']}/{self.batches}", flush=True)
        fresh.seconds = float(saved.get("train_seconds", 0.0))
        fresh.steps = int(saved["batches_done"]) // self.config.grad_accum
        fresh.nonfinite_steps = int(saved.get("nonfinite_steps", 0))
        return int(saved["batches_done"]), fresh

    def _plan(self) -> dict[str, Any]:
        """What fixes the batch order of an epoch (an interrupted epoch resumes only under the same plan)."""
        config = self.config
        return {
            "world_size": self.context.world_size, "dataset_ids": list(config.dataset_ids),
            "dataset_shuffle": config.dataset_shuffle, "dataset_seed": config.dataset_seed,
            "batch_size": config.batch_size, "grad_accum": config.grad_accum, "batch_order": config.batch_order,
            "seed": config.seed, "control_points": config.control_points, "batches": self.batches,
        }

    def _train_epoch(self, epoch: int) -> TrainPass:
        config = self.config
        start_batch, result = self._resume_point(epoch)
        windows = epoch_windows(self.train_windows, order=config.batch_order, seed=config.seed, epoch=epoch,
                                steps=self.batches)
        batches = iter(self.loader.batches(windows[start_batch:]))
        self.model.train()
        clock = PhaseClock(self.device)
        timing = TimingReport("train", epoch, self.steps, "step", config, self.is_main)
        pending: list[StepMarks] = []
        progress = self._progress(epoch, result.steps)
        consecutive = 0
        started = time.perf_counter()
        for step in range(result.steps, self.steps):
            step_started = time.perf_counter()
            step_sums, step_samples, micro_marks = self._accumulate(batches, clock)
            nonfinite, stop = self._agree(step_sums[0])
            for marks in pending:
                timing.record(result.steps, *marks.phases(clock))
            if nonfinite:
                self.optimizer.zero_grad(set_to_none=True)
                consecutive += 1
                result.nonfinite_steps += 1
                if self.is_main:
                    print(f"epoch {epoch} step {step + 1}: non-finite loss on some rank, step skipped "
                          f"({consecutive} in a row)", flush=True)
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                consecutive = 0
                result.sums += step_sums
                result.samples += step_samples
            result.steps = step + 1
            result.batches_done = result.steps * config.grad_accum
            pending = [StepMarks(micro_marks, clock.mark(), (time.perf_counter() - step_started) * 1000.0)]
            self._show_progress(progress, epoch, result.steps, step_sums, step_samples)
            if consecutive >= config.max_nonfinite_steps:
                result.aborted = True
                break
            if stop:
                result.interrupted = True
                break
        if clock.cuda:
            torch.cuda.synchronize(self.device)
        for marks in pending:
            timing.record(result.steps, *marks.phases(clock))
        if progress is not None:
            progress.close()
        result.seconds += time.perf_counter() - started
        return result

    def _next_batch(self, batches: Iterator, clock: PhaseClock) -> tuple[Batch, Any, Any, Any]:
        """The next batch on the device, with the time marks (start, fetched, copied)."""
        before = clock.mark()
        batch = next(batches)
        fetched = clock.mark()
        if self.copy_batches:
            batch = batch.to(self.device, non_blocking=self.loader.pin_memory)
        return batch, before, fetched, clock.mark()

    def _losses(self, model: Callable[..., Any], batch: Batch) -> dict[str, Tensor]:
        """Every loss term of ``batch`` through ``model`` (a CrossModel, its DDP or side-by-side runner)."""
        with self._autocast():
            forward_out, inverse_out = model(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
        return cross_training_loss(forward_out, inverse_out, batch)

    def _accumulate(self, batches: Iterator, clock: PhaseClock) -> tuple[Tensor, Tensor, list]:
        """Forward and backward over one optimizer step's micro-batches.

        Returns the sample-weighted loss sums (NUM_TERMS,), the sample count and, per
        micro-batch, the time marks (start, fetched, copied, backward done).
        """
        accum = self.config.grad_accum
        sums = torch.zeros(NUM_TERMS, device=self.device)
        samples = torch.zeros((), device=self.device)
        marks = []
        for micro in range(accum):
            batch, before, fetched, copied = self._next_batch(batches, clock)
            sync = self.ddp.no_sync() if self.ddp is not None and micro < accum - 1 else contextlib.nullcontext()
            with sync:
                losses = self._losses(self.step_model, batch)
                self.step_backward(self.scaler.scale(losses["total"] / accum))
            sums += torch.stack([losses[term].detach() for term in LOSS_TERMS]) * len(batch)
            samples += len(batch)
            marks.append((before, fetched, copied, clock.mark()))
        return sums, samples, marks

    def _agree(self, step_total: Tensor) -> tuple[bool, bool]:
        """Whether any rank saw a non-finite loss this step, and whether any rank was asked to stop."""
        flags = torch.stack([
            (~torch.isfinite(step_total)).float(),
            torch.full((), float(self.stop.requested), device=self.device),
        ])
        distributed.all_reduce(flags, dist.ReduceOp.MAX)
        nonfinite, stop = flags.tolist()
        return nonfinite > 0, stop > 0

    def _progress(self, epoch: int, done: int) -> Any:
        if not (self.is_main and self.config.progress and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.steps, initial=done, desc=f"epoch {epoch}", unit="step", leave=False, dynamic_ncols=True)

    def _show_progress(self, progress: Any, epoch: int, done: int, step_sums: Tensor, step_samples: Tensor) -> None:
        if not self.is_main:
            return
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{(step_sums[0] / step_samples).item():.3e}", refresh=False)
            return
        if self.steps < PROGRESS_LINES_MIN_STEPS:
            return
        every = math.ceil(self.steps / PROGRESS_LINES_PER_EPOCH)
        if done % every == 0 and done < self.steps:
            print(f"epoch {epoch}: step {done}/{self.steps}, loss {(step_sums[0] / step_samples).item():.4e} (rank 0)", flush=True)

    def _abort_nonfinite(self, epoch: int) -> int:
        if self.is_main:
            kept = self.state.epoch
            where = f"the checkpoint of epoch {kept} at {self.config.checkpoint_path} is kept" if kept else "no checkpoint was written"
            print(
                f"Training stopped in epoch {epoch}: {self.config.max_nonfinite_steps} consecutive optimizer steps had "
                f"a non-finite loss (EPID_MAX_NONFINITE_STEPS); {where}. Try a lower EPID_LR or EPID_PRECISION=fp32.",
                file=sys.stderr, flush=True,
            )
        distributed.barrier()
        return 1

    # ----------------------------------------------------------------- validation

    def _validate(self, epoch: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Loss sums and sample count over the rank's validation windows, and its gamma (sum, count)."""
        self.model.eval()
        clock = PhaseClock(self.device)
        sums = torch.zeros(NUM_TERMS, device=self.device)
        samples = torch.zeros((), device=self.device)
        marks = []
        batches = iter(self.loader.batches(self.val_windows))
        with torch.no_grad():
            for _ in range(len(self.val_windows)):
                batch, before, fetched, copied = self._next_batch(batches, clock)
                losses = self._losses(self.eval_model, batch)
                sums += torch.stack([losses[term] for term in LOSS_TERMS]) * len(batch)
                samples += len(batch)
                marks.append((before, fetched, copied, clock.mark()))
            end = clock.mark()
            if clock.cuda:
                torch.cuda.synchronize(self.device)
            gamma_started = time.perf_counter()
            gamma = self._gamma_sums()
            if clock.cuda:
                torch.cuda.synchronize(self.device)
        self._print_val_timing(epoch, clock, marks, end)
        if self.is_main and self.gamma_items and self.config.timing_max > 0:
            print(f"[TIMING][gamma] epoch {epoch}: {(time.perf_counter() - gamma_started) * 1000.0:.1f} ms for "
                  f"{len(self.gamma_items)} sample(s) on rank 0", flush=True)
        self.model.train()
        return sums, samples, gamma

    def _print_val_timing(self, epoch: int, clock: PhaseClock, marks: list, end: Any) -> None:
        """Timing lines of the validation batches; a batch's iteration runs to the next batch's start."""
        if not (self.is_main and marks):
            return
        timing = TimingReport("val", epoch, len(marks), "batch", self.config, True)
        starts = [before for before, _, _, _ in marks[1:]] + [end]
        for done, ((before, fetched, copied, finished), following) in enumerate(zip(marks, starts), start=1):
            timing.record(done, clock.ms(before, fetched), clock.ms(fetched, copied), clock.ms(copied, finished),
                          clock.ms(before, following))

    def _gamma_sums(self) -> tuple[Tensor, Tensor]:
        """Sum and count of the forward model's gamma pass rates (%) on this rank's gamma samples."""
        zero = torch.zeros((), device=self.device)
        if not self.gamma_items:
            return zero, zero.clone()
        inputs = self._gamma_inputs()
        predictions = []
        for start in range(0, len(self.gamma_items), self.config.batch_size):
            chunk = slice(start, start + self.config.batch_size)
            with self._autocast():
                epid, _ = self.model.forward_model(inputs["leaf_a"][chunk], inputs["leaf_b"][chunk], inputs["scalars"][chunk])
            predictions.append(epid[:, 0].float())
        rates = gamma_pass_rate(gamma_maps(inputs["epid_curr"], torch.cat(predictions), device=self.device))
        counted = ~torch.isnan(rates)
        return torch.where(counted, rates, 0.0).sum().to(self.device), counted.sum().float().to(self.device)

    def _gamma_inputs(self) -> dict[str, Tensor]:
        """The gamma samples' inputs and measured frames, synthesised once and kept on the device."""
        if self.gamma_inputs is None:
            batches = [self.data.make_batch(Window(d, s, s + 1), self.device) for d, s in self.gamma_items]
            self.gamma_inputs = {
                "leaf_a": torch.cat([b.leaf_a for b in batches]),
                "leaf_b": torch.cat([b.leaf_b for b in batches]),
                "scalars": torch.cat([b.scalars for b in batches]),
                "epid_curr": torch.cat([b.epid_curr[:, 0] for b in batches]),
            }
        return self.gamma_inputs

    # ----------------------------------------------------------------- epoch end

    def _reduce(self, train: TrainPass, val_sums: Tensor, val_samples: Tensor, gamma: tuple[Tensor, Tensor]) -> EpochTotals:
        """One all-reduce of everything the epoch line and the checkpoint need."""
        world = self.context.world_size
        steps = torch.zeros(world, device=self.device)
        steps[self.context.rank] = train.steps
        stop = torch.full((1,), float(self.stop.requested), device=self.device)
        packed = torch.cat([train.sums, train.samples.view(1), val_sums, val_samples.view(1),
                            gamma[0].view(1), gamma[1].view(1), stop, steps])
        values = distributed.all_reduce(packed).tolist()
        train_sums, train_samples = values[:NUM_TERMS], values[NUM_TERMS]
        offset = NUM_TERMS + 1
        val_sums_all, val_samples_all = values[offset:offset + NUM_TERMS], values[offset + NUM_TERMS]
        gamma_sum, gamma_count, stop_flag = values[offset + NUM_TERMS + 1: offset + NUM_TERMS + 4]
        return EpochTotals(
            train=_means(train_sums, train_samples),
            val=_means(val_sums_all, val_samples_all),
            train_samples=int(train_samples),
            val_samples=int(val_samples_all),
            gamma_pass=gamma_sum / gamma_count if gamma_count else math.nan,
            gamma_count=int(gamma_count),
            steps_per_rank=[int(v) for v in values[-world:]],
            stop_requested=stop_flag > 0,
        )

    def _decide_early_stop(self, epoch: int, totals: EpochTotals) -> bool:
        """Rank 0 updates the best validation loss and decides early stopping; every rank gets the decision."""
        val_loss = totals.val["total"]
        self.new_best = math.isfinite(val_loss) and val_loss < self.state.best_val_loss
        if self.new_best:
            self.state.best_val_loss, self.state.best_epoch = val_loss, epoch
        patience = self.config.early_stop_patience
        decision = torch.zeros(1, device=self.device)
        if self.is_main and patience and epoch - self.state.best_epoch >= patience:
            decision += 1
        return distributed.broadcast(decision).item() > 0

    def _finish_epoch(self, epoch: int, train: TrainPass, totals: EpochTotals, epoch_seconds: float) -> None:
        history = self.state.history
        elapsed = (history["elapsed_s"][-1] if history["elapsed_s"] else 0.0) + epoch_seconds
        record = {
            "train": totals.train, "val": totals.val, "gamma_pass": totals.gamma_pass,
            "lr": self.optimizer.param_groups[0]["lr"],
            "samples_per_s": totals.train_samples / train.seconds if train.seconds > 0 else math.nan,
            "epoch_s": epoch_seconds, "elapsed_s": elapsed, "steps": totals.steps_per_rank[0],
            "nonfinite_steps": train.nonfinite_steps, "world_size": self.context.world_size,
        }
        metrics_log.append_epoch(history, record)
        history.setdefault("steps_per_rank", []).append(totals.steps_per_rank)
        with warnings.catch_warnings():
            # with fp16 the gradient scaler may skip every step of an epoch, which torch reports here
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            self.scheduler.step()
        self.state.epoch = epoch
        if not self.is_main:
            return
        payload = self._payload()
        save_checkpoint(self.config.checkpoint_path, payload)
        if self.new_best:
            save_checkpoint(best_path(self.config.checkpoint_path), payload)
        self.metrics.append(history)
        self.metrics.plot(history, self.state.best_epoch)
        print(self._epoch_line(epoch, record, train), flush=True)

    def _epoch_line(self, epoch: int, record: dict[str, Any], train: TrainPass) -> str:
        def terms(values: dict[str, float]) -> str:
            detail = ", ".join(f"{term} {values[term]:.3e}" for term in LOSS_TERMS[1:])
            return f"{values['total']:.4e} ({detail})"

        gamma = "off" if math.isnan(record["gamma_pass"]) else f"{record['gamma_pass']:.1f} %"
        line = (
            f"epoch {epoch}/{self.config.epochs} | train {terms(record['train'])} | val {terms(record['val'])} | "
            f"gamma pass {gamma} | {record['samples_per_s']:.1f} samples/s | lr {record['lr']:.3e} | "
            f"elapsed {_clock(record['elapsed_s'])}"
        )
        if self.device.type == "cuda":
            line += f" | peak GPU memory {torch.cuda.max_memory_allocated(self.device) / 2**30:.1f} GiB"
        if train.nonfinite_steps:
            line += f" | {train.nonfinite_steps} non-finite step(s) skipped"
        if self.new_best:
            line += " | best"
        return line

    def _print_stop(self, epoch: int, by_signal: bool) -> None:
        if not self.is_main:
            return
        if by_signal:
            print(f"Stopped by {self.stop.name or 'a signal on another rank'} after epoch {epoch}; checkpoint "
                  f"{self.config.checkpoint_path} written; resume with EPID_RESUME=1", flush=True)
        else:
            print(f"Early stop after epoch {epoch}: no new best validation loss for {self.config.early_stop_patience} "
                  f"epoch(s) (best {self.state.best_val_loss:.4e} at epoch {self.state.best_epoch})", flush=True)

    def _save_interrupted(self, epoch: int, train: TrainPass) -> None:
        """Checkpoint of a signal-stopped epoch: weights now, history up to the last full epoch, and
        every rank's loss sums so far (each rank goes on adding to its own, as without the stop)."""
        packed = distributed.gather_objects(torch.cat([train.sums, train.samples.view(1)]).tolist())
        if not self.is_main:
            return
        self.state.interrupted = {
            "epoch": epoch, "batches_done": train.batches_done,
            "rank_train_sums": [values[:NUM_TERMS] for values in packed],
            "rank_train_samples": [values[NUM_TERMS] for values in packed], "train_seconds": train.seconds,
            "nonfinite_steps": train.nonfinite_steps, "plan": self._plan(),
        }
        save_checkpoint(self.config.checkpoint_path, self._payload())
        print(f"Stopped by {self.stop.name or 'a signal on another rank'} in epoch {epoch} after optimizer step "
              f"{train.steps}/{self.steps}; checkpoint {self.config.checkpoint_path} written; resume with EPID_RESUME=1",
              flush=True)

    def _payload(self) -> dict[str, Any]:
        """The checkpoint content (plain containers, tensors on the CPU)."""
        state, config = self.state, self.config
        return {
            "format_version": FORMAT_VERSION,
            "run_id": state.run_id,
            "epoch": state.epoch,
            "forward_model": _to_cpu(self.model.forward_model.state_dict()),
            "inverse_model": _to_cpu(self.model.inverse_model.state_dict()),
            "model_config": self.model.config.to_dict(),
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "rng": rng_state(),
            "history": state.history,
            "best_val_loss": state.best_val_loss,
            "best_epoch": state.best_epoch,
            "config": config.to_dict(),
            "dataset_ids": list(config.dataset_ids),
            "world_size": self.context.world_size,
            "torch_version": str(torch.__version__),
            "interrupted": state.interrupted,
        }


def _means(sums: Sequence[float], samples: float) -> dict[str, float]:
    return {term: (value / samples if samples else math.nan) for term, value in zip(LOSS_TERMS, sums)}


def _clock(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))
