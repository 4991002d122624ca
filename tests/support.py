"""Helpers shared by tests that run the entry scripts as subprocesses."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without EPID_* variables, single-threaded, non-interactive plots.

    One thread per subprocess keeps tests fast when they run beside each other on few cores.
    """
    environ = {key: value for key, value in os.environ.items() if not key.startswith("EPID_")}
    environ.update(MPLBACKEND="Agg", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    environ.update(extra)
    return environ
