"""The xgrammar backend: grammars compiled against the engine's own vocabulary.

xgrammar precomputes, per grammar state, which tokens are context-independent, so filling a
mask costs microseconds on most steps; it compiles JSON schemas, regular expressions and EBNF.
Its vocabulary is read from our ``tokenizers`` object (the token strings by id, and how they
encode bytes) rather than from transformers, which the engine does not need.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
import xgrammar

from etinfer.model.tokenizer import Tokenizer, components
from etinfer.structured.backend import CompiledGrammar, GrammarBackend, Matcher
from etinfer.structured.params import StructuredOutputsParams
from etinfer.structured.schema_support import bounded_fractions, unenforced_feature


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @classmethod
    def fill_masks(cls, matchers: list[Matcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) == 1:  # the batched call's thread hand-off costs more than one row
            matchers[0].fill_mask(bitmask, rows[0])
            return
        inner = [m._matcher for m in matchers]  # type: ignore[attr-defined]
        _batch_matcher().batch_fill_next_token_bitmask(inner, bitmask, indices=rows)

    def jump_forward(self) -> str:
        return self._matcher.find_jump_forward_string()

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        self._compiled = compiled

    def matcher(self) -> Matcher:
        return XGrammarMatcher(xgrammar.GrammarMatcher(self._compiled))


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        info = tokenizer_info(tokenizer, vocab_size)
        # Our own cache (compiler.py) keys whole constraints; xgrammar's would hold a second
        # copy of each. One thread: compilations already run off the step loop, one at a time.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        compiler, kind = self._compiler, params.kind
        try:
            if kind == "json" and params.json is True:
                compiled = compiler.compile_builtin_json_grammar()
            elif kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else params.json
                if schema is False:
                    raise ValueError("the schema false allows no value")
                unenforced = unenforced_feature(schema)
                if unenforced is not None:
                    raise ValueError(f"uses {unenforced}, which this backend cannot enforce")
                compiled = compiler.compile_json_schema(
                    bounded_fractions(schema),
                    any_whitespace=True,
                    max_whitespace_cnt=params.max_whitespace,
                )
            elif kind == "regex":
                compiled = compiler.compile_regex(params.regex)
            elif kind == "grammar":
                compiled = compiler.compile_grammar(params.grammar)
            else:
                compiled = compiler.compile_grammar(choice_grammar(params.choice))
        except (RuntimeError, ValueError, TypeError) as error:
            raise ValueError(
                f"structured.{kind} cannot be compiled: {_first_line(error)}"
            ) from None
        return XGrammarCompiled(compiled)


@functools.cache
def _batch_matcher() -> xgrammar.BatchGrammarMatcher:
    """xgrammar's batched mask filler (its threads: sampling runs while torch's are idle)."""
    return xgrammar.BatchGrammarMatcher(max_threads="auto")


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int) -> xgrammar.TokenizerInfo:
    """xgrammar's view of the vocabulary: each id's token string and how strings encode bytes.

    Ids the model has rows for but the tokenizer does not name (padding up to a multiple of
    64) get empty strings, which xgrammar never allows."""
    backend = tokenizer.backend
    encoded = [""] * vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    settings = json.loads(backend.to_str())
    return xgrammar.TokenizerInfo(
        encoded,
        _vocab_type(settings.get("decoder")),
        vocab_size=vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids),
        add_prefix_space=_adds_prefix_space(settings),
    )


def _vocab_type(decoder: dict[str, Any] | None) -> xgrammar.VocabType:
    """Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) maps bytes to printable characters;
    SentencePiece with byte fallback (Llama 2, Gemma) spells unknown bytes as <0xNN>."""
    kinds = {piece.get("type") for piece in components(decoder)}
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW


def _adds_prefix_space(settings: dict[str, Any]) -> bool:
    """Whether encoding puts a space before the text (SentencePiece's dummy prefix)."""
    for part in (settings.get("normalizer"), settings.get("pre_tokenizer")):
        for piece in components(part):
            if piece.get("type") == "Prepend" or piece.get("prepend_scheme") in ("always", "first"):
                return True
    return False


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
