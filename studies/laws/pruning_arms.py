"""The fidelity study's arms: each configuration as the engine runs it, and with the rankings
that measure what a block choice could reach (``Rankings``, chosen on the command line)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.engine.layers import full_context_layers
from etinfer.llm import LLM
from etinfer.options import positive_int
from studies.laws.low_rank_sketch import calibrated_sketch
from studies.laws.oracle_selection import OracleSelector
from studies.laws.reused_variants import OwnBoundsSelector, calibrated

# name, configuration, selector (None: the configuration's own)
Arm = tuple[str, PruningConfig, BlockSelector | None]


@dataclass(frozen=True)
class Rankings:
    oracle: bool = False  # key-bound configurations: blocks ranked by their exact mass
    sketches: tuple[int, ...] = ()  # ... by that many channels of each query
    fixed_sketches: tuple[int, ...] = ()  # ... by that many channels fixed per layer and head
    low_rank: tuple[int, ...] = ()  # ... by a 4-bit copy of the keys of that rank
    whitened: tuple[int, ...] = ()  # ... by an 8-bit query-aware copy of that rank
    head_roles: tuple[float, ...] = ()  # reused-mass: that share of KV heads read every block
    own_bounds: tuple[float, ...] = ()  # ... and each layer keeps that share by its key bounds
    own_digests: tuple[float, ...] = ()  # ... or by its key digest (two spreads)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Rankings:
        lists = {field: tuple(getattr(args, field)) for _, field, _, _ in LIST_OPTIONS}
        return cls(oracle=args.oracle, **lists)


# Each list of settings on the command line: its flag, the Rankings field it fills, its type, help
LIST_OPTIONS = (
    ("--sketch-channels", "sketches", positive_int,
     "fidelity also with blocks ranked by this many channels of each query (slow)"),
    ("--fixed-sketch-channels", "fixed_sketches", positive_int,
     "...and by this many channels chosen once a layer and KV head (slow)"),
    ("--low-rank-sketch", "low_rank", positive_int,
     "...and by a 4-bit copy of the keys of this rank (slow; with --block-size 1, tokens)"),
    ("--whitened-sketch", "whitened", positive_int,
     "...and by an 8-bit copy of this rank in the calibration queries' white coordinates"),
    ("--head-roles", "head_roles", float,
     "fidelity also with this share of KV heads reading every block, for each reused-mass "
     "configuration (calibrated on other text; slow)"),
    ("--own-bounds", "own_bounds", float,
     "fidelity also with this share of blocks ranked by each layer's own key bounds added, "
     "for each reused-mass configuration"),
    ("--own-digests", "own_digests", float,
     "...and with this share ranked by each layer's own key digest (two spreads)"),
)  # fmt: skip


def arms(
    llm: LLM,
    configs: dict[str, PruningConfig],
    rankings: Rankings,
    calibration_text: list[int],
    context: int,
    steps: int,
) -> list[Arm]:
    """Every configuration, then the ``rankings`` that apply to it: the oracle and sketches
    replace the key bounds (the mass scorer's refresh steps are dense anyway), head
    roles and own bounds add to reused masses (head roles and low-rank bases calibrated on
    ``calibration_text``, ``steps`` tokens teacher-forced after ``context``)."""
    runs: list[Arm] = [(name, config, None) for name, config in configs.items()]
    cache = llm.engine.runner.cache
    # Rankings that replace the key bounds, each with the selector it makes for a configuration.
    replacing: list[tuple[str, Callable[[PruningConfig], BlockSelector]]] = []
    if rankings.oracle:
        replacing.append(("oracle", lambda config: OracleSelector(config, cache)))
    for n in rankings.sketches:
        replacing.append((f"sketch-{n}", partial(OracleSelector, cache=cache, channels=n)))
    for n in rankings.fixed_sketches:
        fixed = partial(OracleSelector, cache=cache, channels=n, fixed=True)
        replacing.append((f"fixed-sketch-{n}", fixed))
    for n in rankings.low_rank:
        sketch = partial(calibrated_sketch, llm=llm, rank=n, text=calibration_text, context=context)
        replacing.append((f"low-rank-{n}", sketch))
    for n in rankings.whitened:
        sketch = partial(
            calibrated_sketch, llm=llm, rank=n, text=calibration_text, context=context, bits=8,
            whitened=True,
        )  # fmt: skip
        replacing.append((f"whitened-{n}", sketch))
    runs += [
        (f"{name} {ranking}", config, make(config))
        for ranking, make in replacing
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
        runs += [
            (f"{name} own-digest-{share}", config, OwnBoundsSelector(config, share, full, 2.0))
            for share in rankings.own_digests
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
    for flag, field, kind, text in LIST_OPTIONS:
        metavar = flag.removeprefix("--").replace("-", "_").upper()
        parser.add_argument(
            flag, dest=field, metavar=metavar, type=kind, nargs="+", default=[], help=text
        )
