"""A rank's validation pass: the loss on each of its validation windows once, and the forward
model's gamma pass rate on its share of the fixed gamma samples.

No collectives run inside it; the training loop all-reduces the sums it returns. The gamma
pass rate is 3 %/3 mm global with a 10 % cutoff (``epid.evaluation.gamma.GammaCriteria``) on the frames
of EPID_GAMMA_SAMPLES validation samples spread over the selected datasets
(``epid.evaluation.inference.gamma_subset``), synthesised once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from epid.config.load import Config
from epid.core.devices import autocast
from epid.evaluation.gamma import gamma_pass_rates
from epid.models.families import CrossModel, predict_frames
from epid.models.losses import LOSS_TERMS, batch_losses
from epid.training.progress import IterationTimer, TimingReport
from epid.training.rank_data import RankData


class Validation:
    """Validation of one rank's models on its data.

    ``frames``: after each pass, (dataset ID, sample, measured frame, predicted frame) of the
    rank's first ``keep_frames`` gamma samples (frames (256, 256) on the CPU), for TensorBoard.
    """

    def __init__(self, model: CrossModel, data: RankData, config: Config, amp_dtype: torch.dtype,
                 is_main: bool, keep_frames: int = 0) -> None:
        self.model, self.data, self.config = model, data, config
        self.device, self.amp_dtype, self.is_main = data.device, amp_dtype, is_main
        self.keep_frames = keep_frames
        self.frames: list[tuple[int, int, Tensor, Tensor]] = []

    def run(self, evaluate: Callable[..., Any], epoch: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Loss sums (per term, weighted by batch size) and sample count over the validation
        windows through ``evaluate`` (called like the CrossModel), and the gamma (sum, count)."""
        self.model.eval()
        windows = len(self.data.val_windows)
        timer = IterationTimer(self.device, TimingReport("val", epoch, windows, "batch", self.config, self.is_main))
        sums, samples = torch.zeros(len(LOSS_TERMS), device=self.device), torch.zeros((), device=self.device)
        batches = self.data.val_batches()
        with torch.no_grad():
            for _ in range(windows):
                timer.start()
                batch = timer.fetch(batches, self.data.to_device)
                losses = batch_losses(evaluate, batch, self.device, self.amp_dtype)
                timer.computed()
                sums += torch.stack([losses[term] for term in LOSS_TERMS]) * len(batch)
                samples += len(batch)
                timer.end()
            timer.finish()
            started = time.perf_counter()
            gamma = self.gamma_sums()
        if self.is_main and self.data.gamma_items and self.config.timing_max > 0:
            print(f"[TIMING][gamma] epoch {epoch}: {(time.perf_counter() - started) * 1000.0:.1f} ms for "
                  f"{len(self.data.gamma_items)} sample(s) on rank 0", flush=True)
        self.model.train()
        return sums, samples, gamma

    def gamma_sums(self) -> tuple[Tensor, Tensor]:
        """Sum and count of the forward model's gamma pass rates (%) on this rank's gamma samples."""
        zero = torch.zeros((), device=self.device)
        if not self.data.gamma_items:
            return zero, zero.clone()
        inputs = self.data.gamma_inputs()
        predictions = []
        for start in range(0, len(self.data.gamma_items), self.config.batch_size):
            chunk = slice(start, start + self.config.batch_size)
            with autocast(self.device, self.amp_dtype):
                epid, _ = predict_frames(self.model.forward_model, inputs["leaf_a"][chunk], inputs["leaf_b"][chunk],
                                         inputs["scalars"][chunk], inputs["epid_prev"][chunk])
            predictions.append(epid[:, 0].float())
        predicted = torch.cat(predictions)
        self.frames = [(dataset_id, sample, inputs["epid_curr"][index].cpu(), predicted[index].cpu())
                       for index, (dataset_id, sample) in enumerate(self.data.gamma_items[:self.keep_frames])]
        rates = gamma_pass_rates(inputs["epid_curr"], predicted, device=self.device)
        counted = ~torch.isnan(rates)
        return torch.where(counted, rates, 0.0).sum().to(self.device), counted.sum().float().to(self.device)
