"""Jump-forward decoding: where a grammar allows one continuation only, verify it in one step.

When a constrained sequence's grammar admits exactly one string next (the rest of a key, the
`": "` after it, a closing brace), that string's tokens join the step as drafts after the
sequence's known token, and the step's sampling checks each against the grammar's mask as it
checks speculative drafts (``engine/sampling/step_sampling.py``): a token is kept only where the
sampler, under the mask, draws it. So the output is token for token what plain constrained
decoding gives (the tokenizer may split the forced text otherwise than the model would; then
the draft is simply not kept), and a run of forced tokens costs one forward pass instead of
one each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from etinfer.engine.kv_cache.manager import KVCacheManager
    from etinfer.engine.scheduler import ScheduledBatch
    from etinfer.model.tokenizer import Tokenizer


class JumpForward:
    def __init__(
        self,
        kv: KVCacheManager,
        tokenizer: Tokenizer,
        *,
        max_model_len: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens

    def draft(self, batch: ScheduledBatch) -> None:
        """Add each constrained decoding sequence's forced continuation as its drafts, within
        the step's token budget (sequences that already carry drafts are left as they are)."""
        budget = self.max_num_batched_tokens - sum(batch.num_tokens)
        for i in range(batch.num_decode):
            seq = batch.seqs[i]
            if seq.matcher is None or batch.drafts[i] or seq.forced or budget <= 0:
                continue
            text = seq.matcher.jump_forward()
            if not text:
                continue
            limit = min(budget, seq.draft_room(self.max_model_len))
            drafts = self.tokenizer.encode(text, add_special_tokens=False)[:limit]
            # Blocks past the drafts kept go back when the step commits.
            if drafts and self.kv.allocate(seq, 1 + len(drafts)):
                batch.add_drafts(i, drafts)
                budget -= len(drafts)
