"""Latent KV compression (EntropyInfer's decode side, seed 003): which cached positions each
(layer, KV head) keeps once a request has generated its first tokens.

After ``decode_queries`` generated tokens (the seed's ``N_d``), the queries of the prompt's last
``window`` tokens and of those generated tokens vote: each (layer, KV head) ranks the cached
positions by the attention those queries paid them (softmax per query, summed over the queries
and the query heads sharing the KV head), averaged over ``pool_kernel`` neighbouring positions
so that runs of tokens stay together (SnapKV's pooling), and keeps the ``budget`` best, the
``sink`` first and the ``recent`` last positions always among them. With ``decode_queries = 0``
only the prompt's window votes (SnapKV). Keys are cached after the rotary embedding, so a kept
key needs no position of its own: each head keeps its own set, and every set has the same size,
so the attention of a compressed sequence reads ``budget`` slots per head and needs no mask.

**Novel keys** (``key_novelty``, on by default; our addition, after KeyDiff). The voters ask
about what they are reading; a question that comes later may ask about something they ignored.
A position is also kept when its key is far from the head's mean key (``1 - cos(k, mean k)``):
a position ranks by the better of its two ranks, attention and novelty. Measured on passkeys
asked after compression (``python -m studies longcontext``): with attention alone, not one of the
passkeys dense attention finds in a repeated haystack survived a compression to 1,024 or 2,048
positions of 3K-6K prompts (measured with a script while choosing; the benchmark keeps an
attention-only arm); with novelty, all of them did.

**Sizes for an 8K context.** The seed keeps 1,024 tokens of 32K-128K contexts (1-3 %). Scaled
to 8K that is 64 tokens, which leaves a 135M model nothing to retrieve with; the budget here is
2,048 tokens (a quarter of a full 8K context: with 256 generated tokens, 28 % of its blocks),
chosen with ``python -m studies longcontext``. ``N_d = 16`` and the window of 32 are the seed's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from etinfer.validation import check_int


@dataclass(frozen=True)
class KVCompressionConfig:
    budget: int = 2048  # positions kept per (layer, KV head), sink and recent included
    decode_queries: int = 16  # N_d: generated tokens whose queries vote, then compression
    window: int = 32  # the prompt's last queries that vote
    pool_kernel: int = 5  # positions averaged when ranking; odd
    sink: int = 16  # first positions always kept
    recent: int = 64  # last positions always kept
    key_novelty: bool = True  # also keep the positions whose keys stand out

    def __post_init__(self) -> None:
        check_int("decode_queries", self.decode_queries, low=0)
        check_int("window", self.window, low=1)
        check_int("sink", self.sink, low=0)
        check_int("recent", self.recent, low=1)
        check_int("budget", self.budget, low=self.sink + self.recent)
        check_int("pool_kernel", self.pool_kernel, low=1)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be odd, got {self.pool_kernel}")


@dataclass
class KVCompressionState:
    """One request under KV compression (the engine's compressor writes it).

    - voting_queries: [layers, voters, heads, head_dim] the voters' queries, captured out of the
      forward pass until the cache is compressed; ``voted``: [voters] which were computed (those
      served from the prefix cache never were).
    - compressed: the cache was compressed, or was left whole for good (no voter computed).
    - offset: how many fewer cache entries than positions the request has (position - offset is
      the cache index of a position after the compression).
    """

    voting_queries: torch.Tensor | None = None
    voted: torch.Tensor | None = None
    compressed: bool = False
    offset: int = 0

    def cache_freed(self) -> None:
        """Its blocks went back to the pool (a preemption): the recompute writes every position
        again, and may be compressed again once it decodes."""
        self.compressed, self.offset = False, 0


def observed_attention(
    queries: torch.Tensor,  # [voters, heads, head_dim], after the rotary embedding
    query_pos: torch.Tensor,  # [voters]
    keys: torch.Tensor,  # [kv_heads, context, head_dim], positions 0..context-1
    scale: float,
) -> torch.Tensor:
    """The attention each position received from the voting queries, per KV head [kv_heads,
    context]: each query's softmax (causal) summed over the queries and the query heads of the
    KV head."""
    voters, heads, dim = queries.shape
    kv_heads, context, _ = keys.shape
    group = heads // kv_heads
    q = queries.view(voters, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, -1, dim)
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [kv_heads, group * voters, ctx]
    future = torch.arange(context, device=keys.device) > query_pos.repeat(group)[:, None]
    scores.masked_fill_(future, -torch.inf)
    return scores.softmax(-1).sum(1)


def key_novelty(keys: torch.Tensor) -> torch.Tensor:
    """How far each key lies from its head's mean key, ``1 - cos``: [kv_heads, context]."""
    return 1 - F.cosine_similarity(keys, keys.mean(1, keepdim=True), dim=-1)


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """Each entry's rank within its row, 0 for the lowest."""
    return scores.argsort(-1).argsort(-1)


def kept_positions(
    attention: torch.Tensor, keys: torch.Tensor | None, config: KVCompressionConfig
) -> torch.Tensor:
    """The ``budget`` positions each KV head keeps, ascending, [kv_heads, budget]: the sink and
    the recent ones, then the best by pooled attention (``attention`` [kv_heads, context]) or,
    with ``key_novelty``, by the better of that rank and the rank of the key's novelty
    (``keys`` [kv_heads, context, head_dim])."""
    context = attention.shape[-1]
    pooled = F.avg_pool1d(
        attention[:, None],
        config.pool_kernel,
        stride=1,
        padding=config.pool_kernel // 2,
        count_include_pad=False,
    )[:, 0]
    if config.key_novelty and keys is not None:
        pooled = torch.maximum(_ranks(pooled), _ranks(key_novelty(keys))).float()
    pooled[:, : config.sink] = torch.inf
    pooled[:, context - config.recent :] = torch.inf
    return pooled.topk(min(config.budget, context), dim=-1).indices.sort(-1).values
