"""EPID_PRECISION=auto on the CPU: the decision on timings, its cache, the family allow-list and a
real timing of tiny models."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from epid.config.load import load_config
from epid.core.devices import PrecisionChoice
from epid.training import precision
from epid.training.distributed import RankContext
from epid.training.precision import Timings, Workload, bf16_wins, choose_run_precision

CPU = torch.device("cpu")
LEGACY_TINY = Workload("legacy", "tiny", 4, 1, False)


class FakeTimer:
    """Timings given in advance (seconds per step), and how often they were asked for."""

    def __init__(self, fp32_s: float, bf16_s: float) -> None:
        self.timings = Timings(fp32_s, bf16_s, "training step")
        self.calls = 0

    def __call__(self, workload: Workload) -> Timings:
        self.calls += 1
        return self.timings


@pytest.mark.parametrize("fp32_s, bf16_s, chosen", [
    (0.40, 0.30, torch.bfloat16),  # 1.33x
    (0.40, 0.52, torch.float32),  # 0.77x
    (0.40, 0.40, torch.float32),  # a tie keeps fp32
    (0.40, 0.38, torch.float32),  # 1.05x: under the margin
])
def test_auto_keeps_bf16_only_when_it_trains_faster_by_the_margin(tmp_path, fp32_s, bf16_s, chosen):
    assert bf16_wins(Timings(fp32_s, bf16_s, "training step")) == (chosen == torch.bfloat16)
    choice = choose_run_precision("auto", CPU, LEGACY_TINY, cache=tmp_path / "precision.json",
                                  timer=FakeTimer(fp32_s, bf16_s))
    assert choice.dtype == chosen
    assert f"fp32 {1e3 * fp32_s:.1f} ms, bf16 {1e3 * bf16_s:.1f} ms" in choice.reason
    assert f"bf16 {fp32_s / bf16_s:.2f}x as fast as fp32, needs >= 1.10x" in choice.reason
    assert "legacy tiny models, batch 4, 1 thread(s)" in choice.reason


def test_timings_are_cached_per_machine_and_workload(tmp_path):
    cache = tmp_path / "cache" / "precision.json"
    timer = FakeTimer(0.40, 0.30)
    announced: list[str] = []
    first = choose_run_precision("auto", CPU, LEGACY_TINY, cache=cache, timer=timer, announce=announced.append)
    assert timer.calls == 1 and first.reason.endswith(f"timed now, cached in {cache}")
    assert announced == ["EPID_PRECISION=auto: timing fp32 against bf16 on this CPU "
                         "(legacy tiny models, batch 4, 1 thread(s))"]
    again = choose_run_precision("auto", CPU, LEGACY_TINY, cache=cache, timer=FakeTimer(0.40, 0.80),
                                 announce=announced.append)
    assert again.dtype == first.dtype == torch.bfloat16 and len(announced) == 1
    assert re.search(rf"; timed on \d{{4}}-\d\d-\d\d, cached in {re.escape(str(cache))}$", again.reason)
    other = Workload("legacy", "tiny", 8, 1, False)
    assert choose_run_precision("auto", CPU, other, cache=cache, timer=timer).dtype == torch.bfloat16
    assert timer.calls == 2
    entries = json.loads(cache.read_text())
    assert [entry["key"]["batch_size"] for entry in entries] == [4, 8]
    key = entries[0]["key"]
    assert key["cpu"] and key["cpu_features"] and key["torch"] == torch.__version__
    assert (key["family"], key["size"], key["threads"], key["side_by_side"]) == ("legacy", "tiny", 1, False)


def test_an_unreadable_cache_is_timed_again_and_an_unwritable_one_says_so(tmp_path):
    cache = tmp_path / "precision.json"
    cache.write_text("{half a file")
    timer = FakeTimer(0.40, 0.30)
    assert choose_run_precision("auto", CPU, LEGACY_TINY, cache=cache, timer=timer).dtype == torch.bfloat16
    assert timer.calls == 1 and len(json.loads(cache.read_text())) == 1
    blocked = tmp_path / "a file" / "precision.json"
    blocked.parent.write_text("not a folder")
    choice = choose_run_precision("auto", CPU, LEGACY_TINY, cache=blocked, timer=timer)
    assert choice.dtype == torch.bfloat16 and f"timed now, not cached ({blocked}: " in choice.reason


def test_families_outside_the_allow_list_and_explicit_precisions_are_not_timed(tmp_path):
    timer = FakeTimer(0.40, 0.10)
    cache = tmp_path / "precision.json"
    aperture = choose_run_precision("auto", CPU, Workload("aperture", "tiny", 4, 1, False), cache=cache, timer=timer)
    assert aperture.dtype == torch.float32
    assert "the aperture family's training quality in bf16 is not established" in aperture.reason
    assert choose_run_precision("bf16", CPU, LEGACY_TINY, cache=cache, timer=timer) == PrecisionChoice(
        torch.bfloat16, "EPID_PRECISION=bf16")
    assert choose_run_precision("fp32", CPU, LEGACY_TINY, cache=cache, timer=timer).dtype == torch.float32
    assert timer.calls == 0 and not cache.exists()


def test_the_cache_lives_in_the_users_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert precision.user_cache_dir() == tmp_path / "epid"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    if os.name != "nt":
        assert precision.user_cache_dir() == tmp_path / "home" / ".cache" / "epid"


def test_a_training_rank_takes_the_choice_of_auto_from_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timer = FakeTimer(0.40, 0.30)
    monkeypatch.setattr(precision, "time_training", timer)
    context = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="", threads=1)
    config = load_config({"EPID_MODEL": "legacy", "EPID_MODEL_SIZE": "tiny", "EPID_BATCH_SIZE": "4"})
    assert precision.agreed_precision(config, context).dtype == torch.bfloat16
    assert timer.calls == 1 and (tmp_path / "epid" / "precision.json").is_file()
    fixed = load_config({"EPID_MODEL": "legacy", "EPID_PRECISION": "fp32"})
    assert precision.agreed_precision(fixed, context).reason == "EPID_PRECISION=fp32"


def test_a_real_timing_of_tiny_models_names_both_timings(tmp_path):
    before = torch.get_rng_state()
    choice = choose_run_precision("auto", CPU, Workload("legacy", "tiny", 2, 1, False), cache=tmp_path / "p.json")
    assert torch.equal(torch.get_rng_state(), before)
    assert choice.dtype in (torch.float32, torch.bfloat16)
    match = re.search(r"per (.+?): fp32 ([\d.]+) ms, bf16 ([\d.]+) ms", choice.reason)
    assert match and float(match[2]) > 0 and float(match[3]) > 0, choice.reason


@pytest.mark.parametrize("workload", [Workload("legacy", "tiny", 2, 2, True),
                                      Workload("aperture", "tiny", 2, 1, False)])
def test_training_steps_are_timed_in_both_precisions(workload):
    timings = precision.time_steps(workload)
    assert timings.unit == "training step" and timings.fp32_s > 0 and timings.bf16_s > 0
