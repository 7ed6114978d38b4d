"""``python -m studies NAME ...``: one of the papers' studies, from a checkout of etinfer."""

from __future__ import annotations

import argparse
import sys

from etinfer.cli import run_command


def build_parser() -> argparse.ArgumentParser:
    # Imported here, as etinfer's own commands are: a study's --help needs only its own module.
    from studies.ablation import ablation
    from studies.laws import pruning, sampling, scheduling_sim
    from studies.seed_systems import longcontext, speculative, switching
    from studies.stress import iss_check, stress

    parser = argparse.ArgumentParser(prog="python -m studies", description=__doc__)
    kinds = parser.add_subparsers(dest="study", required=True)
    sampling.add_command(kinds)
    pruning.add_commands(kinds)
    scheduling_sim.add_command(kinds)
    ablation.add_command(kinds)
    longcontext.add_command(kinds)
    speculative.add_command(kinds)
    switching.add_command(kinds)
    iss_check.add_command(kinds)
    stress.add_command(kinds)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
