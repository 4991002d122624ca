"""What a training run prints: rank 0 speaks, once for the whole run.

At the start: the resolved configuration, the dataset IDs per rank, the epoch plan (steps per
epoch, which windows, what stops the run) and one line per rank (process, device, threads,
precision and why, its share of the data), gathered so that they print as one block. Then the
lines of the run's events: a skipped step, a resumed or restarted epoch, the stop (signal, time
limit, early stop, non-finite losses) and the end.
"""

from __future__ import annotations

import os
import sys

from epid.config.load import Config, describe, rank_report
from epid.core.devices import PrecisionChoice
from epid.training import distributed
from epid.training.distributed import RankContext
from epid.training.progress import clock_text
from epid.training.rank_data import RankData
from epid.training.run_state import RunState
from epid.training.side_by_side import SideBySide


class RunReport:
    """The messages of one rank's run; only rank 0 prints them (the start block holds every rank's line)."""

    def __init__(self, config: Config, context: RankContext) -> None:
        self.config, self.context = config, context

    def say(self, text: str, *, error: bool = False) -> None:
        """Print ``text`` on rank 0 (to stderr with ``error``); nothing for an empty text."""
        if self.context.is_main and text:
            print(text, file=sys.stderr if error else sys.stdout, flush=True)

    def start(self, data: RankData, window_cursor: int, precision: PrecisionChoice, side: SideBySide | None) -> None:
        """The start block (a collective: every rank calls it); ``side``: the models' side-by-side runner, if any."""
        config, context = self.config, self.context
        self.say(f"Resolved configuration:\n{describe(config)}\nDataset IDs per rank:\n{rank_report(config)}")
        self.say(self.plan_text(data, window_cursor))
        threads = f"{context.threads} thread(s)"
        if side is not None:
            threads += " (forward and inverse models side by side on {} + {})".format(*side.threads)
        line = (
            f"rank {context.rank}/{context.world_size} (local {context.local_rank}): pid {os.getpid()}, "
            f"device {context.device}, backend {context.backend or 'none'}, {threads}, "
            f"precision {precision.name} ({precision.reason}), {len(data.dataset_ids)} dataset(s), "
            f"{len(data.train_windows)} training and {len(data.val_windows)} validation window(s), "
            f"{len(data.gamma_items)} gamma sample(s)"
        )
        self.say("\n".join(distributed.gather_objects(line)))  # one block, never interleaved

    def plan_text(self, data: RankData, window_cursor: int) -> str:
        """How many steps an epoch takes, which windows it trains on and validates, what stops the run."""
        config = self.config
        lines = [f"Every rank takes {data.steps} optimizer step(s) of {config.grad_accum} batch(es) per epoch"]
        if data.capped:
            lines[0] += (f" (EPID_STEPS_PER_EPOCH): each epoch goes on through the rank's batch windows where the one "
                         f"before stopped, from position {window_cursor}")
        else:
            lines[0] += " (the largest rank share; ranks with fewer batch windows repeat their first windows)"
        if config.val_steps:
            lines.append(f"Validation on a fixed set of {config.val_steps} batch window(s) spread over the selected "
                         "datasets (EPID_VAL_STEPS)")
        if config.time_limit:
            lines.append(f"Training stops after the step that reaches {config.time_limit:g} min (EPID_TIME_LIMIT), "
                         "with a checkpoint to resume from")
        return "\n".join(lines)

    def skipped_step(self, epoch: int, step: int, consecutive: int) -> None:
        """Optimizer step ``step`` (1-based) was skipped for a non-finite loss."""
        self.say(f"epoch {epoch} step {step}: non-finite loss on some rank, step skipped ({consecutive} in a row)")

    def interrupted(self, stopped_by: str, epoch: int, steps: int, steps_per_epoch: int) -> None:
        """A signal or the time limit (``stopped_by``) stopped ``epoch`` after ``steps`` optimizer steps."""
        self.say(f"{stopped_by} in epoch {epoch} after optimizer step {steps}/{steps_per_epoch}; checkpoint "
                 f"{self.config.checkpoint_path} written; resume with EPID_RESUME=1")

    def stopped(self, epoch: int, stopped_by: str) -> None:
        """A signal or the time limit (``stopped_by``) stopped the run after ``epoch``."""
        self.say(f"{stopped_by} after epoch {epoch}; checkpoint {self.config.checkpoint_path} written; resume with "
                 "EPID_RESUME=1")

    def early_stop(self, epoch: int, state: RunState) -> None:
        self.say(f"Early stop after epoch {epoch}: no new best validation loss for {self.config.early_stop_patience} "
                 f"epoch(s) (best {state.best_val_loss:.4e} at epoch {state.best_epoch})")

    def nonfinite_stop(self, epoch: int, kept_epoch: int) -> None:
        """EPID_MAX_NONFINITE_STEPS steps in a row were skipped in ``epoch``; the checkpoint of
        ``kept_epoch`` (0: none) is the run's last."""
        where = (f"the checkpoint of epoch {kept_epoch} at {self.config.checkpoint_path} is kept" if kept_epoch
                 else "no checkpoint was written")
        self.say(f"Training stopped in epoch {epoch}: {self.config.max_nonfinite_steps} consecutive optimizer steps "
                 f"had a non-finite loss (EPID_MAX_NONFINITE_STEPS); {where}. Try a lower EPID_LR or "
                 "EPID_PRECISION=fp32.", error=True)

    def finished(self, state: RunState, seconds: float) -> None:
        self.say(f"Training finished after {state.epoch} epoch(s) in {clock_text(seconds)}; best validation loss "
                 f"{state.best_val_loss:.4e} at epoch {state.best_epoch}")
