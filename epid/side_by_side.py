"""The forward and inverse models side by side on CPU threads.

On a GPU one training step is a queue of kernels; on a CPU it is a chain of operators, each
split over every thread. At the batch sizes a CPU trains with (8 samples) many operators are
too small or too memory-bound to keep all threads busy, and every one pays for waking and
joining the thread team. The two models are independent until the loss, so on the CPU they
can run at the same time, each on its own share of the threads:

1. forward passes: the forward model in one worker thread, the inverse model in another, each
   under the caller's grad mode and autocast setting;
2. the loss, in the caller's thread, on the models' outputs cut from their graphs;
3. ``backward(loss)``: the loss graph back to the cut outputs, then both models' backward
   passes again in the two workers (their parameters are disjoint, so nothing is shared).

Gradients equal those of the sequential step up to floating-point summation order. OpenMP
thread counts are per calling thread, so each worker keeps its own count for its lifetime
and the caller's count is left as it was. Measured on the 2-core CPU (bench/bench_models.py,
batch 8, bf16): see the README's Performance section.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from epid.train import CrossModel

Outputs = tuple[Tensor, ...]


def _use_threads(count: int) -> None:
    """Worker initialiser: fix this thread's intra-op thread count (OpenMP and MKL keep it per thread)."""
    torch.get_num_threads()  # torch's per-thread lazy initialisation first, so that it cannot undo the next line
    torch.set_num_threads(count)


def _run(grad: bool, autocast_dtype: torch.dtype | None, module: nn.Module, *inputs: Tensor) -> Outputs:
    """``module(*inputs)`` under the given grad mode and CPU autocast setting (both are per thread)."""
    with torch.set_grad_enabled(grad), torch.autocast(
        "cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        return module(*inputs)


def _cut(outputs: Outputs) -> Outputs:
    """Leaf copies of a model's outputs: the loss graph stops at them and collects their gradients."""
    return tuple(output.detach().requires_grad_(output.requires_grad) for output in outputs)


def _backward_through(outputs: Outputs, cut: Outputs) -> None:
    """Continue the backward pass from the cut copies' gradients into the model behind ``outputs``."""
    pairs = [(output, leaf.grad) for output, leaf in zip(outputs, cut) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])


def used_for(device: torch.device, threads: int, *, distributed: bool, compiled: bool) -> bool:
    """Whether training runs the models side by side: one CPU rank, 2+ threads, eager mode."""
    return device.type == "cpu" and threads >= 2 and not distributed and not compiled


class SideBySide:
    """Runs a ``CrossModel``'s two models at the same time on the CPU, ``threads`` threads in all.

    Call it like the model; when gradients are enabled, finish the step with ``backward(loss)``
    instead of ``loss.backward()``. The inverse model, the larger of the two, gets the odd thread.
    Not for DistributedDataParallel (its gradient hooks expect one backward pass per step).
    """

    def __init__(self, model: CrossModel, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"side-by-side models need at least 2 threads, got {threads}")
        devices = {parameter.device.type for parameter in model.parameters()}
        if devices != {"cpu"}:
            raise ValueError(f"side-by-side models run on the CPU, got parameters on {sorted(devices)}")
        self.model = model
        inverse_threads = (threads + 1) // 2
        self.threads = (threads - inverse_threads, inverse_threads)
        self._workers = tuple(
            ThreadPoolExecutor(1, thread_name_prefix=f"epid-{name}", initializer=_use_threads, initargs=(count,))
            for name, count in zip(("forward", "inverse"), self.threads)
        )
        caller_threads = torch.get_num_threads()
        for worker in self._workers:  # start both now: their initialisers also set torch's default for new threads
            worker.submit(torch.get_num_threads).result()
        torch.set_num_threads(caller_threads)
        self._pending: tuple[tuple[Outputs, Outputs], tuple[Outputs, Outputs]] | None = None

    def worker_threads(self) -> tuple[int, int]:
        """The intra-op thread counts the (forward, inverse) workers actually use."""
        counts = [worker.submit(torch.get_num_threads).result() for worker in self._workers]
        return counts[0], counts[1]

    def __call__(
        self, leaf_a: Tensor, leaf_b: Tensor, scalars: Tensor, epid_prev: Tensor, epid_curr: Tensor
    ) -> tuple[Outputs, Outputs]:
        """``(forward model output, inverse model output)``, as ``CrossModel.forward`` returns them."""
        grad = torch.is_grad_enabled()
        dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
        forward_job = self._workers[0].submit(_run, grad, dtype, self.model.forward_model, leaf_a, leaf_b, scalars)
        inverse_job = self._workers[1].submit(_run, grad, dtype, self.model.inverse_model, epid_prev, epid_curr)
        forward_out, inverse_out = forward_job.result(), inverse_job.result()
        if not grad:
            return forward_out, inverse_out
        forward_cut, inverse_cut = _cut(forward_out), _cut(inverse_out)
        self._pending = ((forward_out, forward_cut), (inverse_out, inverse_cut))
        return forward_cut, inverse_cut

    def backward(self, loss: Tensor) -> None:
        """Gradients of ``loss`` (computed from the last call's outputs) into both models' parameters."""
        if self._pending is None:
            raise RuntimeError("SideBySide.backward needs a preceding call with gradients enabled")
        pending, self._pending = self._pending, None
        loss.backward()
        jobs = [worker.submit(_backward_through, *model_pending) for worker, model_pending in zip(self._workers, pending)]
        for job in jobs:
            job.result()

    def close(self) -> None:
        """Stop the worker threads."""
        for worker in self._workers:
            worker.shutdown()
