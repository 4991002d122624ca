"""Writes the family of measured-looking EPID response kernels (``epid.synthesis.kernel.
RESPONSE_FAMILY``: from the sharpest to the broadest plausible, one elongated) to a folder, one
MATLAB file per kernel (variable ``kernel``), for ``EPID_KERNEL`` and ``bench.bench_quality
--kernel``/``--kernels``, and prints how broad each is. Run from the repository root:

    python -m bench.kernel_family kernels/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import scipy.io

from epid.core.tables import format_table
from epid.synthesis.kernel import DEFAULT_KERNEL_SIZE, RESPONSE_FAMILY, default_kernel, kernel_figures, response_kernel


def figure_row(name: str, kernel) -> list[str]:
    """One table row: name, core FWHM x / y, energy radii, second singular value share."""
    figures = kernel_figures(kernel)
    return [name, f"{figures.fwhm_x_mm:.1f} / {figures.fwhm_y_mm:.1f}",
            " / ".join(f"{radius:.0f}" for radius in figures.energy_radii_mm), f"{100 * figures.singular_ratio:.1f}"]


HEADER = ["kernel", "core FWHM x / y (mm)", "radius of 50/80/90/99 % energy (mm)", "s2/s1 (%)"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_family", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="the folder to write NAME.mat into (made if missing)")
    parser.add_argument("--size", type=int, default=DEFAULT_KERNEL_SIZE, help="odd size in pixels (default 261)")
    args = parser.parse_args(argv)
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = [figure_row("built-in (not written)", default_kernel(args.size))]
    for name, shape in RESPONSE_FAMILY.items():
        kernel = response_kernel(shape, args.size)
        scipy.io.savemat(folder / f"{name}.mat", {"kernel": kernel})
        rows.append(figure_row(f"{name}.mat", kernel))
    print(format_table(HEADER, rows))
    print(f"wrote {len(RESPONSE_FAMILY)} kernels to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
