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
import hashlib
from pathlib import Path

import torch

from etinfer.config import EngineConfig
from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.control.key_sketch import SketchMaps, fit_maps, gram
from etinfer.corpus import corpus_windows
from etinfer.engine.llm_engine import LLMEngine
from etinfer.fit_cache import fit_once, plain_engine
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.kv_cache import KVCache
from etinfer.model.loader import LoadedModel
from etinfer.sampling_params import SamplingParams

# Prompt tokens of each passage, read one after another. Keys and queries are taken after the
# rotary embedding, which turns them by their positions: passages of several lengths give the
# maps the positions of short and long contexts alike (fitted at 1K tokens alone, they ranked
# blocks at 3K tokens worse than the key bounds did).
CONTEXTS = (1024, 2048, 4096, 6144, 8192)
STEPS = 32  # forced decode steps a passage: the queries


class QueryRecorder(BlockSelector):
    """Reads everything; sums each whole-context layer's decode queries' ``gram`` by KV head,
    and keeps the step's layout, to read the passage's keys back once it ends."""

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = kv_heads
        self.query_grams: dict[int, torch.Tensor] = {}
        self.layout: DecodeBlocks | None = None

    def select(self, layer, query, blocks, summaries) -> None:
        seqs, _, dim = query.shape
        grouped = (
            query.view(seqs, self.kv_heads, -1, dim).transpose(0, 1).reshape(self.kv_heads, -1, dim)
        )
        self.query_grams[layer] = self.query_grams.get(layer, 0) + gram(grouped.cpu())
        self.layout = blocks
        return None


def context_keys(cache: KVCache, layer: int, blocks: DecodeBlocks) -> torch.Tensor:
    """Every key in the contexts of ``blocks`` at ``layer``, [kv_heads, tokens, head_dim]."""
    size = blocks.block_size
    slots = []
    for row, length in enumerate(blocks.context_lens.tolist()):
        positions = torch.arange(length, device=blocks.block_tables.device)
        slots.append(blocks.block_tables[row, positions // size] * size + positions % size)
    return cache.read(layer, torch.cat(slots))[0]


def fit_sketch_maps(engine: LLMEngine, rank: int) -> SketchMaps:
    """The maps of ``engine``'s model at ``rank``: for each whole-context layer, from the
    queries of passages of the corpus's last text, ``STEPS`` forced tokens each, and the keys
    of their contexts."""
    model = engine.model_config
    recorder = QueryRecorder(model.num_kv_heads)
    key_grams: dict[int, torch.Tensor] = {}
    # The longest passage fits the engine (its last steps at the longest context it decodes).
    contexts = sorted({min(c, engine.max_model_len - STEPS) for c in CONTEXTS})
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    engine.set_pruning(PruningConfig(), recorder)
    try:
        for context in contexts:
            ids = list(corpus_windows(engine.tokenizer, context + STEPS))[-1]
            engine.add_request(
                None, params, prompt_token_ids=ids[:context], forced_token_ids=ids[context:]
            )
            while engine.has_unfinished_requests():
                engine.step()
            # Read before the next passage takes the freed blocks.
            for layer in recorder.query_grams:
                keys = gram(context_keys(engine.runner.cache, layer, recorder.layout).cpu())
                key_grams[layer] = key_grams.get(layer, 0) + keys
    finally:
        engine.set_pruning(None)
    key_maps = torch.zeros(model.num_layers, model.num_kv_heads, model.head_dim, rank)
    query_maps = torch.zeros_like(key_maps)
    for layer, query_gram in recorder.query_grams.items():  # sliding layers never asked: zeros
        key_maps[layer], query_maps[layer] = fit_maps(query_gram, key_grams[layer], rank)
    return SketchMaps(key_maps, query_maps)


def with_sketch_maps(config: EngineConfig, loaded: LoadedModel, cache_path: Path) -> EngineConfig:
    """``config`` with its sketch scorer's maps: from beside ``cache_path``, fitted now if there
    are none yet. Unchanged where pruning does not score by the sketch or names its maps."""
    pruning = config.control.pruning_config
    if pruning is None or not pruning.sketched or pruning.sketch_maps is not None:
        return config
    # Named by how the maps are fitted too: a change of passages fits them afresh.
    rank = pruning.rank_for(loaded.config.head_dim)
    recipe = hashlib.sha256(repr((CONTEXTS, STEPS, rank)).encode()).hexdigest()
    path = cache_path.with_name(f"{cache_path.stem}-sketch-{recipe[:12]}.pt")
    # With pruning on, so that the recorder may ask every layer.
    plain = ControlConfig(pruning=PruningConfig())
    fit_once(
        path,
        f"pruning scorer {pruning.scorer!r}: fitting {loaded.path.name}'s key maps",
        lambda partial: fit_sketch_maps(plain_engine(config, loaded, plain), rank).save(partial),
    )
    sketched = dataclasses.replace(pruning, sketch_maps=str(path))
    control = dataclasses.replace(config.control, pruning=sketched)
    return dataclasses.replace(config, control=control)
