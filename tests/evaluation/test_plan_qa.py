"""Real plans in use: training on the arcs of RT Plans (EPID_PLANS), a plan's frames predicted,
the delivery QA report against measured frames (epid.evaluation.plan_qa, inference_visualize.py --plan),
the DICOM exports, and the one-line errors on bad input.

The end-to-end run is tiny: two synthetic arcs of 12 and 16 control points written as RT Plans,
one epoch of the tiny legacy models on two CPU ranks (gloo), then --plan with --frames from an
RT Image of the synthesised frames.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pydicom
import pytest
import torch

import inference_visualize
from bench.xim_files import write_xim
from epid.config.load import Config, load_config
from epid.config.variables import ConfigError
from epid.core.errors import InputError
from epid.data.cache import plan_cache_key
from epid.data.dataset import EpidData
from epid.data.plans import scan_plans
from epid.dicom.image import read_frames, write_frames
from epid.dicom.plan import Arc, read_plan, write_arcs, write_plan
from epid.evaluation import arc_review, commission, inference, plan_qa, qa_report, timeline
from epid.models.checkpoint import load_checkpoint
from epid.models.families import build_models, predict_frames
from epid.synthesis.frames import render_frames
from epid.synthesis.kernel import default_kernel
from epid.synthesis.mlc import LEGACY_GRID, MlcGeometry
from epid.synthesis.sequences import ControlPoints, generate_control_points
from tests.dicom.test_series import raw_image, save
from tests.evaluation.test_timeline import direct_integral, series_of
from tests.support import ROOT, TINY_RUN, clean_environment

ARCS = {5: 12, 200: 16}  # dataset ID -> control points of the arcs written as plans
pytestmark = pytest.mark.timeout(240)


def write_arc_plans(folder: Path) -> dict[int, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for dataset_id, count in ARCS.items():
        paths[dataset_id] = folder / f"arc_{dataset_id:03d}.dcm"
        write_plan(paths[dataset_id], generate_control_points(dataset_id, count), label=f"arc {dataset_id}")
    return paths


def run(script: str, *arguments: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *arguments], env=clean_environment(**environment),
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)


def synthesised(dataset_id: int, count: int, mlc: MlcGeometry = LEGACY_GRID) -> np.ndarray:
    """Frames 1..count-1 of a synthetic arc on ``mlc``, as training renders them (no noise)."""
    control_points = generate_control_points(dataset_id, count, mlc)
    return render_frames(control_points, range(1, count), default_kernel(), dataset_id=dataset_id,
                         noise_std=0.0).numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """Two plans and a checkpoint trained one epoch on them over two ranks, with a frame cache."""
    root = tmp_path_factory.mktemp("plans_run")
    plans = write_arc_plans(root / "plans")
    checkpoint = root / "run" / "epid.pth"
    result = run("generate_and_train.py", **TINY_RUN, EPID_PLANS=str(root / "plans"), EPID_WORLD_SIZE="2",
                 EPID_BACKEND="gloo", EPID_BATCH_SIZE="4", EPID_GAMMA_SAMPLES="2", EPID_EPOCHS="1",
                 EPID_CACHE_DIR=str(root / "cache"), EPID_CHECKPOINT_PATH=str(checkpoint))
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "checkpoint": checkpoint, "cache": root / "cache", "stdout": result.stdout, **{
        f"plan_{dataset_id}": path for dataset_id, path in plans.items()}}


@pytest.fixture(scope="module")
def report(trained) -> dict[str, object]:
    """Arc 5 exported by the script (plan and synthesised frames), then --plan with --frames."""
    folder = trained["root"] / "qa"
    exported = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--dataset-ids", "5",
                   "--export-plan", str(folder / "arc5.dcm"), "--export-frames", str(folder / "arc5_frames.dcm"),
                   "--device", "cpu", EPID_CONTROL_POINTS="12")
    assert exported.returncode == 0, exported.stderr[-3000:]
    output = folder / "report"
    result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan",
                 str(folder / "arc5.dcm"), "--frames", str(folder / "arc5_frames.dcm"), "--export-frames",
                 str(folder / "predicted.dcm"), "--output-dir", str(output), "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    return {"folder": folder, "output": output, "stdout": result.stdout}


# --------------------------------------------------------------------------- training on plans


def test_training_on_plans_shards_the_arcs_and_caches_each_by_its_plan(trained):
    stdout = trained["stdout"]
    assert "plan arc 0" in stdout and "arc_005.dcm beam 1 (ARC), 12 control points" in stdout
    assert "arc_200.dcm beam 1 (ARC), 16 control points" in stdout
    assert "rank 0: 1 dataset(s)" in stdout and "rank 1: 1 dataset(s)" in stdout
    cached = sorted(path.name for path in trained["cache"].glob("*.f16"))
    assert len(cached) == 2 and cached[0].split("_")[2] != cached[1].split("_")[2]
    checkpoint = load_checkpoint(trained["checkpoint"])
    arcs = checkpoint["config"]["plan_arcs"]
    assert [arc["control_points"] for arc in arcs] == [12, 16] and all(len(arc["sha256"]) == 64 for arc in arcs)
    assert checkpoint["dataset_ids"] == [0, 1]


def test_plan_arcs_give_their_own_lengths_frames_and_cache_keys(tmp_path):
    write_arc_plans(tmp_path / "plans")
    arcs = scan_plans(tmp_path / "plans", 4)
    assert [arc.control_points for arc in arcs] == [12, 16]
    cached = EpidData([0, 1], noise_std=0.0, cache_dir=tmp_path / "cache", plan_arcs=arcs)
    direct = EpidData([0, 1], noise_std=0.0, plan_arcs=arcs)
    assert [len(direct.windows("train", 4)), len(direct.windows("val", 4))] == [2 + 3, 1 + 1]
    control_points = direct.control_points_for(1)
    assert control_points.pattern == "plan" and len(control_points) == 16
    np.testing.assert_allclose(control_points.leaf_a, generate_control_points(200, 16).leaf_a, atol=0.051)
    window = direct.windows("val", 4)[-1]
    batch, from_cache = direct.make_batch(window, "cpu"), cached.make_batch(window, "cpu")
    torch.testing.assert_close(from_cache.epid_curr, batch.epid_curr, atol=2e-2, rtol=1e-3)  # float16 cache
    keys = [plan_cache_key(arc, default_kernel(), 0.0, 0, "engine") for arc in arcs]
    assert keys[0]["plan_sha256"] != keys[1]["plan_sha256"] and keys[0]["n_control_points"] == 12


def test_bad_plans_are_refused_when_the_config_is_read(tmp_path):
    plans = tmp_path / "plans"
    write_arc_plans(plans)
    config = load_config({"EPID_PLANS": str(plans)})
    assert config.dataset_ids == (0, 1) and [config.arc_control_points(i) for i in (0, 1)] == [12, 16]
    assert Config.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match="EPID_DATASET_IDS='3'.*EPID_PLANS is set"):
        load_config({"EPID_PLANS": str(plans), "EPID_DATASET_IDS": "3"})
    with pytest.raises(ConfigError, match="EPID_PLANS=.*rank 2 would get no dataset"):
        load_config({"EPID_PLANS": str(plans), "EPID_WORLD_SIZE": "3"})
    write_plan(plans / "short.dcm", generate_control_points(7, 3))
    with pytest.raises(ConfigError, match=r"EPID_PLANS=.*short\.dcm: beam 1 \(ARC\): 3 control points"):
        load_config({"EPID_PLANS": str(plans)})
    (plans / "short.dcm").write_text("not a plan\n")
    with pytest.raises(ConfigError, match=r"short\.dcm: not a DICOM file") as error:
        load_config({"EPID_PLANS": str(plans)})
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="no such folder"):
        load_config({"EPID_PLANS": str(tmp_path / "missing")})


# --------------------------------------------------------------------------- the report


def test_plan_with_measured_frames_writes_the_report(report):
    output = report["output"]
    summary = json.loads((output / "qa_summary.json").read_text())
    assert set(plan_qa.SUMMARY_KEYS) <= set(summary) and {"checkpoint", "epoch"} <= set(summary)
    assert summary["banks"].startswith("A = X1 (IEC 61217: the -x side") and "Varian's bank B" in summary["banks"]
    assert (summary["beam"], summary["control_points"], summary["frames"]) == (1, 12, 11)
    assert (summary["first_control_point"], summary["last_control_point"]) == (1, 11)
    for key in ("gamma_3_2mm_mean", "gamma_3_2mm_min", "gamma_3_2mm_integrated", "gamma_2_2mm_mean"):
        assert 0.0 <= summary[key] <= 100.0
    assert summary["gamma_2_2mm_mean"] <= summary["gamma_3_2mm_mean"] + 1e-6
    assert 0 <= summary["frames_passing_3_2mm"] <= 11
    assert summary["reconstruction"] == "network"  # the legacy models cannot refine
    assert summary["reconstructed_control_points"] == 11 and summary["leaves_scored"] > 0
    for key in ("leaf_mae_mm", "leaf_max_mm", "jaw_mae_mm", "mu_total_error_percent"):
        assert math.isfinite(summary[key])
    assert 0.0 <= summary["leaf_within_1mm_percent"] <= 100.0
    assert set(summary["criteria"]) == {"gamma_3_2mm_frames", "gamma_3_2mm_integrated", "leaf_1mm", "delivery_errors"}
    assert summary["criteria"]["delivery_errors"]["pass"] == (not summary["delivery_errors"]["flagged"])
    assert summary["pass"] == all(item["pass"] for item in summary["criteria"].values())
    with open(output / "qa_frames.csv", newline="") as handle:
        frames = list(csv.DictReader(handle))
    assert [int(row["control_point"]) for row in frames] == list(range(1, 12))
    assert set(frames[0]) == set(qa_report.FRAME_COLUMNS)
    with open(output / "qa_leaves.csv", newline="") as handle:
        leaves = list(csv.DictReader(handle))
    assert len(leaves) == 11 * 104 and set(leaves[0]) == set(qa_report.LEAF_COLUMNS)
    # the legacy grid written as Agility: strip j under Agility's leaf 15 + j (numbered from 1)
    assert all(int(row["mlc_leaf"]) == int(row["leaf"]) + 15 for row in leaves)
    with open(output / "qa_leaf_errors.csv", newline="") as handle:
        errors = list(csv.DictReader(handle))
    assert [(row["bank"], int(row["leaf"]), int(row["mlc_leaf"])) for row in errors] == [
        (bank, strip, strip + 15) for bank in "AB" for strip in range(52)]
    for name in ("plan_frames.png", "qa_gamma.png", "qa_leaves.png", "qa_worst_frame.png"):
        assert (output / name).stat().st_size > 10_000
    assert "overall:" in report["stdout"]


def test_exports_read_back(report):
    folder = report["folder"]
    (beam,) = read_plan(folder / "arc5.dcm")
    np.testing.assert_allclose(beam.control_points.jaw_1, generate_control_points(5, 12).jaw_1, atol=1e-4)
    assert beam.geometry.name == "agility" and beam.x_jaws is None  # the arc on the plans' MLC, without X jaws
    measured = read_frames(folder / "arc5_frames.dcm")
    assert measured.control_point_index.tolist() == list(range(1, 12))
    expected = synthesised(5, 12, beam.geometry)
    noise_std = 0.005 * generate_control_points(5, 12).mu[1:] / np.sqrt(7)  # the checkpoint's noise per frame
    error = np.abs(measured.frames - expected).max(axis=(1, 2))
    assert np.all(error <= 6 * noise_std + 1e-3 * expected.max())
    predicted = read_frames(folder / "predicted.dcm")
    assert predicted.frames.shape == (11, 256, 256) and predicted.control_point_index.tolist() == list(range(1, 12))


def test_bad_input_exits_2_with_one_line_naming_the_file(tmp_path, trained):
    not_a_plan = tmp_path / "notes.txt"
    not_a_plan.write_text("hello\n")
    output = tmp_path / "out"
    result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan", str(not_a_plan),
                 "--output-dir", str(output))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(not_a_plan) in result.stderr and "not a DICOM file" in result.stderr
    assert not output.exists()


def test_a_plan_on_another_mlc_than_the_checkpoints_exits_2_naming_both(tmp_path, trained):
    from epid.models.checkpoint import load_checkpoint
    from epid.synthesis.mlc import MLC_GEOMETRIES

    saved = load_checkpoint(trained["checkpoint"])["config"]["mlc_geometry"]
    assert saved["name"] == "agility"  # EPID_PLANS unset EPID_MLC: the plans' own MLC, kept by the checkpoint
    halcyon = tmp_path / "halcyon.dcm"
    write_plan(halcyon, generate_control_points(5, 12, MLC_GEOMETRIES["halcyon"]), mlc=MLC_GEOMETRIES["halcyon"])
    output = tmp_path / "out"
    result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan", str(halcyon),
                 "--output-dir", str(output))
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert "beam 1 is on halcyon" in error and "trained on agility" in error
    assert not output.exists()


@pytest.mark.parametrize("case", ["outside", "gap", "beam", "frames alone", "with ids", "export no id", "folder",
                                  "over the plan", "dark alone", "flood of another panel"])
def test_bad_arguments_and_frames_are_refused_before_anything_is_written(tmp_path, case):
    plan = write_arc_plans(tmp_path / "plans")[5]
    frames = synthesised(5, 12)
    images = tmp_path / "frames.dcm"
    output = tmp_path / "out"
    arguments = ["--checkpoint", str(tmp_path / "missing.pth"), "--output-dir", str(output), "--plan", str(plan),
                 "--frames", str(images)]
    if case == "outside":
        write_frames(images, frames, control_point_index=range(2, 13))
        expected = r"frames\.dcm: measured frames of control points 2\.\.12: outside the frames 1\.\.11"
    elif case == "gap":
        write_frames(images, frames[:3], control_point_index=[1, 3, 5])
        expected = "the longest run of consecutive frames has 1; at least 2 are needed"
    elif case == "beam":
        arguments = arguments[:6] + ["--beam", "3"]
        expected = "arc_005.dcm: no beam 3"
    elif case == "frames alone":
        arguments = ["--frames", str(images)]
        expected = "--frames: needs --plan"
    elif case == "with ids":
        arguments = arguments[:6] + ["--dataset-ids", "5"]
        expected = "--dataset-ids: not with --plan"
    elif case == "export no id":
        arguments = ["--export-plan", str(tmp_path / "arc.dcm")]
        expected = "expected one dataset ID"
    elif case == "folder":
        arguments = ["--dataset-ids", "5", "--export-plan", str(tmp_path)]
        expected = "--export-plan .*: a folder"
    elif case == "dark alone":
        arguments = arguments[:6] + ["--dark-image", str(images)]
        expected = "--dark-image: only with --frames or --commission"
    elif case == "flood of another panel":
        write_frames(images, frames)
        flood = save(raw_image(np.full((64, 64), 900.0), pitch_mm=4.0, sid_mm=1000.0), tmp_path / "flood.dcm")
        arguments = arguments + ["--flood-image", str(flood)]
        expected = "frames.dcm: 256 x 256 pixels, but the dark and flood images have 64 x 64"
    else:
        arguments = arguments[:6] + ["--export-frames", str(plan)]
        expected = "--export-frames .*arc_005.dcm.*: is an input file"
    with pytest.raises(InputError, match=expected):
        inference_visualize.main(arguments)
    assert not output.exists() and not (tmp_path / "arc.dcm").exists()


# --------------------------------------------------------------------------- epid.evaluation.plan_qa


def test_predicted_plan_frames_carry_the_models_own_lag():
    torch.manual_seed(0)
    forward_model = build_models("tiny", "aperture")[0].eval()
    with torch.no_grad():
        forward_model.lag_percent.fill_(5.0)
    control_points = generate_control_points(80, 6)
    predicted = plan_qa.predict_plan_frames(forward_model, control_points, batch_size=2)
    leaf_a, leaf_b, scalars = plan_qa.frame_inputs(control_points)
    previous = torch.zeros(1, 1, 256, 256)
    with torch.no_grad():
        for k in range(5):
            previous, _ = predict_frames(forward_model, leaf_a[k:k + 1], leaf_b[k:k + 1], scalars[k:k + 1], previous)
            torch.testing.assert_close(predicted[k], previous[0, 0], atol=1e-4, rtol=1e-4)
    assert scalars[0].tolist()[1:] == [control_points.jaw_1[0], control_points.jaw_1[1], control_points.jaw_2[0],
                                       control_points.jaw_2[1]]


def qa_of(tmp_path: Path, estimate_from_plan: bool, first: int = 1) -> plan_qa.PlanQA:
    """QA of arc 5 (12 control points) against its own synthesised frames from frame ``first``:
    predictions equal to the measured frames; the reconstruction the plan itself or an
    untrained aperture pair's short arc fit."""
    plan = write_arc_plans(tmp_path / "plans")[5]
    (beam,) = read_plan(plan)
    images = tmp_path / "frames.dcm"
    write_frames(images, synthesised(5, 12)[first - 1:], control_point_index=range(first, 12))
    measured = read_frames(images)
    points = plan_qa.match_frames(beam, measured)
    frames = torch.from_numpy(np.array(measured.frames))
    gamma = plan_qa.frame_gamma(frames, frames.clone(), batch_size=4)
    segment = plan_qa.plan_segment(beam, points, frames)
    if estimate_from_plan:
        estimate = arc_review.ArcEstimate(
            torch.from_numpy(segment.leaf_a), torch.from_numpy(segment.leaf_b),
            torch.from_numpy(np.stack([segment.jaw_1, segment.jaw_2], 1)), torch.from_numpy(segment.mu), "arc")
    else:
        torch.manual_seed(0)
        estimate = plan_qa.reconstruct(build_models("tiny", "aperture"), segment, "arc", stages=((1.0, 0.5),))
    return plan_qa.PlanQA(beam, measured, points, frames, gamma, segment, estimate)


def test_a_delivery_that_matches_its_plan_passes_every_criterion(tmp_path):
    summary = plan_qa.summarise(qa_of(tmp_path, estimate_from_plan=True))
    assert summary["gamma_3_2mm_mean"] == summary["gamma_3_2mm_min"] == summary["gamma_3_2mm_integrated"] == 100.0
    assert summary["frames_passing_3_2mm"] == 11 and summary["frames_passing_2_2mm"] == 11
    assert summary["leaf_mae_mm"] == summary["leaf_max_mm"] == 0.0 and summary["leaf_within_1mm_percent"] == 100.0
    assert summary["jaw_mae_mm"] == 0.0 and abs(summary["mu_total_error_percent"]) < 1e-4
    assert summary["pass"] and all(item["pass"] for item in summary["criteria"].values())


def test_leaves_an_x_jaw_hides_are_scored_as_that_jaw_and_never_as_leaves(tmp_path):
    # arc 5 (its in-band leaves at x = 26.7..29.8 and 59.9..63.6 mm) behind X jaws at 28.4 and 62.0 mm, its
    # leaves folded into them as the plan reading does; the reconstruction finds every visible leaf where
    # planned and the X1 jaw's edge 1.5 mm inside the plan's
    qa = qa_of(tmp_path, estimate_from_plan=True)
    cp = qa.beam.control_points
    x1, x2 = 28.4, 62.0
    leaf_a = np.clip(cp.leaf_a, x1, x2)
    leaf_b = np.maximum(np.clip(cp.leaf_b, x1, x2), leaf_a)
    beam = dataclasses.replace(qa.beam, control_points=dataclasses.replace(
        cp, leaf_a=leaf_a, leaf_b=leaf_b, x_jaws=np.tile(np.float32([x1, x2]), (len(cp), 1))))
    segment = plan_qa.plan_segment(beam, qa.points, torch.from_numpy(np.array(qa.measured.frames)))
    rows = qa.points  # the scored control points (from frame 1: every frame's)
    band = inference.jaw_band(torch.from_numpy(cp.jaw_1[rows]), torch.from_numpy(cp.jaw_2[rows])).numpy()
    behind_x1 = {"A": cp.leaf_a[rows] <= x1, "B": cp.leaf_b[rows] <= x1}  # from the unfolded plan
    behind_x2 = {"A": cp.leaf_a[rows] >= x2, "B": cp.leaf_b[rows] >= x2}
    shift = {bank: np.where(behind_x1[bank], 1.5, 0.0).astype(np.float32) for bank in "AB"}
    estimate = arc_review.ArcEstimate(
        torch.from_numpy(segment.leaf_a + shift["A"]), torch.from_numpy(segment.leaf_b + shift["B"]),
        torch.from_numpy(np.stack([segment.jaw_1, segment.jaw_2], 1)), torch.from_numpy(segment.mu), "arc")
    summary = plan_qa.summarise(dataclasses.replace(qa, beam=beam, segment=segment, estimate=estimate))
    hidden_x1 = sum(int((band & behind_x1[bank]).sum()) for bank in "AB")
    hidden_x2 = sum(int((band & behind_x2[bank]).sum()) for bank in "AB")
    assert hidden_x1 > 15 and hidden_x2 > 15, "each jaw hides a share of its bank's leaves inside the band"
    assert summary["leaves_scored"] == 2 * int(band.sum()) - hidden_x1 - hidden_x2
    assert summary["leaf_mae_mm"] == 0.0 and summary["leaf_within_1mm_percent"] == 100.0
    assert summary["x_jaw_positions"] == hidden_x1 + hidden_x2
    assert summary["x_jaw_max_mm"] == pytest.approx(1.5)
    found = summary["delivery_errors"]
    assert found["x_jaws"]["X1"]["mean_mm"] == pytest.approx(1.5) and found["x_jaws"]["X1"]["flagged"]
    assert found["x_jaws"]["X2"]["mean_mm"] == 0.0 and not found["x_jaws"]["X2"]["flagged"]
    assert not any(bank["flagged"] for bank in found["banks"].values()) and found["flagged_leaves"] == 0
    assert found["flagged"]
    # gamma (the frames against themselves) and the leaves pass; the flagged X1 jaw fails the verdict
    assert [name for name, item in summary["criteria"].items() if not item["pass"]] == ["delivery_errors"]
    assert summary["criteria"]["delivery_errors"]["value"] == 1 and not summary["pass"]
    qa_report.write_leaves_csv(tmp_path / "qa_leaves.csv", dataclasses.replace(qa, beam=beam, segment=segment,
                                                                               estimate=estimate))
    with open(tmp_path / "qa_leaves.csv", newline="") as handle:
        hiding = [row["behind_x_jaw"] for row in csv.DictReader(handle)]
    assert hiding.count("X1") == sum(int(behind_x1[bank].sum()) for bank in "AB")
    assert hiding.count("X2") == sum(int(behind_x2[bank].sum()) for bank in "AB")


def test_positions_an_x_jaw_hides_are_read_as_the_jaw_and_the_mu_with_the_jaws_rendered(tmp_path):
    # frames the aperture model renders of arc 5 behind X jaws at 28.4 and 62.0 mm (leaf-end offsets 0.4 / 0.3
    # mm, leaves passing 1.4 %, jaws 0.2 %); a reconstruction that renders leaves alone fits each hidden leaf
    # its leaf-end offset inside the jaw's edge and reads the frames' MU against its leaves' leakage
    qa = qa_of(tmp_path, estimate_from_plan=True)
    cp = qa.beam.control_points
    x1, x2 = 28.4, 62.0
    leaf_a = np.clip(cp.leaf_a, x1, x2)
    x_jaws = np.tile(np.float32([x1, x2]), (len(cp), 1))
    folded = dataclasses.replace(cp, leaf_a=leaf_a, leaf_b=np.maximum(np.clip(cp.leaf_b, x1, x2), leaf_a),
                                 x_jaws=x_jaws)
    beam = dataclasses.replace(qa.beam, control_points=folded)
    segment = plan_qa.plan_segment(beam, qa.points, torch.from_numpy(np.array(qa.measured.frames)))
    torch.manual_seed(0)
    model = build_models("tiny", "aperture")[0].eval()
    with torch.no_grad():
        model.aperture.leaf_end_offset.copy_(torch.tensor([0.4, 0.3]))
        model.aperture.leaf_transmission_percent.fill_(1.4)
        model.aperture.jaw_transmission_percent.fill_(0.2)
    hidden = segment.behind_x_jaws
    assert (hidden[0] == 1).sum() > 15 and (hidden[1] == 2).sum() > 15
    rows = qa.points
    kept = np.zeros_like(folded.leaf_a, dtype=bool)
    kept[rows[2]] = True  # a control point kept from the network: its hidden positions are the jaw's edge
    assert ((beam.behind_x_jaws()[0][rows[2]] == 1) | (beam.behind_x_jaws()[1][rows[2]] == 2)).any()
    fitted = dataclasses.replace(
        folded, leaf_a=folded.leaf_a + np.where((beam.behind_x_jaws()[0] == 1) & ~kept, 0.4, 0.0),
        leaf_b=folded.leaf_b - np.where((beam.behind_x_jaws()[1] == 2) & ~kept, 0.3, 0.0))
    with torch.no_grad():
        truth = model.render(*plan_qa.frame_inputs(folded, x_jaws))[0].sum((-2, -1))  # frames 1..N-1, per MU
        leaves_alone = model.render(*plan_qa.frame_inputs(fitted))[0].sum((-2, -1))
    estimate = arc_review.ArcEstimate(
        torch.from_numpy(fitted.leaf_a[rows]), torch.from_numpy(fitted.leaf_b[rows]),
        torch.from_numpy(np.stack([segment.jaw_1, segment.jaw_2], 1)), torch.from_numpy(segment.mu), "arc",
        signal_mu=(truth / leaves_alone)[rows - 1], fitted=torch.from_numpy(~kept[rows]))
    assert float(estimate.signal_mu[1:].mean()) < 0.92, "the leaves' leakage beyond the jaws reads as less MU"
    read = plan_qa.read_x_jaws(model, segment, estimate)
    np.testing.assert_allclose(read.leaf_a.numpy(), segment.leaf_a, atol=1e-5)
    np.testing.assert_allclose(read.leaf_b.numpy(), segment.leaf_b, atol=1e-5)
    edges = arc_review.read_hidden_edges(model, segment, estimate)  # the reviews' reading: the edges alone
    assert torch.equal(edges.leaf_a, read.leaf_a) and torch.equal(edges.signal_mu, estimate.signal_mu)
    # frame 0's motion is not known; the others within 1 % (a visible leaf a few tenths inside a jaw's edge
    # meets a hidden one at the jaw in the tongue-and-groove strip, where the two renderings differ)
    np.testing.assert_allclose(read.signal_mu[1:].numpy(), 1.0, atol=0.01)
    assert abs(float(read.signal_mu[1:].mean()) - 1.0) < 3e-3
    summary = plan_qa.summarise(dataclasses.replace(qa, beam=beam, segment=segment, estimate=read))
    assert summary["x_jaw_max_mm"] < 1e-4 and summary["leaf_max_mm"] < 1e-4
    network = plan_qa.read_x_jaws(model, segment, dataclasses.replace(
        estimate, leaf_a=torch.from_numpy(segment.leaf_a), leaf_b=torch.from_numpy(segment.leaf_b), signal_mu=None,
        method="network", fitted=None))
    np.testing.assert_allclose(network.leaf_a.numpy(), segment.leaf_a, atol=1e-5)
    np.testing.assert_allclose(network.leaf_b.numpy(), segment.leaf_b, atol=1e-5)
    assert network.signal_mu is None
    legacy = build_models("tiny", "legacy")[0]
    assert plan_qa.read_x_jaws(legacy, segment, estimate) is estimate
    assert arc_review.read_hidden_edges(legacy, segment, estimate) is estimate


def test_arc_fit_from_a_later_frame_scores_the_control_points_after_it(tmp_path):
    qa = qa_of(tmp_path, estimate_from_plan=False, first=3)
    assert qa.points.tolist() == list(range(3, 12)) and qa.scored_points().tolist() == list(range(4, 12))
    assert qa.estimate.method == "arc" and qa.estimate.leaf_a.shape == (8, 52)
    summary = qa_report.write_report(qa, tmp_path, "test")
    assert summary["reconstructed_control_points"] == 8 and math.isfinite(summary["leaf_mae_mm"])
    assert summary["worst_leaf"]["control_point"] in range(4, 12) and summary["worst_leaf"]["bank"] in "AB"
    with open(tmp_path / "qa_frames.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows[0]["control_point"] == "3" and rows[0]["mu_reconstructed"] == "" and rows[1]["mu_reconstructed"]
    assert json.loads((tmp_path / "qa_summary.json").read_text())["first_control_point"] == 3


# --------------------------------------------------------------------------- measured cine series and integrated images


def cine_delivery(beam, ends: np.ndarray, steps: int = 6, leaf_shift_mm: float = 0.0) -> np.ndarray:
    """The frames a panel records over the spans between consecutive ``ends`` (cumulative MU, the
    first from 0): each span cut into ``steps`` parts whose positions are the plan's, interpolated
    per leaf with numpy (bank A shifted by ``leaf_shift_mm``), rendered by the synthesis and summed."""
    cp = beam.control_points
    cumulative = np.concatenate([[0.0], np.cumsum(cp.mu[1:].astype(np.float64))])
    cuts = np.concatenate([[0.0], np.concatenate([np.linspace(a, b, steps + 1)[1:] for a, b in
                                                  zip(np.concatenate([[0.0], ends[:-1]]), ends, strict=True)])])

    def at(name):
        values = getattr(cp, name).astype(np.float64)
        if values.ndim == 1:
            return np.interp(cuts, cumulative, values).astype(np.float32)
        return np.stack([np.interp(cuts, cumulative, values[:, leaf]) for leaf in range(values.shape[1])],
                        -1).astype(np.float32)

    leaf_a = at("leaf_a") + np.float32(leaf_shift_mm)
    fine = ControlPoints(leaf_a=leaf_a, leaf_b=np.maximum(at("leaf_b"), leaf_a), jaw_1=at("jaw_1"),
                         jaw_2=at("jaw_2"), mu=np.concatenate([[0.0], np.diff(cuts)]).astype(np.float32),
                         leaf_weight=np.ones((len(cuts), 52), np.float32), dataset_id=0, pattern="plan")
    frames = render_frames(fine, range(1, len(cuts)), default_kernel(), dataset_id=0, noise_std=0.0).numpy()
    return frames.reshape(len(ends), steps, 256, 256).sum(1)


def gantry_at(beam, ends: np.ndarray) -> np.ndarray:
    """The gantry angle (deg) of ``beam`` where its cumulative MU reaches each of ``ends``."""
    unwrapped = np.rad2deg(np.unwrap(np.deg2rad(beam.gantry_deg.astype(np.float64))))
    return np.interp(ends, np.concatenate([[0.0], np.cumsum(beam.control_points.mu[1:])]), unwrapped) % 360


def write_cine(folder: Path, frames: np.ndarray, angles: np.ndarray, units: float, keep=None,
               beam: int | None = None) -> list[Path]:
    """Single-frame RT Images in measured units (x ``units``) carrying only a gantry angle (none where
    NaN), an acquisition time at 9.5 frames/s and an instance number (frames not in ``keep`` dropped),
    and the beam they are of where ``beam`` is given."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (frame, angle) in enumerate(zip(frames, angles, strict=True)):
        if keep is not None and index not in keep:
            continue
        path = folder / f"cine_{index:04d}.dcm"
        write_frames(path, frame[None] * units)
        dataset = pydicom.dcmread(path)
        for tag in [element.tag for element in dataset if element.tag.group == 0x0011]:
            del dataset[tag]
        del dataset.FrameIncrementPointer
        if math.isfinite(angle):
            dataset.GantryAngle = f"{angle:.3f}"
        acquired = datetime.datetime(2026, 11, 26, 10, 15) + datetime.timedelta(seconds=index / 9.5)
        dataset.AcquisitionDateTime = acquired.strftime("%Y%m%d%H%M%S.%f")
        dataset.InstanceNumber = index + 1
        if beam is not None:
            dataset.ReferencedBeamNumber = beam
        dataset.save_as(path, enforce_file_format=True)
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def cine(trained) -> dict[str, object]:
    """Arc 200's plan delivered as 2.4 cine frames per control-point interval (one dropped), and as
    one integrated image, both in measured units; the QA run of each, and of the series calibrated
    by an image of a 10 x 10 cm open field of 100 MU."""
    (beam,) = read_plan(trained["plan_200"])
    ends = np.linspace(0.0, float(np.sum(beam.control_points.mu)), 37)[1:]
    frames = cine_delivery(beam, ends)
    folder = trained["root"] / "cine"
    write_cine(folder / "series", frames, gantry_at(beam, ends), units=37.0, keep=set(range(36)) - {17})
    (integrated,) = write_cine(folder / "integrated", frames.sum(0, keepdims=True), [math.nan], units=37.0)
    field = render_frames(timeline.open_field(100.0, 100.0, 100.0), [1], default_kernel(), dataset_id=0,
                          noise_std=0.0).numpy()
    (reference,) = write_cine(folder / "calibration", field, [math.nan], units=37.0)
    runs = {"frames": frames, "ends": ends}
    for name, given, extra in (("cine", str(folder / "series"), []), ("integrated", str(integrated), []),
                               ("calibrated", str(folder / "series"), ["--calibration-image", str(reference)])):
        output = folder / f"report_{name}"
        result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan",
                     str(trained["plan_200"]), "--frames", given, "--output-dir", str(output), "--device", "cpu",
                     *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = {"output": output, "stdout": result.stdout, "stderr": result.stderr,
                      "summary": json.loads((output / "qa_summary.json").read_text())}
    return runs


def test_a_cine_series_is_placed_by_gantry_angle_calibrated_and_reported(cine):
    summary = cine["cine"]["summary"]
    assert summary["placement"].startswith("35 measured frames placed by gantry angles")
    assert summary["dropped_frames"] == 1 and summary["frames"] == 35
    assert summary["calibration"]["scale"] > 0, "the tiny model predicts its own units (timeline tests: exact)"
    assert "global MU error" in summary["calibration"]["method"]
    assert summary["reconstructed_control_points"] == 17, "the longest run (18 frames, after the dropped one)"
    assert math.isfinite(summary["gamma_3_2mm_mean"]) and math.isfinite(summary["leaf_mae_mm"])
    with open(cine["cine"]["output"] / "qa_frames.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 35 and rows[17]["control_point"] == "19", "frame 18 of the timeline is the dropped one"
    for name in ("qa_gamma.png", "qa_leaves.png", "qa_worst_frame.png", "qa_leaves.csv"):
        assert (cine["cine"]["output"] / name).stat().st_size > 0


def test_an_xim_cine_series_is_placed_by_the_mu_counter_and_reviewed_like_its_rt_images(cine, trained):
    # the same delivery as Varian XIM frames (raw integer units, angles on Varian's Standard scale, the
    # linac's MU counter at each frame's start and end, frame 17 dropped), given as a folder
    pytest.importorskip("pylinac.core.image", reason="pylinac (requirements-xim.txt) reads XIM files")
    (beam,) = read_plan(trained["plan_200"])
    frames, ends = cine["frames"], cine["ends"]
    starts = np.concatenate([[0.0], ends[:-1]])
    folder = trained["root"] / "cine" / "xim"
    folder.mkdir()
    header = {"PixelWidth": 0.1, "PixelHeight": 0.1, "MVSourceVrt": 100.0, "MVDetectorVrt": 0.0}
    for index, angle in enumerate(gantry_at(beam, ends)):
        if index != 17:
            write_xim(folder / f"{index:05d}.xim", np.rint(frames[index] * 30_000 / frames.max()).astype(np.int32),
                      {**header, "GantryRtn": (180.0 - angle) % 360.0, "MVDoseStart": float(starts[index]),
                       "MVDoseStop": float(ends[index])})
    output = folder / "report"
    result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan",
                 str(trained["plan_200"]), "--frames", str(folder), "--output-dir", str(output), "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    summary, twin = json.loads((output / "qa_summary.json").read_text()), cine["cine"]["summary"]
    assert summary["placement"].startswith("35 measured frames placed by the linac's MU counter")
    assert (summary["dropped_frames"], summary["frames"], summary["reconstructed_control_points"]) == (1, 35, 17)
    with open(output / "qa_frames.csv", newline="") as handle:
        assert [row["control_point"] for row in csv.DictReader(handle)][16:18] == ["17", "19"]
    # the counter gives each frame its exact span (the angles only approximately the first one's and the
    # one's after the gap), so the predictions fit at least as well; the total signal is the same
    for key in ("gamma_3_2mm_mean", "gamma_2_2mm_mean", "gamma_3_2mm_integrated"):
        assert summary[key] >= twin[key], key
    assert summary["mu_total_error_percent"] == pytest.approx(twin["mu_total_error_percent"], abs=0.1)


def test_a_raw_series_with_its_dark_and_flood_images_is_reviewed_as_the_corrected_one(cine, trained):
    # the series as a raw panel records it: each pixel its own gain (0.7 to 1.3) and dark offset, the dark
    # and a flat flood field beside it; corrected, the QA is the corrected series' (a scale apart)
    (beam,) = read_plan(trained["plan_200"])
    frames, ends = cine["frames"], cine["ends"]
    rng = np.random.default_rng(11)
    gain, dark = 0.7 + 0.6 * rng.random(frames.shape[1:]), 2.0 + rng.random(frames.shape[1:])
    folder = trained["root"] / "cine" / "raw"
    write_cine(folder / "series", frames * gain + dark, gantry_at(beam, ends), units=1.0, keep=set(range(36)) - {17})
    write_cine(folder / "dark", dark[None], [math.nan], units=1.0)
    write_cine(folder / "flood", (gain * 3.0 + dark)[None], [math.nan], units=1.0)
    output = folder / "report"
    result = run("inference_visualize.py", "--checkpoint", str(trained["checkpoint"]), "--plan",
                 str(trained["plan_200"]), "--frames", str(folder / "series"), "--dark-image", str(folder / "dark"),
                 "--flood-image", str(folder / "flood"), "--output-dir", str(output), "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "panel correction (256 x 256 pixels): dark 1 image(s)" in result.stdout + result.stderr
    summary, twin = json.loads((output / "qa_summary.json").read_text()), cine["cine"]["summary"]
    assert summary["panel_correction"] == {"dark_image": [str(folder / "dark")], "flood_image": [str(folder / "flood")]}
    for key in ("gamma_3_2mm_mean", "gamma_2_2mm_mean", "gamma_3_2mm_integrated", "leaf_mae_mm", "jaw_mae_mm",
                "mu_total_error_percent"):
        assert summary[key] == pytest.approx(twin[key], rel=1e-3, abs=0.01), key


def test_a_calibration_image_calibrates_the_series(cine):
    calibration = cine["calibrated"]["summary"]["calibration"]
    assert calibration["method"].startswith("calibration image") and "100 x 100 mm, 100 MU" in calibration["method"]
    assert calibration["scale"] > 0 and calibration["scale"] != cine["cine"]["summary"]["calibration"]["scale"]


def test_an_integrated_image_gets_gamma_against_the_beams_integral(cine):
    summary = cine["integrated"]["summary"]
    assert "the whole beam" in summary["placement"] and summary["calibration"]["scale"] > 0
    assert set(summary["criteria"]) == {"gamma_3_2mm_integrated"}
    assert math.isfinite(summary["gamma_3_2mm_integrated"])
    assert (cine["integrated"]["output"] / "qa_integrated.png").stat().st_size > 0
    assert "Integrated-image QA of beam 1" in cine["integrated"]["stdout"]


def test_a_plans_summary_holds_a_cine_and_an_integrated_beam(cine, tmp_path):
    """qa_plan.json of a plan whose beam 1 was judged from a cine series and beam 2 from an integrated
    image: each beam's own figures (None where its kind of QA has none), the plan passing only when
    both do; the table shows n/a for what a beam lacks."""
    summaries = [cine["cine"]["summary"], {**cine["integrated"]["summary"], "beam": 2, "beam_name": "ARC 2"}]
    plan = qa_report.write_plan_summary("two.dcm", summaries, tmp_path)
    assert json.loads((tmp_path / "qa_plan.json").read_text()) == plan
    first, second = plan["beams"]
    assert first["frames"] == 35 and first["leaf_mae_mm"] == summaries[0]["leaf_mae_mm"]
    assert second["frames"] is None and second["leaf_mae_mm"] is None and second["report"] == "beam_2"
    assert second["gamma_3_2mm_integrated"] == summaries[1]["gamma_3_2mm_integrated"]
    assert plan["pass"] == (summaries[0]["pass"] and summaries[1]["pass"])
    failing = qa_report.write_plan_summary("two.dcm", [summaries[0], {**summaries[1], "pass": False}], tmp_path)
    assert failing["pass"] is False
    table = qa_report.plan_table(failing)
    assert "2 (ARC 2)" in table and "n/a" in table and table.endswith("plan: FAIL")


def test_a_two_arc_plan_is_reviewed_beam_by_beam_in_one_run(trained, tmp_path):
    """Arcs 5 and 200 as one plan (arc 2 back counter-clockwise), each delivered as a cine series
    naming its beam and given together: one run writes each beam's report and qa_plan.json, and each
    beam's figures are those of a run of that beam alone (--beam 2 takes its images from the whole
    delivery); a delivery missing a beam is refused."""
    plan = tmp_path / "two_arcs.dcm"
    write_arcs(plan, [Arc(generate_control_points(5, 12)),
                      Arc(generate_control_points(200, 16), None, 179.0, 181.0, "CC")], label="two arcs")
    folders = []
    for beam in read_plan(plan):
        ends = np.linspace(0.0, float(np.sum(beam.control_points.mu)), 2 * len(beam) - 1)[1:]
        folders.append(tmp_path / f"cine_{beam.beam_number}")
        write_cine(folders[-1], cine_delivery(beam, ends), gantry_at(beam, ends), units=37.0, beam=beam.beam_number)
    common = ["--checkpoint", str(trained["checkpoint"]), "--plan", str(plan), "--device", "cpu"]
    result = run("inference_visualize.py", *common, "--frames", *map(str, folders), "--output-dir",
                 str(tmp_path / "qa"))
    assert result.returncode == 0, result.stderr[-3000:]
    plan_summary = json.loads((tmp_path / "qa" / "qa_plan.json").read_text())
    assert [(beam["beam"], beam["beam_name"], beam["frames"]) for beam in plan_summary["beams"]] == [
        (1, "ARC 1", 22), (2, "ARC 2", 30)]
    assert plan_summary["pass"] == all(beam["pass"] for beam in plan_summary["beams"])
    assert "QA of plan" in result.stdout and "Delivery QA of beam 2" in result.stdout
    alone = run("inference_visualize.py", *common, "--beam", "2", "--frames", *map(str, folders), "--output-dir",
                str(tmp_path / "alone"))
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "the 30 frame(s) of beam 2; left aside: 22 of beam 1" in alone.stdout
    together = json.loads((tmp_path / "qa" / "beam_2" / "qa_summary.json").read_text())
    by_itself = json.loads((tmp_path / "alone" / "qa_summary.json").read_text())
    for key in ("frames", "gamma_3_2mm_mean", "gamma_2_2mm_integrated", "leaf_mae_mm", "jaw_mae_mm",
                "mu_total_error_percent", "pass"):
        assert together[key] == by_itself[key], key
    for beam in (1, 2):  # plan_frames.png drawn from each series' own predicted frames, the plan's not predicted
        assert (tmp_path / "qa" / f"beam_{beam}" / "plan_frames.png").stat().st_size > 0
    assert "predicting its" not in result.stdout
    assert result.stdout.count("frame(s) of the timeline over their spans") == 2
    assert (tmp_path / "qa" / "beam_1" / "qa_leaves.png").stat().st_size > 0
    missing = run("inference_visualize.py", *common, "--frames", str(folders[0]), "--output-dir",
                  str(tmp_path / "missing"))
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
    assert "no images of beam 2 (ARC 2)" in missing.stderr and not (tmp_path / "missing").exists()
    other = run("inference_visualize.py", *common, "--beam", "2", "--frames", str(folders[0]), "--output-dir",
                str(tmp_path / "other"))
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "images of beam 1, compared with beam 2" in other.stderr


def test_a_faulty_delivery_fails_where_the_error_free_one_passes(tmp_path):
    """Cine frames of arc 200 integrated directly (48 parts per frame, numpy's interpolation) by a
    forward model in measured units; the QA chain (placement by gantry angle, the plan integrated
    over each frame's span, calibration, gamma) passes the error-free delivery and fails one whose
    leaves all lie 5 mm off, frame by frame and on the integrated image."""
    plan = write_arc_plans(tmp_path / "plans")[200]
    (beam,) = read_plan(plan)
    total = float(np.sum(beam.control_points.mu))
    ends = np.linspace(0.0, total, 31)[1:]
    torch.manual_seed(0)
    forward = build_models("tiny", "aperture")[0].eval()
    placement = timeline.place_frames(beam, series_of(beam, ends))
    predicted = timeline.predict_spans(forward, placement)
    # the frames integrate the timeline's spans (the first frame's start is read from the step after it)
    spans = np.stack([placement.boundaries_mu[:-1], placement.boundaries_mu[1:]], 1)
    rates = {}
    for shift in (0.0, 5.0):
        measured = direct_integral(forward, beam, spans, steps=16, leaf_shift_mm=shift) * 37.0
        measured *= timeline.calibration_scale(measured, predicted)
        gamma = plan_qa.frame_gamma(measured, predicted)
        rates[shift] = (float(np.nanmean(gamma.pass_rates["3_2mm"])), gamma.integrated["3_2mm"])
    assert min(rates[0.0]) >= plan_qa.TG218_TOLERANCE_PERCENT > max(rates[5.0]), rates


@pytest.mark.parametrize("case", ["odd", "legacy"])
def test_commissioning_refuses_bad_input_before_writing(cine, trained, tmp_path, case):
    output = tmp_path / "commissioned"
    pairs = [str(trained["plan_200"]), str(trained["root"] / "cine" / "series")]
    arguments = ["--checkpoint", str(trained["checkpoint"]), "--commission", *(pairs[:1] if case == "odd" else pairs),
                 "--output-dir", str(output), "--commission-steps", "2"]
    result = run("inference_visualize.py", *arguments)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    expected = "expected pairs of an RT Plan" if case == "odd" else "aperture-family"
    assert expected in result.stderr and not output.exists()


def test_a_commissioned_checkpoint_carries_its_scale_and_mu_reference_into_the_qa(cine, trained, tmp_path):
    """An aperture-family run of two steps commissioned on the cine series (two steps), then the
    QA of that series with the commissioned checkpoint: calibrated by the commissioned scale, its
    total MU read against the stored reference."""
    run_checkpoint = tmp_path / "aperture" / "epid.pth"
    trained_run = run("generate_and_train.py", **{**TINY_RUN, "EPID_MODEL": "aperture"},
                      EPID_PLANS=str(trained["root"] / "plans"), EPID_BATCH_SIZE="4", EPID_GAMMA_SAMPLES="0",
                      EPID_EPOCHS="1", EPID_STEPS_PER_EPOCH="2", EPID_CACHE_DIR=str(trained["cache"]),
                      EPID_CHECKPOINT_PATH=str(run_checkpoint))
    assert trained_run.returncode == 0, trained_run.stderr[-3000:]
    commissioned = tmp_path / "commissioned"
    result = run("inference_visualize.py", "--checkpoint", str(run_checkpoint), "--commission",
                 str(trained["plan_200"]), str(trained["root"] / "cine" / "series"), "--output-dir", str(commissioned),
                 "--commission-steps", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = load_checkpoint(commissioned / "commissioned.pth")
    stored = saved["commissioning"]
    assert stored["calibration_scale"] > 0 and math.isfinite(stored["mu_reference"]) and stored["mu_reference"] > 0
    report = json.loads((commissioned / "commissioning.json").read_text())
    assert report["mu_reference"] == stored["mu_reference"]
    assert set(report["least_squares"]) == set(commission.LEAST_SQUARES_PARAMETERS) >= {
        "aperture.leaf_transmission_percent", "aperture.jaw_transmission_percent", "lag_percent",
        "recording.lag_32_percent", "recording.power_percent"}
    torch.testing.assert_close(saved["inverse_model"]["lag_percent"], saved["forward_model"]["lag_percent"])
    assert "MU reference" in result.stderr + result.stdout
    output = tmp_path / "qa"
    result = run("inference_visualize.py", "--checkpoint", str(commissioned / "commissioned.pth"), "--plan",
                 str(trained["plan_200"]), "--frames", str(trained["root"] / "cine" / "series"), "--output-dir",
                 str(output), "--device", "cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((output / "qa_summary.json").read_text())
    assert summary["calibration"]["mode"] == "commissioned"
    assert summary["calibration"]["scale"] == pytest.approx(stored["calibration_scale"])
    assert math.isfinite(summary["mu_total_error_percent"])
