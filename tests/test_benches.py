"""Every benchmark runs the one way the README states, ``python -m bench.<name>`` from the
repository root: its --help exits 0 and describes its options."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT, clean_environment

BENCHES = sorted(path.stem for path in (ROOT / "bench").glob("bench_*.py"))


def test_every_bench_answers_help_as_a_module():
    assert BENCHES == ["bench_dicom", "bench_gamma", "bench_memory", "bench_models", "bench_quality",
                       "bench_reconstruct", "bench_synthesis", "bench_train"]
    processes = {
        name: subprocess.Popen([sys.executable, "-m", f"bench.{name}", "--help"], cwd=ROOT, env=clean_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in BENCHES
    }
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"{name}: {err[-2000:]}"
        assert out.startswith("usage: python -m bench.") and "--" in out, (name, out[:300])
