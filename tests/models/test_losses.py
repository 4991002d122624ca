"""Cross-training loss terms against hand-worked values on small tensors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from epid.models.losses import LOSS_TERMS, cross_training_loss

LEAVES = 104


def make_case(batch: int = 2, image: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor], SimpleNamespace]:
    """Predictions equal to the targets (every term zero); tests perturb single entries.

    Leaves sit at bank A = -20 mm, bank B = +20 mm, so the ordering penalty is inactive.
    """
    targets = SimpleNamespace(
        leaf_a=torch.full((batch, LEAVES), -20.0),
        leaf_b=torch.full((batch, LEAVES), 20.0),
        scalars=torch.tensor([[10.0, -50.0, -50.0, 50.0, 50.0]]).repeat(batch, 1),
        leaf_weight_a=torch.ones(batch, LEAVES),
        leaf_weight_b=torch.ones(batch, LEAVES),
        epid_prev=torch.zeros(batch, 1, image, image),
        epid_curr=torch.zeros(batch, 1, image, image),
    )
    forward_out = [torch.zeros(batch, 1, image, image), torch.zeros(batch, 1, 4, 4)]
    inverse_out = [
        targets.leaf_a.clone(),
        targets.leaf_b.clone(),
        targets.scalars.clone(),
        torch.zeros(batch, 1, 4, 4),
    ]
    return forward_out, inverse_out, targets


def only_nonzero(terms: dict[str, torch.Tensor], name: str) -> None:
    for other in LOSS_TERMS:
        if other not in ("total", name):
            assert terms[other].item() == 0.0, other


def test_all_terms_are_float32_scalars_and_zero_for_a_perfect_prediction():
    forward_out, inverse_out, targets = make_case()
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert tuple(terms) == LOSS_TERMS
    for name, value in terms.items():
        assert value.shape == () and value.dtype == torch.float32, name
        assert value.item() == 0.0, name


def test_forward_term_weights_each_sample_by_one_over_mu():
    forward_out, inverse_out, targets = make_case(batch=2)
    targets.scalars[:, 0] = torch.tensor([3.0, 2.0])
    inverse_out[2][:, 0] = targets.scalars[:, 0]
    targets.epid_curr[0, 0] = torch.tensor([[1.0, 2.0], [0.0, 1.0]])
    forward_out[0][1, 0] = 2.0
    terms = cross_training_loss(forward_out, inverse_out, targets)
    # sample 0: squared errors 1, 4, 0, 1 -> mean 1.5, / 3 MU = 0.5; sample 1: 4 / 2 MU = 2
    assert terms["forward"].item() == pytest.approx((0.5 + 2.0) / 2)
    only_nonzero(terms, "forward")


def test_forward_term_clamps_zero_mu():
    forward_out, inverse_out, targets = make_case(batch=1)
    targets.scalars[0, 0] = 0.0
    forward_out[0][0, 0, 0, 0] = 1e-3
    terms = cross_training_loss(forward_out, inverse_out, targets)
    # squared error 1e-6 over 4 pixels, divided by the 1e-6 MU floor
    assert terms["forward"].item() == pytest.approx(0.25, rel=1e-5)


def test_leaf_terms_are_leaf_weighted_mean_squared_errors_in_units_of_130_mm():
    forward_out, inverse_out, targets = make_case(batch=2)
    targets.leaf_weight_a[0, 3] = 0.5
    targets.leaf_weight_b[1, 60] = 0.5
    # prev of the first and curr of the last sample, so consistency stays zero
    inverse_out[0][0, 3] += 13.0  # 0.1 normalised, weight 0.5
    inverse_out[0][1, 52 + 7] += 26.0  # 0.2 normalised, weight 1
    inverse_out[1][1, 60] -= 39.0  # 0.3 normalised, weight 0.5
    terms = cross_training_loss(forward_out, inverse_out, targets)
    # mean over all B * 104 elements, not over the sum of the weights
    assert terms["leaf_a"].item() == pytest.approx((0.5 * 0.01 + 0.04) / (2 * LEAVES))
    assert terms["leaf_b"].item() == pytest.approx(0.5 * 0.09 / (2 * LEAVES))
    for name in ("forward", "scalars", "ordering", "consistency", "latent"):
        assert terms[name].item() == 0.0, name


def test_scalar_term_normalises_mu_by_40_and_jaws_by_130():
    forward_out, inverse_out, targets = make_case(batch=2)
    inverse_out[2][0, 0] += 4.0  # MU: 0.1
    inverse_out[2][1, 2] -= 26.0  # jaw_1 curr: 0.2
    inverse_out[2][1, 4] += 13.0  # jaw_2 curr: 0.1
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert terms["scalars"].item() == pytest.approx((0.01 + 0.04 + 0.01) / (2 * 5))
    only_nonzero(terms, "scalars")


def test_ordering_penalty_only_pushes_bank_b():
    forward_out, inverse_out, targets = make_case(batch=2)
    leaf_a = inverse_out[0]
    leaf_b = inverse_out[1]
    leaf_a[0, 5], leaf_b[0, 5] = 26.0, 13.0  # crossed by 0.1 normalised
    leaf_a[1, 70], leaf_b[1, 70] = 10.0, -29.0  # crossed by 0.3
    leaf_a[1, 80], leaf_b[1, 80] = 10.0, 10.0  # touching: no penalty
    leaf_a.requires_grad_(True)
    leaf_b.requires_grad_(True)
    terms = cross_training_loss(forward_out, inverse_out, targets)
    expected = (0.01 + 0.09) / (2 * LEAVES)
    assert terms["ordering"].item() == pytest.approx(expected)
    grad_a, grad_b = torch.autograd.grad(
        terms["ordering"], [leaf_a, leaf_b], allow_unused=True, materialize_grads=True
    )
    assert torch.count_nonzero(grad_a) == 0
    # the total sees bank A only through its own leaf term (zero here at leaf 5 of sample 0)
    grad_a_total = torch.autograd.grad(terms["total"] - terms["leaf_a"], leaf_a)[0]
    assert torch.count_nonzero(grad_a_total) == 0
    # d/db mean(relu(a - b)^2 / 130^2) = -2 (a - b) / 130^2 / (B * 104) at the crossed leaves
    expected_grad_b = torch.zeros_like(leaf_b)
    expected_grad_b[0, 5] = -2 * 13.0 / 130.0**2 / (2 * LEAVES)
    expected_grad_b[1, 70] = -2 * 39.0 / 130.0**2 / (2 * LEAVES)
    torch.testing.assert_close(grad_b, expected_grad_b)


def test_consistency_compares_curr_of_each_sample_with_prev_of_the_next_one():
    forward_out, inverse_out, targets = make_case(batch=3)
    leaf_a, leaf_b = inverse_out[0], inverse_out[1]
    leaf_a[0, 52 + 4] += 13.0  # curr of sample 0, leaf 4 != prev of sample 1: 0.1
    leaf_b[1, 52 + 9] -= 26.0  # curr of sample 1, leaf 9 != prev of sample 2: 0.2
    targets.leaf_weight_a[0, 52 + 4] = 0.5  # sample 0's curr weight applies
    targets.leaf_weight_a[1, 4] = 0.25  # sample 1's prev weight does not
    targets.leaf_weight_b[1, 52 + 9] = 0.5
    terms = cross_training_loss(forward_out, inverse_out, targets)
    # mean over (B - 1) * 52 pairs per bank, banks summed
    expected = 0.5 * 0.01 / (2 * 52) + 0.5 * 0.04 / (2 * 52)
    assert terms["consistency"].item() == pytest.approx(expected)


def test_consistency_ignores_non_adjacent_samples_and_single_sample_batches():
    forward_out, inverse_out, targets = make_case(batch=3)
    # a motion 0 -> 1 -> 2 that is consistent between neighbours, while samples 0 and 2 differ
    for sample, (prev, curr) in enumerate([(-20.0, -10.0), (-10.0, 0.0), (0.0, 10.0)]):
        inverse_out[0][sample, :52] = prev
        inverse_out[0][sample, 52:] = curr
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert terms["consistency"].item() == 0.0
    assert terms["leaf_a"].item() > 0.0

    forward_out, inverse_out, targets = make_case(batch=1)
    inverse_out[0][0, 52:] += 50.0
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert terms["consistency"].item() == 0.0


def test_latent_term_and_the_weights_of_the_total():
    forward_out, inverse_out, targets = make_case(batch=2)
    forward_out[1][0, 0, 1, 1] = 4.0  # latent: 16 / 32 elements = 0.5
    forward_out[0][0, 0, 0, 0] = 2.0  # forward: 4 / 4 pixels / 10 MU / 2 samples = 0.05
    inverse_out[0][0, 0] = 46.0  # bank A 26 mm past bank B (+20 mm): 0.2 normalised
    terms = cross_training_loss(forward_out, inverse_out, targets)
    ordering = 0.04 / (2 * LEAVES)
    leaf_a = (66.0 / 130.0) ** 2 / (2 * LEAVES)
    assert terms["latent"].item() == pytest.approx(0.5)
    assert terms["forward"].item() == pytest.approx(0.05)
    assert terms["ordering"].item() == pytest.approx(ordering)
    assert terms["leaf_a"].item() == pytest.approx(leaf_a)
    expected_total = 0.05 + leaf_a + 10 * ordering + 0.1 * 0.5
    assert terms["total"].item() == pytest.approx(expected_total)


def test_half_precision_inputs_are_summed_in_float32():
    forward_out, inverse_out, targets = make_case(batch=2)
    forward_out = [t.bfloat16() for t in forward_out]
    inverse_out = [t.bfloat16() for t in inverse_out]
    forward_out[1][0, 0, 1, 1] = 4.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        terms = cross_training_loss(forward_out, inverse_out, targets)
    assert all(value.dtype == torch.float32 for value in terms.values())
    assert terms["latent"].item() == pytest.approx(0.5)


class ScalarReads(TorchDispatchMode):
    """Counts tensor -> Python scalar reads (``.item()``, ``float(t)``, ``bool(t)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_loss_never_reads_values_back_to_the_host():
    forward_out, inverse_out, targets = make_case(batch=3)
    inverse_out[0][0, 60] += 5.0
    for prediction in (*forward_out, *inverse_out):
        prediction.requires_grad_(True)
    with ScalarReads() as reads:
        terms = cross_training_loss(forward_out, inverse_out, targets)
        terms["total"].backward()
    assert reads.count == 0
    with ScalarReads() as reads:
        terms["total"].item()
    assert reads.count == 1


def test_a_batch_with_x_jaws_scores_the_five_scalars_the_inverse_model_estimates():
    """The X jaws a batch of an MLC with them appends (the forward model's inputs) are not scored: the
    scalars term of 5 estimated scalars against 9 targets is the one against their first 5."""
    forward_out, inverse_out, targets = make_case()
    inverse_out[2][0, 2] += 13.0
    expected = cross_training_loss(forward_out, inverse_out, targets)["scalars"]
    targets.scalars = torch.cat([targets.scalars, torch.tensor([[-30.0, -31.0, 40.0, 41.0]]).repeat(2, 1)], 1)
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert terms["scalars"].item() == pytest.approx(expected.item()) and expected.item() == pytest.approx(
        (13.0 / 130.0) ** 2 / 10)
    only_nonzero(terms, "scalars")


def test_the_leaf_terms_score_the_edges_the_x_jaws_leave():
    """Targets with X jaws: bank A's leaf at -30 mm behind X1 = -25 mm (prev and curr) is scored as -25 mm,
    the edge the frames show; predicting the hidden -30 mm costs what a 5 mm error costs."""
    forward_out, inverse_out, targets = make_case()
    targets.leaf_a[:, [7, 52 + 7]] = -30.0
    targets.scalars = torch.cat([targets.scalars, torch.tensor([[-25.0, -25.0, 40.0, 40.0]]).repeat(2, 1)], 1)
    inverse_out[0][:, [7, 52 + 7]] = -25.0
    terms = cross_training_loss(forward_out, inverse_out, targets)
    assert terms["leaf_a"].item() == 0.0 and terms["total"].item() == 0.0
    inverse_out[0][:, [7, 52 + 7]] = -30.0
    assert cross_training_loss(forward_out, inverse_out, targets)["leaf_a"].item() == pytest.approx(
        2 * (5.0 / 130.0) ** 2 / LEAVES)
