"""A SentencePiece BPE vocabulary as a GGUF file holds it (``tokenizer.ggml.model = "llama"``:
tokens, scores, token types, no merges), rebuilt as a `tokenizers` BPE with byte fallback.

SentencePiece's BPE merges, at each step, the adjacent pair whose merged piece ranks best; a
`tokenizers` BPE applies merges by rank. So every way of cutting a vocabulary piece into two
vocabulary pieces becomes a merge, ranked by the merged piece (``rank``: lower merges first), a
longer left part first where one piece splits several ways, as transformers rebuilds Gemma's.
Of those, only the cut BPE reaches when it encodes the piece alone can ever apply
(``applied_merges``): Gemma 3's 514,906 merges become 236,336, and `tokenizers` builds the
smaller table in about half the time at every load.

Gemma's files rank pieces by their order in the file (their scores do not follow the merge
order) and spell a piece of several spaces with real spaces where the model's text has "▁".
Llama 2's vocabulary (Phi-3's) ranks them by score and puts "▁" before the text.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPACE = "\u2581"  # SentencePiece's visible space
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4
Merges = list[tuple[str, str]]


def spm_merges(tokens: list[str], rank: list[float]) -> Merges:
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


def applied_merges(merges: Merges) -> Merges:
    """The ``merges`` (in rank order) that BPE can ever apply: for each piece, the last merge
    of BPE over the piece's own characters, where it ends as that piece.

    Why no other can: BPE applies the best-ranked adjacent pair anywhere in a word, so until a
    piece forms over some span, no merge has crossed the span's edges (one that had would have
    fused a character of the span with one outside it). The merges inside the span are then
    the best-ranked of those inside it, one after another, exactly as in BPE over the piece's
    characters alone: whenever the piece forms, the same last merge forms it. A merge of a
    piece cut only one way is kept as it is (if BPE never forms the piece it never applies)."""
    rank = {merge: i for i, merge in enumerate(merges)}
    cuts = Counter(left + right for left, right in merges)
    reached = {_last_merge(piece, rank) for piece, count in cuts.items() if count > 1}
    return [merge for merge in merges if cuts[merge[0] + merge[1]] == 1 or merge in reached]


def _last_merge(piece: str, rank: dict[tuple[str, str], int]) -> tuple[str, str] | None:
    """BPE over ``piece``'s characters: the pair it merges last, if that makes the piece."""
    symbols = list(piece)
    while len(symbols) > 2:
        best, at = None, 0
        for i in range(len(symbols) - 1):
            found = rank.get((symbols[i], symbols[i + 1]))
            if found is not None and (best is None or found < best):  # the leftmost of equals
                best, at = found, i
        if best is None:
            return None
        symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
    pair = (symbols[0], symbols[1])
    return pair if pair in rank else None


def gemma_pieces(tokens: list[str]) -> list[str]:
    """Gemma's pieces as its BPE sees them: a piece of real spaces spelled with "▁"."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def gemma_merges(tokens: list[str]) -> Merges:
    """The merges of Gemma's ``tokens`` (as ``gemma_pieces`` spells them), ranked by order."""
    return applied_merges(spm_merges(tokens, list(range(len(tokens)))))


def llama_merges(tokens: list[str], scores: list[float]) -> Merges:
    """The merges of Llama 2's ``tokens``, ranked by score."""
    return applied_merges(spm_merges(tokens, [-s for s in scores]))


def gemma_tokenizer(tokens: list[str], token_types: list[int], merges: Merges) -> HFTokenizer:
    """Gemma's tokenizer (``tokens`` as ``gemma_pieces`` spells them): no prefix space, spaces
    as "▁" before BPE, byte fallback for what no piece covers."""
    backend = _bpe(tokens, merges)
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    add_marked_tokens(backend, tokens, token_types)
    return backend


def llama_tokenizer(tokens: list[str], token_types: list[int], merges: Merges) -> HFTokenizer:
    """Llama 2's SentencePiece (Phi-3 keeps it): "▁" put before the text and for every space
    by a normalizer (as Phi-3's tokenizer.json does it), byte fallback, and the prefix space
    stripped again when decoding."""
    backend = _bpe(tokens, merges)
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


def _bpe(tokens: list[str], merges: Merges) -> HFTokenizer:
    vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    return HFTokenizer(
        models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )


def add_marked_tokens(backend: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Tokens the file marks as control become special tokens, user-defined ones plain added
    tokens: either is matched whole in the text, never cut into pieces."""
    kinds = np.asarray(token_types)  # found by numpy: a loop over Gemma 3's took 40 ms
    for kind, special in ((CONTROL, True), (USER_DEFINED, False)):
        marked = [
            AddedToken(tokens[i], special=special, normalized=False)
            for i in np.flatnonzero(kinds == kind).tolist()
        ]
        if special:
            backend.add_special_tokens(marked)
        else:
            backend.add_tokens(marked)
