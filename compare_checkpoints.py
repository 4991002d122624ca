"""Evaluate and diff several checkpoints side by side.

Compares the stored training histories, the weights (against the first checkpoint), the
training configs, and evaluates every checkpoint on the same validation samples (frames
synthesised once). Prints tables and writes comparison.csv, comparison.json,
histories.png and metrics.png to --output-dir. Paths may be glob patterns (** for any
depth, matches sorted by name); they are expanded here, so quoted patterns work in bash
and PowerShell alike.

  bash:        python compare_checkpoints.py 'runs/**/*.pth' --dataset-range 0:640:80
  PowerShell:  python .\\compare_checkpoints.py "runs\\*\\epid_checkpoint.pth" --no-eval

Frame synthesis (control points, kernel, noise, physics) follows EPID_CONTROL_POINTS,
EPID_KERNEL, EPID_NOISE_STD, EPID_NOISE_SEED and EPID_PHYSICS (and the physics variables) when
set, else the first checkpoint's training config.
Exit status: 0 all compared, 1 some checkpoint could not be read or rebuilt (the others
are still compared), 2 bad arguments.
"""

from __future__ import annotations

import argparse

from epid.core.cli import run_main
from epid.core.memory import keep_freed_memory


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def main() -> int:
    from epid.evaluation.compare import DEFAULT_DATASET_RANGE, CompareOptions, compare

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                        help="checkpoint files or glob patterns; the first is the reference of the weight diff")
    parser.add_argument("--dataset-range", default="", metavar="START:STOP[:STEP]",
                        help=f"evaluation dataset IDs as start:stop[:step] (default {DEFAULT_DATASET_RANGE})")
    parser.add_argument("--dataset-ids", default="", metavar="IDS",
                        help="evaluation dataset IDs as a list, e.g. 0,80,160")
    parser.add_argument("--samples-per-dataset", type=_count(1), default=8, metavar="N",
                        help="validation samples drawn per dataset (default 8)")
    parser.add_argument("--seed", type=_count(0), default=0, metavar="N", help="seed of the sample choice (default 0)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    parser.add_argument("--output-dir", default="comparison_output", metavar="DIR",
                        help="where the tables and figures go (default comparison_output)")
    parser.add_argument("--gamma-samples", type=_count(0), default=64, metavar="N",
                        help="samples, spread over the set, whose gamma pass rate is computed (0 = none; default 64)")
    parser.add_argument("--tail", type=_count(1), default=10, metavar="N",
                        help="final epochs used for the tail mean and slope of the validation loss (default 10)")
    parser.add_argument("--log-y", action="store_true", help="log scale for the losses in histories.png")
    parser.add_argument("--no-eval", action="store_true", help="compare histories, configs and weights only")
    args = parser.parse_args()
    keep_freed_memory()  # its evaluation reconstructs control points, as inference_visualize.py does
    return compare(CompareOptions(
        checkpoints=args.checkpoints, dataset_range=args.dataset_range, dataset_ids=args.dataset_ids,
        samples_per_dataset=args.samples_per_dataset, seed=args.seed, device=args.device,
        output_dir=args.output_dir, gamma_samples=args.gamma_samples, tail=args.tail, log_y=args.log_y,
        evaluate=not args.no_eval,
    ))


if __name__ == "__main__":
    run_main(main, "compare_checkpoints.py")
