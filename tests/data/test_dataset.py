"""Samples, splits, windows, epoch plans, loaders and the frame cache of epid.data.dataset."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from epid.config.load import epid_data, load_config
from epid.data import cache, dataset
from epid.data import windows as windows_module
from epid.data.sharding import assign_all_ranks
from epid.synthesis.frames import render_frames
from epid.synthesis.geometry import NUM_LEAF_PAIRS
from epid.synthesis.kernel import default_kernel
from epid.synthesis.physics import PRESETS, Physics
from epid.synthesis.sequences import generate_control_points

N_SMALL = 23  # 21 samples: 17 train, 4 val


class CountingRender:
    """Frames that name their dataset and frame: value ``d + f / 256`` plus a ramp over rows."""

    def __init__(self) -> None:
        self.calls = 0
        self.frames = 0

    def __call__(self, control_points, dataset_id, frame_indices, device):
        self.calls += 1
        self.frames += len(frame_indices)
        ramp = torch.arange(256, dtype=torch.float32)[:, None].expand(256, 256) / 256
        levels = torch.as_tensor(dataset_id + np.asarray(frame_indices) / 256, dtype=torch.float32)
        return (levels[:, None, None] + ramp).to(device)


def counting_data(ids, n=N_SMALL, cache_dir=None, render=None) -> dataset.EpidData:
    render = render or CountingRender()
    return dataset.EpidData(ids, control_points=n, cache_dir=cache_dir, render=render, render_id="counting")


def assert_same_batch(a: dataset.Batch, b: dataset.Batch, atol: float = 0.0) -> None:
    assert (a.dataset_id, a.first_sample, len(a)) == (b.dataset_id, b.first_sample, len(b))
    for name in ("leaf_a", "leaf_b", "scalars", "leaf_weight_a", "leaf_weight_b", "epid_prev", "epid_curr"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape and x.dtype == y.dtype, name
        difference = (x.cpu() - y.cpu()).abs().max().item()
        assert difference <= atol, f"{name} differs by {difference}"


# --------------------------------------------------------------------------- splits


def test_full_size_split_is_1664_train_384_val():
    train, val = windows_module.split_range(2050, "train"), windows_module.split_range(2050, "val")
    assert (len(train), len(val)) == (1664, 384)
    assert list(train) + list(val) == list(range(2048))


@pytest.mark.parametrize("n", range(4, 41))
def test_small_splits_are_non_empty_and_cover_all_samples(n):
    train, val = windows_module.split_range(n, "train"), windows_module.split_range(n, "val")
    assert len(train) == math.floor(0.8125 * (n - 2)) >= 1
    assert len(val) >= 1
    assert list(train) + list(val) == list(range(n - 2))


def test_too_few_control_points_are_rejected_with_the_minimum():
    with pytest.raises(ValueError, match="at least 4 control points"):
        windows_module.split_range(3, "train")
    with pytest.raises(ValueError, match="at least 4"):
        dataset.EpidData([0], control_points=3, render=CountingRender(), render_id="counting")


# --------------------------------------------------------------------------- samples


def test_sample_layout_matches_hand_assembly():
    cp = generate_control_points(7, N_SMALL)
    data = counting_data([7])
    window = windows_module.Window(7, 3, 9)
    batch = data.make_batch(window, "cpu")
    assert len(batch) == 6 and batch.dataset_id == 7 and batch.first_sample == 3
    for i, s in enumerate(range(3, 9)):
        prev, curr = s + 1, s + 2
        leaf_a = [float(cp.leaf_a[prev, j]) for j in range(52)] + [float(cp.leaf_a[curr, j]) for j in range(52)]
        leaf_b = [float(cp.leaf_b[prev, j]) for j in range(52)] + [float(cp.leaf_b[curr, j]) for j in range(52)]
        weight = [float(cp.leaf_weight[prev, j]) for j in range(52)] + [
            float(cp.leaf_weight[curr, j]) for j in range(52)
        ]
        scalars = [cp.mu[curr], cp.jaw_1[prev], cp.jaw_1[curr], cp.jaw_2[prev], cp.jaw_2[curr]]
        assert batch.leaf_a[i].tolist() == pytest.approx(leaf_a, abs=1e-5)
        assert batch.leaf_b[i].tolist() == pytest.approx(leaf_b, abs=1e-5)
        assert batch.leaf_weight_a[i].tolist() == pytest.approx(weight)
        assert batch.leaf_weight_b[i].tolist() == pytest.approx(weight)
        assert batch.scalars[i].tolist() == pytest.approx([float(v) for v in scalars], abs=1e-5)
        assert batch.epid_prev[i, 0, 0, 0].item() == pytest.approx(7 + prev / 256)
        assert batch.epid_curr[i, 0, 0, 0].item() == pytest.approx(7 + curr / 256)
    for name in ("leaf_a", "leaf_b", "leaf_weight_a", "leaf_weight_b"):
        assert getattr(batch, name).shape == (6, 2 * NUM_LEAF_PAIRS)
        assert getattr(batch, name).dtype == torch.float32
    assert batch.scalars.shape == (6, 5)
    assert batch.epid_prev.shape == batch.epid_curr.shape == (6, 1, 256, 256)


def test_window_frames_are_rendered_once_and_shared():
    render = CountingRender()
    data = counting_data([2], render=render)
    batch = data.make_batch(windows_module.Window(2, 0, 5), "cpu")
    assert (render.calls, render.frames) == (1, 6)
    assert torch.equal(batch.epid_curr[:-1], batch.epid_prev[1:])


def test_real_frames_match_render_frames_and_are_shared_across_windows():
    kernel = default_kernel()
    data = dataset.EpidData([5], control_points=12, kernel=kernel, noise_std=0.005, noise_seed=3)
    first, second = (data.make_batch(w, "cpu") for w in data.windows("train", 4)[:2])
    cp = generate_control_points(5, 12)
    expected = render_frames(cp, [1, 2, 3, 4, 5], kernel, dataset_id=5, noise_std=0.005, noise_seed=3)
    tolerance = 1e-6 * expected.abs().max().item()
    assert expected.abs().max() > 0
    assert (first.epid_prev[:, 0] - expected[:4]).abs().max() <= tolerance
    assert (first.epid_curr[:, 0] - expected[1:]).abs().max() <= tolerance
    assert torch.equal(first.epid_curr[:-1], first.epid_prev[1:])
    assert (first.epid_curr[-1] - second.epid_prev[0]).abs().max() <= tolerance


# --------------------------------------------------------------------------- windows


def test_windows_stay_in_one_split_of_one_dataset_and_cover_each_sample_once():
    ids = [5, 3, 7]
    data = counting_data(ids)
    for split in windows_module.SPLITS:
        samples = windows_module.split_range(N_SMALL, split)
        windows = data.windows(split, 4)
        assert [w.dataset_id for w in windows] == sorted(
            (w.dataset_id for w in windows), key=ids.index
        )
        for dataset_id in ids:
            mine = [w for w in windows if w.dataset_id == dataset_id]
            covered = [s for w in mine for s in range(w.start, w.stop)]
            assert covered == list(samples)
            assert all(samples.start <= w.start < w.stop <= samples.stop for w in mine)
            assert len(mine) == windows_module.windows_per_dataset(N_SMALL, split, 4)
        assert all(len(w) <= 4 for w in windows)


def test_full_size_window_counts():
    assert windows_module.windows_per_dataset(2050, "train", 128) == 13
    assert windows_module.windows_per_dataset(2050, "val", 128) == 3
    windows = windows_module.dataset_windows(0, 2050, "train", 42)
    assert len(windows) == 40 and len(windows[-1]) == 1664 - 39 * 42


def test_window_rejects_empty_ranges():
    with pytest.raises(ValueError):
        windows_module.Window(0, 4, 4)


# --------------------------------------------------------------------------- epochs


def test_sequential_order_is_the_given_order():
    windows = counting_data([4, 1]).windows("train", 4)
    assert windows_module.epoch_windows(windows, order="sequential", seed=1, epoch=3) == windows


def test_shuffled_order_is_deterministic_per_epoch_and_keeps_the_windows():
    windows = counting_data([4, 1, 9]).windows("train", 3)
    epoch_1 = windows_module.epoch_windows(windows, order="shuffled", seed=11, epoch=1)
    assert epoch_1 == windows_module.epoch_windows(list(windows), order="shuffled", seed=11, epoch=1)
    epoch_2 = windows_module.epoch_windows(windows, order="shuffled", seed=11, epoch=2)
    other_seed = windows_module.epoch_windows(windows, order="shuffled", seed=12, epoch=1)
    assert epoch_1 != epoch_2 and epoch_1 != other_seed and epoch_1 != windows
    assert Counter(epoch_1) == Counter(epoch_2) == Counter(windows)


def test_unknown_batch_order_is_rejected():
    with pytest.raises(ValueError, match="sequential"):
        windows_module.epoch_windows([windows_module.Window(0, 0, 1)], order="random")


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("order", windows_module.BATCH_ORDERS)
def test_uneven_shards_take_equal_steps_and_see_all_their_windows(world_size, order):
    shards = assign_all_ranks(range(7), world_size)
    assert len({len(ids) for ids in shards}) > 1
    steps = windows_module.steps_per_epoch([len(ids) for ids in shards], n_control_points=N_SMALL, batch_size=4)
    largest = max(len(counting_data(ids).windows("train", 4)) for ids in shards)
    assert steps == largest
    for epoch in (1, 2):
        for ids in shards:
            windows = counting_data(ids).windows("train", 4)
            plan = windows_module.epoch_windows(windows, order=order, seed=5, epoch=epoch, steps=steps)
            assert len(plan) == steps
            assert set(plan) == set(windows)
            full = windows_module.epoch_windows(windows, order=order, seed=5, epoch=epoch)
            assert plan[: len(full)] == full
            assert plan[len(full) :] == full[: steps - len(full)]


@pytest.mark.parametrize("order", windows_module.BATCH_ORDERS)
def test_capped_epochs_go_round_every_window_before_any_repeats(order):
    windows = counting_data([0, 1, 2]).windows("train", 4)  # 3 datasets x 5 windows
    cap = 4
    epochs = [windows_module.stream_windows(windows, order=order, seed=3, start=cap * e, count=cap) for e in range(8)]
    stream = [window for epoch in epochs for window in epoch]
    passes = [stream[i:i + len(windows)] for i in range(0, len(stream) - len(windows) + 1, len(windows))]
    assert len(passes) == 2
    for index, one_pass in enumerate(passes):  # every window once per pass, in the pass's epoch order
        assert one_pass == windows_module.epoch_windows(windows, order=order, seed=3, epoch=index + 1)
    assert set(epochs[0]).isdisjoint(epochs[1]) and set(epochs[1]).isdisjoint(epochs[2])
    assert set(epochs[0] + epochs[1] + epochs[2]) | set(epochs[3][:3]) == set(windows)
    # a stream continued from a saved position takes exactly the windows the straight stream takes
    assert windows_module.stream_windows(windows, order=order, seed=3, start=6, count=11) == stream[6:17]


def test_step_cap_limits_every_rank():
    counts = [3, 2]
    assert windows_module.steps_per_epoch(counts, n_control_points=N_SMALL, batch_size=4, max_batches=2) == 2
    assert windows_module.steps_per_epoch(counts, n_control_points=N_SMALL, batch_size=4, max_batches=10**6) == 15
    assert windows_module.steps_per_epoch(counts, n_control_points=N_SMALL, batch_size=4, split="val") == 3
    windows = counting_data([0, 1, 2]).windows("train", 4)
    assert windows_module.epoch_windows(windows, steps=2) == windows[:2]


# --------------------------------------------------------------------------- data source and loaders


def test_control_points_are_generated_for_used_datasets_only():
    data = counting_data([0, 1, 2])
    assert data.control_point_bytes() == 0
    data.make_batch(windows_module.Window(1, 0, 2), "cpu")
    assert data.control_point_bytes() > 0
    one = data.control_point_bytes()
    data.prepare()
    assert data.control_point_bytes() == 3 * one
    with pytest.raises(KeyError):
        data.control_points_for(4)


def test_data_from_config_uses_its_settings(tmp_path):
    config = load_config(
        {"EPID_CONTROL_POINTS": "12", "EPID_NOISE_STD": "0", "EPID_NOISE_SEED": "4", "EPID_CACHE_DIR": str(tmp_path)}
    )
    data = epid_data(config, [9, 2])
    assert data.dataset_ids == (9, 2) and data.n_control_points == 12
    assert (data.noise_std, data.noise_seed, data.cache.directory) == (0.0, 4, tmp_path)
    assert np.array_equal(data.kernel, default_kernel())


def test_pickled_data_drops_its_caches_and_makes_the_same_batches(tmp_path):
    data = counting_data([1, 2], cache_dir=tmp_path)
    window = windows_module.Window(2, 3, 7)
    batch = data.make_batch(window, "cpu")
    copy = pickle.loads(pickle.dumps(data))
    assert copy.control_point_bytes() == 0
    assert_same_batch(batch, copy.make_batch(window, "cpu"))


@pytest.mark.parametrize("dataset_id", [0, 100, 200])
def test_packed_control_points_are_bit_identical_in_half_the_bytes(dataset_id):
    cp = generate_control_points(dataset_id, 40)
    packed = dataset.PackedControlPoints(cp)
    arrays = [f.name for f in dataclasses.fields(cp) if isinstance(getattr(cp, f.name), np.ndarray)]
    assert packed.nbytes * 2 == sum(getattr(cp, name).nbytes for name in arrays)
    unpacked = packed.unpack()
    for name in arrays:
        original, restored = getattr(cp, name), getattr(unpacked, name)
        assert restored.dtype == original.dtype
        assert restored.tobytes() == original.tobytes()
    assert (unpacked.dataset_id, unpacked.pattern) == (cp.dataset_id, cp.pattern)


def test_values_off_the_tenths_grid_are_kept_as_they_are():
    cp = generate_control_points(3, 12)
    odd = dataclasses.replace(cp, leaf_a=cp.leaf_a + np.float32(0.0123), mu=cp.mu * np.float32(1e4))
    unpacked = dataset.PackedControlPoints(odd).unpack()
    assert unpacked.leaf_a.tobytes() == odd.leaf_a.tobytes()
    assert unpacked.mu.tobytes() == odd.mu.tobytes()
    assert unpacked.leaf_b.tobytes() == cp.leaf_b.tobytes()


def test_dataloader_workers_give_the_direct_batches_in_order():
    data = dataset.EpidData([3, 8], control_points=12, noise_seed=1)
    windows = windows_module.epoch_windows(data.windows("train", 3), order="shuffled", seed=2, epoch=1)
    direct = list(dataset.BatchLoader(data, "cpu").batches(windows))
    loader = dataset.BatchLoader(data, "cpu", num_workers=2, prefetch_factor=2)
    for _ in range(2):
        loaded = list(loader.batches(windows))
        assert len(loaded) == len(direct) == len(windows)
        for a, b in zip(direct, loaded, strict=True):
            assert_same_batch(a, b)
    val = data.windows("val", 3)
    assert [b.first_sample for b in loader.batches(val)] == [w.start for w in val]


def test_batch_to_and_pin_memory_keep_values_and_shared_frames():
    batch = counting_data([1]).make_batch(windows_module.Window(1, 2, 6), "cpu")
    moved = batch.to("cpu", non_blocking=True)
    assert_same_batch(batch, moved)
    assert moved.epid_prev.untyped_storage().data_ptr() == moved.epid_curr.untyped_storage().data_ptr()
    loose = dataset.Batch(
        **{name: getattr(batch, name).clone() for name in
           ("leaf_a", "leaf_b", "scalars", "leaf_weight_a", "leaf_weight_b", "epid_prev", "epid_curr")}
    )
    assert len(loose) == 4 and loose.dataset_id == -1
    assert_same_batch(loose.to(torch.device("cpu")), loose)
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs an accelerator")
    pinned = batch.pin_memory()
    assert pinned.epid_prev.is_pinned() and pinned.leaf_a.is_pinned()
    assert_same_batch(batch, pinned)
    on_gpu = pinned.to("cuda", non_blocking=True)
    assert_same_batch(batch, on_gpu.to("cpu"))


# --------------------------------------------------------------------------- frame cache


def all_batches(data: dataset.EpidData) -> list[dataset.Batch]:
    return [data.make_batch(w, "cpu") for split in windows_module.SPLITS for w in data.windows(split, 5)]


def test_cache_is_written_once_and_reused(tmp_path):
    fresh = all_batches(counting_data([2, 6]))
    first_render = CountingRender()
    first = all_batches(counting_data([2, 6], cache_dir=tmp_path, render=first_render))
    chunks = math.ceil((N_SMALL - 1) / cache.CACHE_CHUNK_FRAMES)
    assert (first_render.calls, first_render.frames) == (2 * chunks, 2 * (N_SMALL - 1))
    assert len(list(tmp_path.glob("*.f16"))) == 2
    second_render = CountingRender()
    second = all_batches(counting_data([2, 6], cache_dir=tmp_path, render=second_render))
    assert second_render.calls == 0
    for a, b, c in zip(fresh, first, second, strict=True):
        assert_same_batch(a, b, atol=8 / 1024)
        assert_same_batch(b, c)


def test_cached_real_frames_are_within_float16_of_fresh_frames(tmp_path):
    fresh = dataset.EpidData([4], control_points=10)
    cached = dataset.EpidData([4], control_points=10, cache_dir=tmp_path)
    for window in fresh.windows("train", 3):
        a, b = fresh.make_batch(window, "cpu"), cached.make_batch(window, "cpu")
        scale = a.epid_curr.abs().max().item()
        assert_same_batch(a, b, atol=scale / 1024)


def test_cache_key_separates_settings(tmp_path):
    counting_data([1], cache_dir=tmp_path).make_batch(windows_module.Window(1, 0, 2), "cpu")
    other = dataset.EpidData([1], control_points=N_SMALL, noise_seed=9, cache_dir=tmp_path,
                             render=CountingRender(), render_id="counting")
    other.make_batch(windows_module.Window(1, 0, 2), "cpu")
    assert len(list(tmp_path.glob("frames_001_*.f16"))) == 2



def test_cache_key_holds_the_physics():
    kernel = default_kernel(11)

    def key(physics):
        return cache.cache_key(12, kernel, 0.005, 0, "engine", physics)

    assert key(None) == key(Physics())  # the default is ideal
    assert key(PRESETS["realistic"]) != key(PRESETS["ideal"])
    assert key(Physics(lag_percent=2.0, tongue_groove_mm=0.8)) == key(Physics(tongue_groove_mm=0.8, lag_percent=2))
    assert key(Physics(lag_percent=2.0)) != key(Physics(lag_percent=2.5))
    assert key(PRESETS["realistic"])["physics"] == PRESETS["realistic"].to_dict()


def test_cache_key_holds_the_mlc_and_how_its_layers_are_rendered():
    from epid.synthesis.mlc import MLC_GEOMETRIES

    kernel = default_kernel(11)
    keys = {name: cache.cache_key(12, kernel, 0.005, 0, "engine", PRESETS["realistic"], geometry)
            for name, geometry in MLC_GEOMETRIES.items() if geometry.modelled}
    assert "mlc" not in keys["legacy"] and "mlc_fluence" not in keys["legacy"]  # the legacy grid's keys as before
    assert keys["agility"]["mlc"]["name"] == "agility" and "mlc_fluence" not in keys["agility"]  # strips = leaves
    for name in ("millennium120", "mlci2", "halcyon"):
        assert keys[name]["mlc_fluence"] == cache.MLC_FLUENCE and keys[name]["mlc"]["name"] == name
    assert len({json.dumps(key, sort_keys=True) for key in keys.values()}) == len(keys)


def test_data_renders_and_caches_its_physics(tmp_path):
    realistic = PRESETS["realistic"]
    config = load_config({"EPID_CONTROL_POINTS": "8", "EPID_PHYSICS": "realistic", "EPID_CACHE_DIR": str(tmp_path)})
    data = epid_data(config, [5])
    assert data.physics == realistic and data.render.physics == realistic
    batch = data.make_batch(windows_module.Window(5, 0, 3), "cpu")
    expected = render_frames(generate_control_points(5, 8), [1, 2, 3, 4], default_kernel(), dataset_id=5,
                             physics=realistic)
    assert (batch.epid_curr[:, 0] - expected[1:]).abs().max() <= expected.abs().max() / 1024  # float16 cache
    ideal = dataset.EpidData([5], control_points=8, cache_dir=tmp_path)
    assert ideal.physics.is_ideal and ideal.cache.path(5) != data.cache.path(5)
    ideal_curr = ideal.make_batch(windows_module.Window(5, 0, 3), "cpu").epid_curr
    assert (ideal_curr - batch.epid_curr).abs().max() > expected.abs().max() / 100  # not the ideal frames


def damage_truncate(path):
    path.write_bytes(path.read_bytes()[:-1000])


def damage_flip_data(path):
    raw = bytearray(path.read_bytes())
    raw[cache.CACHE_HEADER_BYTES + 5000] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_header(path):
    raw = bytearray(path.read_bytes())
    raw[:8] = b"garbage!"
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(damage_truncate, "wrong size"), (damage_flip_data, "checksum"), (damage_header, "bad header")],
)
def test_damaged_cache_is_reported_regenerated_and_never_used(tmp_path, caplog, damage, reason):
    expected = all_batches(counting_data([3], cache_dir=tmp_path))
    (path,) = tmp_path.glob("*.f16")
    good = path.read_bytes()
    damage(path)
    render = CountingRender()
    with caplog.at_level(logging.WARNING, logger="epid.data.cache"):
        again = all_batches(counting_data([3], cache_dir=tmp_path, render=render))
    (record,) = caplog.records
    assert str(path) in record.getMessage() and reason in record.getMessage()
    assert "\n" not in record.getMessage()
    assert render.frames == N_SMALL - 1
    assert path.read_bytes() == good
    for a, b in zip(expected, again, strict=True):
        assert_same_batch(a, b)


def test_truncation_after_first_open_is_caught(tmp_path, caplog):
    data = counting_data([3], cache_dir=tmp_path)
    expected = data.make_batch(windows_module.Window(3, 0, 4), "cpu")
    (path,) = tmp_path.glob("*.f16")
    damage_truncate(path)
    with caplog.at_level(logging.WARNING, logger="epid.data.cache"):
        again = data.make_batch(windows_module.Window(3, 0, 4), "cpu")
    assert "wrong size" in caplog.text
    assert_same_batch(expected, again)


def test_a_batch_on_an_mlc_with_x_jaws_appends_them_and_shows_the_leaves_they_leave():
    """Millennium 120, a static-X-jaw arc: each sample's leaves are the arc's as delivered, its scalars
    the 5 of the design plus [X1 prev, X1 curr, X2 prev, X2 curr], and the edges its frames show
    (``shown_leaves``, the inverse model's targets) the leaves cut at the X jaws (a loop over
    positions); the legacy grid's batch keeps its 5 scalars and shows its leaves."""
    from epid.models.losses import shown_leaves
    from epid.synthesis.mlc import MLC_GEOMETRIES

    arc = generate_control_points(162, 20, MLC_GEOMETRIES["millennium120"])
    window = windows_module.Window(162, 0, 8)
    batch = dataset.assemble_batch(arc, window, torch.zeros(len(window) + 1, 256, 256))
    prev = np.arange(window.start + 1, window.stop + 1)
    for name in ("leaf_a", "leaf_b"):
        delivered = getattr(arc, name)
        np.testing.assert_array_equal(getattr(batch, name).numpy(),
                                      np.concatenate([delivered[prev], delivered[prev + 1]], 1))
    shown_a, shown_b = shown_leaves(batch.leaf_a, batch.leaf_b, batch.scalars)
    x_jaws = arc.x_jaws
    for row, point in enumerate(prev):
        np.testing.assert_array_equal(batch.scalars[row, 5:].numpy(), [x_jaws[point, 0], x_jaws[point + 1, 0],
                                                                        x_jaws[point, 1], x_jaws[point + 1, 1]])
        for half, index in ((0, point), (1, point + 1)):
            for strip in range(52):
                low, high = float(x_jaws[index, 0]), float(x_jaws[index, 1])
                a = min(max(float(arc.leaf_a[index, strip]), low), high)
                b = max(min(max(float(arc.leaf_b[index, strip]), low), high), a)
                assert shown_a[row, 52 * half + strip].item() == pytest.approx(a, abs=1e-6)
                assert shown_b[row, 52 * half + strip].item() == pytest.approx(b, abs=1e-6)
    assert bool((shown_a != batch.leaf_a).any())
    legacy = dataset.assemble_batch(generate_control_points(162, 20), window, torch.zeros(len(window) + 1, 256, 256))
    assert legacy.scalars.shape == (len(window), 5)
    assert all(shown is leaves for shown, leaves in zip(shown_leaves(legacy.leaf_a, legacy.leaf_b, legacy.scalars),
                                                        (legacy.leaf_a, legacy.leaf_b), strict=True))
