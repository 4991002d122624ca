"""Training engine: gamma subset, devices, metrics files, pre-flight checks and real multi-process runs.

The end-to-end tests run ``generate_and_train.py`` as a subprocess (the real entry point) on
a tiny configuration: 12 control points (8 training and 2 validation samples per dataset),
three datasets over two ranks (uneven shards), the tiny model preset, gloo on the CPU.
"""

from __future__ import annotations

import atexit
import csv
import hashlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from matplotlib.image import imread

from epid.config.load import load_config
from epid.core import devices
from epid.core.errors import InputError
from epid.evaluation import inference, plots
from epid.models.checkpoint import CheckpointError, best_path, load_checkpoint, save_checkpoint
from epid.models.losses import LOSS_TERMS
from epid.training import loop, precision, preflight
from epid.training.distributed import (
    LaunchError,
    RankContext,
    StopSignal,
    free_port,
    launch,
    resolve_backend,
    tune_host_allocator,
)
from epid.training.metrics_log import COLUMNS, MetricsLog, append_epoch, empty_history
from tests.support import ROOT, TINY_RUN, clean_environment
from tests.training.test_schedule import cosine_restarts

SCRIPT = ROOT / "generate_and_train.py"
TINY = {**TINY_RUN, "EPID_CONTROL_POINTS": "12", "EPID_DATASET_IDS": "0,80,160", "EPID_BATCH_SIZE": "4",
        "EPID_GAMMA_SAMPLES": "3"}
RUN_TIMEOUT_S = 150

# generous: the first test that needs the shared 2-rank run pays for it inside its own limit
pytestmark = pytest.mark.timeout(300)


def run_env(checkpoint: Path, **overrides: str) -> dict[str, str]:
    """The test process environment without EPID_* / launcher variables, plus the tiny run."""
    return clean_environment(**{**TINY, "EPID_CHECKPOINT_PATH": str(checkpoint), **overrides})


def run_script(env: dict[str, str], timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)


def start_script(env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, str(SCRIPT)], env=env, cwd=ROOT, stdout=handle,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rank_pids(text: str) -> dict[int, int]:
    return {int(rank): int(pid) for rank, pid in re.findall(r"^rank (\d+)/\d+ .*?pid (\d+)", text, re.MULTILINE)}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_losses_png(path: Path) -> None:
    """``path`` decodes as a PNG of the losses figure's pixel size with curves and text on it."""
    image = imread(path)
    rows = math.ceil((len(LOSS_TERMS) + len(plots.EXTRA_SERIES)) / 4)
    height = (plots.LOSSES_ROW_HEIGHT_IN * rows + 0.8) * plots.DPI
    assert image.shape[:2] == (round(height), round(plots.LOSSES_WIDTH_IN * plots.DPI))
    gray = image[..., :3].mean(axis=2)
    assert gray.std() > 0.05 and (gray < 0.5).mean() > 0.005  # dark lines and text, not an empty canvas


# --------------------------------------------------------------------------- pure functions


def test_gamma_subset_is_spread_fixed_and_inside_validation():
    ids = list(range(640))
    chosen = inference.gamma_subset(ids, 2050, 64)
    assert len(chosen) == 64 and len(set(chosen)) == 64
    assert [d for d, _ in chosen] == list(range(0, 640, 10))
    assert all(1664 <= s < 2048 for _, s in chosen)
    several = inference.gamma_subset([3, 1, 2], 2050, 7)
    assert sorted({d for d, _ in several}) == [1, 2, 3] and len(several) == 7
    assert inference.gamma_subset([5], 12, 10) == [(5, 8), (5, 9)]  # only 2 validation samples
    assert inference.gamma_subset(ids, 2050, 0) == []


def test_spread_takes_the_middle_of_equal_parts():
    assert inference.spread(range(6), 4) == [0, 2, 3, 5]
    assert inference.spread(range(100, 110), 2) == [102, 107]
    assert inference.spread(["a", "b"], 5) == ["a", "b"]
    assert inference.spread(range(10), 0) == []


def test_placement_helpers():
    assert resolve_backend("auto", torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert resolve_backend("gloo", torch.device("cuda", 0)) == "gloo"
    if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):
        assert tune_host_allocator()
    port = free_port()
    assert 1024 <= port < 65536


def test_device_requests_map_to_one_gpu_per_local_rank(monkeypatch):
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 4)
    assert devices.resolve_device("cpu", 3) == torch.device("cpu")
    assert devices.resolve_device("auto", 1) == torch.device("cuda", 1)
    assert devices.resolve_device("cuda", 2) == torch.device("cuda", 2)
    assert devices.resolve_device("cuda:1", 2) == torch.device("cuda", 3)
    with pytest.raises(InputError, match=r"^EPID_DEVICE='cuda:1': local rank 3 would use cuda:4, this machine has 4"):
        devices.resolve_device("cuda:1", 3)
    with pytest.raises(InputError, match=r"^--device 'tpu': expected auto, cpu, cuda or cuda:N$"):
        devices.resolve_device("tpu", given="--device 'tpu'")
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    assert devices.resolve_device("auto", 1) == torch.device("cpu")
    with pytest.raises(InputError, match="CUDA is not available on this machine"):
        devices.resolve_device("cuda")


def test_checkpoint_is_atomic_and_weights_only(tmp_path):
    path = tmp_path / "run" / "epid.pth"
    payload = {"format_version": 1, "epoch": 3, "forward_model": {"module.w": torch.ones(2)},
               "inverse_model": {"_orig_mod.module.b": torch.zeros(1)}, "model_config": {"forward": {}, "inverse": {}},
               "history": {"train": {"total": [1.0, 0.5]}}, "rng": {"python": [3, [1, 2], None]}}
    save_checkpoint(path, payload)
    assert sorted(p.name for p in path.parent.iterdir()) == ["epid.pth"]  # no temporary left behind
    raw = torch.load(path, weights_only=True)
    assert raw["epoch"] == 3 and raw["history"]["train"]["total"] == [1.0, 0.5]
    loaded = load_checkpoint(path)
    assert list(loaded["forward_model"]) == ["w"] and list(loaded["inverse_model"]) == ["b"]
    assert best_path(path).name == "epid_best.pth"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="epid.pth"):
        load_checkpoint(path)


def test_metrics_csv_rows_and_plot(tmp_path):
    history = empty_history()
    log = MetricsLog(tmp_path)
    log.restart(history)
    for epoch in range(3):
        record = {
            "train": {term: 1.0 / (epoch + 1) for term in LOSS_TERMS},
            "val": {term: 2.0 / (epoch + 1) for term in LOSS_TERMS},
            "gamma_pass": 90.0 + epoch, "lr": 1e-4, "samples_per_s": 10.0, "train_samples": 80, "epoch_s": 1.0,
            "elapsed_s": epoch + 1.0, "steps": 4, "nonfinite_steps": 0, "world_size": 2,
        }
        append_epoch(history, record)
        log.append(history)
    log.plot(history, best_epoch=3)
    rows = read_rows(log.csv_path)
    assert tuple(rows[0]) == COLUMNS
    assert [float(r["val_total"]) for r in rows] == pytest.approx([2.0, 1.0, 2.0 / 3.0], rel=1e-5)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert_losses_png(log.plot_path)


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A finished 2-rank spawn run of 2 epochs, 2 batches per optimizer step, shuffled batch order,
    with an empty cache folder (EPID_PRECISION=auto times its steps); (checkpoint path, completed process)."""
    folder = tmp_path_factory.mktemp("two_rank")
    checkpoint = folder / "epid.pth"
    result = run_script(run_env(checkpoint, EPID_WORLD_SIZE="2", EPID_EPOCHS="2", EPID_GRAD_ACCUM="2",
                                EPID_BATCH_ORDER="shuffled", XDG_CACHE_HOME=str(folder / "cache")))
    assert result.returncode == 0, result.stdout + result.stderr
    return checkpoint, result


def test_two_rank_run_writes_checkpoint_metrics_and_equal_steps(two_rank_run):
    checkpoint, result = two_rank_run
    assert set(rank_pids(result.stdout)) == {0, 1}
    raw = torch.load(checkpoint, weights_only=True)
    assert raw["epoch"] == 2 and raw["world_size"] == 2 and raw["interrupted"] is None
    assert not any(key.startswith("module.") for key in raw["forward_model"])
    # rank 0 has datasets with 4 training windows, rank 1 has 2: both take 4 batches = 2 steps per epoch
    assert raw["history"]["steps_per_rank"] == [[2, 2], [2, 2]]
    for split in ("train", "val"):
        for term in LOSS_TERMS:
            assert len(raw["history"][split][term]) == 2
            assert all(math.isfinite(v) for v in raw["history"][split][term])
    assert all(0.0 <= g <= 100.0 for g in raw["history"]["gamma_pass"])
    assert raw["history"]["lr"] == pytest.approx([cosine_restarts(0, 1e-4), cosine_restarts(1, 1e-4)], rel=1e-12)
    assert raw["optimizer"]["param_groups"][0]["lr"] == pytest.approx(cosine_restarts(2, 1e-4), rel=1e-12)
    assert raw["schedule"]["base_lr"] == 1e-4 and raw["schedule"]["decay"] == "cosine-restarts"
    assert best_path(checkpoint).is_file()
    rows = read_rows(checkpoint.parent / "metrics.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [float(r["train_total"]) for r in rows] == pytest.approx(raw["history"]["train"]["total"], rel=1e-5)
    assert_losses_png(checkpoint.parent / "losses.png")
    epoch_lines = r"^epoch \d/2 \| train .* \| val .* \| gamma pass .* samples/s \| lr "
    assert len(re.findall(epoch_lines, result.stdout, re.MULTILINE)) == 2
    assert len(re.findall(r"^\[TIMING\]\[train\] epoch \d steps 1-2/2: data_wait", result.stdout, re.MULTILINE)) == 2
    assert len(re.findall(r"^\[TIMING\]\[val\] epoch \d", result.stdout, re.MULTILINE)) == 2


def test_torchrun_launch_joins_its_group_without_spawning(tmp_path):
    checkpoint = tmp_path / "epid.pth"
    env = run_env(checkpoint, EPID_EPOCHS="1", EPID_STEPS_PER_EPOCH="1", EPID_GAMMA_SAMPLES="0")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    output = result.stdout + result.stderr
    assert len(rank_pids(output)) == 2 and output.count("backend gloo") == 2
    assert re.search(r"launch\s+= torchrun \(WORLD_SIZE=2\)", output)
    saved = load_checkpoint(checkpoint)
    assert saved["world_size"] == 2 and saved["config"]["launched_by_torchrun"] is True
    assert saved["history"]["steps_per_rank"] == [[1, 1]]


def test_resume_from_module_prefixed_checkpoint_on_another_world_size(two_rank_run, tmp_path):
    source, _ = two_rank_run
    saved = torch.load(source, weights_only=True)
    prefixed = dict(saved)
    for key in ("forward_model", "inverse_model"):
        prefixed[key] = {f"module.{name}": value for name, value in saved[key].items()}
    checkpoint = tmp_path / "epid.pth"
    save_checkpoint(checkpoint, prefixed)
    result = run_script(run_env(checkpoint, EPID_RESUME="1", EPID_EPOCHS="3", EPID_NUM_WORKERS="1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size changes from 2 to 1" in result.stdout and "grad_accum changes from 2 to 1" in result.stdout
    resumed = torch.load(checkpoint, weights_only=True)
    assert resumed["epoch"] == 3 and resumed["run_id"] == saved["run_id"] and resumed["world_size"] == 1
    assert resumed["optimizer"]["param_groups"][0]["lr"] == pytest.approx(cosine_restarts(3, 1e-4), rel=1e-12)
    history = resumed["history"]
    for split in ("train", "val"):
        assert history[split]["total"][:2] == saved["history"][split]["total"]
        assert len(history[split]["total"]) == 3
    assert history["lr"] == pytest.approx([cosine_restarts(e, 1e-4) for e in range(3)], rel=1e-12)
    assert history["steps_per_rank"][-1] == [6]  # one rank now owns all 3 datasets x 2 windows
    assert re.search(r"^epoch 3/3 ", result.stdout, re.MULTILINE)
    assert not re.search(r"^epoch [12]/", result.stdout, re.MULTILINE)
    rows = read_rows(tmp_path / "metrics.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]


def test_rank_zero_times_the_auto_precision_and_every_rank_takes_its_choice(two_rank_run):
    checkpoint, result = two_rank_run
    assert result.stdout.count("EPID_PRECISION=auto: timing fp32 against bf16 on this CPU (legacy tiny models, "
                               "batch 4, 1 thread(s))") == 1
    lines = re.findall(r"^rank (\d)/2 .*, precision (\w+) \((auto: .*)\), \d+ dataset", result.stdout, re.MULTILINE)
    assert [rank for rank, _, _ in lines] == ["0", "1"] and lines[0][1:] == lines[1][1:]
    assert re.search(r"per .+: fp32 [\d.]+ ms, bf16 [\d.]+ ms; .*; timed now, cached in ", lines[0][2])
    assert (checkpoint.parent / "cache" / "epid" / "precision.json").is_file()


def test_a_resumed_auto_run_keeps_the_precision_it_started_in(two_rank_run, tmp_path, monkeypatch):
    """The checkpoint records the precision the run chose and its CPU; with a cache that now says the
    other precision wins, the resumed run keeps its own (and says so) while a fresh run of the same
    shape takes the cache's; a record from another CPU is not kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source, _ = two_rank_run
    record = load_checkpoint(source)["precision"]
    assert record == {"name": record["name"], "cpu": devices.cpu_model(), "cpu_features": devices.cpu_features().text()}
    assert record["name"] in ("fp32", "bf16")
    other = "bf16" if record["name"] == "fp32" else "fp32"
    context = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                          backend="", threads=1)
    checkpoint = tmp_path / "epid.pth"
    shutil.copy(source, checkpoint)
    resumed = load_config(run_env(checkpoint, EPID_RESUME="1", EPID_EPOCHS="5", EPID_GAMMA_SAMPLES="0"))
    workload = precision.Workload.of(resumed, context)
    timings = precision.Timings(*((1.0, 0.5) if other == "bf16" else (0.5, 1.0)), "training step")
    precision.write_cache(precision.user_cache_dir() / precision.CACHE_NAME, [], precision.cache_key(workload), timings)
    kept = loop.Trainer(context, resumed, StopSignal()).precision
    assert kept.name == record["name"] and "kept from its checkpoint" in kept.reason
    fresh = load_config(run_env(tmp_path / "fresh" / "epid.pth", EPID_EPOCHS="5", EPID_GAMMA_SAMPLES="0"))
    assert precision.agreed_precision(fresh, context).name == other
    assert precision.kept_precision({**record, "cpu": "another CPU"}) is None
    assert precision.kept_precision(None) is None


def test_restored_trainer_holds_the_saved_weights_optimizer_and_schedule(two_rank_run, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # EPID_PRECISION=auto times its steps
    source, _ = two_rank_run
    checkpoint = tmp_path / "epid.pth"
    shutil.copy(source, checkpoint)
    config = load_config(run_env(checkpoint, EPID_RESUME="1", EPID_EPOCHS="5", EPID_GAMMA_SAMPLES="0"))
    context = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                          backend="", threads=1)
    trainer = loop.Trainer(context, config, StopSignal())
    saved = torch.load(checkpoint, weights_only=True)
    for name, module in (("forward_model", trainer.model.forward_model),
                         ("inverse_model", trainer.model.inverse_model)):
        state = module.state_dict()
        assert state.keys() == saved[name].keys()
        assert all(torch.equal(state[key], saved[name][key]) for key in state)
    optimizer_state = trainer.optimizer.state_dict()["state"]
    saved_state = saved["optimizer"]["state"]
    assert optimizer_state.keys() == saved_state.keys() and len(saved_state) == len(list(trainer.model.parameters()))
    for index, state in saved_state.items():
        assert state.keys() == optimizer_state[index].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(optimizer_state[index][key], value) for key, value in state.items())
        assert int(state["step"]) == 4  # 2 epochs x 2 optimizer steps
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(cosine_restarts(2, 1e-4), rel=1e-12)
    assert trainer.schedule.rate(trainer.schedule.position(trainer.state.epoch, 0)) == pytest.approx(
        cosine_restarts(2, 1e-4), rel=1e-12)
    assert trainer.state.epoch == 2 and trainer.state.history["lr"] == saved["history"]["lr"]


def two_cpu_ranks(monkeypatch, **settings: str):
    """The configuration of two spawned CPU ranks of one thread each, on a free local port."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return load_config({"EPID_WORLD_SIZE": "2", "EPID_DEVICE": "cpu", "EPID_THREADS": "1", **settings})


def _rank_one_stays_silent(context: RankContext, config) -> int:
    """Rank 1 lives on without joining rank 0's all-reduce: a peer lost without closing its connection."""
    if context.rank == 1:
        time.sleep(300)
    else:
        torch.distributed.all_reduce(torch.zeros(1))
    return 0


@pytest.mark.timeout(120)
def test_a_silent_peer_fails_the_job_after_the_collective_timeout(monkeypatch):
    config = two_cpu_ranks(monkeypatch, EPID_COLLECTIVE_TIMEOUT="3")
    started = time.monotonic()
    assert launch(_rank_one_stays_silent, config) == 1
    # spawning and importing torch take a few seconds; without the timeout rank 0 would wait 300 s
    assert time.monotonic() - started < 60


def _rank_one_aborts(context: RankContext, config) -> int:
    """Rank 1 dies of SIGABRT at once; rank 0 would go on for a minute."""
    if context.rank == 1:
        os.abort()
    time.sleep(60)
    return 0


@pytest.mark.timeout(120)
def test_a_rank_that_dies_of_a_signal_is_named_with_its_pid_and_signal(monkeypatch, capfd):
    config = two_cpu_ranks(monkeypatch)
    started = time.monotonic()
    assert launch(_rank_one_aborts, config) == 1
    assert time.monotonic() - started < 50  # rank 0 is stopped, not waited for
    stderr = capfd.readouterr().err
    assert re.search(r"^training failed: rank 1 \(pid \d+\) was killed by SIGABRT$", stderr, re.MULTILINE), stderr


def _rank_one_would_abort_in_teardown(context: RankContext, config) -> int:
    """Both ranks finish their work; rank 1 holds something that aborts the process if the
    interpreter's teardown runs (as a backend thread holding a tensor can)."""
    torch.distributed.all_reduce(torch.zeros(1))
    if context.rank == 1:
        atexit.register(os.abort)
    return 0


@pytest.mark.timeout(120)
def test_a_rank_that_finished_its_work_is_not_failed_by_interpreter_teardown(monkeypatch, capfd):
    config = two_cpu_ranks(monkeypatch)
    assert launch(_rank_one_would_abort_in_teardown, config) == 0
    assert "training failed" not in capfd.readouterr().err


def test_a_killed_rank_fails_the_job_and_its_last_checkpoint_resumes_on_another_world_size(tmp_path):
    checkpoint = tmp_path / "epid.pth"
    longer = {"EPID_CONTROL_POINTS": "34", "EPID_GAMMA_SAMPLES": "0"}

    # SIGKILL rank 0 once it has written a checkpoint: the job fails quickly
    log = tmp_path / "kill.log"
    process = start_script(run_env(checkpoint, EPID_WORLD_SIZE="2", EPID_EPOCHS="1000", **longer), log)
    try:
        wait_for(lambda: re.search(r"^epoch 1/", log.read_text(), re.MULTILINE), 150, "epoch 1")
        os.kill(rank_pids(log.read_text())[0], signal.SIGKILL)
        killed_at = time.monotonic()
        assert process.wait(timeout=90) != 0
        assert time.monotonic() - killed_at < 90
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text()
    # the launcher names the killed rank, or rank 1's error if rank 1 failed its collective first
    assert re.search(rf"^training failed(: rank 0 \(pid {rank_pids(text)[0]}\) was killed by SIGKILL$| on rank 1:)",
                     text, re.MULTILINE), text
    killed = load_checkpoint(checkpoint)
    assert killed["epoch"] >= 1 and killed["interrupted"] is None
    assert killed["history"]["steps_per_rank"][0] == [14, 14]  # 2 datasets x 7 windows on rank 0

    # the checkpoint left by the killed job resumes in one process
    result = run_script(run_env(checkpoint, EPID_RESUME="1", EPID_STEPS_PER_EPOCH="2",
                                EPID_EPOCHS=str(killed["epoch"] + 1), **longer))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "world size changes from 2 to 1" in result.stdout
    final = load_checkpoint(checkpoint)
    assert final["epoch"] == killed["epoch"] + 1 and final["run_id"] == killed["run_id"]
    assert len(final["history"]["train"]["total"]) == final["epoch"]


def test_non_finite_losses_stop_the_run_and_keep_the_last_good_checkpoint(two_rank_run, tmp_path, capsys):
    source, _ = two_rank_run
    checkpoint = tmp_path / "epid.pth"
    shutil.copy(source, checkpoint)
    before = sha256(checkpoint)
    config = load_config(run_env(checkpoint, EPID_RESUME="1", EPID_EPOCHS="4", EPID_LR="1e30",
                                 EPID_MAX_NONFINITE_STEPS="2", EPID_GAMMA_SAMPLES="0"))
    assert loop.launch(config) == 1  # one rank: runs in this process
    captured = capsys.readouterr()
    assert "epoch 3 step 2: non-finite loss on some rank, step skipped (1 in a row)" in captured.out
    assert "2 consecutive optimizer steps had a non-finite loss" in captured.err
    assert "checkpoint of epoch 2" in captured.err
    assert sha256(checkpoint) == before


def _bad_kernel(tmp_path: Path) -> str:
    path = tmp_path / "kernel.mat"
    path.write_bytes(b"not a MATLAB file")
    return str(path)


@pytest.mark.parametrize(
    "case", ["nccl on cpu", "bad kernel file", "other model size", "epochs already done", "cuda", "unwritable folder"]
)
def test_launch_checks_reject_bad_input(case, two_rank_run, tmp_path):
    source, _ = two_rank_run
    checkpoint = tmp_path / "epid.pth"
    shutil.copy(source, checkpoint)
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    overrides, error, message = {
        "nccl on cpu": ({"EPID_BACKEND": "nccl", "EPID_WORLD_SIZE": "2"}, LaunchError, "nccl needs CUDA"),
        "bad kernel file": ({"EPID_KERNEL": _bad_kernel(tmp_path)}, InputError, "kernel.mat"),
        "other model size": ({"EPID_RESUME": "1", "EPID_MODEL_SIZE": "small"}, CheckpointError, "EPID_MODEL_SIZE"),
        "epochs already done": ({"EPID_RESUME": "1", "EPID_EPOCHS": "2"}, CheckpointError, "EPID_EPOCHS above 2"),
        "cuda": ({"EPID_DEVICE": "cuda"}, InputError, "CUDA is not available"),
        "unwritable folder": ({"EPID_CHECKPOINT_PATH": str(blocker / "epid.pth")}, InputError, "cannot write there"),
    }[case]
    with pytest.raises(error, match=message):
        preflight.check(load_config(run_env(checkpoint, **overrides)))


@pytest.mark.parametrize("case", ["more ranks than datasets", "bad kernel file"])
def test_input_errors_exit_2_before_any_rank_starts(case, tmp_path):
    checkpoint = tmp_path / "run" / "epid.pth"
    overrides = {
        "more ranks than datasets": {"EPID_WORLD_SIZE": "4"},
        "bad kernel file": {"EPID_WORLD_SIZE": "2", "EPID_KERNEL": _bad_kernel(tmp_path)},
    }[case]
    result = run_script(run_env(checkpoint, **overrides), timeout=100)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("generate_and_train.py: error: "), result.stderr
    assert "rank 0/" not in result.stdout  # no rank was started
    assert not checkpoint.parent.exists()


def test_the_dry_run_makes_the_launch_checks_and_starts_nothing(two_rank_run, tmp_path):
    result = run_script(run_env(tmp_path / "run" / "epid.pth", EPID_DRY_RUN="1", EPID_KERNEL=_bad_kernel(tmp_path)))
    assert result.returncode == 2 and "kernel file" in result.stderr and "kernel.mat" in result.stderr
    source, _ = two_rank_run
    checkpoint = tmp_path / "epid.pth"
    shutil.copy(source, checkpoint)
    result = run_script(run_env(checkpoint, EPID_DRY_RUN="1", EPID_RESUME="1", EPID_EPOCHS="3", EPID_BATCH_SIZE="2"))
    assert result.returncode == 0, result.stderr
    assert "Resuming" in result.stdout and "batch_size changes from 4 to 2" in result.stdout
    assert "rank 0: " in result.stdout and not re.search(r"^epoch \d", result.stdout, re.MULTILINE)
    assert not (tmp_path / "run").exists() and load_checkpoint(checkpoint)["epoch"] == 2



def test_two_ranks_train_the_aperture_family_on_an_mlc_with_x_jaws(tmp_path):
    """Millennium 120, whose arcs have X jaws: two gloo ranks train the aperture family without a
    parameter DistributedDataParallel waits for in vain; the forward model learns the X jaws' own
    physics, the inverse model's aperture holds it."""
    checkpoint = tmp_path / "epid.pth"
    result = run_script(run_env(checkpoint, EPID_MODEL="aperture", EPID_MLC="millennium120", EPID_WORLD_SIZE="2",
                                EPID_BACKEND="gloo", EPID_EPOCHS="1", EPID_STEPS_PER_EPOCH="3",
                                EPID_DATASET_IDS="18,34", EPID_PHYSICS="realistic", EPID_GAMMA_SAMPLES="0"))
    assert result.returncode == 0, result.stderr[-3000:]
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert saved["model_config"]["forward"]["x_jaws"] is True
    assert float(saved["forward_model"]["aperture.x_jaw_transmission_change_percent"]) != 0.0
    assert float(saved["inverse_model"]["aperture.x_jaw_transmission_change_percent"]) == 0.0
