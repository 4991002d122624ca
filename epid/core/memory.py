"""The C allocator's settings for work that makes and drops large arrays at a high rate.

glibc serves an allocation above its mmap threshold (128 kB, raised as such blocks are freed up
to 32 MB) with a fresh mapping and hands it back to the kernel when freed, and it trims the
heap's free top beyond its trim threshold: every new frame-sized tensor then costs a page fault
per 4 kB page, which the kernel zeroes. The arc reconstruction of a cine series makes such
tensors by the thousand; on a 2-core AMD EPYC the QA of a two-arc plan (1,416 frames) spent 35 s
of its 73 s in the kernel. ``keep_freed_memory`` serves every allocation from the heap and keeps
what is freed for the next one: the same QA took 54 s, 3 s in the kernel, its peak memory 3.2
instead of 3.0 GB. Training makes its tensors at a far lower rate and is unchanged by it.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameters (glibc's malloc.h)."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Trim threshold (the largest ``mallopt`` takes): free heap top glibc keeps rather than hands back."""


def keep_freed_memory() -> bool:
    """On Linux with glibc: no allocation by a fresh mapping, no trimming of the heap (module
    docstring), so that memory freed is reused without page faults; the process's memory stays at
    its peak until it ends. Left as it is where the user set any ``MALLOC_`` variable, and where
    the C library has no ``mallopt`` (musl, macOS, Windows). Returns whether it took effect."""
    if not sys.platform.startswith("linux") or any(name.startswith("MALLOC_") for name in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
