"""Which torch device and which autocast precision a run or a tool uses.

``resolve_device`` reads every device request (EPID_DEVICE for training, ``--device`` of the
entry scripts, the ``device`` arguments of the library) the same way; ``choose_precision``
turns EPID_PRECISION into the autocast dtype of a device and says why (training times ``auto``
on the CPU: ``epid.training.precision``, which keys its cache with ``cpu_model`` and ``cpu_features``).
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass

import torch

from epid.core.errors import InputError

Device = torch.device | str | None
"""A device, its name, or None for the default."""

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def cuda_device_count() -> int:
    """Visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str | torch.device, local_rank: int = 0, *, given: str | None = None) -> torch.device:
    """The device ``spec`` (auto|cpu|cuda|cuda:N, or a torch.device, taken as it is) names for the
    node's rank ``local_rank``.

    ``auto`` is ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; ``cuda`` is
    ``cuda:LOCAL_RANK``; ``cuda:N`` is ``cuda:(N + LOCAL_RANK)``, so a single process picks its GPU
    and the ranks of a node take consecutive GPUs from N. Raises InputError, naming the request
    as ``given`` (default ``EPID_DEVICE='...'``), when the name is unknown or the GPU is missing.
    """
    if isinstance(spec, torch.device):
        return spec
    name = spec.strip().lower()
    if name == "cpu":
        return torch.device("cpu")
    given = given or f"EPID_DEVICE={spec!r}"
    count = cuda_device_count()
    if name == "auto" and count == 0:
        return torch.device("cpu")
    if name in ("auto", "cuda"):
        first = 0
    elif name.startswith("cuda:") and name[5:].isdigit():
        first = int(name[5:])
    else:
        raise InputError(f"{given}: expected {DEVICE_CHOICES}")
    if count == 0:
        raise InputError(f"{given}: CUDA is not available on this machine; expected cpu or auto")
    index = first + local_rank
    if index >= count:
        who = f"local rank {local_rank}" if local_rank else "it"
        raise InputError(f"{given}: {who} would use cuda:{index}, this machine has {count} CUDA device(s); "
                         "expected fewer ranks per node, a lower index or EPID_DEVICE=cpu")
    return torch.device("cuda", index)


def device_of(*values: object) -> torch.device:
    """The device of the first tensor among ``values``; the CPU when there is none."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


@dataclass(frozen=True)
class CpuFeatures:
    """What the CPU offers for bfloat16 matrix products: AMX tiles (bfloat16 matrix products in
    hardware), AVX-512 BF16 (bfloat16 dot products in vector registers) and torch's vector
    capability (``DEFAULT``, ``AVX2``, ``AVX512``)."""

    amx_tiles: bool
    avx512_bf16: bool
    capability: str

    def text(self) -> str:
        """``AVX2, no AVX-512 BF16, no AMX``: the features as the start line and the benchmarks name them."""
        flags = [self.capability, "AVX-512 BF16" if self.avx512_bf16 else "no AVX-512 BF16",
                 "AMX" if self.amx_tiles else "no AMX"]
        return ", ".join(flags)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor name elsewhere)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> CpuFeatures:
    """This machine's CPU features, as torch detects them."""
    return CpuFeatures(amx_tiles=torch.cpu._is_amx_tile_supported(),
                       avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
                       capability=torch.backends.cpu.get_cpu_capability())


@dataclass(frozen=True)
class PrecisionChoice:
    """The autocast dtype of a run (float32 = autocast off) and why it was chosen."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return PRECISION_NAMES[self.dtype]


PRECISION_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def choose_precision(spec: str, device: torch.device) -> PrecisionChoice:
    """The autocast dtype EPID_PRECISION (auto|bf16|fp16|fp32) gives on ``device``, with the reason.

    ``auto`` on CUDA: bfloat16 where the GPU supports it, else float32. On the CPU no feature
    flag tells which trains faster, so without a run to time ``auto`` is float32 here; training
    times its own steps in both (``epid.training.precision.choose_run_precision``). Raises InputError for
    bf16 on a GPU without it.
    """
    if spec == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            raise InputError(f"EPID_PRECISION='bf16': {name} has no bfloat16; expected fp16, fp32 or auto")
        return PrecisionChoice(torch.bfloat16, "EPID_PRECISION=bf16")
    if spec in ("fp16", "fp32"):
        return PrecisionChoice(torch.float16 if spec == "fp16" else torch.float32, f"EPID_PRECISION={spec}")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice(torch.bfloat16, f"auto: {name} has bfloat16")
        return PrecisionChoice(torch.float32, f"auto: {name} has no bfloat16")
    return PrecisionChoice(torch.float32, "auto: fp32 on the CPU without a run to time (training times bf16 against "
                                          "fp32 at its start)")


def resolve_precision(spec: str, device: torch.device) -> torch.dtype:
    """Autocast dtype for EPID_PRECISION on ``device`` (``choose_precision``): float32 means autocast off."""
    return choose_precision(spec, device).dtype


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``; no autocast for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
