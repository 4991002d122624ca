"""Suite-wide set-up: tests never see the EPID_* variables of the shell that runs them, run
torch on one intra-op thread, as their subprocesses do (``tests.support.clean_environment``), and
keep the user's cache folder (the precision timings of ``epid.training.precision``) out of reach."""

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


@pytest.fixture(autouse=True, scope="session")
def private_cache_folder(tmp_path_factory):
    """XDG_CACHE_HOME (and LOCALAPPDATA on Windows) of this process and its subprocesses: a fresh
    folder of the session, so that no test reads or writes the user's own cache."""
    folder = str(tmp_path_factory.mktemp("user_cache"))
    before = {name: os.environ.get(name) for name in ("XDG_CACHE_HOME", "LOCALAPPDATA")}
    os.environ.update(XDG_CACHE_HOME=folder, LOCALAPPDATA=folder)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
