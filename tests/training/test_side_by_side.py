"""The forward and inverse models side by side on CPU threads: same outputs and gradients as the
sequential step, per-worker thread counts, and a real single-rank training run that uses it."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

from epid.models.families import CrossModel, build_models
from epid.models.losses import cross_training_loss
from epid.training.side_by_side import SideBySide, has_towers, used_for
from tests.models.test_legacy import training_batch
from tests.support import ROOT, clean_environment


@pytest.fixture
def threads():
    """Run the test with 3 torch threads in this thread, restoring the previous count afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    yield 3
    torch.set_num_threads(before)


def step(runner, model: CrossModel, batch, autocast: torch.dtype | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and parameter gradients of one cross-training step run by ``runner``."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
        forward_out, inverse_out = runner(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
    loss = cross_training_loss(forward_out, inverse_out, batch)["total"]
    runner.backward(loss)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def small_pair(threads):
    """The small models placed for training, a batch of 3 samples, and a side-by-side runner of them."""
    torch.manual_seed(0)
    model = CrossModel(*build_models("small", "legacy")).place(torch.device("cpu"))
    runner = SideBySide(model, threads)
    yield model, training_batch(3), runner
    runner.close()


def test_side_by_side_step_gives_the_sequential_loss_and_gradients(small_pair):
    model, batch, runner = small_pair
    want_loss, want_grads = step(model, model, batch, None)
    got_loss, got_grads = step(runner, model, batch, None)
    assert all(grad.abs().sum() > 0 for grad in got_grads)
    # only the summation order differs (one thread per model instead of several per operator)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=0)
    for want, got in zip(want_grads, got_grads, strict=True):
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_side_by_side_bf16_gradients_differ_from_sequential_ones_only_by_bf16_rounding(small_pair):
    """In bf16 another summation order changes a gradient by as much as bf16 rounding does: the
    side-by-side gradients stay within a few times the sequential bf16 step's distance from fp32."""
    model, batch, runner = small_pair
    _, exact_grads = step(model, model, batch, None)
    want_loss, want_grads = step(model, model, batch, torch.bfloat16)
    got_loss, got_grads = step(runner, model, batch, torch.bfloat16)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-2, atol=0)
    for exact, want, got in zip(exact_grads, want_grads, got_grads, strict=True):
        rounding = (want - exact).norm()
        assert (got - want).norm() <= 4 * rounding + 1e-3 * exact.norm()
    exact, got = (torch.cat([grad.flatten() for grad in grads]) for grads in (exact_grads, got_grads))
    assert (got - exact).norm() <= 0.05 * exact.norm()  # bf16 rounding of the whole gradient stays small


def test_workers_keep_their_own_thread_counts_and_the_callers_is_unchanged(threads):
    runner = SideBySide(CrossModel(*build_models("tiny", "legacy")), threads)
    try:
        assert runner.threads == (1, 2)  # the inverse model, the larger one, gets the odd thread
        assert runner.worker_threads() == (1, 2)
        assert torch.get_num_threads() == threads
    finally:
        runner.close()


def test_the_prev_frame_tower_runs_with_the_forward_model_and_the_rest_in_the_inverse_worker(threads):
    torch.manual_seed(0)
    model = CrossModel(*build_models("tiny", "legacy")).place(torch.device("cpu"))
    inverse = model.inverse_model
    parts = {
        "forward model": model.forward_model,
        "prev tower": inverse.prev_encoder,
        "curr tower": inverse.curr_encoder,
        "inverse decoder": inverse.decoder,
        "inverse memory": inverse.memory_layers[0],
    }
    seen: dict[str, set[str]] = {}

    def record(event: str):
        return lambda *_: seen.setdefault(event, set()).add(threading.current_thread().name.split("_")[0])

    for name, part in parts.items():
        part.register_forward_hook(record(f"{name} forward"))
        for parameter in part.parameters():  # parameter hooks run where the parameter's gradient is computed
            parameter.register_hook(record(f"{name} backward"))
    runner = SideBySide(model, threads)
    try:
        step(runner, model, training_batch(3), torch.bfloat16)
    finally:
        runner.close()
    in_forward_worker = {"forward model", "prev tower"}
    for name in parts:
        worker = "epid-forward" if name in in_forward_worker else "epid-inverse"
        assert seen[f"{name} forward"] == {worker}, name
        assert seen[f"{name} backward"] == {worker}, name


class WholeInverseModel(torch.nn.Module):
    """An inverse model without split points (no ``encode`` / ``decode``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, epid_prev: torch.Tensor, epid_curr: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.inner(epid_prev, epid_curr)


def test_an_inverse_model_without_split_points_runs_whole_in_the_inverse_worker(threads):
    torch.manual_seed(0)
    forward_model, inverse_model = build_models("small", "legacy")
    model = CrossModel(forward_model, WholeInverseModel(inverse_model)).place(torch.device("cpu"))
    seen: dict[str, set[str]] = {}
    for name, part in (("forward model", forward_model), ("inverse model", inverse_model)):
        part.register_forward_hook(lambda *_, name=name: seen.setdefault(name, set()).add(
            threading.current_thread().name.split("_")[0]))
    batch = training_batch(3)
    runner = SideBySide(model, threads)
    try:
        assert not runner.towers
        want_loss, want_grads = step(model, model, batch, None)
        seen.clear()
        got_loss, got_grads = step(runner, model, batch, None)
    finally:
        runner.close()
    assert seen == {"forward model": {"epid-forward"}, "inverse model": {"epid-inverse"}}
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-4, atol=0)
    for want, got in zip(want_grads, got_grads, strict=True):
        assert got.abs().sum() > 0
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_without_gradients_it_returns_the_models_outputs_and_backward_needs_a_graph(threads):
    torch.manual_seed(0)
    model = CrossModel(*build_models("tiny", "legacy")).eval()
    batch = training_batch(2)
    runner = SideBySide(model, threads)
    try:
        with torch.no_grad():
            want = model(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
            got = runner(batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr)
        for want_part, got_part in zip(want, got, strict=True):
            for want_tensor, got_tensor in zip(want_part, got_part, strict=True):
                assert not got_tensor.requires_grad
                assert (got_tensor - want_tensor).abs().max() <= 1e-4 * want_tensor.abs().max()
        with pytest.raises(RuntimeError, match="preceding call with gradients enabled"):
            runner.backward(torch.zeros((), requires_grad=True))
    finally:
        runner.close()


def test_used_only_for_a_single_eager_cpu_rank_with_several_threads():
    cpu = torch.device("cpu")
    legacy, aperture = build_models("tiny", "legacy")[1], build_models("tiny", "aperture")[1]
    assert used_for(cpu, 2, legacy, distributed=False, compiled=False)
    assert not used_for(cpu, 1, legacy, distributed=False, compiled=False)
    assert not used_for(cpu, 4, legacy, distributed=True, compiled=False)
    assert not used_for(cpu, 4, legacy, distributed=False, compiled=True)
    assert not used_for(torch.device("meta"), 4, legacy, distributed=False, compiled=False)
    assert not used_for(cpu, 2, aperture, distributed=False, compiled=False)
    assert used_for(cpu, 2, type(legacy), distributed=False, compiled=False)  # a family's class answers alike
    assert has_towers(legacy) and not has_towers(aperture)
    with pytest.raises(ValueError, match="at least 2 threads"):
        SideBySide(CrossModel(*build_models("tiny", "legacy")), 1)
    with pytest.raises(ValueError, match="run on the CPU"):
        SideBySide(CrossModel(*build_models("tiny", "legacy")).to("meta"), 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["legacy", "aperture"])
def test_a_single_rank_two_thread_run_trains_side_by_side_when_the_inverse_model_has_towers(tmp_path, family):
    checkpoint = tmp_path / "epid.pth"
    env = clean_environment(
        EPID_MODEL=family, EPID_CONTROL_POINTS="12", EPID_DATASET_IDS="0", EPID_MODEL_SIZE="tiny", EPID_BATCH_SIZE="4",
        EPID_GAMMA_SAMPLES="2", EPID_THREADS="2", EPID_DEVICE="cpu", EPID_PROGRESS="0", EPID_EPOCHS="3",
        EPID_CHECKPOINT_PATH=str(checkpoint),
    )
    result = subprocess.run([sys.executable, str(ROOT / "generate_and_train.py")], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    side_by_side = "2 thread(s) (forward and inverse models side by side on 1 + 1)" in result.stdout
    assert side_by_side == (family == "legacy") and "2 thread(s)" in result.stdout
    saved = torch.load(checkpoint, weights_only=True)
    assert saved["epoch"] == 3
    train_totals = saved["history"]["train"]["total"]
    assert len(train_totals) == 3 and all(torch.isfinite(torch.tensor(train_totals)))
    assert train_totals[-1] < train_totals[0]
