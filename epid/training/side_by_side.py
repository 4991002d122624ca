"""The forward and inverse models side by side on CPU threads.

On a GPU one training step is a queue of kernels; on a CPU it is a chain of operators, each
split over every thread. At the batch sizes a CPU trains with (8 samples) many operators are
too small or too memory-bound to keep all threads busy, and every one pays for waking and
joining the thread team. The two models are independent until the loss, so on the CPU they
can run at the same time, each on its own share of the threads.

The inverse model is the larger of the two (one thread, batch 8, bf16, forward and backward:
inverse about 270 ms, forward model about 185 ms, one of the inverse model's two encoder towers
about 55 ms), and its two towers are independent of each other. When the inverse model offers
them as split points (``encode(tower, frame)`` and ``decode(prev, curr)``, as the legacy
family's does), the work is split as:

* the forward worker: the inverse model's prev-frame tower, then the forward model;
* the inverse worker: the curr-frame tower, then the rest of the inverse model, which waits
  for the prev-frame tower's outputs.

Without split points the forward worker runs the forward model and the inverse worker the
whole inverse model. A step then runs

1. forward passes in the two workers as above, each under the caller's grad mode and autocast
   setting; every hand-over (tower outputs to the inverse worker, model outputs to the caller)
   is a leaf copy cut from the graph, which collects the gradient arriving at it;
2. the loss, in the caller's thread;
3. ``backward(loss)``: the loss graph back to the cut model outputs; then in the inverse worker
   the rest of the inverse model back to the cut tower outputs, then the curr-frame tower; in
   the forward worker the forward model, then (once the inverse worker has delivered its
   gradients) the prev-frame tower. The parts' parameters are disjoint.

Gradients equal those of the sequential step up to floating-point summation order. OpenMP
thread counts are per calling thread, so each worker keeps its own count for its lifetime
and the caller's count is left as it was. Measured on the 2-core CPU (bench/bench_models.py,
batch 8, bf16): see the README's Performance section.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from epid.models.families import predict_frames

if TYPE_CHECKING:
    from epid.models.families import CrossModel

Outputs = tuple[Tensor, ...]
Handover = tuple[Outputs, Outputs]  # (outputs in their graph, leaf copies cut from it)


def _use_threads(count: int) -> None:
    """Worker initialiser: fix this thread's intra-op thread count (OpenMP and MKL keep it per thread)."""
    torch.get_num_threads()  # torch's per-thread lazy initialisation first, so that it cannot undo the next line
    torch.set_num_threads(count)


def _run(grad: bool, autocast_dtype: torch.dtype | None, part: Callable[..., Outputs], *inputs: object) -> Outputs:
    """``part(*inputs)`` under the given grad mode and CPU autocast setting (both are per thread)."""
    with torch.set_grad_enabled(grad), torch.autocast(
        "cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None
    ):
        return part(*inputs)


def _handover(outputs: Outputs, grad: bool) -> Handover:
    """A part's outputs and, with gradients enabled, leaf copies of them: the graph after the
    copies stops there and collects their gradients (without gradients, the outputs themselves)."""
    if not grad:
        return outputs, outputs
    return outputs, tuple(output.detach().requires_grad_(output.requires_grad) for output in outputs)


def _backward_through(handover: Handover) -> None:
    """Continue the backward pass from the cut copies' gradients into the part behind the outputs."""
    outputs, cut = handover
    pairs = [(output, leaf.grad) for output, leaf in zip(outputs, cut, strict=True) if leaf.grad is not None]
    if pairs:
        torch.autograd.backward([output for output, _ in pairs], [grad for _, grad in pairs])


def _after(first: Future, handover: Handover) -> None:
    """``_backward_through(handover)`` once the job ``first`` (which delivers its gradients) is done."""
    first.result()
    _backward_through(handover)


def has_towers(inverse_model: torch.nn.Module | type) -> bool:
    """Whether an inverse model (or its class) offers its encoder towers as split points
    (``encode``, ``decode``)."""
    return all(hasattr(inverse_model, name) for name in ("encode", "decode"))


def used_for(device: torch.device, threads: int, inverse_model: torch.nn.Module | type, *, distributed: bool,
             compiled: bool) -> bool:
    """Whether training runs the models side by side: one CPU rank, 2+ threads, eager mode, and an
    inverse model (or its class) with split points (``has_towers``). Without them the forward
    worker idles while the other runs the whole inverse model: for the aperture family, whose
    forward model is a few matrix products, one model after the other on all threads is faster
    (README, Performance)."""
    return (device.type == "cpu" and threads >= 2 and not distributed and not compiled
            and has_towers(inverse_model))


class SideBySide:
    """Runs a ``CrossModel``'s two models at the same time on the CPU, ``threads`` threads in all.

    Call it like the model; when gradients are enabled, finish the step with ``backward(loss)``
    instead of ``loss.backward()``. The inverse worker gets the odd thread.
    Not for DistributedDataParallel (its gradient hooks expect one backward pass per step).
    """

    def __init__(self, model: CrossModel, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"side-by-side models need at least 2 threads, got {threads}")
        devices = {parameter.device.type for parameter in model.parameters()}
        if devices != {"cpu"}:
            raise ValueError(f"side-by-side models run on the CPU, got parameters on {sorted(devices)}")
        self.model = model
        self.towers = has_towers(model.inverse_model)
        inverse_threads = (threads + 1) // 2
        self.threads = (threads - inverse_threads, inverse_threads)
        self._workers = tuple(
            ThreadPoolExecutor(1, thread_name_prefix=f"epid-{name}", initializer=_use_threads, initargs=(count,))
            for name, count in zip(("forward", "inverse"), self.threads, strict=True)
        )
        caller_threads = torch.get_num_threads()
        for worker in self._workers:  # start both now: their initialisers also set torch's default for new threads
            worker.submit(torch.get_num_threads).result()
        torch.set_num_threads(caller_threads)
        # the last call's parts to run backward through, in order: (worker, hand-over, index of a part to wait for)
        self._pending: list[tuple[ThreadPoolExecutor, Handover, int | None]] = []

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
        forward_model, inverse_model = self.model.forward_model, self.model.inverse_model
        forward_worker, inverse_worker = self._workers
        if not self.towers:
            forward_job = forward_worker.submit(_run, grad, dtype, predict_frames, forward_model, leaf_a, leaf_b,
                                                scalars, epid_prev)
            inverse_job = inverse_worker.submit(_run, grad, dtype, inverse_model, epid_prev, epid_curr)
            forward_out, inverse_out = _handover(forward_job.result(), grad), _handover(inverse_job.result(), grad)
            self._pending = [(forward_worker, forward_out, None), (inverse_worker, inverse_out, None)] if grad else []
            return forward_out[1], inverse_out[1]

        def tower(name: str, frame: Tensor) -> Handover:
            return _handover(_run(grad, dtype, inverse_model.encode, name, frame), grad)

        def inverse_part(prev_job: Future) -> tuple[Handover, Handover, Handover]:
            curr = tower("curr", epid_curr)
            prev = prev_job.result()
            return _handover(_run(grad, dtype, inverse_model.decode, prev[1], curr[1]), grad), curr, prev

        prev_job = forward_worker.submit(tower, "prev", epid_prev)
        forward_job = forward_worker.submit(_run, grad, dtype, predict_frames, forward_model, leaf_a, leaf_b, scalars,
                                            epid_prev)
        inverse_job = inverse_worker.submit(inverse_part, prev_job)
        forward_out = _handover(forward_job.result(), grad)
        inverse_out, curr, prev = inverse_job.result()
        # the prev-frame tower's backward needs the gradients the rest of the inverse model (part 0) delivers
        parts = [(inverse_worker, inverse_out, None), (inverse_worker, curr, None), (forward_worker, forward_out, None),
                 (forward_worker, prev, 0)]
        self._pending = parts if grad else []
        return forward_out[1], inverse_out[1]

    def backward(self, loss: Tensor) -> None:
        """Gradients of ``loss`` (computed from the last call's outputs) into both models' parameters."""
        if not self._pending:
            raise RuntimeError("SideBySide.backward needs a preceding call with gradients enabled")
        parts, self._pending = self._pending, []
        loss.backward()
        jobs: list[Future] = []
        for worker, handover, first in parts:
            if first is None:
                jobs.append(worker.submit(_backward_through, handover))
            else:
                jobs.append(worker.submit(_after, jobs[first], handover))
        for job in jobs:
            job.result()

    def close(self) -> None:
        """Stop the worker threads."""
        for worker in self._workers:
            worker.shutdown()
