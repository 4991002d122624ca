"""What training promises, measured on real runs of ``generate_and_train.py``.

* Exact resume: a run stopped at an epoch boundary, resumed, stopped by SIGTERM inside an
  epoch and resumed again ends with the same weights, optimizer, schedule, gradient scaler,
  random generator states and history, bit for bit, as the same run done in one go; on one
  rank and on two gloo ranks. EPID_LR_SCALING and EPID_WARMUP_EPOCHS set the optimizer's
  learning rate on the way, the warm-up going on where it was after each resume.
* EPID_GRAD_ACCUM=k gives the update of one k times larger batch.
* On two gloo ranks: a non-finite loss on one rank skips the step on both; early stopping
  decided on rank 0 stops both.

Runs use the tiny model preset on short arcs: 66 control points give 52 training and 12
validation samples per dataset.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from epid.config.load import load_config
from epid.data import dataset
from epid.models import losses
from epid.models.checkpoint import best_path, load_checkpoint
from epid.training.distributed import RankContext, free_port, launch
from tests.support import ROOT, TINY_RUN, clean_environment

SCRIPT = ROOT / "generate_and_train.py"
SHORT_ARCS = {**TINY_RUN, "EPID_CONTROL_POINTS": "66", "EPID_DATASET_IDS": "0,80", "EPID_BATCH_SIZE": "2",
              "EPID_GAMMA_SAMPLES": "2", "EPID_COLLECTIVE_TIMEOUT": "60"}
TRAIN_SAMPLES = 52  # per dataset at 66 control points
RUN_TIMEOUT_S = 240
TIMING_SERIES = ("samples_per_s", "epoch_s", "elapsed_s")  # wall-clock figures differ between runs
RUN_SETTINGS = ("resume", "epochs", "checkpoint_path")  # what differs between the runs compared

pytestmark = pytest.mark.timeout(600)


def run_env(checkpoint: Path, **overrides: str) -> dict[str, str]:
    return clean_environment(**{**SHORT_ARCS, "EPID_CHECKPOINT_PATH": str(checkpoint), **overrides})


def start(checkpoint: Path, log: Path, **overrides: str) -> subprocess.Popen:
    """Start the entry script in its own session, its output going to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, str(SCRIPT)], env=run_env(checkpoint, **overrides), cwd=ROOT,
                                stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(process: subprocess.Popen, log: Path) -> str:
    """Wait for a started run, which must succeed; its output."""
    try:
        status = process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert status == 0, log.read_text()[-3000:]
    return log.read_text()


def train(checkpoint: Path, **overrides: str) -> str:
    """Run the entry script to its end; its output."""
    log = checkpoint.parent / f"run_{time.monotonic_ns()}.log"
    return finish(start(checkpoint, log, **overrides), log)


def train_until_sigterm(checkpoint: Path, epoch: int, step: int, **overrides: str) -> str:
    """Run the entry script and send it SIGTERM once optimizer step ``step`` of ``epoch`` has
    finished (its timing line is printed while the next step runs); its output."""
    log = checkpoint.parent / f"sigterm_{time.monotonic_ns()}.log"
    marker = re.compile(rf"^\[TIMING\]\[train\] epoch {epoch} steps {step}-{step}/", re.MULTILINE)
    process = start(checkpoint, log, EPID_TIMING_EVERY="1", EPID_TIMING_MAX="1000", **overrides)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not marker.search(log.read_text()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    return finish(process, log)


def assert_same(expected: Any, actual: Any, where: str = "checkpoint") -> None:
    """Equal containers, tensors equal bit for bit (same dtype and shape), floats exactly equal."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and expected.dtype == actual.dtype, where
        assert expected.shape == actual.shape and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and expected.keys() == actual.keys(), (where, expected.keys(), actual.keys())
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(expected) is type(actual) and len(expected) == len(actual), where
        for index, (a, b) in enumerate(zip(expected, actual, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), where
    else:
        assert expected == actual, (where, expected, actual)


def comparable(payload: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint without what legitimately differs between a resumed and a straight run:
    the run ID, the wall-clock series of the history and the settings that start a run."""
    kept = {key: value for key, value in payload.items() if key != "run_id"}
    kept["history"] = {key: value for key, value in payload["history"].items() if key not in TIMING_SERIES}
    kept["config"] = {key: value for key, value in payload["config"].items() if key not in RUN_SETTINGS}
    return kept


def optimizer_moments(payload: dict[str, Any]) -> list[torch.Tensor]:
    """AdamW's first and second moments of every parameter, in parameter order."""
    state = payload["optimizer"]["state"]
    return [state[index][name] for index in sorted(state) for name in ("exp_avg", "exp_avg_sq")]


# --------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_run_stopped_and_resumed_twice_ends_bit_identical_to_a_straight_run(world_size, tmp_path):
    # fp32 pinned: under EPID_PRECISION=auto the straight run and the first of the resumed ones time the
    # precisions at once, each for itself; at batch 4 the tiny legacy models step about as fast in bf16 as
    # in fp32 (0.95x), so under load one of them may find bf16 10 % faster and train in it
    settings = {"EPID_WORLD_SIZE": str(world_size), "EPID_BATCH_ORDER": "shuffled", "EPID_STEPS_PER_EPOCH": "10",
                "EPID_LR": "4e-3", "EPID_LR_SCALING": "sqrt", "EPID_WARMUP_EPOCHS": "2", "EPID_EPOCHS": "2",
                "EPID_PRECISION": "fp32"}
    straight = tmp_path / "straight" / "epid.pth"
    straight_run = start(straight, straight.parent / "run.log", **settings)

    resumed = tmp_path / "resumed" / "epid.pth"
    train(resumed, **{**settings, "EPID_EPOCHS": "1"})  # stops at an epoch boundary, inside the warm-up
    assert load_checkpoint(resumed)["epoch"] == 1
    output = train_until_sigterm(resumed, epoch=2, step=3, EPID_RESUME="1", **settings)
    assert re.search(r"^Stopped by .* in epoch 2 after optimizer step", output, re.MULTILINE), output[-2000:]
    stopped = load_checkpoint(resumed)
    assert stopped["epoch"] == 1 and 3 <= stopped["interrupted"]["batches_done"] < 10
    output = train(resumed, EPID_RESUME="1", **settings)
    assert f"Epoch 2 continues after batch {stopped['interrupted']['batches_done']}/10" in output
    finish(straight_run, straight.parent / "run.log")

    expected, actual = load_checkpoint(straight), load_checkpoint(resumed)
    assert actual["epoch"] == expected["epoch"] == 2 and actual["interrupted"] is None
    assert_same(comparable(expected), comparable(actual))
    # EPID_LR_SCALING and EPID_WARMUP_EPOCHS set the optimizer's learning rate, epoch by epoch
    base = 4e-3 * math.sqrt(world_size * 2 / 128)
    assert actual["history"]["lr"] == pytest.approx([base / 3, 2 * base / 3], rel=1e-12)
    assert actual["optimizer"]["param_groups"][0]["lr"] == pytest.approx(base, rel=1e-12)  # the cosine starts


def test_the_aperture_recipe_resumes_bit_identical_after_a_mid_epoch_stop(tmp_path):
    # the default family with its recipe: shuffled windows, a per-step warm-up and cosine, gradient
    # clipping and two learning-rate groups (the renderer's physics at 10x)
    settings = {"EPID_MODEL": "aperture", "EPID_STEPS_PER_EPOCH": "8", "EPID_EPOCHS": "2", "EPID_WARMUP_STEPS": "4"}
    straight = tmp_path / "straight" / "epid.pth"
    straight_run = start(straight, straight.parent / "run.log", **settings)
    resumed = tmp_path / "resumed" / "epid.pth"
    output = train_until_sigterm(resumed, epoch=1, step=5, **settings)
    assert re.search(r"^Stopped by .* in epoch 1 after optimizer step", output, re.MULTILINE), output[-2000:]
    train(resumed, EPID_RESUME="1", **settings)
    finish(straight_run, straight.parent / "run.log")

    expected, actual = load_checkpoint(straight), load_checkpoint(resumed)
    assert actual["model_config"]["family"] == "aperture" and actual["epoch"] == expected["epoch"] == 2
    assert_same(comparable(expected), comparable(actual))
    assert actual["config"]["batch_order"] == "shuffled" and actual["config"]["grad_clip"] == 1.0
    groups = actual["optimizer"]["param_groups"]
    assert sorted(group["lr_factor"] for group in groups) == [1.0, 10.0]
    assert max(group["lr"] for group in groups) == pytest.approx(10 * min(group["lr"] for group in groups))


def test_fp16_gradient_scaler_state_survives_a_resume(tmp_path):
    settings = {"EPID_PRECISION": "fp16", "EPID_STEPS_PER_EPOCH": "3", "EPID_DATASET_IDS": "0",
                "EPID_GAMMA_SAMPLES": "0", "EPID_EPOCHS": "2"}
    straight = tmp_path / "straight" / "epid.pth"
    straight_run = start(straight, straight.parent / "run.log", **settings)
    resumed = tmp_path / "resumed" / "epid.pth"
    train(resumed, **{**settings, "EPID_EPOCHS": "1"})
    train(resumed, EPID_RESUME="1", **settings)
    finish(straight_run, straight.parent / "run.log")
    expected, actual = load_checkpoint(straight), load_checkpoint(resumed)
    assert expected["scaler"]["scale"] < 65536.0  # the scaler has backed off: its state is not the initial one
    assert_same(comparable(expected), comparable(actual))


# --------------------------------------------------------------------------- gradient accumulation


def first_step(tmp_path: Path, monkeypatch, name: str, **overrides: str) -> dict[str, Any]:
    """The checkpoint after one optimizer step of one rank in this process, with the consistency
    term weighted 0: it pairs neighbouring samples inside a batch, the one term that depends on
    how samples are cut into batches."""
    monkeypatch.setitem(losses.LOSS_WEIGHTS, "consistency", 0.0)
    checkpoint = tmp_path / name / "epid.pth"
    config = load_config(run_env(checkpoint, EPID_EPOCHS="1", EPID_STEPS_PER_EPOCH="1", EPID_DATASET_IDS="0",
                                 EPID_GAMMA_SAMPLES="0", EPID_PRECISION="fp32", **overrides))
    from epid.training.loop import launch as launch_training

    assert launch_training(config) == 0
    return load_checkpoint(checkpoint)


def test_accumulated_batches_give_the_update_of_one_larger_batch(tmp_path, monkeypatch):
    whole = first_step(tmp_path, monkeypatch, "whole", EPID_BATCH_SIZE="8")
    accumulated = first_step(tmp_path, monkeypatch, "accumulated", EPID_BATCH_SIZE="2", EPID_GRAD_ACCUM="4")
    half = first_step(tmp_path, monkeypatch, "half", EPID_BATCH_SIZE="4")
    want, got, other = (torch.cat([m.flatten() for m in optimizer_moments(c)]) for c in (whole, accumulated, half))
    for want_tensor, got_tensor in zip(optimizer_moments(whole), optimizer_moments(accumulated), strict=True):
        assert (got_tensor - want_tensor).abs().max() <= 1e-3 * want_tensor.abs().max()
    assert (got - want).norm() <= 1e-4 * want.norm()
    assert (other - want).norm() > 0.01 * want.norm()  # the first half of the batch alone is another update
    assert accumulated["history"]["train"]["total"] == pytest.approx(whole["history"]["train"]["total"], rel=1e-5)


# --------------------------------------------------------------------------- two gloo ranks


def launch_two_ranks(worker, tmp_path: Path, monkeypatch, **overrides: str) -> tuple[int, Path]:
    """``worker`` on two spawned gloo ranks of this node; (exit status, checkpoint path)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    checkpoint = tmp_path / "epid.pth"
    config = load_config(run_env(checkpoint, EPID_WORLD_SIZE="2", **overrides))
    return launch(worker, config), checkpoint


def _train_rank(context: RankContext, config) -> int:
    from epid.training.loop import run_rank

    return run_rank(context, config)


def _rank_1_loses_its_fourth_batch(context: RankContext, config) -> int:
    """Rank 1's fourth training batch has a NaN frame: its loss is not finite, rank 0's is."""
    if context.rank == 1:
        make_batch = dataset.EpidData.make_batch
        calls = []

        def poisoned(self, window, device):
            batch = make_batch(self, window, device)
            calls.append(window)
            if len(calls) == 4:
                batch.epid_curr[0, 0, 0, 0] = math.nan
            return batch

        dataset.EpidData.make_batch = poisoned
    return _train_rank(context, config)


def _validation_gets_worse_every_epoch(context: RankContext, config) -> int:
    """Every validation batch is further off than the one before, on both ranks: the best
    validation loss stays at epoch 1."""
    make_batch = dataset.EpidData.make_batch
    validation_calls = []

    def drifting(self, window, device):
        batch = make_batch(self, window, device)
        if window.start >= TRAIN_SAMPLES:
            validation_calls.append(window)
            batch.epid_curr.add_(float(len(validation_calls)))
        return batch

    dataset.EpidData.make_batch = drifting
    return _train_rank(context, config)


def test_a_non_finite_loss_on_one_rank_skips_the_step_on_both(tmp_path, monkeypatch, capfd):
    status, checkpoint = launch_two_ranks(_rank_1_loses_its_fourth_batch, tmp_path, monkeypatch,
                                          EPID_EPOCHS="2", EPID_STEPS_PER_EPOCH="5", EPID_GAMMA_SAMPLES="0")
    assert status == 0
    assert "epoch 1 step 4: non-finite loss on some rank, step skipped (1 in a row)" in capfd.readouterr().out
    saved = load_checkpoint(checkpoint)
    assert saved["history"]["nonfinite_steps"] == [1, 0]
    # had rank 1 stepped, its weights would be NaN and every later step of both ranks non-finite
    assert all(math.isfinite(value) for split in ("train", "val") for value in saved["history"][split]["total"])
    steps = {int(state["step"]) for state in saved["optimizer"]["state"].values()}
    assert steps == {2 * 5 - 1}
    for name in ("forward_model", "inverse_model"):
        assert all(torch.isfinite(value).all() for value in saved[name].values())


def test_early_stopping_decided_on_rank_0_stops_both_ranks(tmp_path, monkeypatch, capfd):
    status, checkpoint = launch_two_ranks(_validation_gets_worse_every_epoch, tmp_path, monkeypatch,
                                          EPID_EPOCHS="10", EPID_STEPS_PER_EPOCH="1", EPID_EARLY_STOP_PATIENCE="2",
                                          EPID_GAMMA_SAMPLES="0", EPID_COLLECTIVE_TIMEOUT="30")
    assert status == 0  # a rank 1 that went on would fail in its next collective
    assert "Early stop after epoch 3: no new best validation loss for 2 epoch(s)" in capfd.readouterr().out
    saved = load_checkpoint(checkpoint)
    assert saved["epoch"] == 3 and saved["best_epoch"] == 1
    assert load_checkpoint(best_path(checkpoint))["epoch"] == 1
    assert saved["history"]["val"]["total"] == sorted(saved["history"]["val"]["total"])
