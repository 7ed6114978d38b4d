"""Merges rebuilt from a file's SentencePiece vocabulary are kept once built, and read back only
for the same vocabulary and the same rebuilding code."""

import numpy as np

from etinfer.model import tokenizer_cache
from etinfer.model.tokenizer_cache import cached_merges

TOKENS = ["a", "b", "ab", "abb"]
MERGES = [("a", "b"), ("ab", "b")]


def counting_build(built: list[int]):
    def build() -> list[tuple[str, str]]:
        built.append(1)
        return list(MERGES)

    return build


def test_merges_are_built_once_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "rebuild.py"
    source.write_text("# the code that rebuilds them\n")
    built: list[int] = []
    first = cached_merges(TOKENS, (), [source], counting_build(built))
    again = cached_merges(TOKENS, (), [source], counting_build(built))
    assert len(built) == 1 and len(list(tokenizer_cache.cache_folder().glob("*.npy"))) == 1
    assert first == again == MERGES
    # Another vocabulary, other inputs, or changed rebuilding code: built again.
    cached_merges([*TOKENS, "c"], (), [source], counting_build(built))
    cached_merges(TOKENS, ("scores",), [source], counting_build(built))
    source.write_text("# changed\n")
    cached_merges(TOKENS, (), [source], counting_build(built))
    assert len(built) == 4


def test_a_damaged_or_unwritable_cache_still_gives_the_merges(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built: list[int] = []
    cached_merges(TOKENS, (), [], counting_build(built))
    (kept,) = tokenizer_cache.cache_folder().glob("*.npy")
    for damage in (b"not an array", None):
        if damage is None:  # a readable array naming a token past the vocabulary
            np.save(kept, np.array([[0, 9]], np.int32))
        else:
            kept.write_bytes(damage)
        assert cached_merges(TOKENS, (), [], counting_build(built)) == MERGES
    assert len(built) == 3 and np.load(kept).tolist() == [[0, 1], [2, 1]]
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the folder would be
    assert cached_merges(TOKENS, (), [], counting_build(built)) == MERGES
