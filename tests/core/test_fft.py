"""The one-axis-at-a-time real FFTs (epid.core.fft) against torch's own 2-D transforms."""

from __future__ import annotations

import pytest
import torch

from epid.core.fft import cropped_irfft2, padded_rfft2


@pytest.mark.parametrize(("size", "shape"), [((260, 256), (400, 384)), ((7, 5), (12, 9)), ((31, 40), (31, 45))])
def test_padded_and_cropped_transforms_are_torchs_own(size, shape):
    torch.manual_seed(0)
    images = torch.rand(3, 2, *size, dtype=torch.float64)
    torch.testing.assert_close(padded_rfft2(images, shape), torch.fft.rfft2(images, s=shape), rtol=1e-12, atol=1e-10)
    spectrum = torch.fft.rfft2(images, s=shape) * torch.rand(shape[0], shape[1] // 2 + 1, dtype=torch.float64)
    full = torch.fft.irfft2(spectrum, s=shape)
    rows, columns = slice(1, size[0] - 1), slice(2, size[1])
    window = cropped_irfft2(spectrum, shape, rows, columns)
    assert window.shape == (3, 2, size[0] - 2, size[1] - 2)
    torch.testing.assert_close(window, full[..., rows, columns], rtol=1e-12, atol=1e-12)


def test_a_convolution_through_them_has_torchs_gradient():
    torch.manual_seed(1)
    images = torch.rand(2, 20, 16, dtype=torch.float64, requires_grad=True)
    kernel = torch.fft.rfft2(torch.rand(5, 5, dtype=torch.float64), s=(28, 24))
    ours = cropped_irfft2(padded_rfft2(images, (28, 24)) * kernel, (28, 24), slice(2, 22), slice(2, 18))
    theirs = torch.fft.irfft2(torch.fft.rfft2(images, s=(28, 24)) * kernel, s=(28, 24))[..., 2:22, 2:18]
    weights = torch.rand_like(ours)
    (ours_grad,) = torch.autograd.grad((ours * weights).sum(), images)
    (theirs_grad,) = torch.autograd.grad((theirs * weights).sum(), images)
    torch.testing.assert_close(ours_grad, theirs_grad, rtol=1e-12, atol=1e-12)
