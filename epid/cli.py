"""What the three entry scripts share: turning bad input into one line and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable

from epid.errors import InputError

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
