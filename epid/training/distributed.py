"""Process placement for training: launch mode, process group, device, threads, signals.

Three ways a run starts, detected from the environment (nanoGPT style):

* one process (``EPID_WORLD_SIZE=1``, the default): no process group, no spawning;
* ``EPID_WORLD_SIZE=N``: this process spawns N ranks with ``torch.multiprocessing`` on this
  node, on ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT`` (default: a free port);
* under ``torchrun`` (``RANK`` set): this process is one rank and joins the group torchrun
  describes (single or multi node); nothing is spawned.

Failure policy. A rank that raises or dies ends the job with a non-zero status in bounded
time: with spawning, the parent sees the dead rank at once, gives the others
``SHUTDOWN_GRACE_S`` to stop, then terminates and finally kills them; under torchrun its
agent does the same. Collectives time out after EPID_COLLECTIVE_TIMEOUT seconds, so a rank
blocked on a peer that vanished without closing its connection (a lost node) fails instead
of hanging.
SIGINT / SIGTERM only set a flag (``StopSignal``); the training loop agrees on it across
ranks at the next step boundary, writes a checkpoint and exits normally.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Self, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from epid.config.load import Config
from epid.core.devices import resolve_device
from epid.core.errors import InputError

# glibc mallopt parameters and the values set in every rank (see tune_host_allocator)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
ALLOCATOR_SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))
SHUTDOWN_GRACE_S = 20.0
DEFAULT_MASTER_ADDR = "127.0.0.1"
T = TypeVar("T")


class LaunchError(InputError):
    """A device or backend request this machine cannot honour (checked before spawning)."""


@dataclass(frozen=True)
class RankContext:
    """Where one rank runs.

    rank / world_size: global position; local_rank / local_world_size: on this node;
    device: the torch device of this rank (``cuda:LOCAL_RANK`` on GPUs); backend: the process
    group backend ("" when running as a single process); threads: intra-op CPU threads.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    threads: int

    @property
    def is_main(self) -> bool:
        """True on the rank that logs and writes checkpoints (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group connects several ranks."""
        return self.world_size > 1


Worker = Callable[[RankContext, Config], int]


# --------------------------------------------------------------------------- placement


def resolve_backend(spec: str, device: torch.device) -> str:
    """EPID_BACKEND: ``auto`` is nccl for CUDA devices, gloo for the CPU."""
    if spec != "auto":
        return spec
    return "nccl" if device.type == "cuda" else "gloo"


def local_world_size(config: Config) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, else every spawned rank."""
    if config.launched_by_torchrun:
        return int(os.environ.get("LOCAL_WORLD_SIZE", config.world_size))
    return config.world_size


def available_cpus() -> int:
    """CPUs this process may run on (honours cgroup/SLURM CPU sets where the OS reports them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_rank(config: Config, ranks_on_node: int) -> int:
    """EPID_THREADS, or the node's CPUs shared evenly among its ranks (at least 1)."""
    if config.threads > 0:
        return config.threads
    return max(1, available_cpus() // max(1, ranks_on_node))


def tune_host_allocator() -> bool:
    """Keep freed host memory in the process instead of returning it to the OS (glibc only).

    By default glibc serves allocations above a dynamic threshold with fresh mmap pages and
    trims the heap on free, so every training step of a CPU run page-faults its activations
    in again (about 25 000 faults and 50 ms of kernel time per step of the full model at
    batch 8). A fixed 32 MiB mmap threshold and a 1 GiB trim threshold let the allocator
    reuse the memory. Returns False where the C library is not glibc (nothing changes).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all(libc.mallopt(parameter, value) == 1 for parameter, value in ALLOCATOR_SETTINGS)
    except (OSError, AttributeError):
        return False


# --------------------------------------------------------------------------- launch


def free_port(host: str = DEFAULT_MASTER_ADDR) -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def launch(worker: Worker, config: Config) -> int:
    """Run ``worker(context, config)`` on every rank of this node and return the job status.

    Single process and torchrun: the worker runs in this process. ``EPID_WORLD_SIZE > 1``:
    ranks are spawned here; a failed rank makes this return 1 once the others are stopped.
    """
    if config.launched_by_torchrun:
        return _run_rank(worker, config, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]))
    if config.world_size == 1:
        return _run_rank(worker, config, 0, 0)
    return _spawn(worker, config)


def _spawn(worker: Worker, config: Config) -> int:
    os.environ.setdefault("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    if not os.environ.get("MASTER_PORT"):
        os.environ["MASTER_PORT"] = str(free_port(os.environ["MASTER_ADDR"]))
    context = mp.start_processes(
        _spawned_rank, args=(worker, config), nprocs=config.world_size, join=False, start_method="spawn"
    )
    with _ForwardTermination(context.pids()):
        try:
            while not context.join(timeout=1.0, grace_period=SHUTDOWN_GRACE_S):
                pass
        except mp.ProcessRaisedException as error:
            print(f"training failed on rank {error.error_index}:{error}", file=sys.stderr, flush=True)
            return 1
        except mp.ProcessExitedException as error:
            print(f"training failed: rank {error.error_index} (pid {error.error_pid}) {_exit_text(error)}",
                  file=sys.stderr, flush=True)
            return 1
    return 0


def _exit_text(error: mp.ProcessExitedException) -> str:
    if error.signal_name:
        return f"was killed by {error.signal_name}"
    return f"exited with status {error.exit_code}"


def _spawned_rank(index: int, worker: Worker, config: Config) -> None:
    """One spawned rank; it leaves without the interpreter's teardown once its work is done.

    The distributed backend's threads outlive ``destroy_process_group`` (DDP keeps the group
    alive), and one that still holds a tensor when the interpreter finalises can abort the
    process (SIGABRT, "terminate called without an active exception") after the job has
    finished. Everything the rank wrote is closed by then; a collection first lets the data
    loader's finalizers stop its worker processes.
    """
    status = _run_rank(worker, config, index, index)
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_rank(worker: Worker, config: Config, rank: int, local_rank: int) -> int:
    ranks_here = local_world_size(config)
    device = resolve_device(config.device, local_rank)
    context = RankContext(
        rank=rank,
        local_rank=local_rank,
        world_size=config.world_size,
        local_world_size=ranks_here,
        device=device,
        backend=resolve_backend(config.backend, device) if config.world_size > 1 else "",
        threads=threads_per_rank(config, ranks_here),
    )
    tune_host_allocator()
    torch.set_num_threads(context.threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if context.distributed:
        dist.init_process_group(
            backend=context.backend,
            init_method="env://",
            rank=rank,
            world_size=context.world_size,
            timeout=datetime.timedelta(seconds=config.collective_timeout),
            device_id=device if device.type == "cuda" else None,
        )
    try:
        return worker(context, config)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _ForwardTermination:
    """While active, SIGINT / SIGTERM to the launching process are passed on to the ranks once.

    Each rank turns the signal into a checkpoint and a clean exit; the launcher keeps waiting.
    """

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.forwarded = False
        self.previous: dict[int, object] = {}

    def __enter__(self) -> Self:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._forward)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        if self.forwarded:
            return
        self.forwarded = True
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


# --------------------------------------------------------------------------- in-rank helpers


class StopSignal:
    """Turns SIGINT / SIGTERM into a flag the training loop polls between steps.

    Repeated signals (a terminal's Ctrl-C reaches every rank and the launcher forwards it
    too) keep the flag set; use SIGKILL to end a rank at once.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, object] = {}

    def install(self) -> Self:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce across ranks (identity in a single process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=op)
    return tensor


def broadcast(tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
    """In-place broadcast from ``source`` (identity in a single process)."""
    if dist.is_initialized():
        dist.broadcast(tensor, src=source)
    return tensor


def gather_objects(value: T) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order, on every rank (``[value]`` in a single process)."""
    if not dist.is_initialized():
        return [value]
    values: list[T] = [value] * dist.get_world_size()  # placeholders, overwritten in place
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    """Wait for every rank (no-op in a single process)."""
    if dist.is_initialized():
        dist.barrier()
