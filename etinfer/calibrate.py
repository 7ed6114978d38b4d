"""``etinfer calibrate``: fit the post-hoc temperature of a model on held-out human text.

The text is the Python Language Reference as CPython ships it (``etinfer/corpus.py``), so
nothing is downloaded. Windows of the text alternate between the fitting set and the evaluation
set, so the ECE and NLL reported "after" are measured on text the fit did not see.

The temperature belongs to one model file (and how its weights are read): ``calibration="auto"``
fits it the first time an engine over that file is built (``build_engine``; ``LLM``, ``etinfer
serve`` and the replicas build theirs so) and keeps it in the cache directory, keyed by the
file's identity, for every later engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from etinfer import options
from etinfer.calibrate_sketch import with_sketch_maps
from etinfer.config import EngineConfig
from etinfer.control.calibration import (
    Calibration,
    expected_calibration_error,
    fit_temperature,
    nll,
)
from etinfer.control.config import ControlConfig
from etinfer.corpus import CORPUS, corpus_windows
from etinfer.engine.llm_engine import LLMEngine
from etinfer.fit_cache import fit_once, plain_engine
from etinfer.model.loader import LoadedModel, load_model

AUTO = "auto"  # EngineConfig.calibration: the model file's own, fitted once and cached
CACHE_ENV = "ETINFER_CACHE_DIR"  # where cached calibrations live (default ~/.cache/etinfer)


def collect(
    engine: LLMEngine, windows: Iterator[list[int]], num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and next tokens for ``num_tokens`` positions of teacher-forced text."""
    logits, targets, have = [], [], 0
    for ids in windows:
        if have >= num_tokens:
            break
        logits.append(engine.score(ids)[:-1])
        targets.append(torch.tensor(ids[1:], device=logits[-1].device))
        have += len(ids) - 1
    if have < num_tokens:
        raise ValueError(
            f"the corpus holds only {have} positions, fewer than the {num_tokens} asked"
        )
    return torch.cat(logits)[:num_tokens], torch.cat(targets)[:num_tokens]


def split_windows(engine: LLMEngine, window: int) -> tuple[list[list[int]], list[list[int]]]:
    """The corpus's windows, alternately to fit on and held out."""
    windows = list(corpus_windows(engine.tokenizer, window))
    return windows[0::2], windows[1::2]


def corpus_logits(
    engine: LLMEngine, fit_tokens: int = 4096, eval_tokens: int = 4096, window: int = 256
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Logits and next tokens of the fitting windows and of the held-out ones (to fit several
    temperatures on one collection)."""
    fit, held_out = split_windows(engine, window)
    return collect(engine, iter(fit), fit_tokens), collect(engine, iter(held_out), eval_tokens)


def scaled(logits: torch.Tensor, logit_scale: float) -> torch.Tensor:
    return logits if logit_scale == 1.0 else logits * logit_scale


def fit_calibration(
    engine: LLMEngine,
    fit: tuple[torch.Tensor, torch.Tensor],
    held_out: tuple[torch.Tensor, torch.Tensor],
    logit_scale: float = 1.0,
) -> Calibration:
    """The post-hoc temperature of ``logit_scale`` times the model's logits (a stress study's
    distorted model; 1 for the model itself), fitted on ``fit``, scored on ``held_out``."""
    temperature = fit_temperature(scaled(fit[0], logit_scale), fit[1])
    return scored(engine, temperature, len(fit[1]), held_out, logit_scale)


def scored(
    engine: LLMEngine,
    temperature: float,
    fit_tokens: int,
    held_out: tuple[torch.Tensor, torch.Tensor],
    logit_scale: float,
) -> Calibration:
    """A fitted temperature with its NLL and ECE before and after, on the held-out text."""
    logits, targets = scaled(held_out[0], logit_scale), held_out[1]
    return Calibration(
        temperature=temperature,
        model=str(engine.config.model or "default"),
        vocab_size=engine.model_config.vocab_size,
        corpus=CORPUS,
        fit_tokens=fit_tokens,
        eval_tokens=len(targets),
        nll_before=nll(logits, targets),
        nll_after=nll(logits, targets, temperature),
        ece_before=expected_calibration_error(logits, targets),
        ece_after=expected_calibration_error(logits, targets, temperature),
        logit_scale=logit_scale,
    )


def calibrate(
    engine: LLMEngine, fit_tokens: int = 4096, eval_tokens: int = 4096, window: int = 256
) -> Calibration:
    """Fit on the engine's model, or on its stressed logits when the engine has a stress (the
    control layers then read ``logit_scale * z / T_cal``)."""
    scale = 1.0 if engine.config.stress is None else engine.config.stress.logit_scale
    fit_windows, held_windows = split_windows(engine, window)
    fit = collect(engine, iter(fit_windows), fit_tokens)
    temperature = fit_temperature(scaled(fit[0], scale), fit[1])
    del fit  # the held-out logits take its place: hundreds of MB each
    held_out = collect(engine, iter(held_windows), eval_tokens)
    return scored(engine, temperature, fit_tokens, held_out, scale)


def build_engine(config: EngineConfig, loaded: LoadedModel | None = None) -> LLMEngine:
    """An engine for ``config``; with ``calibration="auto"`` over the model file's cached
    calibration, fitted now (on a plain engine over the same weights) if there is none yet,
    and likewise the sketch scorer's maps where pruning asks for them."""
    pruning = config.control.pruning_config
    sketching = pruning is not None and pruning.sketched and pruning.sketch_maps is None
    if config.calibration != AUTO and not sketching:
        return LLMEngine(config, loaded)
    loaded = loaded or load_model(config.model)
    path = cached_calibration_path(config, loaded)
    config = with_sketch_maps(config, loaded, path)
    if config.calibration != AUTO:
        return LLMEngine(config, loaded)
    fit_once(
        path,
        f"calibration='auto': fitting {loaded.path.name}'s temperature",
        lambda partial: calibrate(plain_engine(config, loaded, ControlConfig())).save(partial),
    )
    return LLMEngine(dataclasses.replace(config, calibration=str(path)), loaded)


def cached_calibration_path(config: EngineConfig, loaded: LoadedModel) -> Path:
    """Where the calibration of ``loaded`` as ``config`` reads it is cached: keyed by the file
    (path, size, modification time) and what changes its logits (weights' format and type,
    a stress's logit scale)."""
    stat = loaded.path.stat()
    stress = 1.0 if config.stress is None else config.stress.logit_scale
    identity = [str(loaded.path.resolve()), stat.st_size, stat.st_mtime_ns]
    identity += [config.quantization, config.dtype, config.device, stress, CORPUS]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:24]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "etinfer")
    return root / "calibration" / f"{loaded.path.stem}-{key}.json"


def run(args: argparse.Namespace) -> int:
    engine = LLMEngine(EngineConfig(model=args.model, **options.engine_kwargs(args)))
    result = calibrate(engine, args.fit_tokens, args.eval_tokens, args.window)
    result.save(args.output)
    print(
        f"T_cal = {result.temperature:.4f} on {result.fit_tokens} tokens of {CORPUS}\n"
        f"held-out {result.eval_tokens} tokens: "
        f"NLL {result.nll_before:.4f} -> {result.nll_after:.4f} nats/token, "
        f"ECE {result.ece_before:.4f} -> {result.ece_after:.4f} (15 bins)\n"
        f"written to {args.output}"
    )
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("calibrate", help="fit the post-hoc temperature on held-out text")
    # Calibration measures the model itself: no control layers, no earlier calibration.
    options.add_engine_options(parser, exclude=("control", "calibration"))
    parser.add_argument("--output", default="calibration.json")
    parser.add_argument("--fit-tokens", type=int, default=4096)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.set_defaults(func=run)
