"""Fit the sketch scorer's maps of a model on the shipped corpus, once per model file.

The maps (``control/key_sketch.py``) come from the keys and queries each whole-context layer
meets while the model reads human text: a few passages of the corpus (``etinfer/corpus.py``,
the Python Language Reference CPython ships, so nothing is downloaded), the last ones, which the
fidelity benchmarks do not score. Each passage is a prompt whose continuation is forced a token
a step, so the queries are those of decode steps over real text. ``build_engine`` fits them the
first time an engine over a model file asks for the sketch scorer and caches them beside the
temperature calibration, keyed the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from etinfer.config import EngineConfig
from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.control.key_sketch import SketchMaps, fit_maps
from etinfer.corpus import corpus_windows
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache
from etinfer.model.loader import LoadedModel
from etinfer.sampling_params import SamplingParams

logger = logging.getLogger("etinfer.calibrate")

PASSAGES = 4  # passages read at once, each a prompt and its forced continuation
CONTEXT = 1024  # prompt tokens a passage
STEPS = 32  # forced decode steps a passage: the queries


class QueryRecorder(BlockSelector):
    """Reads everything and keeps every whole-context layer's decode queries, and the layout of
    the widest step (every passage decoding) to read their keys back once they end."""

    def __init__(self) -> None:
        self.queries: dict[int, list[torch.Tensor]] = {}
        self.layout: DecodeBlocks | None = None

    def select(self, layer, query, blocks, summaries) -> None:
        self.queries.setdefault(layer, []).append(query.float().clone())
        widest = self.layout is None or len(blocks.context_lens) >= len(self.layout.context_lens)
        self.layout = blocks if widest else self.layout
        return None


def context_keys(cache: KVCache, layer: int, blocks: DecodeBlocks) -> torch.Tensor:
    """Every key in the contexts of ``blocks`` at ``layer``, [kv_heads, tokens, head_dim]."""
    size = blocks.block_size
    slots = [
        blocks.block_tables[row, torch.arange(length) // size] * size + torch.arange(length) % size
        for row, length in enumerate(blocks.context_lens.tolist())
    ]
    return cache.read(layer, torch.cat(slots).to(blocks.block_tables.device))[0]


def fit_sketch_maps(engine: LLMEngine, rank: int) -> SketchMaps:
    """The maps of ``engine``'s model at ``rank``: for each whole-context layer, from the
    queries of ``PASSAGES`` forced continuations and the keys of their contexts."""
    model = engine.model_config
    windows = list(corpus_windows(engine.tokenizer, CONTEXT + STEPS))[-PASSAGES:]
    recorder = QueryRecorder()
    engine.set_pruning(PruningConfig(), recorder)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
        for ids in windows:
            engine.add_request(
                None, params, prompt_token_ids=ids[:CONTEXT], forced_token_ids=ids[CONTEXT:]
            )
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.set_pruning(None)
    kv_heads, group = model.num_kv_heads, model.num_heads // model.num_kv_heads
    key_maps = torch.zeros(model.num_layers, kv_heads, model.head_dim, rank)
    query_maps = torch.zeros_like(key_maps)
    for layer, queries in recorder.queries.items():  # sliding layers are never asked: zeros
        grouped = torch.cat(queries).view(-1, kv_heads, group, model.head_dim)
        grouped = grouped.transpose(0, 1).flatten(1, 2)  # [kv_heads, n, dim]
        keys = context_keys(engine.runner.cache, layer, recorder.layout)
        key_maps[layer], query_maps[layer] = fit_maps(grouped.cpu(), keys.cpu(), rank)
    return SketchMaps(key_maps, query_maps)


def with_sketch_maps(config: EngineConfig, loaded: LoadedModel, cache_path: Path) -> EngineConfig:
    """``config`` with its sketch scorer's maps: from ``cache_path``, fitted now (on a plain
    engine over the same weights, with pruning on so that it may ask every layer) if there are
    none yet. Unchanged where pruning does not score by the sketch or names its maps."""
    pruning = config.control.pruning_config
    if pruning is None or pruning.scorer != "sketch" or pruning.sketch_maps is not None:
        return config
    path = cache_path.with_name(f"{cache_path.stem}-sketch{pruning.sketch_rank}.pt")
    if not path.exists():
        logger.warning(
            "pruning scorer 'sketch': fitting %s's key maps once (cached at %s)",
            loaded.path.name,
            path,
        )
        plain = dataclasses.replace(
            config,
            calibration=None,
            control=ControlConfig(pruning=PruningConfig()),
            speculative=None,
            draft_model=None,
        )
        maps = fit_sketch_maps(LLMEngine(plain, loaded), pruning.sketch_rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        maps.save(partial)
        partial.replace(path)  # whole or not at all, if two processes fit at once
    sketched = dataclasses.replace(pruning, sketch_maps=str(path))
    control = dataclasses.replace(config.control, pruning=sketched)
    return dataclasses.replace(config, control=control)
