"""The size bound that refuses a prompt before tokenizing it: no text encodes to fewer tokens
than its UTF-8 bytes over the tokenizer's longest entry, and the bound is the tightest one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from etinfer.engine.request_validator import ContextLengthError
from etinfer.model.loader import LoadedModel
from etinfer.model.tokenizer import Tokenizer

# Long whitespace runs and special-token texts are where tokens cover the most bytes.
pieces = st.one_of(
    st.text(max_size=40),
    st.sampled_from([" " * 81, "\n" * 40, "\t" * 30, "<|im_start|>", "<|endoftext|>", "🙂"]),
    st.from_regex(r"[a-z]{1,12}( [a-z]{1,12}){0,6}", fullmatch=True),
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(pieces, min_size=1, max_size=8))
def test_no_text_encodes_to_fewer_tokens_than_the_bound(loaded_model: LoadedModel, parts):
    tokenizer = loaded_model.tokenizer
    text = "".join(parts)
    bound = -(-len(text.encode()) // tokenizer.max_token_bytes)
    assert len(tokenizer.encode(text, add_special_tokens=False)) >= bound


def test_the_bound_is_the_longest_token(loaded_model: LoadedModel):
    tokenizer = loaded_model.tokenizer
    assert tokenizer.max_token_bytes == 81
    # It is reached: some text of that many bytes is one token.
    longest = max(tokenizer.backend.get_vocab(with_added_tokens=False), key=len)
    text = tokenizer.decode([tokenizer.backend.token_to_id(longest)])
    assert len(text.encode()) == 81 and len(tokenizer.encode(text)) == 1


def test_tokenizers_without_a_bound_get_none():
    word_level = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert Tokenizer(word_level, eos_token_ids=[0]).max_token_bytes is None
    normalized = HFTokenizer(models.BPE({"a": 0}, [], byte_fallback=True))
    normalized.normalizer = normalizers.NFKC()
    normalized.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert Tokenizer(normalized, eos_token_ids=[0]).max_token_bytes is None


def test_a_prompt_too_large_to_fit_is_refused_without_tokenizing(llm, monkeypatch):
    validator = llm.engine.validator
    text = "word " * 200_000  # 1 MB: at least 12,346 tokens, over the 8,192 of the context

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(validator.tokenizer, "encode", no_tokenizing)
    with pytest.raises(ContextLengthError, match="at least 12346 tokens"):
        validator.encode_prompt(text)
    with pytest.raises(ContextLengthError, match="maximum context length is 8192"):
        validator.encode_prompt(list(range(10_000)))
