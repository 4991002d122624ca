"""Jaw refinement: the row-sum model is the forward model's fluence summed along x, jaws started
off by tenths of a mm (a zig-zag among them) come back to the rendered ones, and whole-arc
reconstruction reports the refined jaws."""

from __future__ import annotations

import pytest
import torch

from epid.reconstruction import jaws as jaws_module
from epid.reconstruction import rows as rows_module
from tests.reconstruction.test_estimate import forward_with_2mm_response, record, with_real_mlc


def moving_aperture(points: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Leaves (points, 52) moving a few mm per control point and jaws (points, 2) moving by up to
    3 mm, their edges inside leaf rows (rows partly open), jaw_2 at first just past a row boundary."""
    leaf_a = -30.3 + 0.7 * (torch.arange(52) % 5) + (torch.randn(points, 52, generator=generator) * 2).cumsum(0)
    leaf_b = leaf_a + 30.0 + 5.0 * torch.rand(points, 52, generator=generator)
    steps = torch.stack([torch.linspace(0.0, 9.0, points), torch.linspace(0.0, 12.0, points)], 1)
    jaws = torch.tensor([-41.3, 40.4]) + steps + 0.3 * torch.rand(points, 2, generator=generator)
    return leaf_a, leaf_b, jaws


def test_row_sums_of_the_model_are_the_forward_models_fluence_summed_along_x():
    forward = with_real_mlc(forward_with_2mm_response())
    aperture = forward.aperture
    with torch.no_grad():
        aperture.edge_shift.fill_(0.2)
    leaf_a, leaf_b, jaws = moving_aperture(3, torch.Generator().manual_seed(1))
    leaf_b[:, 20] = leaf_a[:, 20] + 0.4  # a nearly closed pair: the strips beside it pass almost nothing
    domain = rows_module.RowDomain.of(forward)
    scalars = torch.cat([torch.ones(2, 1), jaws[:-1, :1], jaws[1:, :1], jaws[:-1, 1:], jaws[1:, 1:]], 1)
    with torch.no_grad():
        fluence = aperture(torch.cat([leaf_a[:-1], leaf_a[1:]], 1), torch.cat([leaf_b[:-1], leaf_b[1:]], 1), scalars)
    rows = jaws_module.leaf_row_fluence(domain, leaf_a[None], leaf_b[None])
    model = (jaws_module.jaw_passes(domain, jaws[None]) * rows).mean(-2)[0]
    torch.testing.assert_close(model, fluence.sum(-1), atol=1e-3 * float(model.max()), rtol=0.0)


def test_jaws_started_off_come_back_to_the_rendered_ones():
    forward = forward_with_2mm_response()
    gen = torch.Generator().manual_seed(2)
    points = 14
    leaf_a, leaf_b, jaws = moving_aperture(points, gen)
    mu = 5.0 + 10.0 * torch.rand(points - 1, generator=gen)
    frames = record(forward, leaf_a, leaf_b, jaws, mu, torch.zeros(256, 256))
    zigzag = 0.3 * (-1.0) ** torch.arange(points)[:, None]
    start = jaws + zigzag + 0.2 * torch.randn(points, 2, generator=gen)
    domain = rows_module.RowDomain.of(forward)
    row_sums = domain.filtered_rows(frames[None]).sum(-1)
    refined = jaws_module.track_jaws(domain, row_sums, leaf_a[None], leaf_b[None], start[None], mu[None])[0]
    assert (start - jaws).abs().mean() > 0.25
    error = (refined - jaws)[1:-1].abs()  # an end of the chain is seen by one frame only
    assert error.mean() < 0.08 and error.max() < 0.2, (error.mean(), error.max())


@pytest.mark.parametrize("centre", [(-41.3, 40.4), (-122.6, 122.3)], ids=["middle", "near the imager's ends"])
def test_jaws_started_off_by_the_same_amount_everywhere_come_back(centre):
    """A start off by 0.6 mm at every control point (a network's bias) comes back without a
    zig-zag, also with the jaws 5-6 mm inside the imager's ends (128 mm from its centre)."""
    forward = forward_with_2mm_response()
    gen = torch.Generator().manual_seed(4)
    points = 10
    leaf_a, leaf_b, _ = moving_aperture(points, gen)
    jaws = torch.tensor(centre) + 0.4 * torch.rand(points, 2, generator=gen)
    mu = 5.0 + 10.0 * torch.rand(points - 1, generator=gen)
    frames = record(forward, leaf_a, leaf_b, jaws, mu, torch.zeros(256, 256))
    domain = rows_module.RowDomain.of(forward)
    row_sums = domain.filtered_rows(frames[None]).sum(-1)
    for offset in (0.6, -0.6):
        start = jaws + torch.tensor([offset, -offset])
        refined = jaws_module.track_jaws(domain, row_sums, leaf_a[None], leaf_b[None], start[None], mu[None])[0]
        error = (refined - jaws)[1:-1].abs()
        assert error.mean() < 0.15 and error.max() < 0.3, (offset, error.mean(), error.max())
