"""What the engine fits once per model file and keeps in the user's cache (the temperature
calibration, the sketch scorer's key maps): fitted on a plain engine over the same weights, and
written whole or not at all."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from pathlib import Path

from etinfer.config import EngineConfig
from etinfer.control.config import ControlConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.loader import LoadedModel

logger = logging.getLogger("etinfer.calibrate")


def plain_engine(config: EngineConfig, loaded: LoadedModel, control: ControlConfig) -> LLMEngine:
    """An engine over ``loaded`` as ``config`` reads it, with ``control`` alone: no earlier
    calibration, no drafts."""
    plain = dataclasses.replace(
        config, calibration=None, control=control, speculative=None, draft_model=None
    )
    return LLMEngine(plain, loaded)


def fit_once(path: Path, what: str, fit: Callable[[Path], None]) -> None:
    """Unless ``path`` exists, ``fit`` writes it (``what`` says what to the log): to a file of
    this process first, moved into place whole, if two processes fit at once."""
    if path.exists():
        return
    logger.warning("%s once (cached at %s)", what, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    fit(partial)
    partial.replace(path)
