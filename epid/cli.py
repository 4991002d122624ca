"""What the entry scripts share: one-line errors with exit 2, output folders, devices."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from epid.errors import InputError

USAGE_ERROR = 2
DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def run_main(main: Callable[[], int | None], program: str) -> None:
    """Run ``main`` and exit with its status; an InputError becomes one line on stderr and exit 2."""
    try:
        status = main()
    except InputError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except KeyboardInterrupt:
        print(f"{program}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)


def prepare_output_dir(path: str, argument: str = "--output-dir") -> Path:
    """Create ``path`` if needed and check that a file can be written there; InputError otherwise."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise InputError(f"{argument} {path!r}: cannot write there ({error.strerror or error})") from None
    return directory


def resolve_device(name: str, argument: str = "--device"):
    """A torch.device for ``name`` (``auto`` picks CUDA when available); InputError if absent or unknown."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"{argument} {name!r}: expected {DEVICE_CHOICES}") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{argument} {name!r}: expected {DEVICE_CHOICES}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{argument} {name!r}: CUDA is not available on this machine")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise InputError(f"{argument} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device
