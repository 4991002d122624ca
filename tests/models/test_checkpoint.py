"""Checkpoints written in format 1, before model configs named their family, still load,
rebuild their models and resume training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from epid.models.checkpoint import FORMAT_VERSION, build_models_from_checkpoint, load_checkpoint
from epid.models.families import CrossModel, build_models
from tests.models.test_legacy import training_batch
from tests.support import ROOT, clean_environment

TINY_FORWARD_KWARGS = {"d_model": 16, "num_heads": 2, "ff_dim": 32, "num_layers": 1, "unet_widths": [4, 8, 16],
                       "bottleneck_width": 32, "upsample_widths": [4, 4]}
TINY_INVERSE_KWARGS = {"unet_widths": [4, 8, 16], "bottleneck_width": 32, "d_model": 16, "num_heads": 2, "ff_dim": 32,
                       "num_encoder_layers": 1, "num_decoder_layers": 1, "patch_size": 4}
TERMS = ("total", "forward", "leaf_a", "leaf_b", "scalars", "ordering", "consistency", "latent")


def format_1_checkpoint(path: Path, model: CrossModel, interrupted: dict | None = None) -> None:
    """A checkpoint in the layout format 1 wrote after 2 epochs of a single-rank run: model
    configs as constructor keyword arguments, the optimizer of one AdamW step and the state
    of the LambdaLR scheduler it stepped once per epoch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
    for parameter in model.parameters():
        parameter.grad = torch.full_like(parameter, 1e-3)
    optimizer.step()
    scheduler.step()
    scheduler.step()
    history = {"train": {term: [2.0, 1.5] for term in TERMS}, "val": {term: [2.5, 2.0] for term in TERMS},
               "gamma_pass": [10.0, 20.0], "lr": [1e-4, 1e-4], "samples_per_s": [5.0, 5.0], "epoch_s": [1.0, 1.0],
               "elapsed_s": [1.0, 2.0], "steps": [2, 2], "nonfinite_steps": [0, 0], "world_size": [1, 1],
               "steps_per_rank": [[2], [2]]}
    torch.save({
        "format_version": 1, "run_id": "format-1-run", "epoch": 2,
        "forward_model": model.forward_model.state_dict(), "inverse_model": model.inverse_model.state_dict(),
        "model_config": {"forward": TINY_FORWARD_KWARGS, "inverse": TINY_INVERSE_KWARGS},
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "scaler": None,
        "rng": {"torch": torch.get_rng_state(), "cuda": [], "numpy": ["MT19937", torch.zeros(624, dtype=torch.int64),
                                                                      0, 0, 0.0], "python": [3, [0] * 625, None]},
        "history": history, "best_val_loss": 2.0, "best_epoch": 2,
        "config": {"model_size": "tiny", "control_points": 12, "batch_size": 4, "grad_accum": 1, "lr": 1e-4,
                   "epochs": 2, "dataset_ids": [0, 80]},
        "dataset_ids": [0, 80], "world_size": 1, "torch_version": str(torch.__version__), "interrupted": interrupted,
    }, path)


@pytest.fixture
def tiny_model() -> CrossModel:
    torch.manual_seed(0)
    return CrossModel(*build_models("tiny", "legacy"))


def test_a_format_1_checkpoint_loads_as_the_current_format_and_rebuilds_its_models(tmp_path, tiny_model):
    path = tmp_path / "old.pth"
    interrupted = {"epoch": 3, "batches_done": 1, "train_sums": [1.0] * len(TERMS), "train_samples": 4.0,
                   "train_seconds": 0.5, "nonfinite_steps": 0, "plan": {}}
    format_1_checkpoint(path, tiny_model, interrupted)
    checkpoint = load_checkpoint(path)
    assert checkpoint["format_version"] == FORMAT_VERSION
    assert checkpoint["model_config"] == {"family": "legacy", "forward": TINY_FORWARD_KWARGS,
                                          "inverse": TINY_INVERSE_KWARGS}
    assert checkpoint["interrupted"]["rank_train_sums"] == [[1.0] * len(TERMS)]
    assert checkpoint["interrupted"]["rank_train_samples"] == [4.0]
    forward_model, inverse_model = build_models_from_checkpoint(checkpoint)
    assert forward_model.config == tiny_model.forward_model.config
    assert inverse_model.config == tiny_model.inverse_model.config
    batch = training_batch(2)
    tiny_model.eval()
    with torch.no_grad():
        want = tiny_model(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
        got = (forward_model(batch.leaf_a, batch.leaf_b, batch.scalars),
               inverse_model(batch.epid_prev, batch.epid_curr))
    for want_part, got_part in zip(want, got, strict=True):
        for want_tensor, got_tensor in zip(want_part, got_part, strict=True):
            assert torch.equal(want_tensor, got_tensor)


def test_training_resumes_from_a_format_1_checkpoint(tmp_path, tiny_model):
    path = tmp_path / "epid.pth"
    format_1_checkpoint(path, tiny_model)
    before = torch.load(path, weights_only=True)
    env = clean_environment(EPID_CHECKPOINT_PATH=str(path), EPID_RESUME="1", EPID_EPOCHS="3", EPID_MODEL="legacy",
                            EPID_MODEL_SIZE="tiny",
                            EPID_CONTROL_POINTS="12", EPID_DATASET_IDS="0,80", EPID_BATCH_SIZE="4",
                            EPID_STEPS_PER_EPOCH="2", EPID_GAMMA_SAMPLES="0", EPID_THREADS="1", EPID_DEVICE="cpu",
                            EPID_PROGRESS="0")
    result = subprocess.run([sys.executable, str(ROOT / "generate_and_train.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Resuming" in result.stdout and "after epoch 2 (run format-1-run)" in result.stdout
    resumed = torch.load(path, weights_only=True)
    assert resumed["format_version"] == FORMAT_VERSION and resumed["epoch"] == 3
    assert resumed["run_id"] == "format-1-run" and resumed["model_config"]["family"] == "legacy"
    assert resumed["history"]["train"]["total"][:2] == before["history"]["train"]["total"]
    assert len(resumed["history"]["train"]["total"]) == 3
    steps = {int(state["step"]) for state in resumed["optimizer"]["state"].values()}
    assert steps == {1 + 2}  # the old run's step, then this epoch's two
