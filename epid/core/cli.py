"""What the entry scripts share: one-line errors with exit 2, output folders."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from epid.core.errors import InputError

USAGE_ERROR = 2


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
