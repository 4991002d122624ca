"""Helpers shared by tests that run the entry scripts as subprocesses."""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TINY_RUN = {"EPID_MODEL": "legacy", "EPID_MODEL_SIZE": "tiny", "EPID_THREADS": "1", "EPID_DEVICE": "cpu",
            "EPID_PROGRESS": "0"}
"""Training runs of the tests: tiny models, one CPU thread per rank, no progress bar. They pin the
training loop with the legacy family and the variables' own defaults (its recipe); the tests that
train the aperture family say so."""


def clean_environment(**extra: str) -> dict[str, str]:
    """This process's environment without EPID_* and launcher variables (a test run under torchrun
    must not make its subprocesses ranks), single-threaded, non-interactive plots.

    One thread per subprocess keeps tests fast when they run beside each other on few cores.
    """
    environ = {key: value for key, value in os.environ.items()
               if not key.startswith("EPID_") and key not in LAUNCH_VARIABLES}
    environ.update(MPLBACKEND="Agg", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    environ.update(extra)
    return environ
