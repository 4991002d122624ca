"""Synthesise VMAT deliveries and their EPID frames on the fly and cross-train the
forward model (control point -> EPID image) and the inverse model (EPID frame pair ->
control points) with DistributedDataParallel.

Configured entirely by EPID_* environment variables (listed below); with none set it
runs the full default job. Examples:

  bash:        EPID_WORLD_SIZE=2 EPID_DATASET_RANGE=0:640:80 python generate_and_train.py
  PowerShell:  $env:EPID_DATASET_RANGE = "0:640:80"; python .\\generate_and_train.py
  torchrun:    torchrun --nproc-per-node 4 generate_and_train.py
"""

from __future__ import annotations

import argparse

from epid.config.load import describe, help_text, load_config, rank_report
from epid.core.cli import run_main


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=help_text(), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args()
    config = load_config()
    if config.dry_run:
        from epid.training.preflight import check

        for note in check(config):  # every check the launch makes
            print(note)
        print(f"Resolved configuration:\n{describe(config)}\nDataset IDs per rank:\n{rank_report(config)}")
        return 0
    from epid.training.loop import launch

    return launch(config)


if __name__ == "__main__":
    run_main(main, "generate_and_train.py")
