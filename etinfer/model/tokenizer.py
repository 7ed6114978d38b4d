"""Tokenizer and chat template, read from the same file or folder as the weights.

The engine itself only sees token ids; this wraps a `tokenizers.Tokenizer` with what a serving
front end needs besides: the end-of-sequence ids, whether to prepend BOS, and the chat template
rendered the way transformers renders it (a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models
from tokenizers.decoders import DecodeStream

Message = dict[str, Any]


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self._token_texts: dict[int, str] = {}

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not), so a long prompt
        # tokenized on a worker thread leaves the server's event loop running.
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        ids = encoding.ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    @cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of input text one token can cover, where that bounds how few tokens
        a text can encode to (at least its UTF-8 bytes divided by this); None where it does not.

        It holds for byte-level BPE that keeps every byte of its input (GPT-2, Llama 3, Qwen,
        SmolLM): each character of a vocabulary entry stands for one byte, and an added token
        covers exactly its own text. A normalizer or a pre-tokenizer may drop text first, an
        added token that strips whitespace swallows a run of any length, and fused unknown
        characters (or WordPiece's unknown words) become one token: no bound for those."""
        backend = self.backend
        model = backend.model
        if backend.normalizer is not None or backend.pre_tokenizer is None:
            return None
        if not isinstance(model, models.BPE) or model.fuse_unk:
            return None
        # Only the pre-tokenizer's own settings, not the whole tokenizer.json (10 MB for a
        # 128K vocabulary).
        pieces = components(json.loads(backend.pre_tokenizer.__getstate__()))
        if not any(p["type"] == "ByteLevel" for p in pieces) or not all(map(_keeps_text, pieces)):
            return None
        added = backend.get_added_tokens_decoder().values()
        if any(token.lstrip or token.rstrip for token in added):
            return None
        vocab = backend.get_vocab(with_added_tokens=False)
        return max(
            max(map(len, vocab), default=1),
            max((len(token.content.encode()) for token in added), default=1),
        )

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (what logprob entries show), decoded once."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.backend.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    def decode_stream(
        self, context: Sequence[int], *, skip_special_tokens: bool = True
    ) -> DecodeStream:
        """A per-sequence incremental decoder: it holds back bytes of an unfinished character.

        ``context`` are the ids before the first one to decode (the prompt)."""
        return DecodeStream(list(context), skip_special_tokens=skip_special_tokens)

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself."""
        return self.chat_template is not None and "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ValueError("this model ships no chat template; pass plain prompts to generate()")
        return self._template.render(
            messages=list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._special_text(self.bos_token_id),
            eos_token=self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def encode_chat(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes BOS itself where the model wants one, so nothing is added here
        # (transformers' apply_chat_template(tokenize=True) does the same).
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def _special_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


# Pre-tokenizers that split text without dropping any of it (Split and Punctuation can be set
# to remove what they match).
_TEXT_KEEPING = frozenset({"ByteLevel", "Sequence", "Split", "Punctuation", "Digits"})


def components(settings: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The settings of one part of a tokenizer (its normalizer, pre-tokenizer or decoder) and
    of every part a sequence of them holds, sequences opened, in order."""
    if not settings:
        return []
    inner = settings.get("normalizers") or settings.get("pretokenizers") or settings.get("decoders")
    return [settings, *(piece for child in inner or [] for piece in components(child))]


def _keeps_text(piece: dict[str, Any]) -> bool:
    return piece["type"] in _TEXT_KEEPING and piece.get("behavior") != "Removed"
