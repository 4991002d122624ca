"""What rank 0 shows while a run goes: ``[TIMING]`` lines, the progress bar or lines, the epoch line.

Timing splits an iteration (an optimizer step in training, a batch in validation) into
``data_wait`` (the next batch from the loader), ``h2d`` (its copy to the device), ``compute``
(forward, loss, backward and, in training, the optimizer step) and the rest of the
iteration. Marks are wall-clock times on the CPU and CUDA events on a GPU, read one step later
or at the end of the epoch, when the device has reached them. EPID_TIMING_EVERY and
EPID_TIMING_MAX say how many lines an epoch prints.
"""

from __future__ import annotations

import datetime
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from epid.config.load import Config
from epid.data.dataset import Batch
from epid.models.losses import LOSS_TERMS

TIMING_PHASES = ("data_wait", "h2d", "compute", "iter")
PROGRESS_LINES_PER_EPOCH = 10
PROGRESS_LINES_MIN_STEPS = 100


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
    """Milliseconds per phase (``TIMING_PHASES``) summed over ``count`` iterations."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMING_PHASES, 0.0))
    count: int = 0

    def add(self, phases: Mapping[str, float]) -> None:
        for name, milliseconds in phases.items():
            self.totals[name] += milliseconds
        self.count += 1

    def line(self, kind: str, epoch: int, first: int, last: int, total: int, unit: str) -> str:
        """``[TIMING][kind]`` line with mean ms per ``unit`` over iterations ``first..last`` of ``total``."""
        n = max(self.count, 1)
        other = max(self.totals["iter"] - sum(self.totals[name] for name in TIMING_PHASES[:-1]), 0.0)
        parts = " ".join(f"{name} {value / n:.2f}" for name, value in (*self.totals.items(), ("other", other)))
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

    def record(self, done: int, phases: Mapping[str, float]) -> None:
        """Add iteration ``done`` (1-based) and print a line when one is due."""
        self.window.add(phases)
        due = done == self.total or (self.every > 0 and done % self.every == 0)
        if not due:
            return
        if self.printed < self.most:
            print(self.window.line(self.kind, self.epoch, self.first, done, self.total, self.unit), flush=True)
            self.printed += 1
        self.window, self.first = PhaseTimes(), done + 1


class IterationTimer:
    """Marks the phases of an epoch's iterations and hands them to a ``TimingReport``.

    Per iteration: ``start``; per batch in it, ``fetch`` (next batch, then its copy to the
    device) and ``computed`` (after its backward pass, or its loss in validation); ``end``.
    An iteration is recorded when the next one has started or at ``finish``, so that the
    device has reached its marks.
    """

    def __init__(self, device: torch.device, report: TimingReport, done: int = 0) -> None:
        self.clock = PhaseClock(device)
        self.report = report
        self.started = 0.0
        self.batches: list[tuple[Any, Any, Any, Any]] = []
        self.pending: tuple[list[tuple[Any, Any, Any, Any]], Any, float] | None = None
        self.done = done  # iterations recorded (an interrupted epoch resumes after its first ones)
        self._open: tuple[Any, Any, Any] = (None, None, None)

    def start(self) -> None:
        self.started = time.perf_counter()
        self.batches = []

    def fetch(self, batches: Iterator[Batch], to_device: Callable[[Batch], Batch]) -> Batch:
        """The next batch, on the device: marked before and after the loader and after the copy."""
        before = self.clock.mark()
        batch = next(batches)
        fetched = self.clock.mark()
        batch = to_device(batch)
        self._open = (before, fetched, self.clock.mark())
        return batch

    def computed(self) -> None:
        self.batches.append((*self._open, self.clock.mark()))

    def end(self) -> None:
        """The iteration is over (its optimizer step included); the one before it is recorded."""
        self.flush()
        self.pending = (self.batches, self.clock.mark(), (time.perf_counter() - self.started) * 1000.0)

    def flush(self) -> None:
        """Record the pending iteration (call when the device has reached its marks)."""
        if self.pending is None:
            return
        batches, ended, wall_ms = self.pending
        ms = self.clock.ms
        self.done += 1
        self.report.record(self.done, {
            "data_wait": sum(ms(before, fetched) for before, fetched, _, _ in batches),
            "h2d": sum(ms(fetched, copied) for _, fetched, copied, _ in batches),
            "compute": sum(ms(copied, done) for _, _, copied, done in batches) + ms(batches[-1][3], ended),
            "iter": wall_ms,
        })
        self.pending = None

    def finish(self) -> None:
        """Wait for the device and record the last iteration."""
        if self.clock.cuda:
            torch.cuda.synchronize()
        self.flush()


# --------------------------------------------------------------------------- progress


class ProgressDisplay:
    """Rank 0's progress through an epoch: a tqdm bar on a terminal (EPID_PROGRESS), else plain
    lines for cluster logs; nothing on other ranks.

    A plain line comes after a step when EPID_LOG_SECONDS have passed since the last line (or
    the start of the epoch), and, in epochs of at least ``PROGRESS_LINES_MIN_STEPS`` steps, at
    every tenth of the epoch; never after the last step (the epoch line follows). It gives
    the step, samples/s over all ranks, the running mean loss of the epoch on rank 0 and the
    ETA of the epoch and of the run: the epoch's remaining steps at the rate so far, plus the
    remaining epochs at ``epoch_seconds`` (the last whole epoch, validation included) or, before
    one, at the rate so far; a time limit (``deadline``, a ``time.perf_counter`` value) caps it.
    """

    def __init__(self, epoch: int, steps: int, done: int, config: Config, is_main: bool,
                 epoch_seconds: float | None = None, deadline: float | None = None) -> None:
        self.epoch, self.epochs, self.steps, self.shown = epoch, config.epochs, steps, is_main
        self.global_batch, self.log_seconds = config.global_batch, config.log_seconds
        self.epoch_seconds, self.deadline = epoch_seconds, deadline
        self.every = math.ceil(steps / PROGRESS_LINES_PER_EPOCH) if steps >= PROGRESS_LINES_MIN_STEPS else 0
        self.started = self.last_line = time.perf_counter()
        self.first = done
        self.bar = None
        if is_main and config.progress and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch}", unit="step", leave=False,
                            dynamic_ncols=True)

    def step(self, done: int, loss: Callable[[], float]) -> None:
        """Optimizer step ``done`` (1-based) is over; ``loss()`` reads the epoch's running mean loss."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss():.3e}", refresh=False)
            return
        if not self.shown or done >= self.steps:
            return
        now = time.perf_counter()
        if now - self.last_line >= self.log_seconds or (self.every and done % self.every == 0):
            self.last_line = now
            print(self.line(done, loss(), now), flush=True)

    def line(self, done: int, loss: float, now: float) -> str:
        """``epoch 3/10 step 40/400 (10 %) | 21.3 samples/s | loss 1.234e-02 | ETA epoch 0:05:12, run 1:02:40``."""
        seconds_per_step = (now - self.started) / max(done - self.first, 1)
        epoch_left = (self.steps - done) * seconds_per_step
        run_left = epoch_left + (self.epochs - self.epoch) * (self.epoch_seconds or self.steps * seconds_per_step)
        limit = ""
        if self.deadline is not None and self.deadline - now < run_left:
            run_left, limit = max(self.deadline - now, 0.0), " (time limit)"
        return (f"epoch {self.epoch}/{self.epochs} step {done}/{self.steps} ({100 * done / self.steps:.0f} %) | "
                f"{self.global_batch / seconds_per_step:.1f} samples/s | loss {loss:.4e} | "
                f"ETA epoch {clock_text(epoch_left)}, run {clock_text(run_left)}{limit}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- epoch line


def clock_text(seconds: float) -> str:
    """``H:MM:SS`` of ``seconds``, rounded."""
    return str(datetime.timedelta(seconds=round(seconds)))


def epoch_line(epoch: int, epochs: int, record: Mapping[str, Any], device: torch.device, best: bool) -> str:
    """Rank 0's line for a finished epoch: train and validation loss with every term, gamma pass
    rate, samples/s, learning rate, elapsed time (and the peak GPU memory, skipped steps, best)."""

    def terms(values: Mapping[str, float]) -> str:
        detail = ", ".join(f"{term} {values[term]:.3e}" for term in LOSS_TERMS[1:])
        return f"{values['total']:.4e} ({detail})"

    gamma = "off" if math.isnan(record["gamma_pass"]) else f"{record['gamma_pass']:.1f} %"
    line = (
        f"epoch {epoch}/{epochs} | train {terms(record['train'])} | val {terms(record['val'])} | "
        f"gamma pass {gamma} | {record['samples_per_s']:.1f} samples/s | lr {record['lr']:.3e} | "
        f"elapsed {clock_text(record['elapsed_s'])}"
    )
    if device.type == "cuda":
        line += f" | peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
    if record["nonfinite_steps"]:
        line += f" | {record['nonfinite_steps']} non-finite step(s) skipped"
    if best:
        line += " | best"
    return line
