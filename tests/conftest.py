"""Suite-wide set-up: tests never see the EPID_* variables of the shell that runs them."""

import os

import pytest


@pytest.fixture(autouse=True)
def no_epid_variables(monkeypatch):
    """Remove every EPID_* variable from this process's environment for the test."""
    for key in [key for key in os.environ if key.startswith("EPID_")]:
        monkeypatch.delenv(key)
