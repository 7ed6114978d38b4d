"""The llguidance backend (optional): grammars as llguidance's lazy lexer-parser.

llguidance builds no per-grammar token table: it computes each mask from the tokenizer's trie
as it goes, so compiling is near free and a grammar's first masks cost more than xgrammar's. It
refuses JSON-schema keywords it does not implement (``lenient`` stays off), so a schema it
cannot enforce is refused by the library itself. Objects are closed to properties they do not
list, as xgrammar's strict mode does, so both backends read a schema alike. Its vocabulary
comes from our ``tokenizers`` object's own JSON; EBNF grammars are GBNF, converted to its Lark
dialect.
"""

from __future__ import annotations

import json

import llguidance
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from etinfer.model.tokenizer import Tokenizer
from etinfer.structured.backend import CompiledGrammar, GrammarBackend, Matcher
from etinfer.structured.params import StructuredOutputsParams
from etinfer.structured.schema_support import bounded_fractions, closed_objects

_WHITESPACE = r"[\x20\x0A\x0D\x09]"


class LLGuidanceMatcher(Matcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        return self._matcher.consume_token(token_id) and not self._matcher.is_error()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def jump_forward(self) -> str:
        return self._matcher.compute_ff_bytes().decode("utf-8", errors="ignore")

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()


class LLGuidanceCompiled(CompiledGrammar):
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template  # never advanced: each request starts from a copy

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
        )

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind = params.kind
        try:
            grammar = self._grammar(params)
        except (ValueError, TypeError) as error:
            raise ValueError(f"structured.{kind} cannot be compiled: {error}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            first = (matcher.get_error().strip().splitlines() or ["error"])[0]
            raise ValueError(f"structured.{kind} cannot be compiled: {first}")
        return LLGuidanceCompiled(matcher)

    @staticmethod
    def _grammar(params: StructuredOutputsParams) -> str:
        from_schema = llguidance.LLMatcher.grammar_from_json_schema
        kind = params.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if schema is True:
                schema = {}
            if schema is False:
                raise ValueError("the schema false allows no value")
            cap = "+" if params.max_whitespace is None else f"{{0,{params.max_whitespace}}}"
            return from_schema(
                closed_objects(bounded_fractions(schema)),
                overrides={"whitespace_pattern": _WHITESPACE + cap},
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(params.grammar))
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
