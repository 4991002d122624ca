"""The frames' MU read by the fallback's rendering (epid.reconstruction.fallback.frame_misfits)."""

from __future__ import annotations

import numpy as np
import scipy.ndimage
import torch

from epid.reconstruction.fallback import ControlPointRun, frame_misfits, uncrossed


def test_the_signal_mu_holds_where_the_responses_shape_is_wrong_and_the_least_squares_mu_does_not():
    fluence = np.zeros((3, 256, 256))
    fluence[0, 100:140, 90:170] = 1.0  # 40 x 80 mm
    fluence[1, 120:130, 120:135] = 1.0  # 10 x 15 mm: the shape matters most
    fluence[2, 60:200, 50:210] = 1.0
    rendered = np.stack([scipy.ndimage.gaussian_filter(f, 2.0, mode="constant") for f in fluence])
    # the measured frames: 1.3 MU through a response twice as broad with a 10 % tail of 15 mm, both
    # conserving the signal (the fields lie far enough inside the frame)
    broad = np.stack([0.9 * scipy.ndimage.gaussian_filter(f, 4.0, mode="constant")
                      + 0.1 * scipy.ndimage.gaussian_filter(f, 15.0, mode="constant") for f in fluence])
    measured = 1.3 * broad
    np.testing.assert_allclose(measured.sum((1, 2)), 1.3 * fluence.sum((1, 2)), rtol=1e-4)
    per_leaf, mu, signal_mu, residuals = frame_misfits(torch.from_numpy(rendered).float(),
                                                     torch.from_numpy(measured).float())
    np.testing.assert_allclose(signal_mu.numpy(), 1.3, rtol=1e-4)
    least_squares = (rendered * measured).sum((1, 2)) / (rendered * rendered).sum((1, 2))
    np.testing.assert_allclose(mu.numpy(), least_squares, rtol=1e-5)
    assert np.all(np.abs(least_squares / 1.3 - 1) > 0.01), "the least-squares MU rests on the field's shape"
    assert abs(least_squares[1] / 1.3 - 1) > abs(least_squares[2] / 1.3 - 1), "the more so the smaller the field"
    np.testing.assert_allclose(residuals.numpy(), measured - least_squares[:, None, None] * rendered, atol=1e-5)
    rows = np.square(residuals.numpy()).sum(-1)  # rows of 1 mm, row r centred at y = 127.5 - r mm
    np.testing.assert_allclose(per_leaf.numpy()[:, 25], rows[:, 128:133].sum(-1), rtol=1e-4)  # y in [-5, 0)
    np.testing.assert_allclose(per_leaf.numpy().sum(-1), rows.sum(-1), rtol=1e-4)


def test_crossed_pairs_close_at_their_midpoint_never_further_from_positions_that_do_not_cross():
    gen = torch.Generator().manual_seed(3)
    truth_a = 20.0 * torch.randn(2, 9, 52, generator=gen)
    truth_b = truth_a + torch.where(torch.rand(2, 9, 52, generator=gen) < 0.5, 0.0,
                                    10.0 * torch.rand(2, 9, 52, generator=gen))  # half of the pairs closed
    jaws = torch.randn(2, 9, 2, generator=gen)
    run = ControlPointRun(truth_a + 1.5 * torch.randn(2, 9, 52, generator=gen),
                          truth_b + 1.5 * torch.randn(2, 9, 52, generator=gen), jaws)
    crossed = run.leaf_a > run.leaf_b
    assert 0.1 < float(crossed.float().mean()) < 0.5
    fixed = uncrossed(run)
    assert bool((fixed.leaf_a <= fixed.leaf_b).all()) and fixed.jaws is jaws
    middle = (run.leaf_a + run.leaf_b)[crossed] / 2
    torch.testing.assert_close(fixed.leaf_a[crossed], middle)
    torch.testing.assert_close(fixed.leaf_b[crossed], middle)
    assert bool((fixed.leaf_a[~crossed] == run.leaf_a[~crossed]).all())
    before = (run.leaf_a - truth_a).square() + (run.leaf_b - truth_b).square()
    after = (fixed.leaf_a - truth_a).square() + (fixed.leaf_b - truth_b).square()
    assert bool((after <= before + 1e-4).all()) and float(after.sum()) < float(before.sum())
    assert uncrossed(fixed) is fixed


def test_strip_misfits_give_a_pixel_row_over_two_fine_strips_half_to_each():
    from epid.reconstruction.fallback import strip_misfits
    from epid.synthesis.geometry import FINE_STRIPS, STRIPS

    rows = torch.zeros(2, 256)
    rows[0, 165] = 4.0  # y in [-38, -37) mm: strips [-40, -37.5) and [-37.5, -35) of 2.5 mm, one strip of 5 mm
    rows[1] = torch.arange(256.0)
    fine, coarse = strip_misfits(rows, FINE_STRIPS), strip_misfits(rows, STRIPS)
    assert fine.shape == (2, 104) and coarse.shape == (2, 52)
    assert fine[0, 36] == 2.0 and fine[0, 37] == 2.0 and fine[0].sum() == 4.0
    assert coarse[0, 18] == 4.0 and coarse[0].sum() == 4.0
    torch.testing.assert_close(fine[1].sum(), rows[1].sum())
    torch.testing.assert_close(fine[1].view(52, 2).sum(-1), coarse[1])  # two fine strips make a 5 mm one
