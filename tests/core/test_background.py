"""Calls run by a worker process: figures drawn there are the ones drawn at once, failures are raised."""

import os
import sys
import time

import numpy as np
import pytest

from epid.core.background import BackgroundCalls
from epid.evaluation import plots

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="a worker process is forked only on Linux")


def frames_figure_arguments(seed: int) -> tuple:
    frames = np.random.default_rng(seed).random((3, 256, 256)).astype(np.float32)
    names = [f"frame {index}" for index in range(3)]
    return frames, names, frames.sum(0), "sum of 3 frames", f"figure {seed}"


def failing_call(message: str) -> None:
    raise ValueError(message)


def record_pid(path) -> None:
    path.write_text(str(os.getpid()))


def test_figures_drawn_by_the_worker_are_the_ones_drawn_at_once(tmp_path):
    """Five figures queued: the worker draws the first ones, this process those the worker has not
    begun when the block ends; each file has the bytes of the same figure drawn at once."""
    with BackgroundCalls() as background:
        for seed in range(5):
            background.call(plots.draw, plots.plan_frames_figure, tmp_path / f"background_{seed}.png",
                            *frames_figure_arguments(seed))
    for seed in range(5):
        plots.draw(plots.plan_frames_figure, tmp_path / f"direct_{seed}.png", *frames_figure_arguments(seed))
        assert (tmp_path / f"background_{seed}.png").read_bytes() == (tmp_path / f"direct_{seed}.png").read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_call_runs_in_another_process_while_the_caller_goes_on(tmp_path):
    with BackgroundCalls() as background:
        background.call(record_pid, tmp_path / "pid")
        deadline = time.monotonic() + 30
        while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "pid").exists(), "the worker never ran the call"
    assert int((tmp_path / "pid").read_text()) != os.getpid()


def test_a_failing_call_is_raised_and_the_others_still_run(tmp_path):
    background = BackgroundCalls()
    background.call(failing_call, "no such data")
    background.call(record_pid, tmp_path / "after")
    with pytest.raises(ValueError, match="no such data"):
        background.close()
    assert (tmp_path / "after").exists()


def test_an_exception_leaving_the_block_is_the_one_raised(tmp_path):
    with pytest.raises(KeyError, match="the caller's"), BackgroundCalls() as background:
        background.call(failing_call, "a call's")
        background.call(record_pid, tmp_path / "after")
        raise KeyError("the caller's")
    assert (tmp_path / "after").exists()
