"""Quality metrics against hand-worked cases: leaf errors inside the jaw band, gamma of
identical frames, jaws, MU, per-pattern groups, the table and the JSON file."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from epid.evaluation import quality
from epid.evaluation.inference import Predictions, SampleRef, SampleSet
from epid.synthesis.sequences import leaf_band


def sample_set(patterns: list[str], seed: int = 0) -> SampleSet:
    """Samples with a smooth field (a blurred aperture) per sample, jaws at -20 and 30 mm."""
    gen = torch.Generator().manual_seed(seed)
    count = len(patterns)
    leaf_a = -30.0 + 5.0 * torch.rand(count, 104, generator=gen)
    leaf_b = leaf_a + 40.0
    scalars = torch.tensor([[20.0, -20.0, -20.0, 30.0, 30.0]]).repeat(count, 1)
    scalars[:, 0] = 5.0 + 10.0 * torch.arange(count)
    y, x = torch.meshgrid(torch.arange(256.0) - 127.5, torch.arange(256.0) - 127.5, indexing="ij")
    field = torch.exp(-(x**2 + y**2) / (2 * 40.0**2))
    frames = field.expand(count, 1, 256, 256).clone() * scalars[:, :1, None, None]
    refs = [SampleRef(i, i, pattern) for i, pattern in enumerate(patterns)]
    weights = torch.ones(count, 104)
    return SampleSet(refs, leaf_a, leaf_b, scalars, weights, weights, frames.clone(), frames)


def exact(samples: SampleSet) -> Predictions:
    return Predictions(samples.epid_curr.clone(), samples.leaf_a.clone(), samples.leaf_b.clone(),
                       samples.scalars.clone())


def test_identical_frames_pass_gamma_at_every_criterion():
    samples = sample_set(["regular", "irregular"])
    report = quality.assess(samples, exact(samples))
    for name in quality.QUALITY_CRITERIA:
        assert report.groups["all"][quality.gamma_key(name, "mean")] == 100.0
        assert report.groups["all"][quality.gamma_key(name, "p5")] == 100.0


def test_a_bank_shifted_by_0_7_mm_inside_the_band():
    samples = sample_set(["regular", "regular", "semiregular"])
    predicted = exact(samples)
    predicted.leaf_a[:, 52:] += 0.7  # curr bank A, every leaf
    report = quality.assess(samples, predicted, criteria=())
    figures = report.groups["all"]
    # half of the in-band curr leaves (bank A) are off by 0.7 mm, the other half (bank B) exact
    assert figures["curr_leaf_mae_mm"] == pytest.approx(0.35, abs=1e-5)
    assert figures["curr_leaf_bias_mm"] == pytest.approx(0.35, abs=1e-5)
    assert figures["curr_leaf_rms_mm"] == pytest.approx(math.sqrt(0.7**2 / 2), abs=1e-5)
    assert figures["curr_leaf_within_0.5mm"] == pytest.approx(50.0)
    assert figures["curr_leaf_within_1mm"] == pytest.approx(100.0)
    assert figures["prev_leaf_mae_mm"] == 0.0


def test_bank_errors_alone_give_mae_0_7_and_none_within_0_5_mm():
    samples = sample_set(["regular"])
    errors = np.full(10, 0.7)
    statistics = quality.leaf_statistics(errors)
    assert statistics == {"mae_mm": pytest.approx(0.7), "bias_mm": pytest.approx(0.7), "rms_mm": pytest.approx(0.7),
                          "within_0.5mm": 0.0, "within_1mm": 100.0}
    predicted = exact(samples)
    predicted.leaf_b[:, 52:] += 0.7
    predicted.leaf_a[:, 52:] -= 0.7
    figures = quality.assess(samples, predicted, criteria=()).groups["all"]
    assert figures["curr_leaf_mae_mm"] == pytest.approx(0.7, abs=1e-5)
    assert figures["curr_leaf_bias_mm"] == pytest.approx(0.0, abs=1e-5)
    assert figures["curr_leaf_within_0.5mm"] == 0.0


def test_leaves_outside_the_jaw_band_do_not_count():
    samples = sample_set(["irregular"])
    lo, hi = leaf_band(np.array([-20.0]), np.array([30.0]))
    outside = [j for j in range(52) if not lo[0] <= j < hi[0]]
    predicted = exact(samples)
    predicted.leaf_a[:, [52 + j for j in outside]] += 40.0
    predicted.leaf_a[:, outside] -= 40.0
    figures = quality.assess(samples, predicted, criteria=()).groups["all"]
    assert figures["curr_leaf_mae_mm"] == 0.0 and figures["prev_leaf_mae_mm"] == 0.0
    inside = list(range(lo[0], hi[0]))
    predicted.leaf_b[:, [52 + j for j in inside]] += 2.0
    figures = quality.assess(samples, predicted, criteria=()).groups["all"]
    assert figures["curr_leaf_mae_mm"] == pytest.approx(1.0, abs=1e-5)  # bank B in band off by 2, bank A exact


def test_the_band_follows_each_control_points_jaws():
    samples = sample_set(["regular"])
    samples.scalars[:, 1] = -60.0  # prev jaw_1 lower: more prev leaves in band
    predicted = exact(samples)
    lo_prev, _ = leaf_band(np.array([-60.0]), np.array([30.0]))
    lo_curr, _ = leaf_band(np.array([-20.0]), np.array([30.0]))
    extra = list(range(lo_prev[0], lo_curr[0]))
    predicted.leaf_a[:, extra] += 3.0
    predicted.leaf_a[:, [52 + j for j in extra]] += 3.0
    figures = quality.assess(samples, predicted, criteria=()).groups["all"]
    assert figures["curr_leaf_mae_mm"] == 0.0
    assert figures["prev_leaf_mae_mm"] > 0.0


def test_jaw_and_mu_errors_and_pattern_groups():
    samples = sample_set(["regular", "semiregular", "irregular", "irregular"])
    predicted = exact(samples)
    predicted.scalars[:, 2] += 1.0  # curr jaw_1 off by 1 mm: curr jaw MAE 0.5
    predicted.scalars[:, 3] -= 2.0  # prev jaw_2 off by 2 mm: prev jaw MAE 1
    predicted.scalars[:, 0] *= 1.02
    predicted.scalars[3, 0] = samples.scalars[3, 0] * 0.9
    report = quality.assess(samples, predicted, criteria=())
    assert list(report.groups) == ["all", "regular", "semiregular", "irregular"]
    assert report.groups["all"]["curr_jaw_mae_mm"] == pytest.approx(0.5)
    assert report.groups["all"]["prev_jaw_mae_mm"] == pytest.approx(1.0)
    assert report.groups["regular"]["mu_error_percent"] == pytest.approx(2.0, rel=1e-4)
    assert report.groups["irregular"]["mu_error_percent"] == pytest.approx(6.0, rel=1e-4)
    assert report.groups["all"]["mu_error_percent"] == pytest.approx(4.0, rel=1e-4)  # (2 + 2 + 2 + 10) / 4
    assert report.groups["irregular"]["samples"] == 2


def test_table_and_json_carry_every_figure(tmp_path):
    samples = sample_set(["regular", "irregular"])
    report = quality.assess(samples, exact(samples))
    table = report.table()
    for metric in quality.METRICS:
        assert (metric.label in table) == (metric.key not in quality.NARROW_KEYS)  # the legacy grid: no 2.5 mm leaves
    path = tmp_path / "quality.json"
    report.write_json(path, budget_minutes=20.0, device="cpu")
    written = json.loads(path.read_text())
    assert written["budget_minutes"] == 20.0 and written["device"] == "cpu"
    assert set(written["groups"]) == {"all", "regular", "irregular"}
    assert set(written["groups"]["all"]) == {m.key for m in quality.METRICS} - quality.NARROW_KEYS | {"samples"}


def test_hd120_reports_its_2_5_mm_leaves_apart():
    """On HD120's 104 fine strips (jaws at -60 / 60 mm: strips 28..75 in the band, 2.5 mm leaves over
    strips 36..67), a 0.8 mm error on the 2.5 mm leaves of bank A shows in their own figures as half
    their positions off, and diluted by the 5 mm leaves' in the band's."""
    from epid.synthesis.mlc import MLC_GEOMETRIES

    hd120 = MLC_GEOMETRIES["hd120"]
    base = sample_set(["regular", "irregular"])
    leaf_a = -30.0 + 5.0 * torch.rand(2, 208, generator=torch.Generator().manual_seed(1))
    weights = torch.ones(2, 208)
    scalars = base.scalars.clone()
    scalars[:, 1:] = torch.tensor([-60.0, -60.0, 60.0, 60.0])
    samples = SampleSet(base.refs, leaf_a, leaf_a + 40.0, scalars, weights, weights, base.epid_prev,
                        base.epid_curr, mlc=hd120)
    predicted = exact(samples)
    narrow = torch.from_numpy(hd120.narrow_strips)
    predicted.leaf_a[:, 104:][:, narrow] += 0.8
    figures = quality.assess(samples, predicted, criteria=()).groups["all"]
    assert figures["curr_narrow_leaf_mae_mm"] == pytest.approx(0.4, abs=1e-5)
    assert figures["curr_narrow_leaf_within_1mm"] == pytest.approx(100.0)
    assert figures["curr_leaf_mae_mm"] == pytest.approx(0.8 * 32 / (2 * 48), abs=1e-5)
    assert figures["prev_narrow_leaf_mae_mm"] == 0.0
    assert "curr leaf MAE in band, 2.5 mm leaves" in quality.QualityReport({"all": figures}).table()


def test_leaf_positions_an_x_jaw_hides_are_out_of_the_scored_band():
    """A target edge at X1 or behind X2 shows the jaw's edge, not the leaf's: out of the mask; the
    others in the jaw band stay in (scalars of a beam with X jaws, [X1 prev, X1 curr, X2 prev, X2 curr])."""
    from epid.evaluation.inference import hidden_by_x_jaws

    strips = 52
    target_a, target_b = torch.full((1, 2 * strips), -10.0), torch.full((1, 2 * strips), 10.0)
    target_a[0, strips + 10], target_b[0, strips + 11] = -20.0, 31.0  # curr: at X1, behind X2
    target_a[0, 3] = -40.0  # prev: inside that control point's X1
    scalars = torch.tensor([[5.0, -100.0, -100.0, 100.0, 100.0, -45.0, -20.0, 45.0, 25.0]])
    hidden = hidden_by_x_jaws(target_a, target_b, scalars)
    assert hidden.shape == (1, 2, 2 * strips) and int(hidden.sum()) == 2
    predicted_a, predicted_b = target_a + 0.5, target_b - 0.5
    jaw_1, jaw_2 = torch.tensor([-100.0]), torch.tensor([100.0])
    errors, band = quality.leaf_errors(predicted_a, predicted_b, target_a, target_b, jaw_1, jaw_2, "curr")
    _, scored = quality.leaf_errors(predicted_a, predicted_b, target_a, target_b, jaw_1, jaw_2, "curr", hidden)
    assert torch.equal(errors, torch.stack([torch.full((1, strips), 0.5), torch.full((1, strips), -0.5)], 1))
    dropped = band & ~scored
    assert dropped.sum() == 2 and dropped[0, 0, 10] and dropped[0, 1, 11] and not (scored & ~band).any()
    prev = [quality.leaf_errors(predicted_a, predicted_b, target_a, target_b, jaw_1, jaw_2, "prev", given)[1]
            for given in (None, hidden)]
    assert torch.equal(*prev)  # X1 stood at -45 mm then: the leaf at -40 mm showed
    assert hidden_by_x_jaws(target_a, target_b, scalars[:, :5]) is None
