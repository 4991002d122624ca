"""EPID_PRECISION=auto on the CPU: bf16 or fp32 by timing the run's own training steps.

No CPU flag tells whether bf16 autocast trains faster. Measured training steps at batch 8: on
a Xeon with AMX tiles bf16 was 1.4x fp32 (legacy models); on a Xeon with AVX-512 BF16 and no
AMX, 0.77x; on a 2-core AMD EPYC with AVX-512 BF16 and no AMX, 1.3x (aperture models) and 2.0x
(legacy models, side by side); on AVX2 bf16 is emulated, about 9x slower. So ``auto`` times it:

* a 512 x 512 matrix product in each precision first: when bf16 takes over
  ``EMULATED_RATIO`` times as long, bf16 is emulated and no training step is timed;
* else ``WARMUP_ROUNDS`` + ``TIMED_ROUNDS`` rounds of one training step in each precision
  (both models forward, the cross-training loss, backward, the AdamW step), of the run's model
  family and size at its batch size, on its threads and placement (side by side or not), on
  random inputs of the training shapes; the rounds alternate the precisions, so that load
  from other processes slows both alike, and stop after ``BUDGET_S`` once two were timed.

bf16 is kept when its median step is at least ``MARGIN`` faster (``bf16_wins``) and the family
is in ``BF16_FAMILIES``. The timings are cached per machine and run shape (``cache_key``) in
``precision.json`` under the user's cache directory (``user_cache_dir``), so a machine times a
shape once; delete the file to time again. Rank 0 chooses before any rank trains and every
rank takes its choice (``agreed_precision``). The checkpoint records the choice and the CPU it was
made on (``precision_record``): a resumed run on the same CPU keeps it (``kept_precision``), so that it
resumes bit for bit though the cache has since been deleted or timed again. On CUDA and for an
explicit EPID_PRECISION the choice is ``epid.core.devices.choose_precision``'s.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from epid.config.load import Config
from epid.core.devices import PRECISION_NAMES, PrecisionChoice, choose_precision, cpu_features, cpu_model
from epid.core.files import temporary_path
from epid.data.dataset import Batch
from epid.models.families import LEGACY, CrossModel, build_models, family
from epid.models.losses import batch_losses
from epid.synthesis.geometry import GRID_SIZE, NUM_LEAF_PAIRS
from epid.training import distributed, side_by_side
from epid.training.distributed import RankContext
from epid.training.optimizer import build_optimizer, optimizer_step

MARGIN = 0.10
"""bf16 must train at least this much faster than fp32 (step time ratio fp32 / bf16 >= 1.10)."""
WARMUP_ROUNDS, TIMED_ROUNDS = 2, 4
BUDGET_S = 10.0
"""After this many seconds of training steps, timing stops once two rounds were timed."""
MATMUL_SIZE = 512
EMULATED_RATIO = 4.0
"""A bf16 matrix product that takes this many times as long as fp32 means emulated bf16."""
CACHE_NAME = "precision.json"
METHOD = 1
"""Version of the timing method, part of the cache key: a new method times again."""

BF16_FAMILIES = frozenset({LEGACY})
"""Families that ``auto`` may train in bf16 on the CPU (as it does on GPUs): the legacy family. Not
the aperture family: its training quality in bf16 is not established (no quality benchmark at
bf16 against fp32). Autocast keeps its parameters, the physical ones included, their gradients
and updates in fp32, and its detector response runs with autocast off, but the aperture
rendering's matrix products would run in bf16 (its frames differ from fp32 by about 0.3 % of
their maximum)."""

Timer = Callable[["Workload"], "Timings"]


@dataclass(frozen=True)
class Workload:
    """What a run trains, as far as its step time goes: the model family and size, the batch size
    (samples), the CPU threads of a rank and whether the two models run side by side
    (``epid.training.side_by_side``)."""

    family: str
    size: str
    batch_size: int
    threads: int
    side_by_side: bool

    @classmethod
    def of(cls, config: Config, context: RankContext) -> Workload:
        """The workload of a rank of the run ``config`` describes."""
        side = side_by_side.used_for(context.device, context.threads, family(config.model).inverse_model,
                                     distributed=context.distributed, compiled=config.compile)
        return cls(config.model, config.model_size, config.batch_size, context.threads, side)

    def text(self) -> str:
        """``legacy full models, batch 8, 2 thread(s), side by side``."""
        placement = ", side by side" if self.side_by_side else ""
        return f"{self.family} {self.size} models, batch {self.batch_size}, {self.threads} thread(s){placement}"


@dataclass(frozen=True)
class Timings:
    """Median seconds of one ``unit`` (a training step or a matrix product) in fp32 and in bf16."""

    fp32_s: float
    bf16_s: float
    unit: str

    @property
    def speedup(self) -> float:
        """How many times as fast bf16 runs as fp32."""
        return self.fp32_s / self.bf16_s

    def text(self) -> str:
        """``bf16 1.31x as fast as fp32, needs >= 1.10x; per training step: fp32 412.0 ms, bf16 315.0 ms``."""
        return (f"bf16 {self.speedup:.2f}x as fast as fp32, needs >= {1 + MARGIN:.2f}x; per {self.unit}: "
                f"fp32 {1e3 * self.fp32_s:.1f} ms, bf16 {1e3 * self.bf16_s:.1f} ms")


def bf16_wins(timings: Timings) -> bool:
    """Whether bf16 is at least ``MARGIN`` faster than fp32 (a tie keeps fp32)."""
    return timings.fp32_s >= (1.0 + MARGIN) * timings.bf16_s


def agreed_precision(config: Config, context: RankContext, started: dict[str, str] | None = None) -> PrecisionChoice:
    """The run's autocast precision, the same on every rank: with EPID_PRECISION=auto on the CPU,
    rank 0 chooses and the others take its choice. A resumed run (``started``: its checkpoint's
    ``precision_record``) keeps the precision it started in where rank 0 runs on the same CPU, so that
    it resumes bit for bit whatever the cache holds now; otherwise ``choose_run_precision`` chooses,
    saying when it times."""
    if config.precision != "auto" or context.device.type != "cpu":
        return choose_precision(config.precision, context.device)
    choice = None
    if context.is_main:
        choice = kept_precision(started) or choose_run_precision(
            "auto", context.device, Workload.of(config, context), announce=lambda line: print(line, flush=True))
    return distributed.gather_objects(choice)[0]


def this_cpu() -> dict[str, str]:
    """The CPU that timings and choices of precision hold for: its model name and features."""
    return {"cpu": cpu_model(), "cpu_features": cpu_features().text()}


def precision_record(choice: PrecisionChoice) -> dict[str, str]:
    """What a checkpoint keeps of the run's precision: its name and the CPU it was chosen on (``this_cpu``)."""
    return {"name": choice.name, **this_cpu()}


def kept_precision(started: dict[str, str] | None) -> PrecisionChoice | None:
    """The precision of ``started`` (a checkpoint's ``precision_record``) where it was chosen on this
    CPU, else None (no record, another CPU, or a name this torch does not know)."""
    if not started or {key: started.get(key) for key in ("cpu", "cpu_features")} != this_cpu():
        return None
    dtype = {name: dtype for dtype, name in PRECISION_NAMES.items()}.get(started.get("name", ""))
    if dtype is None:
        return None
    return PrecisionChoice(dtype, f"auto: {started['name']}, the precision this run started in on this CPU, kept "
                                  "from its checkpoint")


def choose_run_precision(spec: str, device: torch.device, workload: Workload, *, cache: Path | None = None,
                         timer: Timer | None = None,
                         announce: Callable[[str], None] | None = None) -> PrecisionChoice:
    """The autocast dtype EPID_PRECISION ``spec`` gives for ``workload`` on ``device``, with the reason.

    ``auto`` on the CPU: fp32 for a family outside ``BF16_FAMILIES``; else the timings cached for
    this machine and workload in ``cache`` (default ``user_cache_dir() / CACHE_NAME``), or new ones
    from ``timer`` (default ``time_training``; ``announce`` is told first), cached; bf16 when
    ``bf16_wins``. Otherwise ``epid.core.devices.choose_precision``.
    """
    if spec != "auto" or device.type != "cpu":
        return choose_precision(spec, device)
    if workload.family not in BF16_FAMILIES:
        return PrecisionChoice(torch.float32, f"auto: not timed, the {workload.family} family's training quality in "
                                              f"bf16 is not established (auto allows bf16 for: "
                                              f"{', '.join(sorted(BF16_FAMILIES))}); EPID_PRECISION=bf16 uses it")
    path = cache or user_cache_dir() / CACHE_NAME
    key = cache_key(workload)
    entries = read_cache(path)
    found = next((entry for entry in entries if entry.get("key") == key), None)
    if found is not None:
        timings = Timings(**found["timings"])
        source = f"timed on {found['date']}, cached in {path}"
    else:
        if announce is not None:
            announce(f"EPID_PRECISION=auto: timing fp32 against bf16 on this CPU ({workload.text()})")
        timings = (timer or time_training)(workload)
        source = f"timed now, {write_cache(path, entries, key, timings)}"
    dtype = torch.bfloat16 if bf16_wins(timings) else torch.float32
    return PrecisionChoice(dtype, f"auto: {timings.text()}; {workload.text()}; {source}")


# --------------------------------------------------------------------------- cache


def user_cache_dir() -> Path:
    """This user's cache folder for the project: ``$XDG_CACHE_HOME/epid``, on Windows
    ``%LOCALAPPDATA%\\epid``, else ``~/.cache/epid``."""
    base = os.environ.get("XDG_CACHE_HOME") or (os.environ.get("LOCALAPPDATA", "") if os.name == "nt" else "")
    return (Path(base) if base else Path.home() / ".cache") / "epid"


def cache_key(workload: Workload) -> dict[str, Any]:
    """What the timings depend on: the CPU model and features, torch, the workload and the method."""
    return {**this_cpu(), "torch": torch.__version__, **asdict(workload), "method": METHOD}


def read_cache(path: Path) -> list[dict[str, Any]]:
    """The cache's entries ({"key", "timings", "date"}); none when the file is missing or unreadable."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    return entries if isinstance(entries, list) else []


def write_cache(path: Path, entries: list[dict[str, Any]], key: dict[str, Any], timings: Timings) -> str:
    """Add ``timings`` under ``key`` to the cache file (a temporary file renamed over it); where it
    went, or why it could not be written."""
    entry = {"key": key, "timings": asdict(timings), "date": datetime.date.today().isoformat()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = temporary_path(path)
        temporary.write_text(json.dumps([*entries, entry], indent=1), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        return f"not cached ({path}: {error.strerror or error})"
    return f"cached in {path}"


# --------------------------------------------------------------------------- timing


def time_training(workload: Workload) -> Timings:
    """fp32 against bf16 on this CPU: matrix products, then, unless bf16 is emulated, training
    steps of ``workload`` (``time_steps``). The global random generators are left as they were."""
    with torch.random.fork_rng(devices=[]):
        products = time_matrix_products()
        if products.bf16_s > EMULATED_RATIO * products.fp32_s:
            return Timings(products.fp32_s, products.bf16_s, f"{products.unit} (bf16 emulated: no training step timed)")
        return time_steps(workload)


def time_matrix_products(size: int = MATMUL_SIZE, repeats: int = 3) -> Timings:
    """Median time of a ``size`` x ``size`` matrix product in fp32 and in bf16 (after one unmeasured)."""
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        left, right = torch.randn(2, size, size).to(dtype)
        samples = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            torch.mm(left, right)
            samples.append(time.perf_counter() - started)
        times[dtype] = statistics.median(samples[1:])
    return Timings(times[torch.float32], times[torch.bfloat16], f"{size} x {size} matrix product")


def time_steps(workload: Workload) -> Timings:
    """Median time of a training step of ``workload`` in fp32 and under bf16 autocast, on the CPU:
    fresh models of its family and size, placed as training places them, AdamW, random inputs."""
    device = torch.device("cpu")
    model = CrossModel(*build_models(workload.size, workload.family)).place(device)
    optimizer = build_optimizer(model, 1e-6, 0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    runner = side_by_side.SideBySide(model, workload.threads) if workload.side_by_side else model
    batch = synthetic_batch(workload.batch_size)
    times: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    started = time.perf_counter()
    try:
        for index in range(WARMUP_ROUNDS + TIMED_ROUNDS):
            if index >= WARMUP_ROUNDS + 2 and time.perf_counter() - started > BUDGET_S:
                break
            for dtype, samples in times.items():
                step_started = time.perf_counter()
                runner.backward(batch_losses(runner, batch, device, dtype)["total"])
                optimizer_step(optimizer, scaler)
                optimizer.zero_grad(set_to_none=True)
                if index >= WARMUP_ROUNDS:
                    samples.append(time.perf_counter() - step_started)
    finally:
        if runner is not model:
            runner.close()
    return Timings(statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16]),
                   "training step")


def synthetic_batch(batch_size: int, seed: int = 0) -> Batch:
    """A batch of the training shapes on the CPU: random leaves (mm, bank A <= bank B), jaws (mm),
    MU in [1, 40] and frames ((batch_size + 1, 1, 256, 256), shared by epid_prev and epid_curr)."""
    generator = torch.Generator().manual_seed(seed)
    leaves = 2 * NUM_LEAF_PAIRS
    leaf_a = -60.0 * torch.rand(batch_size, leaves, generator=generator)
    leaf_b = leaf_a + 10.0 + 50.0 * torch.rand(batch_size, leaves, generator=generator)
    mu = 1.0 + 39.0 * torch.rand(batch_size, 1, generator=generator)
    jaw_1 = -100.0 + 40.0 * torch.rand(batch_size, 2, generator=generator)
    jaw_2 = jaw_1 + 20.0 + 80.0 * torch.rand(batch_size, 2, generator=generator)
    weights = torch.where(torch.rand(batch_size, leaves, generator=generator) < 0.5, 1.0, 0.5)
    frames = mu.mean() * torch.rand(batch_size + 1, 1, GRID_SIZE, GRID_SIZE, generator=generator)
    scalars = torch.cat([mu, jaw_1[:, :1], jaw_1[:, 1:], jaw_2[:, :1], jaw_2[:, 1:]], dim=1)
    return Batch(leaf_a=leaf_a, leaf_b=leaf_b, scalars=scalars, leaf_weight_a=weights, leaf_weight_b=weights.flip(1),
                 epid_prev=frames[:-1], epid_curr=frames[1:], frames=frames)
