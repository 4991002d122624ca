"""inference_visualize.py and epid.evaluation.inference: sample choice, metrics against hand-worked and
independently recomputed values, the figures it writes, and its errors on bad input."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread

import inference_visualize
from epid.config.load import Config, load_config
from epid.core.errors import InputError
from epid.evaluation import inference, plots
from epid.evaluation.gamma import gamma_index, gamma_maps
from epid.models.checkpoint import FORMAT_VERSION, load_checkpoint, save_checkpoint
from epid.models.families import PairConfig, build_models
from epid.models.legacy import ForwardConfig, ForwardModel, InverseConfig, InverseModel
from epid.models.losses import LOSS_TERMS
from epid.synthesis.frames import render_frames
from epid.synthesis.kernel import default_kernel
from epid.synthesis.mlc import MLC_GEOMETRIES
from epid.synthesis.physics import LIMITS, PRESETS, Physics
from epid.synthesis.sequences import generate_control_points, pattern_for
from tests.support import ROOT, clean_environment

SCRIPT = ROOT / "inference_visualize.py"
N_CONTROL_POINTS = 12  # 10 samples per arc: 8 train, 2 validation
DATASET_IDS = (0, 80, 200)  # regular, semiregular, irregular
SAMPLE_PNG_SIZE = (round(plots.SAMPLE_FIGSIZE[1] * plots.DPI), round(plots.SAMPLE_FIGSIZE[0] * plots.DPI))
# Lenient criteria: an untrained model's pass rate lands strictly between 0 and 100 %, so the
# comparison with the recomputed rate means something.
GAMMA_ARGS = ("--gamma-dose-percent", "60", "--gamma-distance-mm", "4", "--gamma-cutoff-percent", "20")


def history(epochs: int) -> dict:
    """A plausible decreasing history of every loss term."""
    decay = np.exp(-0.4 * np.arange(epochs))
    return {
        "train": {term: (1.0 / (k + 1) * decay).tolist() for k, term in enumerate(LOSS_TERMS)},
        "val": {term: (1.2 / (k + 1) * decay).tolist() for k, term in enumerate(LOSS_TERMS)},
        "gamma_pass": (20 + 10 * np.arange(epochs, dtype=float)).tolist(),
        "lr": [1e-4] * epochs,
        "samples_per_s": [50.0] * epochs,
    }


def checkpoint_payload(forward_model: ForwardModel, inverse_model: InverseModel, **config_values) -> dict:
    config = Config(control_points=N_CONTROL_POINTS, model_size="tiny", dataset_ids=DATASET_IDS, **config_values)
    return {
        "format_version": FORMAT_VERSION, "run_id": "test", "epoch": 3,
        "forward_model": forward_model.state_dict(), "inverse_model": inverse_model.state_dict(),
        "model_config": PairConfig.of(forward_model, inverse_model).to_dict(),
        "optimizer": {}, "schedule": {}, "scaler": None, "rng": {},
        "history": history(3), "best_val_loss": 0.5, "best_epoch": 2,
        "config": config.to_dict(), "dataset_ids": list(DATASET_IDS), "world_size": 1,
        "torch_version": str(torch.__version__),
    }


@pytest.fixture(scope="module")
def checkpoint_path(tmp_path_factory) -> Path:
    """A checkpoint of freshly initialised tiny models (fast; no training needed)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("run") / "epid.pth"
    save_checkpoint(path, checkpoint_payload(*build_models("tiny", "legacy")))
    return path


@pytest.fixture(scope="module")
def inference_run(checkpoint_path, tmp_path_factory):
    """One run of the script on the tiny checkpoint; returns (output dir, completed process)."""
    output = tmp_path_factory.mktemp("inference")
    command = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint_path), "--dataset-ids",
               ",".join(map(str, DATASET_IDS)), "--device", "cpu", "--output-dir", str(output), *GAMMA_ARGS]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=clean_environment(), timeout=300)
    assert result.returncode == 0, result.stderr
    return output, result


# --------------------------------------------------------------------------- sample choice


def test_sample_choice_is_deterministic_validation_only_and_independent_per_dataset():
    refs = inference.select_samples(range(0, 640, 40), 2, seed=5, n_control_points=2050)
    assert refs == inference.select_samples(range(0, 640, 40), 2, seed=5, n_control_points=2050)
    assert len(refs) == 32 and len(set(refs)) == 32
    assert all(1664 <= ref.sample < 2048 and ref.pattern == pattern_for(ref.dataset_id) for ref in refs)
    alone = inference.select_samples([80], 2, seed=5, n_control_points=2050)
    assert alone == [ref for ref in refs if ref.dataset_id == 80]
    assert inference.select_samples([80], 2, seed=6, n_control_points=2050) != alone
    assert inference.select_samples([3], 5, seed=0, n_control_points=12) == [
        inference.SampleRef(3, 8, "regular"), inference.SampleRef(3, 9, "regular")
    ]


def test_capped_sample_choice_spreads_over_datasets_and_patterns():
    refs = inference.select_samples(range(640), 2, seed=0, n_control_points=2050, max_total=12)
    assert len(refs) == 12
    assert len({ref.dataset_id for ref in refs}) == 6
    assert {ref.pattern for ref in refs} == {"regular", "semiregular", "irregular"}
    assert min(ref.dataset_id for ref in refs) == 0 and max(ref.dataset_id for ref in refs) == 639
    odd = inference.select_samples(range(10), 3, seed=0, n_control_points=2050, max_total=7)
    assert len(odd) == 7 and len({ref.dataset_id for ref in odd}) == 3


def test_synthesised_samples_are_the_training_samples():
    refs = [inference.SampleRef(80, 8, "semiregular"), inference.SampleRef(80, 9, "semiregular")]
    settings = inference.SynthesisSettings(N_CONTROL_POINTS, "", 0.005, 3, {})
    samples = inference.synthesise_samples(refs, settings, default_kernel())
    cp = generate_control_points(80, N_CONTROL_POINTS)
    frames = render_frames(cp, [9, 10, 11], default_kernel(), dataset_id=80, noise_std=0.005, noise_seed=3)
    torch.testing.assert_close(samples.epid_prev[:, 0], frames[:2], rtol=0, atol=1e-6)
    torch.testing.assert_close(samples.epid_curr[:, 0], frames[1:], rtol=0, atol=1e-6)
    for row, sample in enumerate((8, 9)):
        prev, curr = sample + 1, sample + 2
        assert samples.leaf_a[row].tolist() == pytest.approx([*cp.leaf_a[prev], *cp.leaf_a[curr]])
        assert samples.leaf_b[row].tolist() == pytest.approx([*cp.leaf_b[prev], *cp.leaf_b[curr]])
        assert samples.leaf_weight_b[row].tolist() == [*cp.leaf_weight[prev], *cp.leaf_weight[curr]]
        assert samples.scalars[row].tolist() == pytest.approx(
            [cp.mu[curr], cp.jaw_1[prev], cp.jaw_1[curr], cp.jaw_2[prev], cp.jaw_2[curr]])


# --------------------------------------------------------------------------- metrics


def hand_made_samples() -> inference.SampleSet:
    """Two samples with jaws at -10 / +10 mm (leaf pairs 24..27 open at both control points)."""
    count = 2
    frame = torch.zeros(count, 1, 256, 256)
    frame[:, :, 100:150, 90:170] = 5.0
    scalars = torch.tensor([[20.0, -10.0, -10.0, 10.0, 10.0]] * count)
    leaves = torch.linspace(-20, 20, 104).repeat(count, 1)
    return inference.SampleSet(
        refs=[inference.SampleRef(0, 8, "regular"), inference.SampleRef(200, 9, "irregular")],
        leaf_a=leaves - 10, leaf_b=leaves + 10, scalars=scalars,
        leaf_weight_a=torch.ones(count, 104), leaf_weight_b=torch.ones(count, 104),
        epid_prev=frame.clone(), epid_curr=frame,
    )


def test_metrics_of_hand_worked_errors():
    samples = hand_made_samples()
    leaf_a, leaf_b, scalars = samples.leaf_a.clone(), samples.leaf_b.clone(), samples.scalars.clone()
    leaf_a[0, 24] += 3.0  # prev, bank A, inside the band: 16 band values, 208 in all
    leaf_b[0, 52 + 40] -= 2.0  # curr, bank B, outside the band
    scalars[0] += torch.tensor([1.5, 2.0, 0.0, -1.0, 1.0])
    epid = samples.epid_curr.clone()
    epid[0, 0, 100:150, 90:170] = 5.1  # +2 %: passes 3 %/3 mm everywhere
    epid[1, 0, 120:130, 120:130] = 0.0  # a hole in the field fails there
    predictions = inference.Predictions(epid=epid, leaf_a=leaf_a, leaf_b=leaf_b, scalars=scalars)
    gamma = gamma_maps(samples.epid_curr, epid)
    first, second = inference.sample_metrics(samples, predictions, gamma)

    assert first.leaf_mae_band_mm == pytest.approx(3.0 / 16)
    assert first.leaf_mae_mm == pytest.approx(5.0 / 208)
    assert first.jaw_mae_mm == pytest.approx(1.0)
    assert first.mu_abs_error == pytest.approx(1.5)
    assert first.forward_mse == pytest.approx(0.1**2 * 50 * 80 / 256**2, rel=1e-4)
    assert first.forward_mae == pytest.approx(0.1 * 50 * 80 / 256**2, rel=1e-4)
    assert first.gamma_pass_percent == pytest.approx(100.0)
    assert first.curr_leaf_mae_band_mm == 0.0  # the curr leaf moved is outside the band
    assert first.mu_error_percent == pytest.approx(100 * 1.5 / float(samples.scalars[0, 0]))
    assert second.leaf_mae_band_mm == second.leaf_mae_mm == second.jaw_mae_mm == second.mu_abs_error == 0
    assert 0 < second.gamma_pass_percent < 100
    failing = float((gamma[1] > 1).sum())
    assert second.gamma_pass_percent == pytest.approx(100 * (1 - failing / (50 * 80)))


def test_jaw_band_follows_the_leaf_band_formula():
    jaw_1 = torch.tensor([-130.0, -127.0, -10.0, 0.1])
    jaw_2 = torch.tensor([130.0, -122.0, 10.0, 4.9])
    band = inference.jaw_band(jaw_1, jaw_2)
    for row in range(4):
        lo = math.ceil((130 + float(jaw_1[row])) / 5)
        hi = math.ceil((130 + float(jaw_2[row])) / 5)
        assert band[row].nonzero().flatten().tolist() == list(range(lo, hi))


def test_pattern_means_ignore_missing_values():
    records = [
        inference.SampleMetrics(0, "regular", 1, 90.0, 1.0, 2.0, 3.0, 4.0, 0.1, 0.2, 1.0, 5.0),
        inference.SampleMetrics(1, "regular", 1, math.nan, 3.0, 2.0, 3.0, 4.0, 0.3, 0.2, math.nan, 3.0),
        inference.SampleMetrics(200, "irregular", 1, 50.0, 5.0, 6.0, 7.0, 8.0, 0.5, 0.6, 2.0, 1.0),
    ]
    means = inference.pattern_means(records)
    assert list(means) == ["regular", "irregular", "all"]
    assert means["regular"]["gamma_pass_percent"] == 90.0
    assert means["regular"]["leaf_mae_band_mm"] == 2.0
    assert means["all"]["count"] == 3 and means["all"]["gamma_pass_percent"] == 70.0
    assert means["regular"]["curr_leaf_mae_band_mm"] == 1.0 and means["all"]["mu_error_percent"] == 3.0


def test_synthesis_settings_come_from_variables_then_checkpoint_then_defaults():
    trained = Config(control_points=66, noise_std=0.0, noise_seed=4).to_dict()
    del trained["noise_seed"]
    environ = {"EPID_NOISE_STD": "0.01"}
    settings = inference.resolve_synthesis(trained, load_config(environ), environ)
    assert (settings.control_points, settings.noise_std, settings.noise_seed, settings.kernel) == (66, 0.01, 0, "")
    assert settings.sources == {
        "control_points": "checkpoint", "kernel": "checkpoint", "noise_std": "EPID_NOISE_STD", "noise_seed": "default",
        "physics": "checkpoint", "mlc": "checkpoint",
    }
    assert settings.physics.is_ideal and settings.mlc.name == "legacy"
    assert "physics ideal (checkpoint)" in settings.describe()
    on_halcyon = Config(mlc="halcyon", mlc_geometry=MLC_GEOMETRIES["halcyon"]).to_dict()
    assert inference.resolve_synthesis(on_halcyon, load_config({}), {}).mlc is MLC_GEOMETRIES["halcyon"]
    chosen = inference.resolve_synthesis(on_halcyon, load_config({"EPID_MLC": "mlci2"}), {"EPID_MLC": "mlci2"})
    assert chosen.mlc is MLC_GEOMETRIES["mlci2"] and "MLC mlci2 (EPID_MLC)" in chosen.describe()
    missing = inference.SynthesisSettings(66, "gone/kernel.mat:k", 0.0, 0, dict(settings.sources))
    with pytest.raises(InputError, match="gone/kernel.mat"):
        inference.load_synthesis_kernel(missing)


def test_synthesis_physics_comes_from_the_variables_then_the_checkpoint_then_ideal():
    realistic = Config(lag_percent=3.0, leaf_transmission_percent=1.0).to_dict()
    from_checkpoint = inference.resolve_synthesis(realistic, load_config({}), {})
    assert from_checkpoint.physics == Physics(lag_percent=3.0, leaf_transmission_percent=1.0)
    assert from_checkpoint.sources["physics"] == "checkpoint"
    environ = {"EPID_PHYSICS": "realistic"}
    from_environment = inference.resolve_synthesis(realistic, load_config(environ), environ)
    assert (from_environment.physics, from_environment.sources["physics"]) == (PRESETS["realistic"], "EPID_PHYSICS")
    described = from_environment.describe()
    assert "physics leaf transmission 0.4 %, " in described
    assert described.endswith("lag 2 %, backscatter 5 % (EPID_PHYSICS)")
    environ = {"EPID_LAG_PERCENT": "1.5"}
    one_variable = inference.resolve_synthesis(realistic, load_config(environ), environ)
    assert (one_variable.physics, one_variable.sources["physics"]) == (Physics(lag_percent=1.5), "EPID_LAG_PERCENT")
    preset_only = inference.resolve_synthesis({"physics_preset": "realistic"}, load_config({}), {})
    assert (preset_only.physics, preset_only.sources["physics"]) == (PRESETS["realistic"], "checkpoint")
    from_before_the_physics = {key: value for key, value in realistic.items()
                               if key != "physics_preset" and key not in LIMITS}
    old = inference.resolve_synthesis(from_before_the_physics, load_config({}), {})
    assert (old.physics, old.sources["physics"]) == (Physics(), "default")


# --------------------------------------------------------------------------- the script


def read_summary(output):
    """The rows of an inference run's summary.csv."""
    with open(output / "summary.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_writes_one_readable_png_per_sample(inference_run):
    output, result = inference_run
    rows = read_summary(output)
    assert len(rows) == 2 * len(DATASET_IDS)
    sample_pngs = sorted(output.glob("dataset_*_sample_*.png"))
    assert [p.name for p in sample_pngs] == sorted(
        f"dataset_{int(r['dataset_id']):03d}_sample_{int(r['sample']):04d}.png" for r in rows
    )
    for path in sample_pngs:
        image = imread(path)
        assert image.shape[:2] == SAMPLE_PNG_SIZE
        assert_not_blank(image)
    for name in ("losses.png", "summary.png"):
        assert_not_blank(imread(output / name))
    assert "Mean per pattern" in result.stdout
    for pattern in ("regular", "semiregular", "irregular", "all"):
        assert any(line.startswith(pattern) for line in result.stdout.splitlines())
    assert "synthesis: 12 control points (checkpoint)" in result.stdout


def assert_not_blank(image: np.ndarray) -> None:
    assert float(image[..., :3].std()) > 0.05
    rgb = (image[..., :3].reshape(-1, 3) * 255).round().astype(np.uint32)
    colours = np.unique(rgb[:, 0] << 16 | rgb[:, 1] << 8 | rgb[:, 2])
    assert len(colours) > 50


def test_summary_matches_an_independent_computation(inference_run, checkpoint_path):
    output, _ = inference_run
    rows = read_summary(output)
    checkpoint = load_checkpoint(checkpoint_path)
    forward_model = ForwardModel(ForwardConfig(**checkpoint["model_config"]["forward"])).eval()
    inverse_model = InverseModel(InverseConfig(**checkpoint["model_config"]["inverse"])).eval()
    forward_model.load_state_dict(checkpoint["forward_model"])
    inverse_model.load_state_dict(checkpoint["inverse_model"])
    kernel = default_kernel()
    expected_refs = inference.select_samples(DATASET_IDS, 2, 0, N_CONTROL_POINTS)
    assert [(int(r["dataset_id"]), int(r["sample"])) for r in rows] == [(r.dataset_id, r.sample) for r in expected_refs]

    for row in rows:
        dataset_id, sample = int(row["dataset_id"]), int(row["sample"])
        assert row["pattern"] == pattern_for(dataset_id)
        cp = generate_control_points(dataset_id, N_CONTROL_POINTS)
        prev, curr = sample + 1, sample + 2
        frames = render_frames(cp, [prev, curr], kernel, dataset_id=dataset_id, noise_std=0.005, noise_seed=0)
        leaf_a = torch.tensor(np.concatenate([cp.leaf_a[prev], cp.leaf_a[curr]]), dtype=torch.float32)[None]
        leaf_b = torch.tensor(np.concatenate([cp.leaf_b[prev], cp.leaf_b[curr]]), dtype=torch.float32)[None]
        scalars = torch.tensor([[cp.mu[curr], cp.jaw_1[prev], cp.jaw_1[curr], cp.jaw_2[prev], cp.jaw_2[curr]]],
                               dtype=torch.float32)
        with torch.no_grad():
            epid, _ = forward_model(leaf_a, leaf_b, scalars)
            pred_a, pred_b, pred_scalars, _ = inverse_model(frames[0][None, None], frames[1][None, None])

        measured = frames[1]
        gamma = gamma_index(measured, epid[0, 0], dose_percent=60, distance_mm=4, lower_percent_cutoff=20)
        counted = ~torch.isnan(gamma)
        assert float(row["gamma_pass_percent"]) == pytest.approx(
            100 * float((gamma[counted] <= 1).sum()) / int(counted.sum()), abs=0.05)
        assert float(row["forward_mse"]) == pytest.approx(float(((epid[0, 0] - measured) ** 2).mean()), rel=1e-4)

        band_errors, all_errors = [], []
        for half, cp_index in enumerate((prev, curr)):
            lo = math.ceil((130 + float(cp.jaw_1[cp_index])) / 5)
            hi = math.ceil((130 + float(cp.jaw_2[cp_index])) / 5)
            for leaf in range(52):
                for target, predicted in ((cp.leaf_a, pred_a), (cp.leaf_b, pred_b)):
                    error = abs(float(predicted[0, 52 * half + leaf]) - float(target[cp_index, leaf]))
                    all_errors.append(error)
                    if lo <= leaf < hi:
                        band_errors.append(error)
        assert float(row["leaf_mae_band_mm"]) == pytest.approx(np.mean(band_errors), rel=1e-4)
        assert float(row["leaf_mae_mm"]) == pytest.approx(np.mean(all_errors), rel=1e-4)
        jaw_errors = [abs(float(pred_scalars[0, k]) - float(scalars[0, k])) for k in range(1, 5)]
        assert float(row["jaw_mae_mm"]) == pytest.approx(np.mean(jaw_errors), rel=1e-4)
        assert float(row["mu_abs_error"]) == pytest.approx(abs(float(pred_scalars[0, 0]) - cp.mu[curr]), rel=1e-4)
    rates = [float(r["gamma_pass_percent"]) for r in rows]
    assert 0 < min(rates) and max(rates) < 100


def test_runs_on_a_checkpoint_from_a_tiny_training_run(tmp_path):
    checkpoint = tmp_path / "run" / "epid.pth"
    training = clean_environment() | {
        "EPID_MODEL_SIZE": "tiny", "EPID_CONTROL_POINTS": str(N_CONTROL_POINTS), "EPID_EPOCHS": "1",
        "EPID_DATASET_IDS": "0,200", "EPID_STEPS_PER_EPOCH": "1", "EPID_BATCH_SIZE": "4",
        "EPID_GAMMA_SAMPLES": "1", "EPID_PRECISION": "fp32", "EPID_DEVICE": "cpu", "EPID_PROGRESS": "0",
        "EPID_THREADS": "1",
        "EPID_CHECKPOINT_PATH": str(checkpoint),
    }
    trained = subprocess.run([sys.executable, str(ROOT / "generate_and_train.py")], check=False, capture_output=True,
                             text=True, env=training, timeout=300)
    assert trained.returncode == 0, trained.stderr
    output = tmp_path / "out"
    command = [sys.executable, str(SCRIPT), "--checkpoint", str(checkpoint), "--samples-per-dataset", "1",
               "--device", "cpu", "--output-dir", str(output)]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=clean_environment(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "synthesis: 12 control points (checkpoint)" in result.stdout
    rows = read_summary(output)
    assert [(int(r["dataset_id"]), r["pattern"]) for r in rows] == [(0, "regular"), (200, "irregular")]
    assert all(math.isfinite(float(r[name])) for r in rows for name in inference.METRIC_NAMES)
    assert len(list(output.glob("dataset_*_sample_*.png"))) == 2
    assert_not_blank(imread(output / "losses.png"))


# --------------------------------------------------------------------------- bad input


def run_main_expecting(args: list[str], match: str) -> None:
    with pytest.raises(InputError, match=match):
        inference_visualize.main(args)


def test_missing_checkpoint_is_named(tmp_path):
    run_main_expecting(["--checkpoint", str(tmp_path / "absent.pth"), "--output-dir", str(tmp_path)],
                       r"--checkpoint .*absent\.pth.*no such file")


def test_incompatible_checkpoint_is_named(tmp_path):
    forward_model, inverse_model = build_models("tiny", "legacy")
    payload = checkpoint_payload(forward_model, inverse_model)
    payload["model_config"]["forward"]["d_model"] *= 2
    save_checkpoint(tmp_path / "other.pth", payload)
    run_main_expecting(["--checkpoint", str(tmp_path / "other.pth"), "--output-dir", str(tmp_path)],
                       r"other\.pth.*does not match")
    torch.save({"weights": torch.zeros(3)}, tmp_path / "foreign.pth")
    run_main_expecting(["--checkpoint", str(tmp_path / "foreign.pth"), "--output-dir", str(tmp_path)],
                       r"foreign\.pth.*not an epid training checkpoint")


def test_bad_dataset_selection_is_named(checkpoint_path, tmp_path, monkeypatch):
    run_main_expecting(["--checkpoint", str(checkpoint_path), "--dataset-range", "600:700",
                        "--output-dir", str(tmp_path)], r"--dataset-range '600:700'.*outside")
    run_main_expecting(["--checkpoint", str(checkpoint_path), "--dataset-ids", "1,x",
                        "--output-dir", str(tmp_path)], r"--dataset-ids '1,x'")


def test_unwritable_output_dir_is_named(checkpoint_path, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    run_main_expecting(["--checkpoint", str(checkpoint_path), "--output-dir", str(blocker / "out")],
                       r"--output-dir .*file\.txt/out.*cannot write")


def test_help_lists_the_arguments():
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=False, capture_output=True, text=True,
                            env=clean_environment(), timeout=60)
    assert result.returncode == 0
    for option in ("--checkpoint", "--dataset-range", "--dataset-ids", "--samples-per-dataset",
                   "--max-total-samples", "--seed", "--device", "--output-dir", "--gamma-dose-percent",
                   "--gamma-distance-mm", "--gamma-cutoff-percent", "--gamma-local"):
        assert option in result.stdout
    assert "EPID_CHECKPOINT_PATH" in result.stdout and "EPID_CONTROL_POINTS" in result.stdout


def test_bad_input_exits_2_with_one_line(tmp_path):
    command = [sys.executable, str(SCRIPT), "--checkpoint", str(tmp_path / "absent.pth"),
               "--output-dir", str(tmp_path / "out")]
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=clean_environment(), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (
            f"inference_visualize.py: error: --checkpoint {str(tmp_path / 'absent.pth')!r}: "
            "no such file (train first, or pass --checkpoint)"
        )
    ]


def test_a_plan_on_another_mlc_than_the_checkpoints_is_refused_naming_both(tmp_path):
    from epid.dicom.plan import read_plan
    from tests.dicom.test_plan_and_image import hand_plan, random_leaves, saved

    boundaries = np.linspace(-200, 200, 41)  # MLCi2
    (beam,) = read_plan(saved(tmp_path, hand_plan(boundaries, *random_leaves(np.random.default_rng(1), 2, 40)),
                              "mlci2.dcm"))
    on_halcyon = Config(mlc="halcyon", mlc_geometry=MLC_GEOMETRIES["halcyon"]).to_dict()
    with pytest.raises(InputError) as caught:
        inference.check_plan_mlc(beam, on_halcyon, "halcyon.pth")
    message = str(caught.value)
    assert "\n" not in message and "mlci2.dcm: beam 1 is on mlci2" in message and "trained on halcyon" in message
    inference.check_plan_mlc(beam, Config(mlc="mlci2", mlc_geometry=MLC_GEOMETRIES["mlci2"]).to_dict(), "m.pth")
    inference.check_plan_mlc(beam, Config().to_dict(), "legacy.pth")  # the legacy grid takes any MLC's strips
    inference.check_plan_mlc(beam, {}, "old.pth")  # a checkpoint from before MLCs were named: the legacy grid


def test_estimates_are_reported_on_the_mlc_the_samples_were_synthesised_on():
    from epid.synthesis.mlc import LEGACY_GRID, MLC_GEOMETRIES

    gen = torch.Generator().manual_seed(2)
    leaf_a = -20.0 + 2.0 * torch.randn(3, 52, generator=gen)
    leaf_b = leaf_a + 30.0
    jaws = torch.tensor([[-40.3, 45.1]]).repeat(3, 1)

    same = inference.reported_by_mlc(leaf_a, leaf_b, jaws, LEGACY_GRID)
    assert all(value is given for value, given in zip(same, (leaf_a, leaf_b, jaws), strict=True))

    mlci2 = inference.reported_by_mlc(leaf_a, leaf_b, jaws, MLC_GEOMETRIES["mlci2"])
    # 40 x 10 mm from -200 mm: strips 2k and 2k + 1 (y from -130 + 10 k) lie in one leaf, one position
    torch.testing.assert_close(mlci2[0][:, 0::2], (leaf_a[:, 0::2] + leaf_a[:, 1::2]) / 2)
    torch.testing.assert_close(mlci2[0][:, 1::2], mlci2[0][:, 0::2])
    torch.testing.assert_close(mlci2[1][:, 1::2], (leaf_b[:, 0::2] + leaf_b[:, 1::2]) / 2)
    assert mlci2[2] is jaws

    halcyon = inference.reported_by_mlc(leaf_a, leaf_b, jaws, MLC_GEOMETRIES["halcyon"])
    torch.testing.assert_close(halcyon[0], leaf_a)  # a dual layer's strips are its edges already
    torch.testing.assert_close(halcyon[2], torch.tensor([[-130.0, 130.0]]).repeat(3, 1))  # no jaws: open
    samples = inference.SampleSet([], *(torch.zeros(0) for _ in inference.BATCH_FIELDS), mlc=MLC_GEOMETRIES["halcyon"])
    assert samples.subset([]).mlc is MLC_GEOMETRIES["halcyon"]
