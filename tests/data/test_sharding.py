"""Dataset ID selection and the deterministic, strided rank assignment."""

import random

import pytest

from epid.data.sharding import NUM_DATASETS, assign_all_ranks, assign_dataset_ids, select_dataset_ids

ALL_IDS = list(range(NUM_DATASETS))


def legacy_assignment(ids, rank, world_size, seed):
    """The legacy script's assignment, written out independently."""
    ordered = sorted(set(ids))
    random.Random(seed).shuffle(ordered)
    return ordered[rank::world_size]


@pytest.mark.parametrize("world_size", range(1, 9))
def test_assignment_is_disjoint_complete_and_legacy(world_size):
    shares = assign_all_ranks(ALL_IDS, world_size, shuffle=True, seed=12345)
    flat = [i for share in shares for i in share]
    assert len(flat) == len(set(flat)) == NUM_DATASETS
    assert set(flat) == set(ALL_IDS)
    for rank, share in enumerate(shares):
        assert share == legacy_assignment(ALL_IDS, rank, world_size, 12345)
        assert abs(len(share) - NUM_DATASETS / world_size) < 1


def test_assignment_without_shuffle_is_strided_sorted():
    assert assign_dataset_ids([5, 3, 3, 9, 1], 1, 2, shuffle=False) == [3, 9]
    assert assign_dataset_ids([5, 3, 3, 9, 1], 0, 2, shuffle=False) == [1, 5]


def test_assignment_depends_on_seed_and_not_on_input_order():
    ids = list(range(0, 640, 7))
    assert assign_dataset_ids(ids, 0, 3, seed=1) == assign_dataset_ids(list(reversed(ids)), 0, 3, seed=1)
    assert assign_dataset_ids(ids, 0, 3, seed=1) != assign_dataset_ids(ids, 0, 3, seed=2)


def test_rank_without_dataset_is_named():
    with pytest.raises(ValueError, match="rank 2 of 3 would get no dataset"):
        assign_dataset_ids([4, 7], 2, 3)
    with pytest.raises(ValueError, match="rank 3 is outside"):
        assign_dataset_ids([4, 7], 3, 3)


def test_select_range_and_ids():
    assert select_dataset_ids("0:640:80", "") == [0, 80, 160, 240, 320, 400, 480, 560]
    assert select_dataset_ids("10:13", None) == [10, 11, 12]
    assert select_dataset_ids(":3", "") == [0, 1, 2]
    assert select_dataset_ids("637:", "") == [637, 638, 639]
    assert select_dataset_ids("", " 160, 0,80,80 ") == [0, 80, 160]
    assert select_dataset_ids("", "") == ALL_IDS
    assert select_dataset_ids("9:0:-3", "") == [3, 6, 9]


@pytest.mark.parametrize(
    "range_spec, ids_spec, message",
    [
        ("0:640:0", "", "step cannot be 0"),
        ("0:700", "", "outside 0..639"),
        ("-1:3", "", "outside 0..639"),
        ("5:5", "", "selects no dataset"),
        ("a:5", "", "start 'a' is not an integer"),
        ("5", "", "start:stop"),
        ("1:2:3:4", "", "start:stop"),
        ("", "1,,2", "empty item"),
        ("", "1,x", "'x' is not an integer"),
        ("", "640", "outside 0..639"),
        ("0:2", "1", "not both"),
    ],
)
def test_bad_selections(range_spec, ids_spec, message):
    with pytest.raises(ValueError, match=message):
        select_dataset_ids(range_spec, ids_spec)
