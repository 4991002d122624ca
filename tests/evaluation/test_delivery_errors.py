"""The delivery errors a QA report flags (epid.evaluation.delivery_errors): judged on the leaf
positions the frames can show, a stuck leaf in the open field flagged at its control points, the
same errors in a strip the upper jaw covers all but a sliver of never."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epid.evaluation import arc_review, delivery_errors

POINTS = 12


def segment_and_estimate(errors_mm: dict[int, float], first_error: int = 2):
    """A 12-control-point segment of the 52 strips, jaws at y = -40 and -9.8 mm (the band: strips 18
    to 24, strip 24 (-10 to -5 mm) open 0.2 mm of its 5), every pair open 40 mm; its estimate with
    bank A of each strip in ``errors_mm`` off by that much from ``first_error`` on."""
    leaf_a = np.full((POINTS, 52), -20.0, np.float32)
    leaf_b = np.full((POINTS, 52), 20.0, np.float32)
    jaw_1, jaw_2 = np.full(POINTS, -40.0, np.float32), np.full(POINTS, -9.8, np.float32)
    segment = arc_review.ArcSegment(200, "regular", 1, torch.zeros(POINTS + 1, 256, 256), leaf_a, leaf_b, jaw_1, jaw_2,
                                    np.ones(POINTS, np.float32))
    estimated = leaf_a.copy()
    for strip, error in errors_mm.items():
        estimated[first_error:, strip] += error
    estimate = arc_review.ArcEstimate(torch.from_numpy(estimated), torch.from_numpy(leaf_b),
                                      torch.from_numpy(np.stack([jaw_1, jaw_2], 1)), torch.ones(POINTS), "arc")
    return segment, estimate


def flagged(errors: arc_review.LeafErrors) -> tuple[list[dict], dict]:
    points, gantry = np.arange(1, POINTS + 1), np.linspace(180.0, 240.0, POINTS)
    rows = delivery_errors.leaf_table(errors, points, gantry, np.arange(52) * 5.0 - 127.5, [str(i) for i in range(52)])
    summary = delivery_errors.error_summary(errors, rows, 0.0, np.full(POINTS, 99.0), points, gantry, 95.0)
    return [row for row in rows if row["flagged"]], summary


def test_the_open_share_of_each_strip_by_hand():
    segment, estimate = segment_and_estimate({})
    errors = arc_review.leaf_errors(estimate, segment)
    assert np.flatnonzero(errors.band[0]).tolist() == list(range(18, 25))
    np.testing.assert_allclose(errors.open_share[0, 17:26], [0, 1, 1, 1, 1, 1, 1, 0.04, 0], atol=1e-6)
    verifiable = errors.verifiable()["A"][0]
    assert np.flatnonzero(verifiable).tolist() == list(range(18, 24))


def test_a_stuck_leaf_in_the_field_is_flagged_and_one_behind_the_jaw_is_not():
    segment, estimate = segment_and_estimate({20: 12.0})
    rows, summary = flagged(arc_review.leaf_errors(estimate, segment))
    assert [(row["bank"], row["leaf"], row["flagged_control_points"]) for row in rows] == [("A", 20, "3-12")]
    assert summary["flagged"] and summary["banks"]["A"]["mean_mm"] == pytest.approx(12.0 * 10 / 12 / 6)
    verdict = delivery_errors.criterion(summary)
    assert (verdict["value"], verdict["pass"]) == (2, False), "bank A's mean (1.67 mm) and leaf A20 each count"
    # the same error where the upper jaw leaves 4 % of the strip open: the frames show the jaw there
    segment, estimate = segment_and_estimate({24: 12.0})
    errors = arc_review.leaf_errors(estimate, segment)
    rows, summary = flagged(errors)
    assert rows == [] and not summary["flagged"] and summary["banks"]["A"]["mean_mm"] == 0.0
    verdict = delivery_errors.criterion(summary)
    assert (verdict["value"], verdict["pass"]) == (0, True)
    assert np.abs(errors.scored_errors()).max() == 12.0, "the design's band still scores the strip"
