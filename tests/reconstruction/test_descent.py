"""Gauss-Newton steps on the forward model's own misfit (``epid.reconstruction.descent``): the
response's transpose against autograd, the curvature against the rendering's own finite
differences (tongue-and-groove, jaws and an asymmetric response included), the chain solve against a
dense one, and the steps on noisy frames of a broad response synthesised by ``render_frames``."""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch

from epid.reconstruction import descent, fallback, rows
from epid.reconstruction import estimate as estimate_module
from tests.reconstruction.test_broad_response import STAGES, forward_with_response, leaf_mae, noisy_broad_run
from tests.reconstruction.test_estimate import ShiftedTruth


def broad_forward(skewed: bool = False, mlc: str = "legacy") -> torch.nn.Module:
    """The 12 mm wide response with a broad term, on ``mlc``; ``skewed``: a measured kernel whose tail
    reaches twice as far to +x and +y as to -x and -y (no mirror symmetry)."""
    forward = forward_with_response(5.0, mlc)
    with torch.no_grad():
        forward.response.broad_gain.copy_(torch.tensor([0.05, 0.05]))
        forward.response.broad_log_width.fill_(np.log(21.0))
        if skewed:
            offsets = torch.arange(-40, 41, dtype=torch.float64)
            reach = torch.where(offsets > 0, 10.0, 5.0)
            profile = torch.exp(-0.5 * (offsets / reach) ** 2)
            forward.response.start_from(torch.outer(profile, profile))
            forward.response.measured_logit.fill_(20.0)  # the measured kernel alone
    return forward


def test_the_response_adjoint_is_its_transpose():
    response = broad_forward(skewed=True).response
    generator = torch.Generator().manual_seed(0)
    fluence = torch.rand(3, 260, 256, generator=generator, requires_grad=True)
    images = torch.randn(3, 256, 256, generator=generator)
    (response(fluence) * images).sum().backward()
    with torch.no_grad():
        adjoint = response.adjoint(images)
    torch.testing.assert_close(adjoint, fluence.grad, rtol=1e-4, atol=1e-6)


def some_points(frames: int = 3, seed: int = 0, strips: int = 52) -> torch.Tensor:
    """Control points (1, frames + 1, 2 x strips + 2): leaves of varied openings and motion, jaws cutting
    leaf rows."""
    generator = torch.Generator().manual_seed(seed)
    bank_a = -20 + 6 * torch.rand(frames + 1, strips, generator=generator) + torch.arange(frames + 1)[:, None] * 1.5
    bank_b = bank_a + 15 + 20 * torch.rand(strips, generator=generator)
    jaws = torch.tensor([[-60.3, 57.6]]) + 0.8 * torch.arange(frames + 1)[:, None]
    return torch.cat([bank_a, bank_b, jaws], -1)[None]


def rendered(forward: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The frames per MU (F, 256, 256) of control points x (1, F + 1, 2 x strips + 2)."""
    count = (x.shape[-1] - 2) // 2
    pairs = torch.stack([x[0, :-1], x[0, 1:]], 1)
    scalars = torch.cat([torch.ones(len(pairs), 1), pairs[:, :, 2 * count], pairs[:, :, 2 * count + 1]], 1)
    with torch.no_grad():
        return forward.render(pairs[:, :, :count].flatten(1), pairs[:, :, count:2 * count].flatten(1),
                              scalars)[0].double()


def quadratic_form(diagonal: torch.Tensor, upper: torch.Tensor, v: torch.Tensor) -> float:
    v = v.double()
    return float((v * (diagonal @ v[..., None])[..., 0]).sum()
                 + 2 * (v[:, :-1] * (upper @ v[:, 1:, :, None])[..., 0]).sum())


CURVATURE_CASES = {  # strips; a lone leaf, two neighbours, a leaf more closed than both neighbours
    "legacy": (52, 25, 20, 30),
    # HD120's fine strips: a 2.5 mm leaf (strip 45: rows in the other phase than strip 44's), the two
    # strips of one 5 mm leaf (no tongue and groove between them), a 2.5 mm leaf
    "hd120": (104, 45, 28, 50),
}


@pytest.mark.parametrize("skewed, mlc", [(False, "legacy"), (True, "legacy"), (False, "hd120"), (True, "hd120")])
def test_the_curvature_matches_the_renderings_own_differences(skewed, mlc):
    """v^T (J^T J) v against |J v|^2, J v the rendering's central difference, for moves of single
    leaves, of neighbouring leaves apart, of whole banks, of the jaws and random moves of everything,
    on the 52 strips and on HD120's fine ones."""
    strips, lone, pair, protruding = CURVATURE_CASES[mlc]
    forward = broad_forward(skewed, mlc)
    domain = rows.RowDomain.of(forward)
    correlation = descent.ResponseCorrelation.of(forward, domain, "cpu")
    x = some_points(strips=strips)
    neighbours = x[0, :, [protruding - 1, protruding + 1]]
    x[0, :, protruding] = neighbours.max(-1).values + 3.0  # bank A's leaf more closed than both neighbours
    mu = torch.full((1, 3), 2.0)
    diagonal, upper = descent._curvature(domain, correlation, x, mu)
    generator = torch.Generator().manual_seed(1)
    moves = {name: torch.zeros_like(x) for name in ("one leaf", "neighbours apart", "protruding", "bank A", "jaw_2")}
    moves.update({
        "random leaves": torch.randn(x.shape, generator=generator) * (torch.arange(x.shape[-1]) < 2 * strips)})
    moves["one leaf"][0, 1, lone] = 1.0
    moves["neighbours apart"][0, :, pair] = 1.0
    moves["neighbours apart"][0, :, pair + 1] = -1.0
    moves["protruding"][0, :, protruding] = 1.0
    moves["bank A"][0, 2, :strips] = 1.0
    moves["jaw_2"][0, 1:3, -1] = 1.0
    for name, move in moves.items():
        step = 1e-2
        change = (rendered(forward, x + step * move) - rendered(forward, x - step * move)) / (2 * step)
        exact = float((mu[0, :, None, None].double() * change).square().sum())
        assert quadratic_form(diagonal, upper, move) == pytest.approx(exact, rel=0.08), name
    # without the tongue-and-groove strip in the tables, a leaf more closed than its neighbours is far off
    # (it moves the strip's share of their boundary rows too: 5.8 rows of its strip, not 5)
    plain = descent.ResponseCorrelation.of(forward, dataclasses.replace(domain, groove_share=0.0), "cpu")
    diagonal, upper = descent._curvature(domain, plain, x, mu)
    move = moves["protruding"]
    change = (rendered(forward, x + 1e-2 * move) - rendered(forward, x - 1e-2 * move)) / 2e-2
    exact = float((mu[0, :, None, None].double() * change).square().sum())
    assert abs(quadratic_form(diagonal, upper, move) / exact - 1) > 0.2


def test_the_chain_solve_matches_a_dense_solve():
    generator = torch.Generator().manual_seed(0)
    runs, points, size = 2, 5, 6
    dense = torch.zeros(runs, points * size, points * size, dtype=torch.float64)
    for k in range(points - 1):  # a sum of positive semi-definite frame blocks over points k, k + 1
        block = torch.randn(runs, 2 * size, 2 * size, generator=generator, dtype=torch.float64)
        dense[:, k * size:(k + 2) * size, k * size:(k + 2) * size] += block @ block.transpose(-2, -1)
    dense += 0.1 * torch.eye(points * size, dtype=torch.float64)
    diagonal = torch.stack([dense[:, k * size:(k + 1) * size, k * size:(k + 1) * size] for k in range(points)], 1)
    upper = torch.stack([dense[:, k * size:(k + 1) * size, (k + 1) * size:(k + 2) * size]
                         for k in range(points - 1)], 1)
    rhs = torch.randn(runs, points, size, generator=generator, dtype=torch.float64)
    expected = torch.linalg.solve(dense, rhs.flatten(1)).view(runs, points, size)
    torch.testing.assert_close(descent.solve_chain(diagonal, upper, rhs), expected)


@pytest.mark.parametrize("mlc, leaf_share", [("legacy", 0.45), ("hd120", 0.9)])
def test_steps_on_noisy_broad_frames_bring_leaves_and_jaws_closer(mlc, leaf_share):
    """Frames of arc 82 synthesised by ``render_frames`` (12 mm wide response, the MLC's physics,
    noise), on the 52 strips and on HD120's fine ones: from a start off as a network's is (each leaf
    biased by up to 0.8 mm, 0.15 mm jitter; jaws 0.3 mm), every step lowers the misfit, which ends
    within 2 % of the truth's, the leaves' error falls below ``leaf_share`` of the start's (0.47 ->
    0.20 mm in 3 steps; on HD120 0.46 -> 0.40 mm: two 2.5 mm neighbours through this response are so
    alike that the misfit reaches the truth's with the leaves still apart) and the jaws' to a quarter."""
    forward, signals, truth, band = noisy_broad_run(frames=12, mlc=mlc)
    domain = rows.RowDomain.of(forward)
    generator = torch.Generator().manual_seed(3)

    def off(values: torch.Tensor) -> torch.Tensor:
        bias = 0.8 * (2 * torch.rand(values.shape[-1], generator=generator) - 1)
        return values + bias + 0.15 * torch.randn(values.shape, generator=generator)

    start = fallback.ControlPointRun(off(truth.leaf_a), off(truth.leaf_b), truth.jaws + 0.3)
    misfits = []
    for steps in (0, 1, 3):
        points, rendering = descent.descend(forward, domain, signals[None], start, steps=steps)
        misfits.append(float(rendering.misfits.sum()))
        torch.testing.assert_close(rendering.misfits, fallback.render_run(forward, signals[None], points).misfits,
                                   rtol=1e-4, atol=1e-4)
    assert misfits[0] > misfits[1] > misfits[2]
    assert misfits[2] < 1.02 * float(fallback.render_run(forward, signals[None], truth).misfits.detach().sum())
    assert leaf_mae(start, truth, band) > 0.4
    assert leaf_mae(points, truth, band) < leaf_share * leaf_mae(start, truth, band)
    assert float((points.jaws - truth.jaws).abs().mean()) < 0.08


def test_a_step_that_raises_the_misfit_is_not_taken():
    forward, signals, truth, _ = noisy_broad_run(frames=6)
    domain = rows.RowDomain.of(forward)
    start = dataclasses.replace(truth, leaf_a=truth.leaf_a + 0.2)
    before = fallback.render_run(forward, signals[None], start)
    real = descent._curvature

    def too_flat(*arguments):  # a curvature 1e4 times too small: every step runs to the limit and overshoots
        diagonal, upper = real(*arguments)
        return diagonal * 1e-4, upper * 1e-4

    with mock.patch.object(descent, "_curvature", too_flat), mock.patch.object(descent, "PRIOR_SHARE", 0.0):
        points, rendering = descent.descend(forward, domain, signals[None], start, steps=2)
    torch.testing.assert_close(points.leaf_a, start.leaf_a)
    torch.testing.assert_close(points.jaws, start.jaws)
    torch.testing.assert_close(rendering.misfits, before.misfits)


def test_a_run_that_cannot_improve_neither_moves_nor_holds_back_another():
    """Two runs in one batch: one started off the truth takes the steps; one already at it (the forward
    model's own noise-free frames: no step can lower its misfit) stays where it is."""
    forward = broad_forward()
    domain = rows.RowDomain.of(forward)
    truth = some_points(frames=4)
    signals = rendered(forward, truth).float() * 3.0  # 3 MU a frame
    off = truth.clone()
    off[0, :, :104] += 0.4 * torch.sin(torch.arange(104.0))  # each leaf off by up to 0.4 mm
    x = torch.cat([off, truth])
    start = fallback.ControlPointRun(x[..., :52], x[..., 52:104], x[..., 104:])
    points, rendering = descent.descend(forward, domain, torch.stack([signals, signals]), start, steps=2)
    torch.testing.assert_close(points.leaf_a[1], truth[0, :, :52])
    torch.testing.assert_close(points.jaws[1], truth[0, :, 104:])
    before = fallback.render_run(forward, torch.stack([signals, signals]), start).misfits.detach()
    assert float(rendering.misfits[0].sum()) < 0.2 * float(before[0].sum())
    torch.testing.assert_close(rendering.misfits[1], before[1])


def test_frame_pairs_under_a_broad_response_take_the_steps_too():
    """``pair_estimate`` under the 12 mm wide response: the steps run on the batch of pairs (one run of
    two frames each) and the curr leaves end nearer the truth than the network's 0.8 mm (0.44 mm, as
    without the steps: two frames leave them little to settle)."""
    forward, signals, truth, band = noisy_broad_run(frames=6)
    network = ShiftedTruth(signals, truth.leaf_a[0], truth.leaf_b[0], truth.jaws[0], torch.ones(6))
    network.config = type("Config", (), {"track_stages": STAGES})()
    shapes = []

    def counted(forward_model, domain, runs, points, **options):
        shapes.append(tuple(runs.shape[:2]))
        return descent.descend(forward_model, domain, runs, points, **options)

    with mock.patch.object(estimate_module, "descend", counted), torch.inference_mode():
        leaf_a, leaf_b, _ = estimate_module.pair_estimate(forward, network, signals[:-1, None], signals[1:, None])
    assert shapes == [(5, 2)]
    curr = slice(2, 7)  # control points 2..6 end the five pairs
    errors = torch.cat([(leaf_a[:, 52:] - truth.leaf_a[0, curr])[band[curr]],
                        (leaf_b[:, 52:] - truth.leaf_b[0, curr])[band[curr]]]).abs()
    assert float(errors.mean()) < 0.5
