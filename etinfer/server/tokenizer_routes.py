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


def add_tokenizer_routes(
    app: FastAPI, encoder: PromptEncoder, model_name: str, max_model_len: int
) -> None:
    tokenizer = encoder.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> dict:
        check_model(request.model, model_name)
        if request.messages is not None:
            calling = ToolCalling.of(request.tools, None, None)
            messages, tools = template_messages(
                request.messages, calling, tokenizer.template_knows_tools
            )
            special = bool(request.add_special_tokens)
            tokens = await encoder.tokenize_chat(
                messages, tools, request.add_generation_prompt, special
            )
        else:
            special = request.add_special_tokens is not False
            tokens = await encoder.tokenize_text(request.prompt, special)
        strings = None
        if request.return_token_strs:
            strings = [tokenizer.backend.id_to_token(t) for t in tokens]
        return {
            "count": len(tokens),
            "max_model_len": max_model_len,
            "tokens": tokens,
            "token_strs": strings,
        }

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> dict:
        check_model(request.model, model_name)
        vocab = tokenizer.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"token {bad} is outside the vocabulary [0, {vocab})", param="tokens"
            )
        return {"prompt": tokenizer.decode(request.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        def text(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.backend.id_to_token(token_id)

        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": max_model_len,
            "vocab_size": tokenizer.vocab_size,
            "bos_token": text(tokenizer.bos_token_id),
            "eos_token": text(eos),
            "pad_token": None,  # the engine pads nothing
            "add_bos_token": tokenizer.add_bos_token,
            "chat_template": tokenizer.chat_template,
        }
