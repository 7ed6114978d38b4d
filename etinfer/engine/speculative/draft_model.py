"""A separate model as drafter (``draft_model="path"``): any model with the same vocabulary, over
a KV cache of its own.

Each request being drafted for has a shadow here: its tokens as this model last saw them and
their keys and values in this model's cache. Before drafting, the shadow is brought up to the
request's tokens: what still matches (the longest common prefix) is kept, rejected drafts are
forgotten, and the rest runs as one chunk, whose last row gives the first draft; each further
draft is one decode step of this model. Shadows of finished requests are dropped at the next
step; those of preempted requests keep their blocks until they finish, and a full cache leaves
a request without drafts (never without tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from etinfer.config import EngineConfig
from etinfer.control.block_selection import BLOCK_SELECTORS
from etinfer.control.record import StepDecisions, StepShape
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.runner.options import RunnerOptions
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.loader import load_model

_NO_DECISIONS = StepDecisions(StepShape(), None, [])


@dataclass(eq=False)
class _Shadow:
    """What ``ModelRunner.prepare`` and the block manager read of a sequence."""

    token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    kv_offset: int = 0  # never compressed
    kv_compressed: bool = False
    kv_compression: None = None  # the layer's state: its cache is never compressed
    prompt_logprobs: None = None  # a draft scores no prompt


class DraftModelProposer:
    asking_costs = True  # the draft model runs for each token asked

    def __init__(
        self, engine: EngineConfig, vocab_size: int, max_model_len: int, num_blocks: int
    ) -> None:
        loaded = load_model(engine.draft_model)
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(
                f"draft_model {engine.draft_model}: a vocabulary of {loaded.config.vocab_size} "
                f"tokens, the model's has {vocab_size}: drafts must be the model's own tokens"
            )
        if loaded.config.max_position_embeddings < max_model_len:
            raise ValueError(
                f"draft_model {engine.draft_model}: context length "
                f"{loaded.config.max_position_embeddings}, under the engine's {max_model_len}"
            )
        self.kv = KVCacheManager(num_blocks, engine.block_size, enable_prefix_caching=False)
        options = RunnerOptions.of(
            engine, loaded.config, max_model_len=max_model_len, num_blocks=num_blocks
        )
        self.runner = ModelRunner(
            model=loaded,
            options=options.without_layers(),
            selector=BLOCK_SELECTORS.create("dense"),
        )
        self.shadows: dict[Sequence, _Shadow] = {}

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        shadows = [self._synced(seq, limit) for seq, limit in zip(seqs, limits, strict=True)]
        alive = [i for i, shadow in enumerate(shadows) if shadow is not None]
        while alive:
            # Sequences with one token to compute first: the runner wants decode rows first.
            alive.sort(key=lambda i: _to_compute(shadows[i]) > 1)
            batch = ScheduledBatch(
                seqs=[shadows[i] for i in alive],
                num_tokens=[_to_compute(shadows[i]) for i in alive],
                sampled=list(range(len(alive))),
                drafts=[[] for _ in alive],
            )
            logits = self.runner.execute(batch, _NO_DECISIONS).logits
            tokens = logits.argmax(-1).tolist()
            still = []
            for i, token in zip(alive, tokens, strict=True):
                shadow = shadows[i]
                shadow.num_computed_tokens = len(shadow.token_ids)
                shadow.token_ids.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < limits[i]:
                    still.append(i)
            alive = still
        return drafts

    def _synced(self, seq: Sequence, limit: int) -> _Shadow | None:
        """The shadow of ``seq``, its computed tokens cut to those still matching, with blocks
        for the tokens to compute and ``limit`` drafts; None if this cache is full."""
        shadow = self.shadows.get(seq)
        if shadow is None:
            shadow = self.shadows[seq] = _Shadow(list(seq.token_ids))
        else:
            common = _common_prefix(shadow.token_ids, seq.token_ids)
            shadow.token_ids = list(seq.token_ids)
            # At least the last token runs again: its row gives the first draft.
            shadow.num_computed_tokens = min(
                shadow.num_computed_tokens, common, len(seq.token_ids) - 1
            )
        needed = len(shadow.token_ids) - shadow.num_computed_tokens + limit
        if limit <= 0 or not self.kv.allocate(shadow, needed):
            return None
        return shadow

    def drop_finished(self) -> None:
        """Give back the cache of requests that have finished."""
        for seq in [seq for seq in self.shadows if seq.is_finished]:
            self.kv.free(self.shadows.pop(seq))


def _to_compute(shadow: _Shadow) -> int:
    return len(shadow.token_ids) - shadow.num_computed_tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    mismatch = torch.tensor(a[:n]) != torch.tensor(b[:n])
    return int(mismatch.nonzero()[0])
