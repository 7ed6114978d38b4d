"""Drafters: cheap proposals of a sequence's next tokens, for the model to verify.

A drafter proposes deterministically (one token per position, no distribution), which is what
makes verification simple and lossless: drawing the model's own token at each position and
keeping the drafts up to the first one it did not draw gives exactly the model's distribution
(Leviathan et al.'s accept/resample rule with a one-hot draft distribution reduces to this).
"""

from __future__ import annotations

import torch

from etinfer.config import EngineConfig
from etinfer.engine.kv_cache.block_pool import BlockPool
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.sequence import Sequence
from etinfer.engine.speculative.draft_model import DraftModelProposer
from etinfer.engine.speculative.early_exit import EarlyExitDrafter, build_early_exit
from etinfer.model.tokenizer import Tokenizer


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from
    ``max_n`` down to ``min_n``) and propose the tokens that followed it.

    Text that copies from its prompt (summaries, edits, code, quotes) repeats long runs, which
    this proposes at no model cost; elsewhere it mostly finds nothing and proposes nothing.
    """

    asking_costs = False  # only what it proposes costs: the rows that verify it

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return [self.lookup(seq.token_ids, n) for seq, n in zip(seqs, limits, strict=True)]

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        tokens = torch.tensor(token_ids)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            # Windows starting before the suffix itself, matched all at once.
            windows = tokens[:-1].unfold(0, n, 1)
            hits = (windows == tokens[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return token_ids[start : start + num_tokens]
        return []


def make_proposer(
    engine: EngineConfig, runner: ModelRunner, pool: BlockPool, tokenizer: Tokenizer
) -> NgramProposer | EarlyExitDrafter | DraftModelProposer:
    """The drafter ``engine.speculative`` names; an early exit fits its adapter here, at load,
    and a separate draft model is read here."""
    config = engine.speculative
    if config.method == "ngram":
        return NgramProposer(config.ngram_max, config.ngram_min)
    if not engine.draft_model.startswith("self:"):
        return DraftModelProposer(
            engine, runner.config.vocab_size, runner.max_model_len, pool.num_blocks
        )
    return build_early_exit(
        engine.draft_model,
        runner,
        pool,
        tokenizer,
        adapter=config.exit_adapter,
        entropy_threshold=config.entropy_threshold if config.schedule == "entropy" else None,
    )
