"""The data one rank trains and validates on.

Its datasets (``Config.rank_dataset_ids``), the batch windows of each epoch, the validation
windows and the gamma samples, and the loader that turns windows into batches on the rank's
device (``epid.data.dataset``).

Every rank takes the same number of optimizer steps per epoch: the largest window count of
any rank, rounded up to whole EPID_GRAD_ACCUM groups; a rank with fewer windows goes round
its list again from the start. When EPID_STEPS_PER_EPOCH cuts that count, an epoch takes the
next windows of the rank's window stream (``epid.data.windows.stream_windows``) from the run's
window cursor, which advances by the epoch's batches and is saved in the checkpoint: capped
epochs go round all windows before any repeats.

Validation visits each of the rank's validation windows once; with EPID_VAL_STEPS, only
those of a fixed set of that many windows spread over all selected datasets (the same set
every epoch and for any world size).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from epid.config.load import Config, epid_data
from epid.data import sharding
from epid.data.dataset import Batch, BatchLoader
from epid.data.windows import Window, dataset_windows, epoch_steps, epoch_windows, stream_windows, windows_per_dataset
from epid.evaluation import inference
from epid.training.distributed import RankContext


class RankData:
    """One rank's datasets, windows and loader; ``steps`` optimizer steps of ``batches`` batches per epoch."""

    def __init__(self, config: Config, context: RankContext) -> None:
        self.config = config
        self.world_size = context.world_size
        self.device = context.device
        self.dataset_ids = config.rank_dataset_ids(context.rank)
        self.data = epid_data(config, self.dataset_ids)
        self.loader = BatchLoader(self.data, self.device, num_workers=config.num_workers,
                                  pin_memory=config.pin_memory, prefetch_factor=config.prefetch_factor)
        self.copy_batches = config.num_workers > 0 and self.device.type != "cpu"
        self.train_windows = self.data.windows("train", config.batch_size)
        shares = sharding.assign_all_ranks(config.dataset_ids, context.world_size, config.dataset_shuffle,
                                           config.dataset_seed)
        counts = [sum(windows_per_dataset(config.arc_control_points(i), "train", config.batch_size) for i in ids)
                  for ids in shares]
        every = epoch_steps(counts)
        batches = epoch_steps(counts, max_batches=config.steps_per_epoch * config.grad_accum)
        self.steps = math.ceil(batches / config.grad_accum)
        self.batches = self.steps * config.grad_accum
        self.capped = self.batches < every
        self.val_windows = self._validation_windows()
        own = set(self.dataset_ids)
        chosen = inference.gamma_subset(config.dataset_ids, config.arc_control_points, config.gamma_samples)
        self.gamma_items = [item for item in chosen if item[0] in own]
        self._gamma_inputs: dict[str, Tensor] | None = None

    def _validation_windows(self) -> list[Window]:
        """The rank's validation windows: all of them, or with EPID_VAL_STEPS its share of that many
        windows spread over the validation windows of every selected dataset (in ID order)."""
        config = self.config
        if not config.val_steps:
            return self.data.windows("val", config.batch_size)
        every = [window for dataset_id in sorted(config.dataset_ids)
                 for window in dataset_windows(dataset_id, config.arc_control_points(dataset_id), "val",
                                               config.batch_size)]
        own = set(self.dataset_ids)
        return [window for window in inference.spread(every, config.val_steps) if window.dataset_id in own]

    def epoch_windows(self, epoch: int, cursor: int) -> list[Window]:
        """The ``batches`` training windows of ``epoch`` (1-based), in order: the epoch's own order,
        or in a capped epoch the next windows of the rank's stream from position ``cursor``."""
        config = self.config
        if self.capped:
            return stream_windows(self.train_windows, order=config.batch_order, seed=config.seed, start=cursor,
                                  count=self.batches)
        return epoch_windows(self.train_windows, order=config.batch_order, seed=config.seed, epoch=epoch,
                             steps=self.batches)

    def train_batches(self, epoch: int, cursor: int, first_batch: int = 0) -> Iterator[Batch]:
        """The training batches of ``epoch`` from its batch ``first_batch`` (0-based) on (``epoch_windows``)."""
        return iter(self.loader.batches(self.epoch_windows(epoch, cursor)[first_batch:]))

    def val_batches(self) -> Iterator[Batch]:
        return iter(self.loader.batches(self.val_windows))

    def to_device(self, batch: Batch) -> Batch:
        """A loader batch on the rank's device (DataLoader workers make them on the host)."""
        if not self.copy_batches:
            return batch
        return batch.to(self.device, non_blocking=self.loader.pin_memory)

    def plan(self) -> dict[str, Any]:
        """What fixes the batch order of an epoch (an interrupted epoch resumes only under the same plan)."""
        config = self.config
        return {
            "world_size": self.world_size, "dataset_ids": list(config.dataset_ids),
            "dataset_shuffle": config.dataset_shuffle, "dataset_seed": config.dataset_seed,
            "batch_size": config.batch_size, "grad_accum": config.grad_accum, "batch_order": config.batch_order,
            "seed": config.seed, "control_points": config.control_points, "batches": self.batches,
            **({"plan_arcs": [f"{arc.sha256}:{arc.beam_number}" for arc in config.plan_arcs]} if config.plan_arcs
               else {}),
        }

    def gamma_inputs(self) -> dict[str, Tensor]:
        """The gamma samples' inputs and measured frames, synthesised once and kept on the device."""
        if self._gamma_inputs is None:
            batches = [self.data.make_batch(Window(d, s, s + 1), self.device) for d, s in self.gamma_items]
            self._gamma_inputs = {
                "leaf_a": torch.cat([b.leaf_a for b in batches]),
                "leaf_b": torch.cat([b.leaf_b for b in batches]),
                "scalars": torch.cat([b.scalars for b in batches]),
                "epid_prev": torch.cat([b.epid_prev[:, 0] for b in batches]),
                "epid_curr": torch.cat([b.epid_curr[:, 0] for b in batches]),
            }
        return self._gamma_inputs
