"""The allocator settings of epid.core.memory, in fresh processes: a freed large array's memory
stays with the process and the next one reuses it without page faults where it is kept, and goes
back to the kernel (and is faulted in again) by default; a user's MALLOC_ variable leaves glibc
as it is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import ROOT, clean_environment

PROBE = """
import json, os, resource, sys
import numpy as np
from epid.core.memory import keep_freed_memory

def resident():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

taken = keep_freed_memory() if sys.argv[1] == "kept" else False
faults, returned = [], []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    values = np.ones(8 << 20)  # 64 MB: above the largest mmap threshold glibc sets by itself
    holding = resident()
    del values
    returned.append(holding - resident())
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"taken": taken, "faults": faults, "returned": returned}))
"""


def probe(mode: str, **environment: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, mode], env=clean_environment(**environment), cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    return json.loads(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_large_arrays_are_reused_without_page_faults_where_kept():
    kept, default = probe("kept"), probe("default")
    if not kept["taken"]:
        pytest.skip("this C library has no mallopt (not glibc)")
    size = 64 << 20
    assert min(default["returned"]) > 0.9 * size and min(default["faults"][1:]) > 0, default
    assert max(kept["returned"][1:]) < 0.01 * size and max(kept["faults"][1:]) < 0.1 * min(default["faults"][1:]), kept
    assert probe("kept", MALLOC_ARENA_MAX="2")["taken"] is False, "a user's MALLOC_ setting wins"
