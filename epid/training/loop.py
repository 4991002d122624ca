"""Cross-training of the forward and inverse models: ``launch`` and the loop every rank runs.

``launch(config)`` makes the pre-flight checks (``epid.training.preflight``) in the launching process,
so bad input exits with status 2 before any rank starts, then runs ``run_rank`` on every rank
(``epid.training.distributed``).

A rank (``Trainer``) takes the run's autocast precision (``epid.training.precision``: with
EPID_PRECISION=auto on the CPU, rank 0 times training steps in fp32 and bf16, once per machine
and run shape, and every rank takes its choice), builds its models (or rebuilds them from the
checkpoint it resumes), the AdamW optimizer, the learning-rate schedule (``epid.training.schedule``) and
its data (``epid.training.rank_data``), then runs epochs:

* training, one optimizer step at a time (``train_epoch``): set the step's learning rate;
  for each of its EPID_GRAD_ACCUM batches fetch the batch, run both models, compute the loss
  and run backward (gradients are all-reduced on the last batch only); agree with every rank,
  in one small all-reduce, whether any rank saw a non-finite loss (then every rank skips the
  step) and whether any rank received SIGINT / SIGTERM or reached EPID_TIME_LIMIT (then every
  rank stops after the step and rank 0 writes a checkpoint that resumes mid-epoch); take the
  optimizer step (``epid.training.optimizer``: gradients clipped with EPID_GRAD_CLIP); the pass's sums,
  stop rules and resume point are ``epid.training.passes``'s;
* validation: each validation window of the rank once (no collectives inside), and the
  forward model's gamma pass rate (3 %/3 mm global, 10 % cutoff) on a fixed set of
  EPID_GAMMA_SAMPLES validation samples spread over the selected datasets;
* the epoch's end: one all-reduce of the loss sums (weighted by sample counts), sample
  counts, gamma sums, step counts and stop flags; rank 0 decides early stopping and
  broadcasts it, writes the checkpoint(s) (``epid.training.run_state``), ``metrics.csv``,
  ``losses.png`` and the TensorBoard events (EPID_TENSORBOARD), and prints the epoch line
  (``epid.training.progress``). Rank 0 prints the run's messages (``epid.training.report``).

Placement of the models (``ModelRunner``): DistributedDataParallel across ranks; on a single
CPU rank with two or more threads, the forward and inverse models side by side on their own
threads (``epid.training.side_by_side``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from epid.config.load import Config, describe
from epid.core.files import remove_stale_temporaries
from epid.models.checkpoint import best_path, build_models_from_checkpoint, load_checkpoint, save_checkpoint
from epid.models.families import CrossModel, build_models
from epid.models.losses import LOSS_TERMS, batch_losses
from epid.synthesis.kernel import kernel_from_config
from epid.training import distributed, metrics_log, preflight, side_by_side
from epid.training.distributed import RankContext, StopSignal
from epid.training.optimizer import build_optimizer, optimizer_step
from epid.training.passes import NUM_TERMS, StopRules, TrainPass, interrupted_record, pass_values, resumed_pass
from epid.training.precision import agreed_precision, precision_record
from epid.training.progress import IterationTimer, ProgressDisplay, TimingReport, epoch_line
from epid.training.rank_data import RankData
from epid.training.report import RunReport
from epid.training.run_state import RunState, capture_run_state, restore_run_state, seed_rngs
from epid.training.schedule import Schedule, ScheduleConfig
from epid.training.tensorboard_log import FRAMES, TensorBoardLog
from epid.training.validation import Validation

EpochObserver = Callable[[int, nn.Module, nn.Module, int], None]
"""Called on rank 0 after each epoch's checkpoint: (epoch, forward model, inverse model, training
samples seen over all ranks since the run began); the models are left in training mode after it."""


def launch(config: Config, observer: EpochObserver | None = None) -> int:
    """Train as ``config`` says on every rank of this node; return the process exit status.

    ``observer`` (a single process only: EPID_WORLD_SIZE=1, no torchrun) watches the models at
    every epoch end, for example to measure their quality during the run (``bench/bench_quality.py``).

    0: finished, stopped early, or stopped by SIGINT / SIGTERM or EPID_TIME_LIMIT with a
    checkpoint written; 1: a rank failed or the run stopped on non-finite losses. Raises
    InputError (exit 2) before any rank starts when the device, kernel or checkpoint to resume
    cannot work. Temporary files that killed writers left beside the checkpoint are removed.
    """
    notes = preflight.check(config)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this; rank 0 reports and cleans
        for note in notes + stale_temporaries_notes(config):
            print(note, flush=True)
    if observer is None:
        return distributed.launch(run_rank, config)
    if config.world_size != 1 or config.launched_by_torchrun:
        raise ValueError("an epoch observer needs a single-process run (EPID_WORLD_SIZE=1, no torchrun)")
    return distributed.launch(functools.partial(run_rank, observer=observer), config)


def stale_temporaries_notes(config: Config) -> list[str]:
    """Remove the temporary files of this run's checkpoint, best checkpoint, metrics.csv and
    losses.png whose writer process is gone; say which were removed and which were kept."""
    checkpoint = Path(config.checkpoint_path)
    folder = checkpoint.parent
    removed, kept = remove_stale_temporaries([checkpoint, best_path(checkpoint), folder / metrics_log.CSV_NAME,
                                              folder / metrics_log.PLOT_NAME])
    notes = []
    if removed:
        notes.append(f"Removed {len(removed)} temporary file(s) in {folder} that writers which are gone left "
                     f"behind: {', '.join(path.name for path in removed)}")
    if kept:
        notes.append(f"Kept {len(kept)} temporary file(s) in {folder} that running processes are writing (is "
                     f"another run using this checkpoint?): {', '.join(path.name for path in kept)}")
    return notes


def run_rank(context: RankContext, config: Config, observer: EpochObserver | None = None) -> int:
    """Train on one rank until the last epoch, early stopping, a stop signal or a failure."""
    stop = StopSignal().install()
    try:
        return Trainer(context, config, stop, observer).run()
    finally:
        stop.restore()


def starting_models(config: Config, checkpoint: dict[str, Any] | None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The (forward, inverse) models a run starts from: the checkpoint's it resumes, else fresh
    ones of the configured family and size, a forward model with a learned response starting as
    the kernel file EPID_KERNEL names (``DetectorResponse.start_from``) and an inverse model reading
    the frames through it where it is broad (``LeafEdgeInverseModel.read_through``); the built-in
    kernel is given to neither."""
    if checkpoint is not None:
        return build_models_from_checkpoint(checkpoint)
    forward_model, inverse_model = build_models(config.model_size, config.model, config.mlc_geometry)
    if config.kernel_path:
        kernel = torch.from_numpy(kernel_from_config(config.kernel_path, config.kernel_variable))
        if hasattr(forward_model, "response"):
            forward_model.response.start_from(kernel)
        if hasattr(inverse_model, "read_through"):
            inverse_model.read_through(kernel)
    return forward_model, inverse_model


@dataclass
class EpochTotals:
    """Epoch figures over all ranks (after the all-reduce)."""

    train: dict[str, float]
    val: dict[str, float]
    train_samples: int
    val_samples: int
    gamma_pass: float
    steps_per_rank: list[int]
    stop_requested: bool
    time_up: bool


class ModelRunner:
    """How a rank runs its models: ``train`` and ``evaluate`` are called like the CrossModel,
    ``backward(loss)`` ends a training batch. Through DistributedDataParallel across ranks, side
    by side on a single CPU rank with two or more threads, else the model itself (compiled with
    EPID_COMPILE)."""

    def __init__(self, model: CrossModel, context: RankContext, compile_models: bool) -> None:
        compiled = torch.compile(model) if compile_models else model
        self.ddp: DistributedDataParallel | None = None
        self.side_by_side: side_by_side.SideBySide | None = None
        self.train: Callable[..., Any] = compiled
        self.evaluate: Callable[..., Any] = compiled
        device = context.device
        if context.distributed:
            # the models' only buffers are constant index tables: nothing to broadcast each step
            self.ddp = DistributedDataParallel(compiled, device_ids=[device.index] if device.type == "cuda" else None,
                                               gradient_as_bucket_view=True, broadcast_buffers=False)
            self.train = self.ddp
        elif side_by_side.used_for(device, context.threads, model.inverse_model, distributed=False,
                                   compiled=compile_models):
            self.side_by_side = side_by_side.SideBySide(model, context.threads)
            self.train = self.evaluate = self.side_by_side
        self.backward = (self.side_by_side or model).backward

    def gradients_kept_local(self, last_batch: bool) -> contextlib.AbstractContextManager:
        """No gradient all-reduce during the step's batches before its last one."""
        return self.ddp.no_sync() if self.ddp is not None and not last_batch else contextlib.nullcontext()

    def close(self) -> None:
        if self.side_by_side is not None:
            self.side_by_side.close()


class Trainer:
    """One rank's models, optimizer, schedule, data and run state, and the epoch loop."""

    def __init__(self, context: RankContext, config: Config, stop: StopSignal,
                 observer: EpochObserver | None = None) -> None:
        self.stops = StopRules(stop, config.time_limit, context.device)  # the time limit counts from here
        self.observer = observer
        self.context, self.config = context, config
        self.device, self.is_main = context.device, context.is_main
        self.report = RunReport(config, context)
        checkpoint = load_checkpoint(config.checkpoint_path) if config.resume else None
        self.precision = agreed_precision(config, context, (checkpoint or {}).get("precision"))
        self.amp_dtype = self.precision.dtype
        self.stopped_by = ""  # the stop line's start once a signal or the time limit stopped an epoch
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            torch.backends.cudnn.benchmark = True
        seed_rngs(config.seed)
        self.model = CrossModel(*starting_models(config, checkpoint)).place(self.device)
        self.runner = ModelRunner(self.model, context, config.compile)
        self.optimizer = build_optimizer(self.model, config.effective_lr, config.weight_decay)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)
        self.data = RankData(config, context)
        self.schedule = Schedule(ScheduleConfig.from_config(config, self.data.steps), config.effective_lr,
                                 self.data.steps)
        self.state = RunState() if checkpoint is None else restore_run_state(checkpoint, self.optimizer, self.scaler)
        self.metrics = metrics_log.MetricsLog(Path(config.checkpoint_path).parent)
        self.board = None
        if self.is_main and config.tensorboard:
            self.board = TensorBoardLog(config.tensorboard, self.state.epoch + 1, describe(config))
        self.validation = Validation(self.model, self.data, config, self.amp_dtype, self.is_main,
                                     keep_frames=FRAMES if self.board else 0)

    def run(self) -> int:
        """Every remaining epoch; the rank's exit status."""
        try:
            return self._run_epochs()
        finally:
            self.runner.close()
            if self.board is not None:
                self.board.close()

    def _run_epochs(self) -> int:
        self.report.start(self.data, self.state.window_cursor, self.precision, self.runner.side_by_side)
        if self.is_main:
            self.metrics.restart(self.state.history)
        started = time.perf_counter()
        for epoch in range(self.state.epoch + 1, self.config.epochs + 1):
            epoch_started = time.perf_counter()
            train = self.train_epoch(epoch)
            if train.aborted:
                self.report.nonfinite_stop(epoch, self.state.epoch)
                distributed.barrier()
                return 1
            if train.interrupted:
                self._save_interrupted(epoch, train)
                distributed.barrier()
                return 0
            val_sums, val_samples, gamma = self.validation.run(self.runner.evaluate, epoch)
            totals = reduce_epoch(train, val_sums, val_samples, gamma, self.context, self.stops.signal.requested,
                                  self.stops.time_up())
            stop_early = self._decide_early_stop(epoch, totals)
            self._finish_epoch(epoch, train, totals, time.perf_counter() - epoch_started)
            if totals.stop_requested or totals.time_up:
                self.report.stopped(epoch, self.stops.stopped_by(totals.stop_requested))
                distributed.barrier()
                return 0
            if stop_early:
                self.report.early_stop(epoch, self.state)
                break
        distributed.barrier()
        self.report.finished(self.state, time.perf_counter() - started)
        return 0

    # ----------------------------------------------------------------- training

    def train_epoch(self, epoch: int) -> TrainPass:
        """The optimizer steps of ``epoch`` (from where an interrupted run stopped)."""
        config, accum = self.config, self.config.grad_accum
        saved, self.state.interrupted = self.state.interrupted, None
        result, note = resumed_pass(saved, epoch, self.data.plan(), self.context.rank, accum, self.data.batches,
                                    self.device)
        self.report.say(note)
        batches = self.data.train_batches(epoch, self.state.window_cursor, result.batches_done)
        self.model.train()
        report = TimingReport("train", epoch, self.data.steps, "step", config, self.is_main)
        timer = IterationTimer(self.device, report, done=result.steps)
        epoch_seconds = self.state.history["epoch_s"][-1] if self.state.history["epoch_s"] else None
        progress = ProgressDisplay(epoch, self.data.steps, result.steps, config, self.is_main, epoch_seconds,
                                   self.stops.deadline)
        consecutive, started = 0, time.perf_counter()
        for step in range(result.steps, self.data.steps):
            timer.start()
            self.schedule.set(self.optimizer, epoch - 1, step)
            sums, samples = torch.zeros(NUM_TERMS, device=self.device), torch.zeros((), device=self.device)
            for micro in range(accum):
                batch = timer.fetch(batches, self.data.to_device)
                with self.runner.gradients_kept_local(last_batch=micro == accum - 1):
                    losses = batch_losses(self.runner.train, batch, self.device, self.amp_dtype)
                    self.runner.backward(self.scaler.scale(losses["total"] / accum))
                timer.computed()
                sums += torch.stack([losses[term].detach() for term in LOSS_TERMS]) * len(batch)
                samples += len(batch)
            nonfinite, signalled, time_up = self.stops.agree(sums[0])
            if nonfinite:
                consecutive += 1
                result.nonfinite_steps += 1
                self.report.skipped_step(epoch, step + 1, consecutive)
            else:
                optimizer_step(self.optimizer, self.scaler, config.grad_clip)
                consecutive = 0
                result.sums += sums
                result.samples += samples
            self.optimizer.zero_grad(set_to_none=True)
            result.steps, result.batches_done = step + 1, (step + 1) * accum
            timer.end()
            progress.step(result.steps, lambda: (result.sums[0] / result.samples).item())
            result.aborted = consecutive >= config.max_nonfinite_steps
            result.interrupted = signalled or time_up
            if result.interrupted:
                self.stopped_by = self.stops.stopped_by(signalled)
            if result.aborted or result.interrupted:
                break
        timer.finish()
        progress.close()
        result.seconds += time.perf_counter() - started
        return result

    # ----------------------------------------------------------------- epoch end

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
            "lr": self.schedule.rate(self.schedule.position(epoch - 1, self.data.steps - 1)),
            "samples_per_s": totals.train_samples / train.seconds if train.seconds > 0 else math.nan,
            "train_samples": totals.train_samples,
            "epoch_s": epoch_seconds, "elapsed_s": elapsed, "steps": totals.steps_per_rank[0],
            "nonfinite_steps": train.nonfinite_steps, "world_size": self.context.world_size,
        }
        metrics_log.append_epoch(history, record)
        history.setdefault("steps_per_rank", []).append(totals.steps_per_rank)
        self.schedule.set(self.optimizer, epoch, 0)  # the checkpoint's optimizer holds the next step's rate
        self.state.epoch = epoch
        if self.data.capped:
            self.state.window_cursor += self.data.batches
        if not self.is_main:
            return
        payload = self._payload()
        save_checkpoint(self.config.checkpoint_path, payload)
        if self.new_best:
            save_checkpoint(best_path(self.config.checkpoint_path), payload)
        self.metrics.append(history)
        self.metrics.plot(history, self.state.best_epoch)
        if self.board is not None:
            self.board.epoch(epoch, record, self.validation.frames)
        self.report.say(epoch_line(epoch, self.config.epochs, record, self.device, self.new_best))
        if self.observer is not None:
            seen = int(sum(count for count in history["train_samples"] if math.isfinite(count)))
            self.observer(epoch, self.model.forward_model, self.model.inverse_model, seen)
            self.model.train()

    def _save_interrupted(self, epoch: int, train: TrainPass) -> None:
        """Checkpoint of a signal-stopped epoch: weights now, history up to the last full epoch, and
        every rank's loss sums so far (each rank goes on adding to its own, as without the stop)."""
        rank_values = distributed.gather_objects(pass_values(train))
        if not self.is_main:
            return
        self.state.interrupted = interrupted_record(epoch, train, rank_values, self.data.plan())
        save_checkpoint(self.config.checkpoint_path, self._payload())
        self.report.interrupted(self.stopped_by, epoch, train.steps, self.data.steps)

    def _payload(self) -> dict[str, Any]:
        return capture_run_state(self.model, self.optimizer, self.scaler, self.schedule, self.state, self.config,
                                 self.context.world_size, precision_record(self.precision))


def reduce_epoch(train: TrainPass, val_sums: Tensor, val_samples: Tensor, gamma: tuple[Tensor, Tensor],
                 context: RankContext, stop_requested: bool, time_up: bool) -> EpochTotals:
    """One all-reduce of everything the epoch line and the checkpoint need (``stop_requested``:
    this rank received a stop signal; ``time_up``: it reached EPID_TIME_LIMIT)."""
    device, world = context.device, context.world_size
    steps = torch.zeros(world, device=device)
    steps[context.rank] = train.steps
    stops = torch.tensor([float(stop_requested), float(time_up)], device=device)
    packed = torch.cat([train.sums, train.samples.view(1), val_sums, val_samples.view(1),
                        gamma[0].view(1), gamma[1].view(1), stops, steps])
    values = distributed.all_reduce(packed).tolist()
    val = values[NUM_TERMS + 1:]
    gamma_sum, gamma_count, stop_flag, time_flag = val[NUM_TERMS + 1:NUM_TERMS + 5]
    return EpochTotals(
        train=_means(values[:NUM_TERMS], values[NUM_TERMS]), val=_means(val[:NUM_TERMS], val[NUM_TERMS]),
        train_samples=int(values[NUM_TERMS]), val_samples=int(val[NUM_TERMS]),
        gamma_pass=gamma_sum / gamma_count if gamma_count else math.nan,
        steps_per_rank=[int(v) for v in values[-world:]], stop_requested=stop_flag > 0, time_up=time_flag > 0,
    )


def _means(sums: Sequence[float], samples: float) -> dict[str, float]:
    return {term: (value / samples if samples else math.nan) for term, value in zip(LOSS_TERMS, sums, strict=True)}
