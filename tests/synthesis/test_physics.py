"""Realistic physics in the synthesis (epid.synthesis.physics, epid.synthesis.frames), checked against a slow per-cell
reference, hand-worked cases, the lag's recursion and scipy; and the aperture models learning it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.signal
import torch

from epid.data.dataset import assemble_batch
from epid.data.windows import Window
from epid.evaluation.gamma import gamma_index
from epid.models.families import build_models
from epid.synthesis import fluence as fluence_module
from epid.synthesis import frames as frames_module
from epid.synthesis import sequences
from epid.synthesis.kernel import default_kernel, radial_kernel
from epid.synthesis.physics import BACKSCATTER_SIGMA_MM, LIMITS, PRESETS, Physics, physics_of

REALISTIC = PRESETS["realistic"]
N_CONTROL_POINTS = 40


def reference_fluence(leaf_a, leaf_b, jaw_1, jaw_2, mu, physics: Physics) -> np.ndarray:
    """The fluence (260, 256) of one frame, cell by cell: sub-apertures (7, 52) / (7,) in mm."""
    t_leaf = physics.leaf_transmission_percent / 100
    t_jaw = physics.jaw_transmission_percent / 100
    leak = physics.interleaf_leakage_percent / 100
    strip = min(physics.tongue_groove_mm / 2, 1.0)
    offset = physics.leaf_end_offset_mm

    def covered(low, high, centre):
        return min(max(min(high, centre + 0.5) - max(low, centre - 0.5), 0.0), 1.0)

    fluence = np.zeros((260, 256))
    for sub in range(7):
        for row in range(260):
            y = -129.5 + row
            leaf = row // 5
            jaw = t_jaw + (1 - t_jaw) * covered(jaw_1[sub], jaw_2[sub], y)
            neighbour = None
            if row % 5 == 0 and leaf > 0:
                neighbour = leaf - 1
            elif row % 5 == 4 and leaf < 51:
                neighbour = leaf + 1
            closed = t_leaf + (leak if neighbour is not None else 0.0)
            for column in range(256):
                x = -127.5 + column
                own = covered(leaf_a[sub, leaf] - offset, leaf_b[sub, leaf] + offset, x)
                if neighbour is not None:
                    other = covered(leaf_a[sub, neighbour] - offset, leaf_b[sub, neighbour] + offset, x)
                    own = (1 - strip) * own + strip * min(own, other)
                fluence[row, column] += mu / 7 * jaw * (closed + (1 - closed) * own)
    return fluence


def frame_geometry(control_points, frame: int) -> tuple[np.ndarray, ...]:
    return tuple(v[0] for v in fluence_module.interpolated_positions(control_points, np.array([frame])))


def test_physics_settings_are_validated_and_described():
    assert Physics().is_ideal and not REALISTIC.is_ideal
    assert PRESETS["ideal"].describe() == "ideal"
    assert "lag 2 %" in REALISTIC.describe() and "leaf end offset 0.6 mm" in REALISTIC.describe()
    for name, limit in LIMITS.items():
        with pytest.raises(ValueError, match=name):
            Physics(**{name: -0.1})
        with pytest.raises(ValueError, match=name):
            Physics(**{name: limit + 1})
    assert physics_of("realistic", lag_percent=5.0, leaf_transmission_percent=None).lag_percent == 5.0
    assert physics_of("realistic", lag_percent=None) == REALISTIC
    assert Physics.from_dict({"lag_percent": 1, "unknown": 3}) == Physics(lag_percent=1.0)


def test_ideal_physics_is_the_legacy_frame_bit_for_bit():
    control_points = sequences.generate_control_points(170, N_CONTROL_POINTS)
    frames = np.arange(1, N_CONTROL_POINTS)
    legacy = frames_module.render_frames(control_points, frames, default_kernel(), dataset_id=170)
    ideal = frames_module.render_frames(control_points, frames, default_kernel(), dataset_id=170, physics=Physics())
    assert torch.equal(legacy, ideal)


@pytest.mark.parametrize("dataset_id", [5, 200])
def test_fluence_matches_a_cell_by_cell_reference(dataset_id):
    control_points = sequences.generate_control_points(dataset_id, N_CONTROL_POINTS)
    physics = dataclasses.replace(REALISTIC, tongue_groove_mm=1.3, leaf_end_offset_mm=0.7)
    frame = 17
    leaf_a, leaf_b, jaw_1, jaw_2 = frame_geometry(control_points, frame)
    mu = float(control_points.mu[frame])
    positions = [torch.from_numpy(v[None]).float() for v in (leaf_a, leaf_b, jaw_1, jaw_2)]
    fluence = fluence_module.physics_fluence(*positions, torch.tensor([mu]), physics)[0].numpy()
    expected = reference_fluence(leaf_a, leaf_b, jaw_1, jaw_2, mu, physics)
    np.testing.assert_allclose(fluence, expected, rtol=0, atol=3e-6 * expected.max())  # float32 against float64


def static_fluence(leaf_a: np.ndarray, leaf_b: np.ndarray, jaw_1: float, jaw_2: float, physics: Physics) -> np.ndarray:
    positions = [torch.tensor(np.broadcast_to(v, (1, 7, *np.shape(v))).copy()).float()
                 for v in (leaf_a, leaf_b, jaw_1, jaw_2)]
    return fluence_module.physics_fluence(*positions, torch.tensor([1.0]), physics)[0].numpy()


def test_hand_worked_transmission_offset_and_tongue_and_groove():
    leaf_a = np.full(52, -20.0)
    leaf_b = np.full(52, 20.0)
    leaf_b[26] = 0.0  # leaf 26 (y in [0, 5) mm) closes at x = 0; its neighbours stay open to 20 mm
    physics = Physics(leaf_transmission_percent=1.0, jaw_transmission_percent=0.5, leaf_end_offset_mm=0.5,
                      tongue_groove_mm=1.0, interleaf_leakage_percent=2.0)
    fluence = static_fluence(leaf_a, leaf_b, -50.0, 50.0, physics)
    row = {y: round(y + 129.5) for y in (-62.5, 2.5, -0.5, 5.5, 4.5, 12.5)}  # leaf-grid row of a y centre
    column = {x: round(x + 127.5) for x in (-100.5, 10.5, 5.5, 20.5, 0.5)}
    assert fluence[row[2.5], column[-100.5]] == pytest.approx(0.01)  # closed leaf, open jaws
    assert fluence[row[2.5], column[10.5]] == pytest.approx(0.01)
    assert fluence[row[-62.5], column[10.5]] == pytest.approx(0.005)  # open leaf behind a jaw
    assert fluence[row[-62.5], column[-100.5]] == pytest.approx(0.005 * 0.01)  # both closed
    assert fluence[row[2.5], column[0.5]] == pytest.approx(0.5 + 0.5 * 0.01)  # bank B edge at 0.5 mm
    assert fluence[row[12.5], column[20.5]] == pytest.approx(0.5 + 0.5 * 0.01)
    # The rows of the open leaves 25 and 27 beside closed leaf 26 are half inside the strips,
    # open there only where leaf 26 is too; the boundary rows leak 2 % more when closed.
    closed = 0.01 + 0.02
    assert fluence[row[-0.5], column[5.5]] == pytest.approx(closed + (1 - closed) * 0.5)
    assert fluence[row[5.5], column[5.5]] == pytest.approx(closed + (1 - closed) * 0.5)
    assert fluence[row[4.5], column[5.5]] == pytest.approx(closed)
    assert fluence[row[2.5], column[5.5]] == pytest.approx(0.01)
    # Opening width grows by twice the offset: the sum over a row of an open leaf.
    open_row = fluence[row[12.5]] - 0.01
    assert open_row.sum() == pytest.approx((40.0 + 2 * 0.5) * 0.99, rel=1e-6)


def layered_reference(control_points, frame: int, physics: Physics) -> np.ndarray:
    """The fluence per MU (260, 256) of one frame on an MLC of one or two layers, from its leaf
    boundaries alone, sampled every 0.01 mm along x: each leaf of a layer stands at the mean of
    the strip edges under it (a dual layer's at their most open, as the synthetic arcs place it)
    and moves linearly between the control points; a sample behind a layer's leaf is multiplied
    by that layer's transmission, plus the interleaf leakage in the 1 mm rows beside a boundary
    between two of its leaves (none inside a leaf), and one outside the X jaws (where the control
    points have them) by theirs."""
    mlc = control_points.mlc
    t_leaf, leak = physics.leaf_transmission_percent / 100, physics.interleaf_leakage_percent / 100
    t_jaw, offset = physics.jaw_transmission_percent / 100, physics.leaf_end_offset_mm
    rows = -129.5 + np.arange(260)
    samples = -128.0 + 0.005 + 0.01 * np.arange(25600)
    dual = len(mlc.layers) > 1
    layers = []
    for boundaries in (np.asarray(b) for b in mlc.layers):
        leaf_of_row = np.searchsorted(boundaries, rows) - 1
        leaf_of_strip = leaf_of_row[2::5]
        inner = boundaries[1:-1]
        beside = np.isin(np.round(rows - 0.5, 6), inner) | np.isin(np.round(rows + 0.5, 6), inner)
        positions = []
        for point in (frame - 1, frame):
            a, b = (getattr(control_points, bank)[point].astype(np.float64) for bank in ("leaf_a", "leaf_b"))
            leaf_a = {leaf: (a[leaf_of_strip == leaf].min() if dual else a[leaf_of_strip == leaf].mean())
                      for leaf in set(leaf_of_row)}
            leaf_b = {leaf: (b[leaf_of_strip == leaf].max() if dual else b[leaf_of_strip == leaf].mean())
                      for leaf in set(leaf_of_row)}
            positions.append((np.array([leaf_a[leaf] for leaf in leaf_of_row]),
                              np.array([leaf_b[leaf] for leaf in leaf_of_row])))
        layers.append((positions, t_leaf + leak * beside))
    fluence = np.zeros((260, 25600))
    for sub in range(7):
        t = sub / 6
        jaw_1, jaw_2 = (getattr(control_points, jaw)[frame - 1] * (1 - t) + getattr(control_points, jaw)[frame] * t
                        for jaw in ("jaw_1", "jaw_2"))
        covered = np.clip(np.minimum(jaw_2, rows + 0.5) - np.maximum(jaw_1, rows - 0.5), 0, 1)
        transmitted = (t_jaw + (1 - t_jaw) * covered)[:, None] * np.ones_like(fluence)
        for (before, after), closed in layers:
            a = before[0] + t * (after[0] - before[0]) - offset
            b = before[1] + t * (after[1] - before[1]) + offset
            inside = (samples[None, :] >= a[:, None]) & (samples[None, :] < b[:, None])
            transmitted *= np.where(inside, 1.0, closed[:, None])
        if control_points.x_jaws is not None:
            x_1, x_2 = control_points.x_jaws[frame - 1] * (1 - t) + control_points.x_jaws[frame] * t
            transmitted *= np.where((samples >= x_1) & (samples < x_2), 1.0, physics.x_jaw_transmission_percent / 100)
        fluence += transmitted / 7
    return fluence.reshape(260, 256, 100).mean(-1)


@pytest.mark.parametrize("name", ["mlci2", "halcyon"])
def test_layers_and_leaf_boundaries_of_an_mlc_match_a_sampled_reference(name):
    """A 10 mm leaf leaks only at its own boundaries, not between its two strips; behind both of a
    dual layer's leaves the transmission is the square of one layer's."""
    from epid.synthesis.mlc import MLC_GEOMETRIES

    control_points = sequences.generate_control_points(170, N_CONTROL_POINTS, MLC_GEOMETRIES[name])
    physics = dataclasses.replace(REALISTIC, tongue_groove_mm=0.0, interleaf_leakage_percent=3.0)
    frame = 21
    positions, layers = fluence_module.frame_positions(control_points, np.array([frame]), torch.device("cpu"))
    fluence = fluence_module.physics_fluence(*positions, torch.tensor([1.0]), physics, **layers)[0].numpy()
    expected = layered_reference(control_points, frame, physics)
    np.testing.assert_allclose(fluence, expected, rtol=0, atol=1e-3)  # the 0.01 mm sampling
    strips = [torch.from_numpy(v).float() for v in fluence_module.interpolated_positions(control_points,
                                                                                         np.array([frame]))]
    as_strips = fluence_module.physics_fluence(*strips, torch.tensor([1.0]), physics)[0].numpy()
    assert np.abs(as_strips - expected).max() > 0.01  # the strips alone, one layer, would fail


def test_lag_follows_its_recursion_and_a_frame_is_the_same_in_any_call():
    control_points = sequences.generate_control_points(300, N_CONTROL_POINTS)
    kernel = default_kernel()
    frames = np.arange(1, N_CONTROL_POINTS)
    physics = dataclasses.replace(REALISTIC, lag_percent=8.0)
    recorded = frames_module.render_frames(control_points, frames, kernel, dataset_id=300, noise_std=0, physics=physics)
    signals = frames_module.render_frames(control_points, frames, kernel, dataset_id=300, noise_std=0,
                                          physics=dataclasses.replace(physics, lag_percent=0.0)).double()
    expected, previous = [], torch.zeros_like(signals[0])
    for signal in signals:
        previous = 0.92 * signal + 0.08 * previous
        expected.append(previous)
    torch.testing.assert_close(recorded.double(), torch.stack(expected), rtol=1e-5, atol=1e-5)
    some = frames_module.render_frames(control_points, [30, 3, 12, 1], kernel, dataset_id=300, physics=physics)
    full = frames_module.render_frames(control_points, frames, kernel, dataset_id=300, physics=physics)
    assert torch.equal(some, full[[29, 2, 11, 0]])
    first = frames_module.render_frames(control_points, [1], kernel, dataset_id=300, noise_std=0, physics=physics)
    torch.testing.assert_close(first[0], recorded[0])  # nothing before the first frame


def test_backscatter_is_a_broad_blur_weighted_towards_the_arm():
    control_points = sequences.generate_control_points(90, N_CONTROL_POINTS)
    kernel = default_kernel()
    physics = Physics(backscatter_percent=10.0, leaf_transmission_percent=0.4)
    with_arm = frames_module.render_frames(control_points, [20], kernel, dataset_id=90, noise_std=0, physics=physics)
    without = frames_module.render_frames(control_points, [20], kernel, dataset_id=90, noise_std=0,
                                          physics=Physics(leaf_transmission_percent=0.4))
    leaf_a, leaf_b, jaw_1, jaw_2 = frame_geometry(control_points, 20)
    positions = [torch.from_numpy(v[None]).float() for v in (leaf_a, leaf_b, jaw_1, jaw_2)]
    mu = torch.tensor([float(control_points.mu[20])])
    fluence = fluence_module.physics_fluence(*positions, mu, Physics(leaf_transmission_percent=0.4))[0]
    offsets = np.arange(-255, 256)
    profile = np.exp(-0.5 * (offsets / BACKSCATTER_SIGMA_MM) ** 2)
    profile /= profile.sum()
    blurred = scipy.signal.fftconvolve(fluence.numpy()[2:258], np.outer(profile, profile), mode="same")[::-1]
    ramp = 0.1 * 2 * (np.arange(256) + 0.5) / 256
    np.testing.assert_allclose((with_arm - without)[0].numpy(), ramp[:, None] * blurred, atol=2e-4)


def test_a_radial_kernel_is_applied_exactly_by_fft():
    control_points = sequences.generate_control_points(400, N_CONTROL_POINTS)
    kernel = radial_kernel(131)
    renderer = frames_module.renderer_for(kernel)
    assert renderer.method == "fft"
    physics = dataclasses.replace(REALISTIC, lag_percent=0.0, backscatter_percent=0.0)
    frame = frames_module.render_frames(control_points, [9], renderer, dataset_id=400, noise_std=0, physics=physics)
    leaf_a, leaf_b, jaw_1, jaw_2 = frame_geometry(control_points, 9)
    fluence = reference_fluence(leaf_a, leaf_b, jaw_1, jaw_2, float(control_points.mu[9]), physics)
    expected = scipy.signal.fftconvolve(fluence[2:258][::-1], kernel, mode="same")
    np.testing.assert_allclose(frame[0].numpy(), expected, atol=2e-5 * expected.max())


def test_forward_model_learns_the_realistic_physics_from_frames():
    """The aperture forward model, given the true control points, fits realistic frames: its
    learned lag, leaf-end offset and tongue-and-groove strip come close to the synthesis's."""
    torch.manual_seed(0)
    kernel = default_kernel()
    batches = []
    for dataset_id in (0, 100, 200, 300):
        control_points = sequences.generate_control_points(dataset_id, 120)
        frames = frames_module.render_frames(control_points, np.arange(51, 61), kernel, dataset_id=dataset_id,
                                             physics=REALISTIC)
        batches.append(assemble_batch(control_points, Window(dataset_id, 50, 59), frames))
    leaf_a, leaf_b, scalars, prev, curr = (torch.cat([getattr(b, name) for b in batches])
                                           for name in ("leaf_a", "leaf_b", "scalars", "epid_prev", "epid_curr"))
    forward, _ = build_models("full", "aperture")
    optimizer = torch.optim.Adam(forward.parameters(), lr=0.02)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        rows = torch.randint(0, len(leaf_a), (8,), generator=generator)
        epid, _ = forward(leaf_a[rows], leaf_b[rows], scalars[rows], prev[rows])
        loss = ((epid - curr[rows]).square() / scalars[rows, :1, None, None]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    aperture = forward.aperture
    assert forward.lag_percent.item() == pytest.approx(2.0, abs=0.3)
    offsets = (aperture.edge_shift + aperture.leaf_end_offset).detach()
    torch.testing.assert_close(offsets, torch.full((2,), 0.6), atol=0.15, rtol=0)
    assert aperture.tongue_groove_mm.item() == pytest.approx(0.8, abs=0.3)
    assert 0.1 < aperture.leaf_transmission_percent.item() < 1.0
    with torch.no_grad():
        epid, _ = forward(leaf_a, leaf_b, scalars, prev)
    gamma = gamma_index(curr[:, 0].double(), epid[:, 0].double(), dose_percent=3.0, distance_mm=2.0)
    passed = ((gamma <= 1).sum((-2, -1)) / (~gamma.isnan()).sum((-2, -1))).float()
    assert passed.mean() > 0.95  # a frame of 1.9 MU after one of 40 MU is 30 % ghost: the lag must be exact
