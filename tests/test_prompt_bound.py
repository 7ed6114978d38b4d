"""The size bound that refuses a prompt before tokenizing it: no text encodes to fewer tokens
than its UTF-8 bytes over the tokenizer's longest entry, and the bound is the tightest one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from etinfer.engine.request_validator import ContextLengthError
from etinfer.model.loader import LoadedModel
from etinfer.model.tokenizer import Tokenizer

# Long whitespace runs and special-token texts are where tokens cover the most bytes. Control
# characters are left out: six of them (\x04, \x06, \x13, \x14, \x16, \x1d) encode to no token at
# all, so a text of them alone is below the bound (and refused by it: conservative, and such a
# text is no prompt).
pieces = st.one_of(
    st.text(alphabet=st.characters(exclude_categories=("Cc", "Cs")), max_size=40),
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


def byte_level_bpe(pre_tokenizer=None, **bpe) -> HFTokenizer:
    """A tiny byte-level BPE: the 256 byte symbols, "ab" and a 3-space token."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))} | {"ab": 256, "ĠĠĠ": 257}
    merges = [("a", "b"), ("Ġ", "Ġ"), ("ĠĠ", "Ġ")]
    tokenizer = HFTokenizer(models.BPE(vocab | {"ĠĠ": 258}, merges, **bpe))
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    return tokenizer


def test_a_byte_level_bpe_that_keeps_its_text_has_a_bound():
    tokenizer = Tokenizer(byte_level_bpe(), eos_token_ids=[0])
    assert tokenizer.max_token_bytes == 3
    text = "ab   ab" * 50
    assert len(tokenizer.encode(text)) >= len(text) / 3


def test_tokenizers_that_can_drop_or_fuse_text_have_no_bound():
    word_level = HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    normalized = byte_level_bpe()
    normalized.normalizer = normalizers.NFKC()
    removing = byte_level_bpe(
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel(use_regex=False)]
        )
    )
    stripping = byte_level_bpe()
    stripping.add_special_tokens([AddedToken("<s>", lstrip=True)])
    fused = byte_level_bpe(unk_token="a", fuse_unk=True)
    for backend in (word_level, normalized, removing, stripping, fused):
        assert Tokenizer(backend, eos_token_ids=[0]).max_token_bytes is None
    # What the stripping token does: a long run of spaces before it vanishes into it.
    assert len(stripping.encode(" " * 10_000 + "<s>").ids) == 1


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
