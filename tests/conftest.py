"""Suite-wide set-up: tests never see the EPID_* variables of the shell that runs them, and run
torch on one intra-op thread, as their subprocesses do (``tests.support.clean_environment``)."""

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def no_epid_variables(monkeypatch):
    """Remove every EPID_* variable from this process's environment for the test."""
    for key in [key for key in os.environ if key.startswith("EPID_")]:
        monkeypatch.delenv(key)


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """One torch thread per process: the suite's subprocesses and other jobs share the few cores,
    and a thread team waiting for a descheduled member slows small operators many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
