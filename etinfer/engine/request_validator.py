"""What a request must satisfy before an engine queues it: a prompt it can encode, room to
generate within the context, a KV footprint the pool can ever hold, sane scheduling fields."""

from __future__ import annotations

from collections.abc import Sequence

from etinfer.engine.kv_cache_manager import KVCacheManager
from etinfer.model.tokenizer import Tokenizer
from etinfer.sampling_params import SamplingParams
from etinfer.validation import check_float, check_int

Prompt = str | Sequence[int]


class RequestValidator:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_model_len: int,
        kv: KVCacheManager,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.kv = kv

    def encode_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Validate a prompt and return (text or None, token ids)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
            if not ids:
                raise ValueError("prompt must not be empty (it encodes to no tokens)")
            return prompt, ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab - 1}]")
        return None, ids

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Refuse what could never finish: a prompt without room to generate, or a request the
        whole KV pool cannot hold (it would be preempted forever)."""
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens but max_model_len is {self.max_model_len}; "
                f"at most {self.max_model_len - 1} prompt tokens leave room to generate"
            )
        # The last generated token is never computed, so it needs no slot.
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        needed = self.kv.blocks_needed(longest)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"request needs {needed} KV blocks ({n} prompt tokens + max_tokens "
                f"{params.max_tokens} - 1, {self.kv.block_size} tokens per block) but "
                f"num_kvcache_blocks is {self.kv.pool.num_blocks}; lower max_tokens or enlarge "
                "the pool"
            )

    @staticmethod
    def check_scheduling(priority: int, slo: float | None) -> None:
        check_int("priority", priority)
        if slo is not None:
            check_float("slo", slo, low=0.0, low_open=True)
