"""A SentencePiece vocabulary rebuilt as a BPE keeps only the merges BPE can apply, and encodes
as it did with every cut of every piece."""

import random

from tokenizers import Tokenizer, models

from etinfer.model.sentencepiece import applied_merges, spm_merges

# "abc" cuts two ways, but BPE over "a", "b", "c" merges "ab" first (it ranks above "bc"), so
# "abc" is only ever made from "ab" + "c"; "bcd" only from "bc" + "d"; "abcd" from "ab" + "cd"
# ("cd" ranks above "abc").
TOKENS = ["a", "b", "c", "d", "ab", "bc", "cd", "abc", "bcd", "abcd"]


def bpe(merges: list[tuple[str, str]]) -> Tokenizer:
    return Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, merges))


def test_merges_bpe_never_applies_are_left_out():
    every = spm_merges(TOKENS, list(range(len(TOKENS))))
    applied = applied_merges(every)
    assert set(every) - set(applied) == {("a", "bc"), ("b", "cd"), ("a", "bcd"), ("abc", "d")}
    assert applied == [m for m in every if m in applied]  # in the same order


def test_without_them_every_text_encodes_the_same():
    every = spm_merges(TOKENS, list(range(len(TOKENS))))
    full, reduced = bpe(every), bpe(applied_merges(every))
    rng = random.Random(0)
    texts = [*TOKENS, *("".join(rng.choices("abcd", k=12)) for _ in range(2000))]
    assert [e.ids for e in full.encode_batch(texts)] == [e.ids for e in reduced.encode_batch(texts)]
