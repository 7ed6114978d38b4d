"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info``, with vLLM's bodies and answers.

Evaluation harnesses count context lengths with the server's own tokenizer:
lm-evaluation-harness's ``tokenizer_backend="remote"`` (chosen by itself where
``/tokenizer_info`` answers) encodes with ``/tokenize``, decodes with ``/detokenize`` and reads
the special tokens and the chat template from ``/tokenizer_info``.
"""

from __future__ import annotations

from fastapi import FastAPI

from etinfer.server.admission import check_model
from etinfer.server.errors import APIError
from etinfer.server.prompts import PromptEncoder
from etinfer.server.protocol import DetokenizeRequest, TokenizeRequest
from etinfer.server.tool_calls import ToolCalling, template_messages

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizerService:
    """The three endpoints' answers, for the single server's routes and a replica's calls."""

    def __init__(self, encoder: PromptEncoder, model_name: str, max_model_len: int) -> None:
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len

    async def tokenize(self, request: TokenizeRequest) -> dict:
        check_model(request.model, self.model_name)
        tokenizer = self.tokenizer
        if request.messages is not None:
            calling = ToolCalling.of(request.tools, None, None)
            messages, tools = template_messages(
                request.messages, calling, tokenizer.template_knows_tools
            )
            special = bool(request.add_special_tokens)
            tokens = await self.encoder.tokenize_chat(
                messages, tools, request.add_generation_prompt, special
            )
        else:
            special = request.add_special_tokens is not False
            tokens = await self.encoder.tokenize_text(request.prompt, special)
        strings = None
        if request.return_token_strs:
            strings = [tokenizer.backend.id_to_token(t) for t in tokens]
        return {
            "count": len(tokens),
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": strings,
        }

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        check_model(request.model, self.model_name)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"token {bad} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": self.tokenizer.decode(request.tokens, skip_special_tokens=False)}

    def info(self) -> dict:
        tokenizer = self.tokenizer

        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.backend.id_to_token(token_id)

        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": self.max_model_len,
            "vocab_size": tokenizer.vocab_size,
            "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(eos),
            "pad_token": None,  # the engine pads nothing
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
        }

    async def call(self, path: str, body: dict | None) -> dict:
        """One endpoint's answer by its path, from the request's JSON (a replica's calls)."""
        if path == "/tokenize":
            return await self.tokenize(TokenizeRequest.model_validate(body))
        if path == "/detokenize":
            return await self.detokenize(DetokenizeRequest.model_validate(body))
        return self.info()


def add_tokenizer_routes(app: FastAPI, service: TokenizerService) -> None:
    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        return await service.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        return await service.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return service.info()
