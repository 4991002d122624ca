"""Writes the measured-looking, non-separable EPID kernel of ``epid.synthesis.kernel.radial_kernel`` to a
MATLAB file (variable ``kernel``), for ``EPID_KERNEL`` and ``bench.bench_quality --kernel``, and
prints its size, sum and how far from separable it is. Run from the repository root:

    python -m bench.radial_kernel radial.mat
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import scipy.io

from epid.synthesis.kernel import DEFAULT_KERNEL_SIZE, radial_kernel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.radial_kernel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", help="the .mat file to write")
    parser.add_argument("--size", type=int, default=DEFAULT_KERNEL_SIZE, help="odd size in pixels (default 261)")
    args = parser.parse_args(argv)
    kernel = radial_kernel(args.size)
    scipy.io.savemat(args.output, {"kernel": kernel})
    singular = np.linalg.svd(kernel, compute_uv=False)
    print(f"wrote {args.output}: {args.size} x {args.size}, sum {kernel.sum():.6f}, second singular value "
          f"{100 * singular[1] / singular[0]:.1f} % of the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
