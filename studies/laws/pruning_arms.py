"""The fidelity study's arms: each configuration as the engine runs it, and with the rankings
that measure what a block choice could reach (``Rankings``, chosen on the command line)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.engine.layers import full_context_layers
from etinfer.llm import LLM
from etinfer.options import positive_int
from studies.laws.digest_selection import DigestSelector
from studies.laws.oracle_selection import OracleSelector
from studies.laws.reused_variants import OwnBoundsSelector, calibrated

# name, configuration, selector (None: the configuration's own)
Arm = tuple[str, PruningConfig, BlockSelector | None]


@dataclass(frozen=True)
class Rankings:
    oracle: bool = False  # key-bound configurations: blocks ranked by their exact mass
    sketches: tuple[int, ...] = ()  # ... by that many channels of each query
    fixed_sketches: tuple[int, ...] = ()  # ... by that many channels fixed per layer and head
    head_roles: tuple[float, ...] = ()  # reused-mass: that share of KV heads read every block
    own_bounds: tuple[float, ...] = ()  # ... and each layer keeps that share by its key bounds
    digests: tuple[float, ...] = ()  # key bounds: blocks ranked by key mean + that many spreads

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Rankings:
        return cls(
            oracle=args.oracle,
            sketches=tuple(args.sketch_channels),
            fixed_sketches=tuple(args.fixed_sketch_channels),
            head_roles=tuple(args.head_roles),
            own_bounds=tuple(args.own_bounds),
            digests=tuple(args.digest_spreads),
        )


def arms(
    llm: LLM,
    configs: dict[str, PruningConfig],
    rankings: Rankings,
    calibration_text: list[int],
    context: int,
    steps: int,
) -> list[Arm]:
    """Every configuration, then the ``rankings`` that apply to it: the oracle and sketches
    replace the key bounds (the mass scorer's refresh steps are dense anyway), head roles and
    own bounds add to reused masses (head roles calibrated on ``calibration_text``, ``steps``
    tokens teacher-forced after ``context``)."""
    runs: list[Arm] = [(name, config, None) for name, config in configs.items()]
    cache = llm.engine.runner.cache
    replacing = [("oracle", None, False)] if rankings.oracle else []
    replacing += [(f"sketch-{channels}", channels, False) for channels in rankings.sketches]
    replacing += [(f"fixed-sketch-{n}", n, True) for n in rankings.fixed_sketches]
    runs += [
        (f"{name} {ranking}", config, OracleSelector(config, cache, channels, fixed))
        for ranking, channels, fixed in replacing
        for name, config in configs.items()
        if config.scorer == "bound"
    ]
    runs += [
        (f"{name} mean-spread-{spread:g}", config, DigestSelector(config, cache, spread))
        for spread in rankings.digests
        for name, config in configs.items()
        if config.scorer == "bound"
    ]
    full = full_context_layers(llm.engine.model_config)
    for name, config in configs.items():
        if config.scorer != "reused-mass":
            continue
        runs += [
            (f"{name} own-bounds-{share}", config, OwnBoundsSelector(config, share, full))
            for share in rankings.own_bounds
        ]
        if rankings.head_roles:
            missed = calibrated(llm, config, calibration_text, context, steps)
            runs += [
                (f"{name} roles-{share}", config, missed.with_retrieval_heads(share))
                for share in rankings.head_roles
            ]
    return runs


def add_ranking_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="fidelity also with blocks ranked by their exact attention mass (slow)",
    )
    parser.add_argument(
        "--sketch-channels",
        type=positive_int,
        nargs="+",
        default=[],
        help="fidelity also with blocks ranked by this many channels of each query (slow)",
    )
    parser.add_argument(
        "--fixed-sketch-channels",
        type=positive_int,
        nargs="+",
        default=[],
        help="...and by this many channels chosen once a layer and KV head (slow)",
    )
    parser.add_argument(
        "--digest-spreads",
        type=float,
        nargs="+",
        default=[],
        help="fidelity also with blocks ranked by their keys' mean plus this many spreads",
    )
    parser.add_argument(
        "--head-roles",
        type=float,
        nargs="+",
        default=[],
        help="fidelity also with this share of KV heads reading every block, for each "
        "reused-mass configuration (calibrated on other text; slow)",
    )
    parser.add_argument(
        "--own-bounds",
        type=float,
        nargs="+",
        default=[],
        help="fidelity also with this share of blocks ranked by each layer's own key bounds "
        "added, for each reused-mass configuration",
    )
