"""Whole-arc review: the segment of frames synthesised is the training synthesis, its errors
match a hand computation over the jaw band, and ``inference_visualize.py --arc`` writes one
figure per arc and arcs.csv."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from epid.data.windows import split_range
from epid.evaluation import arc_review
from epid.evaluation.inference import SynthesisSettings
from epid.models.checkpoint import save_checkpoint
from epid.models.families import build_models
from epid.synthesis.frames import render_frames
from epid.synthesis.kernel import default_kernel
from epid.synthesis.sequences import generate_control_points, leaf_band
from tests.evaluation.test_inference import checkpoint_path, checkpoint_payload  # noqa: F401  (fixture)
from tests.support import ROOT, clean_environment

SETTINGS = SynthesisSettings(control_points=12, kernel="", noise_std=0.005, noise_seed=3, sources={})


def test_a_segment_is_the_synthesis_of_its_frames_with_the_frame_before():
    kernel = default_kernel()
    control_points = generate_control_points(200, 12)
    segment = arc_review.synthesise_segment(200, 4, 5, SETTINGS, kernel)
    expected = render_frames(control_points, range(3, 9), kernel, dataset_id=200, noise_std=0.005, noise_seed=3)
    assert torch.equal(segment.frames, expected)
    np.testing.assert_array_equal(segment.leaf_b, control_points.leaf_b[4:9])
    np.testing.assert_array_equal(segment.mu, control_points.mu[4:9])
    at_start = arc_review.synthesise_segment(200, 1, 3, SETTINGS, kernel)
    assert torch.equal(at_start.frames[0], torch.zeros(256, 256))
    assert torch.equal(at_start.frames[1:], render_frames(control_points, range(1, 4), kernel, dataset_id=200,
                                                          noise_std=0.005, noise_seed=3))
    with pytest.raises(ValueError, match="inside 1..11"):
        arc_review.synthesise_segment(200, 10, 3, SETTINGS, kernel)


def test_a_segment_on_an_mlc_with_x_jaws_scores_what_they_hide_as_theirs():
    """Millennium 120, static X jaws (arc 162 of 20 control points): the segment's leaves are the arc's
    cut at its X jaws, and the positions they cut are marked behind X1 or X2, never scored as leaves."""
    from epid.synthesis.mlc import MLC_GEOMETRIES

    mlc = MLC_GEOMETRIES["millennium120"]
    settings = dataclasses.replace(SETTINGS, control_points=20, mlc=mlc)
    arc = generate_control_points(162, 20, mlc)
    segment = arc_review.synthesise_segment(162, 1, 8, settings, default_kernel())
    x_jaws = arc.x_jaws[1:9]
    np.testing.assert_array_equal(segment.x_jaws, x_jaws)
    np.testing.assert_array_equal(segment.leaf_a, np.clip(arc.leaf_a[1:9], x_jaws[:, :1], x_jaws[:, 1:]))
    cut = np.stack([arc.leaf_a[1:9] < x_jaws[:, :1], arc.leaf_b[1:9] > x_jaws[:, 1:]])
    assert cut.any() and np.all(segment.behind_x_jaws[cut] > 0)
    estimate = arc_review.ArcEstimate(torch.from_numpy(segment.leaf_a), torch.from_numpy(segment.leaf_b),
                                      torch.from_numpy(np.stack([segment.jaw_1, segment.jaw_2], 1)),
                                      torch.from_numpy(segment.mu), method="arc")
    errors = arc_review.leaf_errors(estimate, segment)
    for bank, mask in errors.scored().items():
        assert not (mask & cut["AB".index(bank)]).any()
    shifted = dataclasses.replace(estimate, leaf_a=estimate.leaf_a + 0.25, leaf_b=estimate.leaf_b + 0.25)
    figures = arc_review.arc_errors(shifted, segment, np.ones(52, dtype=bool))
    assert figures["x_jaw_positions"] > 0 and figures["x_jaw_mae_mm"] == pytest.approx(0.25, abs=1e-5)
    assert figures["narrow_leaves"] == figures["leaves"]


def test_a_reconstruction_marks_the_positions_its_fit_placed_leaf_by_leaf():
    """Millennium 120: a 10 mm leaf (two strips) is the fit's only where both strips are; the network's
    estimate marks none, the pair method's every one."""
    from unittest import mock

    from epid.reconstruction import estimate as estimate_module
    from epid.reconstruction.estimate import ArcReconstruction
    from epid.synthesis.mlc import MLC_GEOMETRIES

    mlc = MLC_GEOMETRIES["millennium120"]
    settings = dataclasses.replace(SETTINGS, control_points=20, mlc=mlc)
    segment = arc_review.synthesise_segment(162, 1, 4, settings, default_kernel())
    models = build_models("tiny", "aperture", mlc)
    kept = torch.zeros(5, 52, dtype=torch.bool)
    kept[2, 0] = True  # one strip of the first 10 mm leaf (strips 0 and 1) at control point 2
    kept[3, 10:12] = True  # strips 10 and 11: two 5 mm leaves
    arc = ArcReconstruction(torch.zeros(5, 52), torch.ones(5, 52), torch.tensor([[-50.0, 50.0]] * 5),
                            torch.ones(4), "arc tracking", leaves_from_start=kept)
    with mock.patch.object(estimate_module, "reconstruct_arc", return_value=arc):
        estimate = arc_review.reconstruct_segment("arc", models, segment, mlc=mlc)
    expected = ~kept[1:]
    expected[1, 1] = False  # the first 10 mm leaf covers strips 0 and 1
    assert torch.equal(estimate.fitted, expected)
    assert arc_review.reconstruct_segment("network", models, segment, mlc=mlc).fitted is None
    assert bool(arc_review.reconstruct_segment("pair", models, segment, mlc=mlc).fitted.all())


def test_the_validation_segment_starts_after_every_training_curr_frame():
    n_train = split_range(12, "val").start
    assert arc_review.first_frame("val", 12) == n_train + 2 == 10
    assert arc_review.first_frame("train", 12) == arc_review.first_frame("all", 12) == 1


def test_errors_of_a_hand_worked_estimate_count_only_the_jaw_band():
    segment = arc_review.synthesise_segment(100, 1, 4, SETTINGS, default_kernel())
    offsets = np.zeros((4, 52), dtype=np.float32)
    offsets[:, ::2] = 1.5  # every even leaf of bank A 1.5 mm out, the rest exact
    jaws = np.stack([segment.jaw_1, segment.jaw_2], 1) + np.array([0.25, -0.75], dtype=np.float32)
    estimate = arc_review.ArcEstimate(
        leaf_a=torch.from_numpy(segment.leaf_a + offsets), leaf_b=torch.from_numpy(segment.leaf_b.copy()),
        jaws=torch.from_numpy(jaws), mu=torch.from_numpy(segment.mu * 1.02), method="arc")
    errors = arc_review.arc_errors(estimate, segment)
    lo, hi = leaf_band(segment.jaw_1, segment.jaw_2)
    band = [(k, j) for k in range(4) for j in range(52) if lo[k] <= j < hi[k]]
    scored = [offsets[k, j] for k, j in band] + [0.0] * len(band)
    assert errors["leaves"] == len(scored)
    assert errors["leaf_mae_mm"] == pytest.approx(np.mean(scored), abs=1e-5)
    assert errors["leaf_rms_mm"] == pytest.approx(np.sqrt(np.mean(np.square(scored))), abs=1e-5)
    assert errors["within_1mm"] == pytest.approx(100 * np.mean(np.array(scored) <= 1), abs=1e-4)
    assert errors["jaw_mae_mm"] == pytest.approx(0.5, abs=1e-5)
    assert errors["mu_error_percent"] == pytest.approx(2.0, abs=1e-3)
    pooled = arc_review.pooled_errors([errors, {**errors, "leaves": 3 * errors["leaves"], "jaw_mae_mm": 1.5}])
    assert pooled["leaf_mae_mm"] == pytest.approx(errors["leaf_mae_mm"])
    assert pooled["jaw_mae_mm"] == pytest.approx(1.0)
    assert "narrow_leaves" not in pooled and "x_jaw_positions" not in pooled
    some = {"narrow_leaves": 10, "narrow_leaf_mae_mm": 0.2, "narrow_within_1mm": 90.0, "x_jaw_positions": 30,
            "x_jaw_mae_mm": 0.6}
    more = {"narrow_leaves": 30, "narrow_leaf_mae_mm": 0.4, "narrow_within_1mm": 98.0, "x_jaw_positions": 10,
            "x_jaw_mae_mm": 0.2}
    pooled = arc_review.pooled_errors([{**errors, **some}, {**errors, **more}, errors])
    assert (pooled["narrow_leaves"], pooled["x_jaw_positions"]) == (40, 40)
    assert pooled["narrow_leaf_mae_mm"] == pytest.approx((10 * 0.2 + 30 * 0.4) / 40)
    assert pooled["narrow_within_1mm"] == pytest.approx((10 * 90.0 + 30 * 98.0) / 40)
    assert pooled["x_jaw_mae_mm"] == pytest.approx((30 * 0.6 + 10 * 0.2) / 40)


def test_inference_visualize_arc_writes_a_figure_per_arc_and_the_table(checkpoint_path, tmp_path):  # noqa: F811
    output = tmp_path / "arcs"
    command = [sys.executable, str(ROOT / "inference_visualize.py"), "--checkpoint", str(checkpoint_path), "--arc",
               "--arc-frames", "3", "--split", "all", "--dataset-ids", "0,200", "--device", "cpu",
               "--output-dir", str(output)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=clean_environment(), timeout=300)
    assert result.returncode == 0, result.stderr
    with open(output / "arcs.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["dataset_id"], row["pattern"], row["frames"], row["first_frame"]) for row in rows] == [
        ("0", "regular", "3", "1"), ("200", "irregular", "3", "1")]
    assert {row["method"] for row in rows} == {"network"}  # a legacy pair cannot refine
    assert all(np.isfinite(float(row[key])) for row in rows for key in arc_review.ERROR_KEYS)
    image = imread(output / "arc_200.png")
    assert image.shape[:2] == (1300, 1700) and image[..., :3].std() > 0.05


def test_bench_reconstruct_reports_every_method_on_held_out_arcs(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "aperture.pth"
    save_checkpoint(checkpoint, checkpoint_payload(*build_models("tiny", "aperture")))
    output = tmp_path / "reconstruct.json"
    command = [sys.executable, "-m", "bench.bench_reconstruct", "--checkpoint", str(checkpoint), "--frames", "3",
               "--stages", "2:1,0.5:0.25", "--device", "cpu", "--output", str(output)]
    result = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, env=clean_environment(),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(output.read_text())
    assert report["arcs"] == [2, 82, 162]  # one held-out (2 mod 4) arc of each pattern
    assert set(report["summary"]) == {"network", "pair", "arc", "forward"}
    assert 0 <= report["summary"].pop("forward")["gamma_2_2mm_percent"] <= 100
    assert 0 <= report["summary"]["arc"]["from_start_percent"] <= 100
    for figures in report["summary"].values():
        assert figures["frames_per_second"] > 0 and figures["leaves"] > 0
        assert 0 <= figures["within_1mm"] <= 100 and np.isfinite(figures["leaf_mae_mm"])
    assert "leaf tracking stages (range, step mm): ((2.0, 1.0), (0.5, 0.25))" in result.stdout
    arc = report["summary"]["arc"]
    verdict = "met" if arc["within_1mm"] >= 99.0 else "MISSED"
    assert f"within 1 mm {verdict}" in result.stdout.splitlines()[-1]


def test_bench_reconstruct_takes_held_out_arcs_only(tmp_path):
    torch.manual_seed(0)
    checkpoint = tmp_path / "aperture.pth"
    payload = checkpoint_payload(*build_models("tiny", "aperture"))
    save_checkpoint(checkpoint, {**payload, "dataset_ids": [0, 4, 8]})
    for arcs, expected in (("4,6", "trained on [4]"), ("6,x", "expected comma-separated dataset IDs")):
        result = subprocess.run([sys.executable, "-m", "bench.bench_reconstruct", "--checkpoint", str(checkpoint),
                                 "--arcs", arcs], cwd=ROOT, check=False, capture_output=True, text=True,
                                env=clean_environment(), timeout=120)
        assert result.returncode == 2 and expected in result.stderr and result.stderr.count("\n") == 1


def test_bench_reconstruct_finds_a_moved_kernel_through_epid_kernel(tmp_path):
    """A checkpoint whose kernel file is gone is refused in one line; EPID_KERNEL names where it is now
    (and no other variable reaches the bench)."""
    import scipy.io

    torch.manual_seed(0)
    moved = tmp_path / "moved.mat"
    scipy.io.savemat(moved, {"kernel": default_kernel()})
    checkpoint = tmp_path / "aperture.pth"
    payload = checkpoint_payload(*build_models("tiny", "aperture"), kernel=str(tmp_path / "gone.mat"))
    save_checkpoint(checkpoint, payload)
    command = [sys.executable, "-m", "bench.bench_reconstruct", "--checkpoint", str(checkpoint), "--frames", "2",
               "--arcs", "6", "--methods", "network", "--device", "cpu"]
    refused = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, env=clean_environment(),
                             timeout=120)
    assert refused.returncode == 2 and "gone.mat" in refused.stderr and refused.stderr.count("\n") == 1
    environment = {**clean_environment(), "EPID_KERNEL": str(moved), "EPID_NOISE_STD": "0.5"}
    found = subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True, env=environment,
                           timeout=300)
    assert found.returncode == 0, found.stderr
    assert f"kernel {moved} (EPID_KERNEL)" in found.stdout and "noise std 0.005 (checkpoint)" in found.stdout
