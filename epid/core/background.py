"""Calls run by a worker process while the caller computes on.

A report's figures are drawn by matplotlib in Python, one artist at a time, while the work they
show runs in torch on every core; a worker process draws the figures of one part (a beam of a
plan) while the caller goes on to the next, and takes up a core that the caller's small steps
leave idle. The worker is forked at once, before the caller's data fill its memory: a process
forked later shares those pages, and every page the caller writes afterwards is copied (on the
QA of a two-arc plan, 12 s more in the kernel). Where processes cannot be forked safely (Windows,
macOS) each call runs at once in the caller.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any


class BackgroundCalls:
    """A worker process for calls whose results are not needed (``call``): the function a
    module-level one, its arguments picklable. Leaving the ``with`` block (or ``close``) waits for
    every call, running those the worker has not begun in the caller meanwhile, and raises the
    first failure; leaving it on an exception, the calls are still finished but that exception is
    the one raised."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._pending: list[tuple[Future, Callable[..., Any], tuple, dict]] = []
        if sys.platform == "linux":
            self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("fork"))
            self._pool.submit(os.getpid).result()  # the worker starts now

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """Queue ``function(*args, **kwargs)`` (run at once where there is no worker)."""
        if self._pool is None:
            function(*args, **kwargs)
            return
        self._pending.append((self._pool.submit(function, *args, **kwargs), function, args, kwargs))

    def close(self) -> None:
        """Wait for the queued calls, the last ones the worker has not begun run here meanwhile;
        the first failure is raised."""
        pending, self._pending = self._pending, []
        try:
            for future, function, args, kwargs in reversed(pending):
                if future.cancel():
                    function(*args, **kwargs)
            for future, *_ in pending:
                if not future.cancelled():
                    future.result()
        finally:
            if self._pool is not None:
                self._pool.shutdown(cancel_futures=True)
                self._pool = None

    def __enter__(self) -> BackgroundCalls:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):
            self.close()
