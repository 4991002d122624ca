"""compare_checkpoints.py and epid.evaluation.compare: history summaries, weight and config diffs,
evaluation on shared samples, rankings, output files and failure handling."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from scipy import stats

import compare_checkpoints
from epid.config.load import Config
from epid.core.cli import run_main
from epid.evaluation import compare, compare_report, histories, inference, weights_diff
from epid.evaluation.compare import CompareOptions
from epid.models.checkpoint import FORMAT_VERSION, build_models_from_checkpoint, load_checkpoint, save_checkpoint
from epid.models.families import PairConfig, build_models
from epid.models.legacy import SIZES, ForwardModel, InverseModel
from epid.reconstruction import estimate
from epid.synthesis.physics import LIMITS, PRESETS, Physics
from tests.support import ROOT, clean_environment

SCRIPT = ROOT / "compare_checkpoints.py"
N_CONTROL_POINTS = 12  # 10 samples per arc: 8 train, 2 validation
EVAL_ARGS = {"dataset_ids": "0,80,200", "samples_per_dataset": 2, "gamma_samples": 4}
LOSS_TERMS = ("total", "forward", "leaf_a", "leaf_b", "scalars", "ordering", "consistency", "latent")




def history(val: list[float], train: list[float] | None = None, gamma: list[float] | None = None) -> dict:
    train = train if train is not None else [v * 0.9 for v in val]
    return {
        "train": {term: list(train) for term in LOSS_TERMS},
        "val": {term: list(val) for term in LOSS_TERMS},
        "gamma_pass": list(gamma) if gamma is not None else [],
        "lr": [1e-4] * len(val),
        "samples_per_s": [50.0] * len(val),
    }


def write_checkpoint(path: Path, models: tuple[ForwardModel, InverseModel], *, prefix: str = "",
                     val: list[float] = (1.0, 0.8, 0.7), **config_values) -> Path:
    """A checkpoint in the training format, with state-dict keys behind ``prefix``."""
    forward_model, inverse_model = models
    config = Config(control_points=N_CONTROL_POINTS, model_size="tiny", dataset_ids=(0, 1),
                    checkpoint_path=str(path), **config_values)
    save_checkpoint(path, {
        "format_version": FORMAT_VERSION, "run_id": path.stem, "epoch": len(val),
        "forward_model": {prefix + k: v for k, v in forward_model.state_dict().items()},
        "inverse_model": {prefix + k: v for k, v in inverse_model.state_dict().items()},
        "model_config": PairConfig.of(forward_model, inverse_model).to_dict(),
        "optimizer": {}, "schedule": {}, "scaler": None, "rng": {},
        "history": history(list(val), gamma=[30.0 + 5 * k for k in range(len(val))]),
        "best_val_loss": min(val), "best_epoch": int(np.argmin(val)) + 1,
        "config": config.to_dict(), "dataset_ids": [0, 1], "world_size": 1, "torch_version": str(torch.__version__),
    })
    return path


def tiny_models(seed: int) -> tuple[ForwardModel, InverseModel]:
    torch.manual_seed(seed)
    return build_models("tiny", "legacy")


def start_tiny_training(directory: Path, **variables: str) -> subprocess.Popen:
    """Start a real two-epoch training run of tiny models on two short arcs, writing
    ``directory/epid.pth``."""
    directory.mkdir()
    environ = clean_environment() | {
        "EPID_MODEL_SIZE": "tiny", "EPID_CONTROL_POINTS": str(N_CONTROL_POINTS), "EPID_EPOCHS": "2",
        "EPID_DATASET_IDS": "0,1", "EPID_STEPS_PER_EPOCH": "2", "EPID_GAMMA_SAMPLES": "2",
        "EPID_PROGRESS": "0", "EPID_THREADS": "1", "EPID_CHECKPOINT_PATH": str(directory / "epid.pth"), **variables,
    }
    return subprocess.Popen([sys.executable, str(ROOT / "generate_and_train.py")], env=environ, cwd=directory,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Two trained runs (in parallel) with different learning rate and batch size, and a byte
    copy of the first."""
    base = tmp_path_factory.mktemp("runs")
    processes = {
        "a": start_tiny_training(base / "run_a", EPID_LR="1e-3", EPID_BATCH_SIZE="4"),
        "b": start_tiny_training(base / "run_b", EPID_LR="3e-4", EPID_BATCH_SIZE="2"),
    }
    for process in processes.values():
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    paths = {key: base / f"run_{key}" / "epid.pth" for key in processes}
    paths["a_copy"] = base / "run_a_copy.pth"
    shutil.copyfile(paths["a"], paths["a_copy"])
    return paths


@pytest.fixture(scope="module")
def evaluated(runs, tmp_path_factory) -> dict:
    """comparison.json of A, B and the copy of A, with evaluation."""
    output = tmp_path_factory.mktemp("evaluated")
    options = CompareOptions([str(runs["a"]), str(runs["b"]), str(runs["a_copy"])], output_dir=str(output),
                             device="cpu", **EVAL_ARGS)
    assert compare.compare(options) == 0
    report = json.loads((output / "comparison.json").read_text())
    report["output_dir"] = output
    return report


def names_of(report: dict) -> list[str]:
    return [entry["name"] for entry in report["checkpoints"]]


# --------------------------------------------------------------------------- pure pieces


def test_rank_orders_by_direction_shares_ties_and_skips_nan():
    values = {"a": 0.3, "b": 0.1, "c": 0.3, "d": math.nan}
    assert compare_report.rank(values, "lower") == {"a": 2, "b": 1, "c": 2, "d": None}
    assert compare_report.rank(values, "higher") == {"a": 1, "b": 3, "c": 1, "d": None}


def test_history_summary_against_hand_computation():
    val = [3.0, 2.0, 2.5, 1.5, 1.7, 1.6]
    train = [2.0, 1.5, 1.2, 1.0, 0.9, 0.8]
    payload = {"history": history(val, train, gamma=[10.0, 20.0, 25.0, 30.0, 40.0, 45.0])}
    summary = histories.summarize_history(payload, common_epochs=4, tail=3)
    fit = stats.linregress(np.arange(3), val[-3:])
    assert summary["epochs"] == 6
    assert summary["last_train_loss"] == 0.8 and summary["last_val_loss"] == 1.6
    assert summary["best_val_loss"] == 1.5 and summary["best_epoch"] == 4
    assert summary["train_val_gap"] == pytest.approx(1.6 - 0.8)
    assert summary["mean_val_common"] == pytest.approx((3.0 + 2.0 + 2.5 + 1.5) / 4)
    assert summary["mean_val_tail"] == pytest.approx((1.5 + 1.7 + 1.6) / 3)
    assert summary["slope_val_tail"] == pytest.approx(fit.slope)
    assert summary["last_gamma_pass"] == 45.0


def test_history_summary_ignores_non_finite_epochs_and_empty_histories():
    summary = histories.summarize_history({"history": history([2.0, math.nan, 1.0, math.inf])}, 4, 4)
    assert summary["best_val_loss"] == 1.0 and summary["best_epoch"] == 3
    assert summary["mean_val_common"] == pytest.approx(1.5)
    empty = histories.summarize_history({"history": {}}, 0, 5)
    assert empty["epochs"] == 0 and math.isnan(empty["best_val_loss"]) and math.isnan(empty["slope_val_tail"])


def test_weight_delta_matches_direct_computation():
    torch.manual_seed(1)
    a, b = torch.randn(5, 7), torch.randn(5, 7)
    delta = weights_diff.WeightDelta.of(a, b)
    assert delta.l2_difference == pytest.approx(float(np.linalg.norm((b - a).numpy())), rel=1e-6)
    assert delta.relative_change == pytest.approx(float(np.linalg.norm((b - a).numpy()) / np.linalg.norm(a.numpy())),
                                                  rel=1e-6)
    cosine = float(np.dot(a.flatten().numpy(), b.flatten().numpy())
                   / np.linalg.norm(a.numpy()) / np.linalg.norm(b.numpy()))
    assert delta.cosine == pytest.approx(cosine, rel=1e-6)
    zeros = weights_diff.WeightDelta.of(torch.zeros(3), torch.zeros(3))
    assert (zeros.l2_difference, zeros.relative_change, zeros.cosine) == (0.0, 0.0, 1.0)


def test_display_names_are_short_and_unique():
    assert compare.display_names(["x/run_a/epid.pth", "x/run_b/epid.pth"]) == ["run_a/epid.pth", "run_b/epid.pth"]
    assert compare.display_names(["x/a.pth", "y/b.pth"]) == ["a.pth", "b.pth"]


# --------------------------------------------------------------------------- diff of trained runs


def test_diff_reports_changed_config_keys_and_weights(runs, evaluated):
    differences = evaluated["config_differences"]
    a, b, a_copy = names_of(evaluated)
    assert differences["lr"][a] == 1e-3 and differences["lr"][b] == 3e-4
    assert differences["batch_size"][a] == 4 and differences["batch_size"][b] == 2
    assert differences["global_batch"][a] == 4 and differences["effective_lr"][b] == 3e-4
    assert "model_size" not in differences and "control_points" not in differences

    diff_b, diff_copy = evaluated["weight_diff"]
    assert (diff_b["reference"], diff_b["other"], diff_copy["other"]) == (a, b, a_copy)
    state_a = load_checkpoint(runs["a"])["forward_model"]
    state_b = load_checkpoint(runs["b"])["forward_model"]
    expected = {name: float(np.linalg.norm(state_b[name].double().numpy() - state_a[name].double().numpy()))
                for name in state_a}
    reported = {t["name"]: t["l2_difference"] for t in diff_b["tensors"] if t["model"] == "forward"}
    assert reported == pytest.approx(expected, rel=1e-9)
    module_sq: dict[str, float] = {}
    for name, value in expected.items():
        module = "forward." + name.split(".")[0]
        module_sq[module] = module_sq.get(module, 0.0) + value**2
    for module, total in module_sq.items():
        assert diff_b["modules"][module]["l2_difference"] == pytest.approx(math.sqrt(total), rel=1e-9)
    for model in ("forward", "inverse"):
        assert diff_b["models"][model]["l2_difference"] > 0
        assert 0 < diff_b["models"][model]["relative_change"]
        assert diff_b["models"][model]["cosine"] < 1
    assert diff_b["unmatched"] == []


def test_the_precision_a_run_trained_in_is_compared_where_its_checkpoint_records_it(runs):
    recorded = load_checkpoint(runs["a"])["precision"]["name"]
    assert compare.config_fields(load_checkpoint(runs["a"]))["precision_trained"] == recorded
    payload = {"config": {}, "precision": {"name": "bf16", "cpu": "a CPU", "cpu_features": "AVX2"}}
    assert compare.config_fields(payload)["precision_trained"] == "bf16"
    assert "precision_trained" not in compare.config_fields({"config": {}})


def test_checkpoint_against_itself_has_zero_difference_and_identical_metrics(evaluated):
    a, _, a_copy = names_of(evaluated)
    diff_copy = evaluated["weight_diff"][1]
    for model in ("forward", "inverse"):
        assert diff_copy["models"][model]["l2_difference"] == 0
        assert diff_copy["models"][model]["relative_change"] == 0
        assert diff_copy["models"][model]["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert all(t["l2_difference"] == 0 for t in diff_copy["tensors"])
    differences = evaluated["config_differences"]
    assert differences, "A and B were trained differently"
    assert all(values[a] == values[a_copy] for values in differences.values())
    metrics = evaluated["evaluation"]["metrics"]
    assert metrics[a] == metrics[a_copy]
    assert evaluated["history"][a] == evaluated["history"][a_copy]


def test_evaluation_metrics_match_a_per_sample_reference_loop(runs, evaluated):
    """Forward MSE/MAE and the pair-refined inverse leaf MAE recomputed sample by sample, unbatched."""
    a = names_of(evaluated)[0]
    report = evaluated["evaluation"]
    refs = [inference.SampleRef(s["dataset_id"], s["sample"], s["pattern"]) for s in report["samples"]]
    assert len(refs) == 6 and {r.pattern for r in refs} == {"regular", "semiregular", "irregular"}
    assert report["gamma_samples"] == 4
    assert report["reconstruction"] == dict.fromkeys(names_of(evaluated), "pair")
    settings = inference.SynthesisSettings(N_CONTROL_POINTS, "", 0.005, 0, {})
    samples = inference.synthesise_samples(refs, settings, inference.load_synthesis_kernel(
        inference.SynthesisSettings(N_CONTROL_POINTS, "", 0.005, 0, {"kernel": "default"})))
    forward_model, inverse_model = build_models_from_checkpoint(load_checkpoint(runs["a"]))
    mse, mae, leaf = [], [], []
    with torch.no_grad():
        for i in range(len(refs)):
            frame, _ = forward_model(samples.leaf_a[i:i + 1], samples.leaf_b[i:i + 1], samples.scalars[i:i + 1])
            error = (frame - samples.epid_curr[i:i + 1]).double()
            mse.append(float(error.square().mean()))
            mae.append(float(error.abs().mean()))
            leaf_a, leaf_b, _ = estimate.pair_estimate(forward_model.eval(), inverse_model.eval(),
                                                       samples.epid_prev[i:i + 1], samples.epid_curr[i:i + 1])
            leaf.append(float(torch.cat([leaf_a - samples.leaf_a[i], leaf_b - samples.leaf_b[i]], 1).abs().mean()))
    overall = report["metrics"][a]["all"]
    assert overall["forward_mse"] == pytest.approx(np.mean(mse), rel=1e-4)
    assert overall["forward_mae"] == pytest.approx(np.mean(mae), rel=1e-4)
    assert overall["leaf_mae_mm"] == pytest.approx(np.mean(leaf), rel=1e-4)
    regular = [i for i, r in enumerate(refs) if r.pattern == "regular"]
    assert report["metrics"][a]["regular"]["forward_mse"] == pytest.approx(np.mean([mse[i] for i in regular]), rel=1e-4)



def test_checkpoints_trained_under_other_physics_are_noted_unless_a_variable_chooses(monkeypatch):
    def loaded(name, **config_values):
        return compare.LoadedCheckpoint(name, f"{name}.pth", {"config": Config(**config_values).to_dict()})

    realistic = {field: getattr(PRESETS["realistic"], field) for field in LIMITS}
    first, second = loaded("first", lag_percent=3.0), loaded("second", **realistic)
    settings, notes = compare.synthesis_settings([first, second])
    assert (settings.physics, settings.sources["physics"]) == (Physics(lag_percent=3.0), "checkpoint")
    assert notes == ["second was trained with physics " + PRESETS["realistic"].describe() + "; all checkpoints are "
                     "evaluated with lag 3 % (set EPID_PHYSICS or the physics variables to choose)"]
    monkeypatch.setenv("EPID_PHYSICS", "realistic")
    settings, notes = compare.synthesis_settings([first, second])
    assert (settings.physics, settings.sources["physics"]) == (PRESETS["realistic"], "EPID_PHYSICS")
    assert notes == []  # a variable that is set chooses for every checkpoint


def test_rankings_match_the_numbers_in_comparison_json(evaluated):
    ranked = evaluated["rankings"]
    assert ranked["history.best_val_loss"]["better"] == "lower"
    assert ranked["evaluation.gamma_pass_percent"]["better"] == "higher"
    assert ranked["evaluation.gamma_pass_p5"]["better"] == "higher"
    assert {"history.last_val_loss", "evaluation.forward_mse", "evaluation.leaf_mae_band_mm"} <= set(ranked)
    for key, entry in ranked.items():
        section, column = key.split(".", 1)
        if section == "history":
            values = {name: row[column] for name, row in evaluated["history"].items()}
        else:
            values = {name: groups["all"][column] for name, groups in evaluated["evaluation"]["metrics"].items()}
        assert entry["values"] == values
        sign = -1 if entry["better"] == "higher" else 1
        for name, position in entry["ranks"].items():
            better_ones = [other for other, value in values.items() if sign * value < sign * values[name]]
            assert position == len(better_ones) + 1, (key, name)


def test_csv_has_one_row_per_checkpoint_with_the_json_values(evaluated):
    with open(evaluated["output_dir"] / "comparison.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["name"] for row in rows] == names_of(evaluated)
    for row in rows:
        name = row["name"]
        assert float(row["best_val_loss"]) == pytest.approx(evaluated["history"][name]["best_val_loss"])
        metrics = evaluated["evaluation"]["metrics"][name]
        assert float(row["forward_mse_irregular"]) == pytest.approx(metrics["irregular"]["forward_mse"])
        assert int(row["rank_best_val_loss"]) == evaluated["rankings"]["history.best_val_loss"]["ranks"][name]


def test_pngs_decode_and_are_not_blank(evaluated):
    for name in ("histories.png", "metrics.png"):
        image = imread(evaluated["output_dir"] / name)
        assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
        gray = image[..., :3].mean(axis=2)
        assert gray.std() > 0.05
        assert (gray < 0.9).mean() > 0.02  # lines, bars and text, not an empty canvas


# --------------------------------------------------------------------------- unusual checkpoints


def test_module_prefixed_states_compare_to_zero_difference(tmp_path):
    models = tiny_models(0)
    plain = write_checkpoint(tmp_path / "plain.pth", models)
    wrapped = write_checkpoint(tmp_path / "wrapped.pth", models, prefix="module.")
    assert next(iter(torch.load(wrapped, weights_only=True)["forward_model"])).startswith("module.")
    options = CompareOptions([str(plain), str(wrapped)], output_dir=str(tmp_path / "out"), evaluate=False)
    assert compare.compare(options) == 0
    report = json.loads((tmp_path / "out" / "comparison.json").read_text())
    diff = report["weight_diff"][0]
    assert diff["unmatched"] == []
    assert all(delta["l2_difference"] == 0 for delta in diff["models"].values())
    assert set(report["config_differences"]) == {"checkpoint_path"}


def test_different_architectures_list_missing_and_mismatched_tensors(tmp_path):
    tiny_forward, tiny_inverse = SIZES["tiny"]
    torch.manual_seed(0)
    deeper = (ForwardModel(replace(tiny_forward, num_layers=2)), InverseModel(tiny_inverse))
    reference = write_checkpoint(tmp_path / "tiny.pth", tiny_models(0))
    other = write_checkpoint(tmp_path / "deeper.pth", deeper)
    widened = (ForwardModel(replace(tiny_forward, bottleneck_width=48)), InverseModel(tiny_inverse))
    third = write_checkpoint(tmp_path / "wider.pth", widened)
    compare.compare(CompareOptions([str(reference), str(other), str(third)], output_dir=str(tmp_path / "out"),
                                   evaluate=False))
    report = json.loads((tmp_path / "out" / "comparison.json").read_text())
    deeper_diff, wider_diff = report["weight_diff"]
    missing = {t["name"] for t in deeper_diff["unmatched"]}
    assert missing == {k for k in deeper[0].state_dict() if k.startswith("layers.1.")}
    assert {t["status"] for t in deeper_diff["unmatched"]} == {"missing in reference"}
    mismatched = {t["name"]: (t["reference_shape"], t["other_shape"]) for t in wider_diff["unmatched"]}
    assert mismatched["bottleneck.conv1.weight"] == ([32, 16, 3, 3], [48, 16, 3, 3])
    assert {t["status"] for t in wider_diff["unmatched"]} == {"shape mismatch"}
    assert report["config_differences"]["model.forward.num_layers"] == {"tiny.pth": 1, "deeper.pth": 2, "wider.pth": 1}


def test_corrupt_and_unbuildable_checkpoints_are_reported_and_the_rest_compared(tmp_path):
    good_a = write_checkpoint(tmp_path / "a.pth", tiny_models(0), val=[1.0, 0.6])
    write_checkpoint(tmp_path / "b.pth", tiny_models(1), val=[1.0, 0.5, 0.4])
    (tmp_path / "corrupt.pth").write_bytes(b"PK\x03\x04 this is not a checkpoint")
    broken = torch.load(good_a, weights_only=True)
    broken["model_config"]["inverse"]["bottleneck_width"] = 64
    torch.save(broken, tmp_path / "broken.pth")
    output = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "*.pth"), "--no-eval", "--output-dir", str(output)],
        check=False, env=clean_environment(), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "corrupt.pth" in result.stdout and "broken.pth" in result.stdout
    report = json.loads((output / "comparison.json").read_text())
    status = {entry["name"]: entry for entry in report["checkpoints"]}
    assert status["corrupt.pth"]["status"] == "failed" and "corrupt.pth" in status["corrupt.pth"]["reason"]
    assert status["broken.pth"]["status"] == "failed" and status["broken.pth"]["reason"]
    assert f"not compared: broken.pth: {status['broken.pth']['reason']}" in result.stdout
    assert set(report["history"]) == {"a.pth", "b.pth"}
    assert report["rankings"]["history.best_val_loss"]["ranks"] == {"a.pth": 2, "b.pth": 1}
    assert report["settings"]["common_epochs"] == 2
    assert report["history"]["b.pth"]["mean_val_common"] == pytest.approx(0.75)
    assert (output / "histories.png").is_file() and not (output / "metrics.png").exists()


@pytest.mark.parametrize("arguments, message", [
    (["missing_*.pth"], "no checkpoint file matches"),
    (["{a}", "--dataset-range", "0:640:0"], "step cannot be 0"),
    (["{a}", "--dataset-ids", "0,700"], "outside 0..639"),
    (["{a}", "--output-dir", "{a}"], "cannot write there"),
    (["{a}", "--samples-per-dataset", "0"], "below 1"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, monkeypatch, capsys, arguments, message):
    a = write_checkpoint(tmp_path / "a.pth", tiny_models(0))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["compare_checkpoints.py", *(arg.format(a=a) for arg in arguments)])
    with pytest.raises(SystemExit) as exit_info:
        run_main(compare_checkpoints.main, "compare_checkpoints.py")
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert message in errors[-1] and errors[-1].startswith("compare_checkpoints.py: error:")
    assert not (tmp_path / "comparison_output").exists()
