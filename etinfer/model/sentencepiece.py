"""A SentencePiece BPE vocabulary as a GGUF file holds it (``tokenizer.ggml.model = "llama"``:
tokens, scores, token types, no merges), rebuilt as a `tokenizers` BPE with byte fallback.

SentencePiece's BPE merges, at each step, the adjacent pair whose merged piece ranks best; a
`tokenizers` BPE applies merges by rank. So every way of cutting a vocabulary piece into two
vocabulary pieces becomes a merge, ranked by the merged piece (``rank``: lower merges first), a
longer left part first where one piece splits several ways, as transformers rebuilds Gemma's.

Gemma's files rank pieces by their order in the file (their scores do not follow the merge
order) and spell a piece of several spaces with real spaces where the model's text has "▁".
Llama 2's vocabulary (Phi-3's) ranks them by score and puts "▁" before the text.
"""

from __future__ import annotations

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # SentencePiece's visible space
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4


def spm_merges(tokens: list[str], rank: list[float]) -> list[tuple[str, str]]:
    """Each split of a piece into two pieces, the best-ranked merged pieces first."""
    ids = {token: i for i, token in enumerate(tokens)}
    merges = []
    for token, token_rank in zip(tokens, rank, strict=True):
        for cut in range(len(token) - 1, 0, -1):  # the longer left part first
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((token_rank, len(token) - cut, left, right))
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in merges]


def gemma_tokenizer(tokens: list[str], token_types: list[int]) -> HFTokenizer:
    """Gemma's tokenizer: pieces ranked by their order in the file, no prefix space, spaces as
    "▁" before BPE, byte fallback for what no piece covers."""
    tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    backend = HFTokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)},
            spm_merges(tokens, list(range(len(tokens)))),
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    add_marked_tokens(backend, tokens, token_types)
    return backend


def llama_tokenizer(tokens: list[str], scores: list[float], token_types: list[int]) -> HFTokenizer:
    """Llama 2's SentencePiece (Phi-3 keeps it): pieces ranked by score, "▁" put before the
    text and for every space by a normalizer (as Phi-3's tokenizer.json does it), byte
    fallback, and the prefix space stripped again when decoding."""
    backend = HFTokenizer(
        models.BPE(
            {t: i for i, t in enumerate(tokens)},
            spm_merges(tokens, [-s for s in scores]),
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    add_marked_tokens(backend, tokens, token_types)
    return backend


def add_marked_tokens(backend: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Tokens the file marks as control become special tokens, user-defined ones plain added
    tokens: either is matched whole in the text, never cut into pieces."""
    backend.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, kind in enumerate(token_types)
            if kind == USER_DEFINED
        ]
    )
