"""TensorBoard event files of a run (EPID_TENSORBOARD), written by rank 0 with
``torch.utils.tensorboard``.

Per epoch (the step of every value is the epoch, from 1): the train and validation loss of
every term (``loss_train/<term>``, ``loss_val/<term>``), the learning rate (``lr``), samples/s
(``samples_per_s``), the gamma pass rate in % (``gamma_pass``) and, for the first
``FRAMES`` gamma samples of rank 0, the measured frame, the forward model's prediction and
their absolute difference side by side on the measured frame's scale
(``validation/dataset_<id>_sample_<s>``); at the start, the resolved configuration
(``config``). A resumed run appends to the same folder; what an earlier attempt wrote after
the checkpoint's epoch is hidden (``purge_step``).

The ``tensorboard`` package is optional (``requirements-dev.txt`` installs it);
``check_available`` raises InputError naming it before any rank starts.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from epid.core.errors import InputError
from epid.models.losses import LOSS_TERMS

FRAMES = 4


def check_available(directory: str) -> None:
    """InputError unless the tensorboard package can be imported."""
    if importlib.util.find_spec("tensorboard") is None:
        raise InputError(f"EPID_TENSORBOARD={directory!r}: the tensorboard package is not installed; expected "
                         "`python -m pip install tensorboard`, or EPID_TENSORBOARD unset")


def frame_image(measured: Tensor, predicted: Tensor) -> Tensor:
    """Measured | predicted | |difference| of one frame ((256, 256) each) as one (256, 768) image in
    [0, 1], every panel divided by the measured frame's maximum."""
    scale = measured.max().clamp_min(1e-12)
    panels = [measured, predicted, (predicted - measured).abs()]
    return (torch.cat(panels, dim=1) / scale).clamp(0.0, 1.0).float().cpu()


class TensorBoardLog:
    """One SummaryWriter in ``directory``; ``first_epoch``: the epoch this run starts with."""

    def __init__(self, directory: str, first_epoch: int, config_text: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=directory, purge_step=first_epoch if first_epoch > 1 else None)
        self.writer.add_text("config", "\n".join(f"    {line}" for line in config_text.splitlines()), first_epoch)

    def epoch(self, epoch: int, record: Mapping[str, Any],
              frames: Sequence[tuple[int, int, Tensor, Tensor]] = ()) -> None:
        """The figures of a finished epoch (``record`` as in ``epid.training.metrics_log.append_epoch``) and
        ``frames``: (dataset ID, sample, measured frame, predicted frame) of a few validation samples."""
        for split in ("train", "val"):
            for term in LOSS_TERMS:
                self.writer.add_scalar(f"loss_{split}/{term}", record[split][term], epoch)
        for name in ("lr", "samples_per_s", "gamma_pass"):
            if math.isfinite(record[name]):
                self.writer.add_scalar(name, record[name], epoch)
        for dataset_id, sample, measured, predicted in frames:
            self.writer.add_image(f"validation/dataset_{dataset_id}_sample_{sample}",
                                  frame_image(measured, predicted), epoch, dataformats="HW")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
