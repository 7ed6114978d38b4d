"""Engine options on the command line, declared once: one flag per ``EngineConfig`` field.

Every field becomes ``--field-name``, with the field's default and the help its metadata carries,
so a field added to ``EngineConfig`` is a flag of every command that builds an engine, without
further code. A command chooses which fields it exposes (a benchmark that sizes the engine itself
leaves those out; one whose own ``--seed`` seeds its workload leaves out the engine's) and may
change their defaults. ``control`` is exposed as the named presets of ``CONTROL_PRESETS``,
``speculative`` and ``stress`` in the short forms their ``parse`` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any

import torch

from etinfer.config import EngineConfig, SpeculativeConfig
from etinfer.control.config import ControlConfig
from etinfer.control.stress import StressConfig

CONTROL_PRESETS: dict[str, ControlConfig] = {
    "baseline": ControlConfig.baseline(),
    "sampling": ControlConfig(sampling=True),
    "pruning": ControlConfig(pruning=True),
    "scheduling": ControlConfig(scheduling=True),
    "full": ControlConfig.full(),
    "sparse-prefill": ControlConfig(sparse_prefill=True),
    "kv-compression": ControlConfig(kv_compression=True),
    "entropyinfer": ControlConfig(sparse_prefill=True, kv_compression=True),
}
FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
_TYPES = typing.get_type_hints(EngineConfig)
_SCALARS = (bool, int, float, str)


def add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    only: Collection[str] | None = None,
    exclude: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """A flag for each ``EngineConfig`` field (those in ``only``, when given), but those in
    ``exclude``; ``defaults``, ``aliases`` (another flag name) and ``helps`` are per field.
    ``engine_kwargs`` reads them back from the parsed arguments."""
    defaults, aliases, helps = defaults or {}, aliases or {}, helps or {}
    names = tuple(name for name in (only or FIELDS) if name not in exclude)
    for name in names:
        flags = [_flag(name), *([aliases[name]] if name in aliases else [])]
        default = defaults[name] if name in defaults else _field_default(name)
        help_ = helps.get(name) or _help(name, default)
        parser.add_argument(*flags, dest=name, default=default, help=help_, **_parsing(name))
    parser.set_defaults(engine_options=names)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from the command line, but the model (``LLM`` takes it
    apart, as a path or a model already read)."""
    values = {name: getattr(args, name) for name in args.engine_options if name != "model"}
    if "control" in values:
        values["control"] = CONTROL_PRESETS[values["control"]]
    return values


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The flags that give another command (a server or benchmark in a subprocess) the same
    engine options; unset ones (None) are left to its defaults."""
    flags = []
    for name in args.engine_options:
        value = getattr(args, name)
        if isinstance(value, bool):
            flags.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        elif isinstance(value, SpeculativeConfig | StressConfig):
            flags += [_flag(name), value.as_flag()]
        elif value is not None:
            flags += [_flag(name), str(value)]
    return flags


def positive_int(text: str) -> int:
    """The argparse type of counts and sizes (steps, repeats, batches, lengths, tokens): an
    integer of at least 1, refused with the flag's name before anything is loaded. A zero there
    ran a benchmark to a division by zero or an empty median at its end."""
    return _int_from(text, 1)


def non_negative_int(text: str) -> int:
    """The argparse type of a count where 0 means none."""
    return _int_from(text, 0)


def _int_from(text: str, low: int) -> int:
    value = int(text)
    if value < low:
        raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    return value


def add_threads_option(parser: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--threads``, the benchmarks' torch thread count (``set_threads`` applies it)."""
    shown = "torch's choice" if default is None else default
    parser.add_argument(
        "--threads", type=positive_int, default=default, help=f"torch threads (default: {shown})"
    )


def set_threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_default(name: str) -> Any:
    field = FIELDS[name]
    if field.default_factory is dataclasses.MISSING:
        return field.default
    value = field.default_factory()
    if name == "control":
        return next(preset for preset, config in CONTROL_PRESETS.items() if config == value)
    return value


def _help(name: str, default: Any) -> str:
    text = FIELDS[name].metadata["help"]
    return text if default is None else f"{text} (default: %(default)s)"


def _parsing(name: str) -> dict[str, Any]:
    """How argparse reads the field: its scalar type (less an optional None), a switch for a
    bool, a preset name for the control layers."""
    if name == "control":
        return {"choices": list(CONTROL_PRESETS)}
    if name == "speculative":
        return {"type": SpeculativeConfig.parse}
    if name == "stress":
        return {"type": StressConfig.parse}
    kind = _TYPES[name]
    if isinstance(kind, types.UnionType):
        kinds = [k for k in typing.get_args(kind) if k is not types.NoneType]
        kind = kinds[0] if len(kinds) == 1 else kind
    if kind not in _SCALARS:
        raise TypeError(f"EngineConfig.{name}: no command-line form for {_TYPES[name]}")
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": kind}
