"""Runs that fit the machine and the budget: the precision ``auto`` picks, capped epochs that go on
through the windows, the validation budget, progress lines in logs, stale temporary files,
TensorBoard, the time limit, gradient clipping, learning-rate groups, the model family and the
dry run's checks.

Runs are in this process on one rank, with the tiny configuration of ``tests.training.test_loop``
(12 control points: 8 training and 2 validation samples per dataset, datasets 0, 80 and 160,
batch 4: 6 training and 3 validation windows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from epid.config.load import load_config
from epid.core import devices
from epid.core.cli import run_main
from epid.core.files import remove_stale_temporaries
from epid.data.dataset import EpidData
from epid.data.windows import Window, dataset_windows
from epid.models import legacy as legacy_module
from epid.models.checkpoint import CheckpointError, load_checkpoint
from epid.training import loop, preflight
from tests.training.test_loop import _bad_kernel, run_env
from tests.training.test_schedule import cosine_restarts

TRAIN_SAMPLES = 8  # per dataset at 12 control points
CAPPED = {"EPID_STEPS_PER_EPOCH": "2", "EPID_VAL_STEPS": "2", "EPID_LOG_SECONDS": "0.001"}
PROGRESS_LINE = re.compile(r"^epoch (\d+)/\d+ step 1/2 \(50 %\) \| [\d.]+ samples/s \| loss \d\.\d{4}e[+-]\d\d \| "
                           r"ETA epoch \d+:\d\d:\d\d, run \d+:\d\d:\d\d$", re.MULTILINE)

pytestmark = pytest.mark.timeout(300)


@dataclasses.dataclass
class Run:
    """What an in-process run printed and the windows its batches were made of, in order."""

    output: str
    windows: list[Window]
    status: int

    @property
    def train_windows(self) -> list[Window]:
        return [window for window in self.windows if window.start < TRAIN_SAMPLES]

    @property
    def validation_windows(self) -> list[Window]:
        return [window for window in self.windows if window.start >= TRAIN_SAMPLES and len(window) > 1]


def train_here(checkpoint: Path, **overrides: str) -> Run:
    """Train on one rank in this process, recording the windows it makes batches of (training and
    validation windows; the gamma samples are windows of one sample)."""
    recorded: list[Window] = []
    make_batch = EpidData.make_batch

    def recording(self, window, device):
        recorded.append(window)
        return make_batch(self, window, device)

    output = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(output):
        patch.setattr(EpidData, "make_batch", recording)
        status = loop.launch(load_config(run_env(checkpoint, **overrides)))
    return Run(output.getvalue(), recorded, status)


def gone_pid() -> int:
    """The ID of a process that has ended."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture(scope="module")
def capped_run(tmp_path_factory) -> dict[str, Any]:
    """Two epochs capped at 2 of the 6 training windows, validating 2 of the 3 validation windows,
    with progress lines and TensorBoard; then a third epoch resumed from its checkpoint. Beside
    the checkpoint lie temporary files of a writer that is gone and of one that runs."""
    folder = tmp_path_factory.mktemp("capped")
    checkpoint = folder / "epid.pth"
    gone = gone_pid()
    stale = [folder / f".epid.pth.{gone}.tmp", folder / f".metrics.csv.{gone}.tmp"]
    live = folder / f".epid_best.pth.{os.getppid()}.tmp"
    for path in (*stale, live):
        path.write_bytes(b"half a checkpoint")
    settings = {**CAPPED, "EPID_TENSORBOARD": str(folder / "tensorboard")}
    first = train_here(checkpoint, EPID_EPOCHS="2", **settings)
    after_two = load_checkpoint(checkpoint)
    resumed = train_here(checkpoint, EPID_EPOCHS="3", EPID_RESUME="1", **settings)
    return {"folder": folder, "checkpoint": checkpoint, "first": first, "after_two": after_two, "resumed": resumed,
            "stale": stale, "live": live}


# --------------------------------------------------------------------------- precision


def test_auto_on_the_cpu_is_fp32_without_a_run_to_time():
    choice = devices.choose_precision("auto", torch.device("cpu"))
    assert choice.dtype == torch.float32 and choice.reason.startswith("auto: fp32 on the CPU without a run to time")
    assert devices.choose_precision("bf16", torch.device("cpu")) == devices.PrecisionChoice(
        torch.bfloat16, "EPID_PRECISION=bf16")
    assert devices.resolve_precision("fp32", torch.device("cpu")) == torch.float32


def test_the_start_line_names_the_precision_and_why(capped_run):
    line = next((line for line in capped_run["first"].output.splitlines() if ", precision " in line), "")
    assert re.search(r", precision (fp32|bf16) \(auto: bf16 [\d.]+x as fast as fp32, needs >= 1\.10x; per .+: "
                     r"fp32 [\d.]+ ms, bf16 [\d.]+ ms; legacy tiny models, batch \d+, 1 thread\(s\)[^;]*; "
                     r"timed (now|on)\b", line), line


# --------------------------------------------------------------------------- capped epochs and validation


def test_capped_epochs_visit_disjoint_windows_and_a_resumed_run_continues_the_cursor(capped_run):
    first, resumed = capped_run["first"], capped_run["resumed"]
    config = load_config(run_env(capped_run["checkpoint"]))
    in_order = [window for dataset_id in config.rank_dataset_ids(0)
                for window in dataset_windows(dataset_id, config.control_points, "train", config.batch_size)]
    epochs = [first.train_windows[:2], first.train_windows[2:], resumed.train_windows]
    assert [len(windows) for windows in epochs] == [2, 2, 2]
    assert epochs[0] + epochs[1] + epochs[2] == in_order  # three epochs, every window once
    assert capped_run["after_two"]["window_cursor"] == 4
    assert load_checkpoint(capped_run["checkpoint"])["window_cursor"] == 6
    assert "from position 4" in resumed.output


def test_validation_takes_the_same_spread_windows_every_epoch(capped_run):
    first, resumed = capped_run["first"], capped_run["resumed"]
    spread = [Window(0, 8, 10), Window(160, 8, 10)]  # 2 of the 3 datasets' windows, spread
    epochs = [first.validation_windows[:2], first.validation_windows[2:], resumed.validation_windows]
    assert [sorted(windows, key=lambda w: w.dataset_id) for windows in epochs] == [spread, spread, spread]
    assert "2 validation window(s)" in first.output


# --------------------------------------------------------------------------- what a run shows and leaves


def test_progress_lines_without_a_terminal(capped_run):
    first = capped_run["first"].output
    assert [int(epoch) for epoch in PROGRESS_LINE.findall(first)] == [1, 2]  # after step 1 of 2, not after the last
    assert [int(epoch) for epoch in PROGRESS_LINE.findall(capped_run["resumed"].output)] == [3]


def test_stale_temporary_files_are_removed_and_live_ones_kept(capped_run):
    output, folder = capped_run["first"].output, capped_run["folder"]
    assert not any(path.exists() for path in capped_run["stale"]) and capped_run["live"].exists()
    names = sorted(path.name for path in capped_run["stale"])
    assert f"Removed 2 temporary file(s) in {folder} that writers which are gone left behind: {', '.join(names)}" \
        in output
    assert f"Kept 1 temporary file(s) in {folder} that running processes are writing" in output


def test_remove_stale_temporaries_reads_the_writer_from_the_name(tmp_path):
    target = tmp_path / "run.pth"
    gone, running = gone_pid(), os.getpid()
    files = {name: tmp_path / name for name in (f".run.pth.{gone}.tmp", f".run.pth.{running}.tmp",
                                                f".other.pth.{gone}.tmp", f".run.pth.{gone}.tmp.bak", "run.pth")}
    for path in files.values():
        path.write_text("x")
    removed, kept = remove_stale_temporaries([target, tmp_path / "missing" / "a.pth"])
    assert removed == [files[f".run.pth.{gone}.tmp"]] and kept == [files[f".run.pth.{running}.tmp"]]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(set(files) - {f".run.pth.{gone}.tmp"})


def test_tensorboard_events_hold_every_epoch(capped_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(capped_run["folder"] / "tensorboard"))
    events.Reload()
    history = load_checkpoint(capped_run["checkpoint"])["history"]
    tags = events.Tags()
    assert {f"loss_{split}/{term}" for split in ("train", "val") for term in history["train"]} <= set(tags["scalars"])
    for tag, series in (("loss_train/total", history["train"]["total"]), ("loss_val/latent", history["val"]["latent"]),
                        ("lr", history["lr"]), ("samples_per_s", history["samples_per_s"]),
                        ("gamma_pass", history["gamma_pass"])):
        scalars = events.Scalars(tag)
        assert [event.step for event in scalars] == [1, 2, 3], tag
        assert [event.value for event in scalars] == pytest.approx(series, rel=1e-6), tag
    assert sorted(tags["images"]) == [f"validation/dataset_{d}_sample_9" for d in (0, 160, 80)]
    for tag in tags["images"]:
        images = events.Images(tag)
        assert [image.step for image in images] == [1, 2, 3]
        assert (images[0].width, images[0].height) == (768, 256) and images[0].encoded_image_string[:4] == b"\x89PNG"
    assert "EPID_STEPS_PER_EPOCH" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


# --------------------------------------------------------------------------- stopping and stepping


def test_the_time_limit_stops_after_a_step_with_a_checkpoint_to_resume(tmp_path):
    checkpoint = tmp_path / "epid.pth"
    stopped = train_here(checkpoint, EPID_EPOCHS="2", EPID_TIME_LIMIT="0.0001", EPID_GAMMA_SAMPLES="0")
    assert stopped.status == 0
    assert (f"Stopped: time limit of 0.0001 min reached in epoch 1 after optimizer step 1/6; checkpoint {checkpoint} "
            "written; resume with EPID_RESUME=1") in stopped.output
    saved = load_checkpoint(checkpoint)
    assert saved["epoch"] == 0 and saved["interrupted"]["batches_done"] == 1
    assert (tmp_path / "metrics.csv").is_file() and len(stopped.train_windows) == 1
    resumed = train_here(checkpoint, EPID_EPOCHS="1", EPID_RESUME="1", EPID_GAMMA_SAMPLES="0")
    assert resumed.status == 0 and "Epoch 1 continues after batch 1/6" in resumed.output
    assert len(resumed.train_windows) == 5 and load_checkpoint(checkpoint)["epoch"] == 1


def first_moments_norm(checkpoint: Path) -> float:
    """The global norm of AdamW's first moments: after one step, 0.1 times the gradient's norm."""
    state = load_checkpoint(checkpoint)["optimizer"]["state"]
    return math.sqrt(sum(float(entry["exp_avg"].double().square().sum()) for entry in state.values()))


def test_gradient_clipping_bounds_the_first_update(tmp_path):
    one_step = {"EPID_EPOCHS": "1", "EPID_STEPS_PER_EPOCH": "1", "EPID_GAMMA_SAMPLES": "0", "EPID_PRECISION": "fp32"}
    train_here(tmp_path / "free" / "epid.pth", **one_step)
    train_here(tmp_path / "clipped" / "epid.pth", EPID_GRAD_CLIP="0.001", **one_step)
    assert first_moments_norm(tmp_path / "clipped" / "epid.pth") == pytest.approx(0.1 * 0.001, rel=1e-4)
    assert first_moments_norm(tmp_path / "free" / "epid.pth") > 100 * 0.1 * 0.001


def forward_first_four_slower(self) -> list[tuple[list[torch.nn.Parameter], float]]:
    parameters = list(self.parameters())
    return [(parameters[:4], 0.5), (parameters[4:], 1.0)]


def test_learning_rate_groups_of_a_model_train_and_resume(tmp_path, monkeypatch, capped_run):
    monkeypatch.setattr(legacy_module.ForwardModel, "parameter_groups", forward_first_four_slower, raising=False)
    checkpoint = tmp_path / "epid.pth"
    train_here(checkpoint, EPID_EPOCHS="1", EPID_STEPS_PER_EPOCH="1", EPID_GAMMA_SAMPLES="0")
    groups = load_checkpoint(checkpoint)["optimizer"]["param_groups"]
    assert [len(group["params"]) for group in groups][0] == 4 and [g["lr_factor"] for g in groups] == [0.5, 1.0]
    assert [group["lr"] for group in groups] == pytest.approx(
        [0.5 * cosine_restarts(1, 1e-4), cosine_restarts(1, 1e-4)])
    resumed = train_here(checkpoint, EPID_EPOCHS="2", EPID_STEPS_PER_EPOCH="1", EPID_GAMMA_SAMPLES="0", EPID_RESUME="1")
    assert resumed.status == 0
    saved = load_checkpoint(checkpoint)
    assert [g["lr"] for g in saved["optimizer"]["param_groups"]] == pytest.approx(
        [0.5 * cosine_restarts(2, 1e-4), cosine_restarts(2, 1e-4)])
    assert saved["history"]["lr"] == pytest.approx([cosine_restarts(0, 1e-4), cosine_restarts(1, 1e-4)])
    assert {int(entry["step"]) for entry in saved["optimizer"]["state"].values()} == {2}
    # a checkpoint of the models with one group cannot resume in two
    legacy = tmp_path / "legacy" / "epid.pth"
    legacy.parent.mkdir()
    shutil.copy(capped_run["checkpoint"], legacy)
    with pytest.raises(CheckpointError, match=r"optimizer parameter groups of \[\d+\] parameters; .* now hold \[4, "):
        preflight.check(load_config(run_env(legacy, EPID_RESUME="1", EPID_EPOCHS="9")))


def test_a_checkpoint_resumes_only_in_its_model_family(capped_run):
    config = load_config(run_env(capped_run["checkpoint"], EPID_RESUME="1", EPID_EPOCHS="9"))
    checkpoint = load_checkpoint(capped_run["checkpoint"])
    assert checkpoint["model_config"]["family"] == config.model == "legacy"
    assert preflight.resume_notes(config, checkpoint)[0].startswith("Resuming")
    with pytest.raises(CheckpointError, match=r"holds EPID_MODEL='legacy' models; EPID_MODEL='other' cannot resume it"):
        preflight.resume_notes(dataclasses.replace(config, model="other"), checkpoint)


# --------------------------------------------------------------------------- the dry run


@pytest.mark.parametrize("case", ["kernel", "folder", "no checkpoint", "unreadable checkpoint", "device",
                                  "tensorboard", "misspelt variable"])
def test_the_dry_run_exits_2_for_each_failed_check(case, tmp_path, monkeypatch, capsys):
    import generate_and_train

    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder or a checkpoint")
    checkpoint = tmp_path / "run" / "epid.pth"
    overrides, message = {
        "kernel": ({"EPID_KERNEL": _bad_kernel(tmp_path)}, "EPID_KERNEL="),
        "folder": ({"EPID_CHECKPOINT_PATH": str(blocker / "epid.pth")}, "cannot write there"),
        "no checkpoint": ({"EPID_RESUME": "1"}, "EPID_RESUME='1': no checkpoint at EPID_CHECKPOINT_PATH"),
        "unreadable checkpoint": ({"EPID_RESUME": "1", "EPID_CHECKPOINT_PATH": str(blocker)}, "not a torch.save file"),
        "device": ({"EPID_DEVICE": "cuda:7"}, "EPID_DEVICE='cuda:7': "),
        "tensorboard": ({"EPID_TENSORBOARD": str(tmp_path / "tb")}, "the tensorboard package is not installed"),
        "misspelt variable": ({"EPID_EPOCH": "3"}, "did you mean EPID_EPOCHS?"),
    }[case]
    if case == "device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    if case == "tensorboard":
        monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    for name, value in run_env(checkpoint, EPID_DRY_RUN="1", **overrides).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["generate_and_train.py"])
    with pytest.raises(SystemExit) as exit_status:
        run_main(generate_and_train.main, "generate_and_train.py")
    captured = capsys.readouterr()
    assert exit_status.value.code == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate_and_train.py: error: ") and message in lines[0], lines
    assert "Resolved configuration" not in captured.out
    assert not checkpoint.parent.exists() and not (tmp_path / "tb").exists()
