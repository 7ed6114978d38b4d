"""Tokenizers rebuilt from a file's vocabulary are kept once built, and read back only for the
same vocabulary and the same rebuilding code."""

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from etinfer.model import tokenizer_cache
from etinfer.model.tokenizer_cache import cached_tokenizer

VOCAB = {"a": 0, "b": 1, "ab": 2, "abb": 3}


def counting_build(built: list[int]):
    def build() -> HFTokenizer:
        built.append(1)
        tokenizer = HFTokenizer(models.BPE(VOCAB, [("a", "b"), ("ab", "b")]))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        return tokenizer

    return build


def test_a_tokenizer_is_built_once_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    source = tmp_path / "rebuild.py"
    source.write_text("# the code that rebuilds it\n")
    built: list[int] = []
    first = cached_tokenizer((list(VOCAB),), [source], counting_build(built))
    again = cached_tokenizer((list(VOCAB),), [source], counting_build(built))
    assert len(built) == 1 and len(list(tokenizer_cache.cache_folder().glob("*.json"))) == 1
    assert again.encode("abb ab a b").ids == first.encode("abb ab a b").ids == [3, 2, 0, 1]
    # Another vocabulary, or changed rebuilding code: built again.
    cached_tokenizer((list(VOCAB), "other"), [source], counting_build(built))
    source.write_text("# changed\n")
    cached_tokenizer((list(VOCAB),), [source], counting_build(built))
    assert len(built) == 3


def test_a_damaged_or_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built: list[int] = []
    cached_tokenizer(("v",), [], counting_build(built))
    (kept,) = tokenizer_cache.cache_folder().glob("*.json")
    kept.write_text("{not json")
    assert cached_tokenizer(("v",), [], counting_build(built)).encode("ab").ids == [2]
    assert len(built) == 2 and HFTokenizer.from_file(str(kept)).encode("ab").ids == [2]
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # a file where the folder would be
    assert cached_tokenizer(("v",), [], counting_build(built)).encode("abb").ids == [3]
