"""``python -m bench.bench_quality --smoke``: a real run of seconds (tiny aperture models, short
arcs) that trains on dataset IDs 0 mod 4, evaluates on IDs 2 mod 4 and writes its three files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from bench import bench_quality
from bench import radial_kernel as radial_kernel_bench
from epid.config.load import load_config
from epid.core.errors import InputError
from epid.evaluation import quality
from epid.models.checkpoint import build_models_from_checkpoint, load_checkpoint
from epid.reconstruction import estimate
from epid.synthesis.frames import render_frames
from epid.synthesis.kernel import load_kernel
from epid.synthesis.physics import PRESETS
from epid.synthesis.sequences import PATTERNS, generate_control_points
from tests.support import ROOT, clean_environment

pytestmark = pytest.mark.timeout(300)

CONTEXT_KEYS = {"model", "size", "budget_minutes", "trained_minutes", "evaluation_seconds", "device", "machine",
                "seed", "samples_seen", "steps", "epochs", "train_dataset_ids", "eval_dataset_ids", "eval_samples",
                "curve"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    output = tmp_path_factory.mktemp("quality")
    done = subprocess.run([sys.executable, "-m", "bench.bench_quality", "--smoke", "--output-dir", str(output)],
                          cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return output, done.stdout


def test_the_smoke_run_writes_quality_json_with_every_metric_overall_and_per_pattern(smoke_run):
    output, stdout = smoke_run
    written = json.loads((output / "quality.json").read_text())
    assert CONTEXT_KEYS <= set(written)
    assert written["model"] == "aperture" and written["size"] == "tiny" and written["device"] == "cpu"
    assert set(written["groups"]) == {quality.ALL, *PATTERNS}
    for figures in written["groups"].values():
        assert {metric.key for metric in quality.METRICS} - quality.NARROW_KEYS <= set(figures)
    overall = written["groups"][quality.ALL]
    assert 0.0 <= overall["gamma_3_2mm_p5"] <= overall["gamma_3_2mm_mean"] <= 100.0
    assert overall["gamma_2_2mm_mean"] <= overall["gamma_3_2mm_mean"] <= overall["gamma_3_3mm_mean"]
    # held out: only dataset IDs 2 mod 4, at least 12 datasets and 48 samples
    ids = written["eval_dataset_ids"]
    assert len(ids) >= 12 and all(dataset_id % 4 == 2 for dataset_id in ids) and written["eval_samples"] >= 48
    assert written["train_dataset_ids"] == "0:640:4"
    curve = written["curve"]
    assert curve["samples_seen"][0] == 0 and len(curve["minutes"]) >= 2
    assert curve["samples_seen"] == sorted(curve["samples_seen"]) and curve["samples_seen"][-1] > 0
    assert written["samples_seen"] == curve["samples_seen"][-1]
    assert "curr leaf MAE in band (mm)" in stdout  # the table is printed
    # the headline is the arc reconstruction; a skipped fit would leave pair and arc at the same network estimate
    assert written["reconstruction"] == "arc" and set(written["reconstructions"]) == {"pair", "arc"}
    assert set(written["evaluation_seconds"]) == {"pair", "arc"}
    pair, arc = (written["reconstructions"][method][quality.ALL] for method in ("pair", "arc"))
    assert pair["curr_leaf_mae_mm"] != arc["curr_leaf_mae_mm"]
    assert written["groups"][quality.ALL]["curr_leaf_mae_mm"] == arc["curr_leaf_mae_mm"]


def test_the_checkpoint_is_an_ordinary_one_trained_on_ids_0_mod_4(smoke_run):
    output, _ = smoke_run
    checkpoint = load_checkpoint(output / "checkpoint.pth")
    assert checkpoint["model_config"]["family"] == "aperture"
    assert checkpoint["dataset_ids"] and all(dataset_id % 4 == 0 for dataset_id in checkpoint["dataset_ids"])
    forward_model, inverse_model = build_models_from_checkpoint(checkpoint)
    assert estimate.can_refine(forward_model, inverse_model)  # evaluation refines with the rendering


def test_quality_png_shows_the_curve(smoke_run):
    output, _ = smoke_run
    image = imread(output / "quality.png")
    assert image.shape[0] > 300 and image.shape[1] > 600
    gray = image[..., :3].mean(axis=2)
    assert gray.std() > 0.05 and (gray < 0.5).mean() > 0.005
    assert np.isfinite(gray).all()


def test_combine_draws_runs_of_several_folders_on_one_figure(smoke_run, tmp_path):
    output, _ = smoke_run
    done = subprocess.run([sys.executable, "-m", "bench.bench_quality", "--combine", str(output),
                           "--output-dir", str(tmp_path / "both")],
                          cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert imread(tmp_path / "both" / "quality.png").shape[1] > 600
    missing = subprocess.run([sys.executable, "-m", "bench.bench_quality", "--combine", str(tmp_path / "none")],
                             cwd=ROOT, env=clean_environment(), capture_output=True, text=True, timeout=120,
                             check=False)
    assert missing.returncode == 2 and "no quality.json there" in missing.stderr


def test_an_epoch_the_time_limit_stopped_counts_its_steps_and_adds_the_last_curve_point(smoke_run):
    from bench.bench_quality import count_stopped_epoch

    output, _ = smoke_run
    checkpoint = load_checkpoint(output / "checkpoint.pth")
    calls = []

    class Observer:
        curve = type("Curve", (), {"samples": [0, 320]})()

        def __call__(self, epoch, forward_model, inverse_model, samples_seen):
            calls.append((epoch, samples_seen, inverse_model.training))

    checkpoint["interrupted"] = None
    assert count_stopped_epoch(checkpoint, Observer(), torch.device("cpu"), 1) == 0 and not calls
    checkpoint["interrupted"] = {"epoch": 3, "batches_done": 6, "rank_train_samples": [24.0, 24.0]}
    assert count_stopped_epoch(checkpoint, Observer(), torch.device("cpu"), 2) == 3
    assert calls == [(3, 320 + 48, False)]


def test_physics_and_kernel_flags_reach_training_and_the_evaluation_frames(tmp_path):
    radial = tmp_path / "radial.mat"
    radial_kernel_bench.main([str(radial), "--size", "31"])
    defaults = bench_quality.parse_arguments([])
    assert (defaults.physics, defaults.kernel) == ("ideal", "")
    assert bench_quality.synthesis_label(defaults.physics, defaults.kernel) == "ideal physics, built-in kernel"
    args = bench_quality.parse_arguments(["--smoke", "--physics", "realistic", "--kernel", str(radial)])
    assert (args.physics, args.kernel) == ("realistic", str(radial))
    assert bench_quality.synthesis_label(args.physics, args.kernel) == "realistic physics, kernel radial.mat"
    environ = bench_quality.training_environment(args, tmp_path, 5, 2, 1.0)
    assert (environ["EPID_PHYSICS"], environ["EPID_KERNEL"]) == ("realistic", str(radial))
    assert load_config(environ).physics == PRESETS["realistic"]
    args.eval_datasets, args.eval_samples = 1, 2  # past the checks: two samples are enough here
    samples = bench_quality.evaluation_set(args)
    ref = samples.refs[0]
    control_points = generate_control_points(ref.dataset_id, args.control_points)
    expected = render_frames(control_points, [ref.sample + 2], load_kernel(radial), dataset_id=ref.dataset_id,
                             noise_std=0.005, physics=PRESETS["realistic"])
    torch.testing.assert_close(samples.epid_curr[0, 0], expected[0].float())


@pytest.mark.parametrize("contents", [None, b"not a MATLAB file"])
def test_a_bad_kernel_file_is_one_line_and_exit_2(tmp_path, contents):
    path = tmp_path / "kernel.mat"
    if contents is not None:
        path.write_bytes(contents)
    with pytest.raises(InputError, match="--kernel"):
        bench_quality.parse_arguments(["--kernel", str(path)])
    done = subprocess.run([sys.executable, "-m", "bench.bench_quality", "--kernel", str(path), "--output-dir",
                           str(tmp_path / "out")], cwd=ROOT, env=clean_environment(), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"python -m bench.bench_quality: error: --kernel '{path}': kernel file")


def test_an_unknown_physics_preset_exits_2(capsys):
    with pytest.raises(SystemExit) as stopped:
        bench_quality.parse_arguments(["--physics", "measured"])
    assert stopped.value.code == 2 and "ideal" in capsys.readouterr().err


def test_the_table_has_one_row_per_finished_run(smoke_run, capsys):
    output, _ = smoke_run
    assert bench_quality.main(["--table", str(output), str(output), "--output-dir", str(output / "table")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("kernel") and "within 1 mm" in printed[0]
    rows = [line for line in printed[2:] if line.startswith("built-in")]
    assert len(rows) == 2 and " ideal " in rows[0]
    written = json.loads((output / "quality.json").read_text())
    assert written["kernel_figures"]["fwhm_x_mm"] == pytest.approx(5.3, abs=0.1)  # the built-in kernel


def test_a_sweep_checks_every_kernel_before_it_trains(tmp_path):
    missing = tmp_path / "missing.mat"
    with pytest.raises(InputError, match=f"--kernels '{missing}'"):
        bench_quality.parse_arguments(["--kernels", f"built-in,{missing}"])
    with pytest.raises(SystemExit):
        bench_quality.parse_arguments(["--kernels", " , "])
