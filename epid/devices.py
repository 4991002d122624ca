"""Which torch device and which autocast precision a run or a tool uses.

``resolve_device`` reads every device request (EPID_DEVICE for training, ``--device`` of the
entry scripts, the ``device`` arguments of the library) the same way; ``resolve_precision``
turns EPID_PRECISION into the autocast dtype of a device.
"""

from __future__ import annotations

import contextlib

import torch

from epid.errors import InputError

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


def resolve_precision(spec: str, device: torch.device) -> torch.dtype:
    """Autocast dtype for EPID_PRECISION on ``device``: float32 means autocast off.

    ``auto`` is bfloat16 on CUDA devices that support it and on CPUs with native bfloat16
    (AMX or AVX512-BF16), float32 elsewhere.
    """
    if spec == "bf16":
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name(device)
            raise InputError(f"EPID_PRECISION='bf16': {name} has no bfloat16; expected fp16, fp32 or auto")
        return torch.bfloat16
    if spec == "fp16":
        return torch.float16
    if spec == "fp32":
        return torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native_bf16 = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if device.type == "cpu" and native_bf16 else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``; no autocast for float32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
