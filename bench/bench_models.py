"""Training-step throughput of the forward and inverse models on this machine.

For each batch size and variant (precision, models side by side, torch.compile) it times a full
cross-training step (both models forward, cross-training loss, backward, AdamW step) with the
models placed as training places them (``CrossModel.place``: channels_last weights on the CPU)
and prints the median step time, samples/s, FLOPs per sample (torch.utils.flop_counter.FlopCounterMode,
forward + backward), the achieved FLOP rate and its fraction of the machine's measured matmul
peak in the same precision, after the CPU's features and the precision EPID_PRECISION=auto
chooses on this machine. Variants are timed round-robin, one step each per round, so that
load from other processes on a shared machine affects all of them alike.

    python -m bench.bench_models                      # fp32, bf16, bf16 side by side; batch 8 and 32
    python -m bench.bench_models --model legacy       # the legacy family's models
    python -m bench.bench_models --variants bf16 bf16+compile --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass

# isort: off
import epid  # noqa: F401  (first: sets the OpenMP wait policy of training before torch loads)
# isort: on

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from epid.core.devices import choose_precision
from epid.data.dataset import Batch
from epid.models.families import DEFAULT_FAMILY, FAMILIES, CrossModel, build_models
from epid.models.losses import cross_training_loss
from epid.synthesis.geometry import GRID_SIZE, NUM_LEAF_PAIRS
from epid.training.distributed import tune_host_allocator
from epid.training.side_by_side import SideBySide

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def synthetic_batch(batch_size: int, device: torch.device, seed: int = 0) -> Batch:
    """Plausible random control points and frames: bank A <= bank B, MU in [1, 40]."""
    gen = torch.Generator().manual_seed(seed)
    leaves = 2 * NUM_LEAF_PAIRS
    leaf_a = torch.rand(batch_size, leaves, generator=gen) * -60.0
    leaf_b = leaf_a + 10.0 + torch.rand(batch_size, leaves, generator=gen) * 50.0
    mu = 1.0 + 39.0 * torch.rand(batch_size, 1, generator=gen)
    jaw_1 = -100.0 + 40.0 * torch.rand(batch_size, 2, generator=gen)
    jaw_2 = jaw_1 + 20.0 + 80.0 * torch.rand(batch_size, 2, generator=gen)
    weights = torch.where(torch.rand(batch_size, leaves, generator=gen) < 0.5, 1.0, 0.5)
    frames = torch.rand(batch_size + 1, 1, GRID_SIZE, GRID_SIZE, generator=gen) * mu.mean()
    batch = Batch(
        leaf_a=leaf_a,
        leaf_b=leaf_b,
        scalars=torch.cat([mu, jaw_1[:, :1], jaw_1[:, 1:], jaw_2[:, :1], jaw_2[:, 1:]], dim=1),
        leaf_weight_a=weights,
        leaf_weight_b=weights.flip(1),
        epid_prev=frames[:-1],
        epid_curr=frames[1:],
        frames=frames,
    )
    return batch.to(device)


@dataclass(frozen=True)
class Variant:
    """One way of running the step: autocast dtype (None = fp32), the two models side by side on
    their own CPU threads (``epid.training.side_by_side``, as training runs a single CPU rank), torch.compile."""

    name: str
    autocast_dtype: torch.dtype | None
    side_by_side: bool
    compile: bool

    @classmethod
    def parse(cls, name: str) -> Variant:
        parts = name.split("+")
        if parts[0] not in PRECISIONS or not set(parts[1:]) <= {"side", "compile"}:
            raise SystemExit(f"variant {name!r}: expected PRECISION[+side][+compile], PRECISION in {list(PRECISIONS)}")
        if "side" in parts and "compile" in parts:
            raise SystemExit(f"variant {name!r}: side and compile do not combine (training uses one or the other)")
        return cls(name, PRECISIONS[parts[0]], "side" in parts, "compile" in parts)


class TrainingStep:
    """Both models, AdamW (fused) and the cross-training loss, run as one callable step."""

    def __init__(self, variant: Variant, size: str, device: torch.device, family: str = DEFAULT_FAMILY,
                 seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.variant = variant
        self.device = device
        model = CrossModel(*build_models(size, family)).place(device)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4, fused=True)
        self.runner = torch.compile(model) if variant.compile else model
        if variant.side_by_side:
            self.runner = SideBySide(model, torch.get_num_threads())

    def loss(self, batch: Batch) -> torch.Tensor:
        """Total cross-training loss of ``batch`` under the variant's autocast setting."""
        dtype = self.variant.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            forward_out, inverse_out = self.runner(
                batch.leaf_a, batch.leaf_b, batch.scalars, batch.epid_prev, batch.epid_curr
            )
        return cross_training_loss(forward_out, inverse_out, batch)["total"]

    def __call__(self, batch: Batch) -> None:
        """One optimizer step on ``batch``."""
        self.runner.backward(self.loss(batch))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Stop the side-by-side worker threads, if any."""
        if isinstance(self.runner, SideBySide):
            self.runner.close()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(dtype: torch.dtype, device: torch.device, repeats: int = 10, budget_s: float = 5.0) -> float:
    """Best FLOP/s of square matmuls (n = 1024, 2048, 4096) in ``dtype``: the measured peak.

    Each size gets at most ``repeats`` products or about ``budget_s`` seconds, and a size is
    skipped when its product would take longer than that (8 times the size before): on CPUs
    without native bfloat16 (AVX2) one bf16 product of n = 4096 takes minutes.
    """
    best, seconds_each = 0.0, 0.0
    for n in (1024, 2048, 4096):
        if seconds_each * 8 > budget_s:
            break
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        times: list[float] = []
        while len(times) < repeats and sum(times) < budget_s:
            synchronize(device)
            start = time.perf_counter()
            a @ b
            synchronize(device)
            times.append(time.perf_counter() - start)
        seconds_each = min(times)
        best = max(best, 2.0 * n**3 / seconds_each)
    return best


def flops_per_sample(size: str, batch_size: int, device: torch.device, family: str = DEFAULT_FAMILY) -> float:
    """Forward + backward FLOPs of one fp32 cross-training step, per sample (optimizer excluded).

    Attention runs as explicit matrix products here: FlopCounterMode does not count the fused
    CPU attention kernel.
    """
    step = TrainingStep(Variant.parse("fp32"), size, device, family)
    batch = synthetic_batch(batch_size, device)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        step.loss(batch).backward()
    return counter.get_total_flops() / batch_size


def time_variants(
    variants: list[Variant], size: str, batch_size: int, device: torch.device, steps: int, warmup: int,
    family: str = DEFAULT_FAMILY,
) -> dict[str, list[tuple[float, float]]]:
    """(wall, process CPU) seconds of each step per variant, timed round-robin after warmup.

    The process CPU time counts the work of all threads; on a machine shared with other jobs it
    stays meaningful when the wall time does not (OMP_WAIT_POLICY=PASSIVE, the default here,
    keeps waiting threads from spinning).
    """
    batch = synthetic_batch(batch_size, device)
    runners = {v.name: TrainingStep(v, size, device, family) for v in variants}
    for runner in runners.values():
        for _ in range(warmup + (2 if runner.variant.compile else 0)):
            runner(batch)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(steps):
        for name, runner in runners.items():
            synchronize(device)
            start, start_cpu = time.perf_counter(), time.process_time()
            runner(batch)
            synchronize(device)
            times[name].append((time.perf_counter() - start, time.process_time() - start_cpu))
    return times


def profile_variant(
    variant: Variant, size: str, batch_size: int, device: torch.device, rows: int, shapes: bool = False,
    family: str = DEFAULT_FAMILY,
) -> None:
    """Print the operators that take the most time in two steps of ``variant``."""
    from torch.profiler import ProfilerActivity, profile

    runner = TrainingStep(variant, size, device, family)
    batch = synthetic_batch(batch_size, device)
    for _ in range(3):
        runner(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(2):
            runner(batch)
    sort_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\nprofile: {variant.name}, batch {batch_size} (two steps)")
    print(prof.key_averages(group_by_input_shape=shapes).table(sort_by=sort_key, row_limit=rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.bench_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--variants", nargs="+", default=["fp32", "bf16", "bf16+side"],
        help="PRECISION[+side][+compile], PRECISION in fp32|bf16|fp16 (side = the models side by side)",
    )
    parser.add_argument("--model", default=DEFAULT_FAMILY, choices=sorted(FAMILIES),
                        help=f"model family (default {DEFAULT_FAMILY})")
    parser.add_argument("--size", default="full", help="model size preset of the family")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--profile", action="store_true", help="print a torch.profiler table per variant")
    parser.add_argument("--profile-shapes", action="store_true", help="group the profile by input shapes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    allocator_tuned = tune_host_allocator()  # as in training: reuse freed activation memory
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    variants = [Variant.parse(name) for name in args.variants]
    peaks = {
        dtype: matmul_peak_flops(dtype or torch.float32, device)
        for dtype in {v.autocast_dtype for v in variants}
    }
    print(
        f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, host allocator tuned {allocator_tuned}, "
        f"model {args.model} {args.size}"
    )
    auto = choose_precision("auto", device)
    print(f"EPID_PRECISION=auto would train in {auto.name} here ({auto.reason})")
    for dtype, peak in peaks.items():
        print(f"measured matmul peak {dtype or torch.float32!s:>15}: {peak / 1e12:.3g} TFLOP/s")
    header = (
        f"{'variant':<22}{'batch':>6}{'step ms':>10}{'samples/s':>11}{'GFLOP/sample':>14}"
        f"{'TFLOP/s':>9}{'% peak':>8}{'cpu ms':>9}"
    )
    rows = []
    for batch_size in args.batch_sizes:
        flops = flops_per_sample(args.size, batch_size, device, args.model)
        times = time_variants(variants, args.size, batch_size, device, args.steps, args.warmup, args.model)
        for variant in variants:
            step_s = statistics.median(wall for wall, _ in times[variant.name])
            cpu_s = statistics.median(cpu for _, cpu in times[variant.name])
            rate = flops * batch_size / step_s
            rows.append(
                f"{variant.name:<22}{batch_size:>6}{step_s * 1e3:>10.1f}{batch_size / step_s:>11.1f}"
                f"{flops / 1e9:>14.2f}{rate / 1e12:>9.3f}{100 * rate / peaks[variant.autocast_dtype]:>8.1f}"
                f"{cpu_s * 1e3:>9.1f}"
            )
        if args.profile:
            for variant in variants:
                profile_variant(variant, args.size, batch_size, device, rows=25, shapes=args.profile_shapes,
                                family=args.model)
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
