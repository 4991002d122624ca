"""Dataset ID selection (EPID_DATASET_RANGE / EPID_DATASET_IDS) and rank assignment.

Assignment follows the legacy behaviour: the sorted unique IDs are shuffled with
``random.Random(seed).shuffle`` (optional), then rank ``r`` takes ``ids[r::world_size]``.
It is a pure function of its arguments, so every rank computes every other rank's
share locally and no communication is needed.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from epid.synthesis.sequences import NUM_DATASETS


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{what} {text.strip()!r} is not an integer") from None


def _check_bounds(ids: Iterable[int], num_datasets: int) -> None:
    outside = sorted({i for i in ids if not 0 <= i < num_datasets})
    if outside:
        shown = ", ".join(str(i) for i in outside[:5]) + (", ..." if len(outside) > 5 else "")
        raise ValueError(f"dataset ID(s) {shown} outside 0..{num_datasets - 1}")


def parse_range(range_spec: str, num_datasets: int = NUM_DATASETS) -> list[int]:
    """IDs of a Python-style ``start:stop[:step]`` range, e.g. ``0:640:80``.

    Empty start or stop take 0 and ``num_datasets``. Raises ValueError on a malformed
    spec, a zero step, IDs outside ``0..num_datasets-1`` or an empty range.
    """
    parts = range_spec.strip().split(":")
    if len(parts) not in (2, 3):
        raise ValueError("not of the form start:stop[:step]")
    start = _parse_int(parts[0], "start") if parts[0].strip() else 0
    stop = _parse_int(parts[1], "stop") if parts[1].strip() else num_datasets
    step = _parse_int(parts[2], "step") if len(parts) == 3 and parts[2].strip() else 1
    if step == 0:
        raise ValueError("step cannot be 0")
    ids = list(range(start, stop, step))
    if not ids:
        raise ValueError("the range selects no dataset")
    _check_bounds(ids, num_datasets)
    return ids


def parse_id_list(ids_spec: str, num_datasets: int = NUM_DATASETS) -> list[int]:
    """IDs of a comma-separated list, e.g. ``0,80,160`` (spaces allowed)."""
    items = ids_spec.split(",")
    if any(not item.strip() for item in items):
        raise ValueError("empty item in the list")
    ids = [_parse_int(item, "item") for item in items]
    _check_bounds(ids, num_datasets)
    return ids


def select_dataset_ids(
    range_spec: str | None, ids_spec: str | None, num_datasets: int = NUM_DATASETS
) -> list[int]:
    """Sorted unique dataset IDs chosen by a range spec or an ID list (all IDs if neither).

    Giving both is an error: they are two ways of saying the same thing.
    """
    range_spec = (range_spec or "").strip()
    ids_spec = (ids_spec or "").strip()
    if range_spec and ids_spec:
        raise ValueError("give a dataset range or a list of IDs, not both")
    if range_spec:
        ids = parse_range(range_spec, num_datasets)
    elif ids_spec:
        ids = parse_id_list(ids_spec, num_datasets)
    else:
        ids = list(range(num_datasets))
    return sorted(set(ids))


def assign_dataset_ids(
    ids: Iterable[int], rank: int, world_size: int, shuffle: bool = True, seed: int = 12345
) -> list[int]:
    """The dataset IDs that ``rank`` of ``world_size`` trains on, in training order.

    Sorted unique IDs, shuffled by ``random.Random(seed).shuffle`` when ``shuffle``, then
    strided: rank ``r`` takes ``ids[r::world_size]``. Raises ValueError naming the rank
    when it would get no dataset.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
    ordered = sorted(set(ids))
    if shuffle:
        random.Random(seed).shuffle(ordered)
    assigned = ordered[rank::world_size]
    if not assigned:
        raise ValueError(
            f"rank {rank} of {world_size} would get no dataset: {len(ordered)} selected; "
            f"select at least {world_size} datasets or use fewer ranks"
        )
    return assigned


def assign_all_ranks(
    ids: Iterable[int], world_size: int, shuffle: bool = True, seed: int = 12345
) -> list[list[int]]:
    """``assign_dataset_ids`` for every rank, indexed by rank."""
    ids = list(ids)
    return [assign_dataset_ids(ids, rank, world_size, shuffle, seed) for rank in range(world_size)]
