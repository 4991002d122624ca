"""Samples, splits and batch windows: which consecutive samples of which dataset each step sees.

Sample ``s`` of a dataset (``0 <= s < N - 2`` for ``N`` control points) pairs control
point ``s + 1`` ("prev") with control point ``s + 2`` ("curr"); its EPID frames are
frame ``s + 1`` and frame ``s + 2``. The first ``floor(0.8125 * (N - 2))`` samples of
each dataset are for training, the rest for validation (1664 / 384 for N = 2050).

A batch is a ``Window``: consecutive samples ``start .. stop - 1`` of one split of one
dataset (the consistency loss compares each sample's curr prediction with the next sample's
prev). An epoch is a sequence of windows per rank, in order or shuffled, capped or whole.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from epid.synthesis.sequences import MIN_CONTROL_POINTS

TRAIN_FRACTION = 0.8125


SPLITS = ("train", "val")


BATCH_ORDERS = ("sequential", "shuffled")


def num_samples(n_control_points: int) -> int:
    """Samples per dataset, ``N - 2``; raises ValueError when a split would be empty."""
    if n_control_points < MIN_CONTROL_POINTS:
        raise ValueError(
            f"{n_control_points} control points give {max(n_control_points - 2, 0)} samples; "
            f"at least {MIN_CONTROL_POINTS} control points are needed for a non-empty "
            "training and validation split"
        )
    return n_control_points - 2


def split_range(n_control_points: int, split: str) -> range:
    """Sample indices of ``split`` ("train" or "val") in a dataset of N control points.

    Train is the first ``floor(0.8125 * (N - 2))`` samples, val the rest; both are
    non-empty for every N >= 4.
    """
    total = num_samples(n_control_points)
    n_train = math.floor(TRAIN_FRACTION * total)
    if split == "train":
        return range(n_train)
    if split == "val":
        return range(n_train, total)
    raise ValueError(f"split {split!r} is not one of {SPLITS}")


@dataclass(frozen=True)
class Window:
    """Consecutive samples ``start .. stop - 1`` of one dataset, inside one split."""

    dataset_id: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"window [{self.start}, {self.stop}) is empty or negative")

    def __len__(self) -> int:
        return self.stop - self.start


def dataset_windows(
    dataset_id: int, n_control_points: int, split: str, batch_size: int
) -> list[Window]:
    """The split's samples cut into windows of ``batch_size`` (the last may be shorter).

    The windows cover every sample of the split exactly once. A window holds one
    sample only when the split's length leaves a remainder of 1; batch losses that
    pair neighbouring samples see no pair in it.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    samples = split_range(n_control_points, split)
    return [
        Window(dataset_id, start, min(start + batch_size, samples.stop))
        for start in range(samples.start, samples.stop, batch_size)
    ]


def windows_per_dataset(n_control_points: int, split: str, batch_size: int) -> int:
    """``len(dataset_windows(...))`` without building them."""
    return math.ceil(len(split_range(n_control_points, split)) / batch_size)


def steps_per_epoch(
    datasets_per_rank: Sequence[int],
    *,
    n_control_points: int,
    batch_size: int,
    split: str = "train",
    max_batches: int = 0,
) -> int:
    """Batches every rank takes in one epoch, so that no rank waits on another.

    Policy: the largest window count of any rank. Ranks with fewer windows wrap around
    and revisit the first windows of their epoch order (see ``epoch_windows``), so every
    sample of every rank is used at least once per epoch and all ranks take the same
    number of steps. ``datasets_per_rank[r]`` is the number of datasets of rank ``r``
    (every rank computes it for every rank from the deterministic assignment, e.g.
    ``[len(ids) for ids in sharding.assign_all_ranks(...)]``). ``max_batches > 0``
    caps the count (short epochs; with gradient accumulation pass optimizer steps times
    accumulation steps); capped epochs take their windows from ``stream_windows``.

    Validation needs no equalisation when it runs without per-step collectives: each
    rank then evaluates each of its windows exactly once.
    """
    if not datasets_per_rank or min(datasets_per_rank) < 1:
        raise ValueError(f"every rank needs at least one dataset, got {list(datasets_per_rank)}")
    per_dataset = windows_per_dataset(n_control_points, split, batch_size)
    return epoch_steps([count * per_dataset for count in datasets_per_rank], max_batches=max_batches)


def epoch_steps(windows_per_rank: Sequence[int], *, max_batches: int = 0) -> int:
    """``steps_per_epoch`` from the number of windows of each rank (datasets of any lengths):
    the largest, capped by ``max_batches > 0``."""
    if not windows_per_rank or min(windows_per_rank) < 1:
        raise ValueError(f"every rank needs at least one window, got {list(windows_per_rank)}")
    steps = max(windows_per_rank)
    return min(steps, max_batches) if max_batches > 0 else steps


def epoch_windows(
    windows: Sequence[Window],
    *,
    order: str = "sequential",
    seed: int = 0,
    epoch: int = 0,
    steps: int | None = None,
) -> list[Window]:
    """This epoch's windows of one rank, in training order.

    ``sequential`` keeps the given order (datasets in the rank's assigned order, windows
    in sample order: the legacy order). ``shuffled`` permutes the windows with a
    generator seeded by ``(seed, epoch)`` only: a new order every epoch, the same order
    on every run. With ``steps``, the list is cut to ``steps`` windows, or wrapped
    around from its start when it is shorter (see ``steps_per_epoch``).
    """
    if order not in BATCH_ORDERS:
        raise ValueError(f"batch order {order!r} is not one of {BATCH_ORDERS}")
    if not windows:
        raise ValueError("no windows to order")
    ordered = list(windows)
    if order == "shuffled":
        random.Random(f"epid-window-order:{seed}:{epoch}").shuffle(ordered)
    if steps is None:
        return ordered
    return [ordered[i % len(ordered)] for i in range(steps)]


def stream_windows(
    windows: Sequence[Window],
    *,
    order: str = "sequential",
    seed: int = 0,
    start: int = 0,
    count: int,
) -> list[Window]:
    """``count`` windows of one rank's window stream from its position ``start`` (0-based).

    The stream is the rank's windows in the order of epoch 1, then in the order of epoch 2, and
    so on (``epoch_windows``): every window comes once in each pass through them. Capped epochs
    (EPID_STEPS_PER_EPOCH) each take the next ``count`` windows from where the one before
    stopped, so they go round all windows before any repeats, in either order.
    """
    if not windows:
        raise ValueError("no windows to order")
    taken: list[Window] = []
    position = start
    while len(taken) < count:
        passes, offset = divmod(position, len(windows))
        ordered = epoch_windows(windows, order=order, seed=seed, epoch=passes + 1)
        part = ordered[offset:offset + count - len(taken)]
        taken.extend(part)
        position += len(part)
    return taken
