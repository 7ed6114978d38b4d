"""The offline API: ``LLM(...).generate(prompts, params)``, ``.chat(...)``, ``.stream(...)``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from etinfer.config import EngineConfig
from etinfer.engine.llm_engine import LLMEngine, Prompt
from etinfer.model.loader import LoadedModel
from etinfer.model.tokenizer import Message, Tokenizer
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams


class LLM:
    """An engine over one model. ``LLM()`` loads the embedded SmolLM2-135M-Instruct; ``model``
    is a .gguf file, a Hugging Face folder, or a model returned by ``load_model`` (whose weights
    several engines can then share).

    Keyword arguments are those of :class:`etinfer.config.EngineConfig`: ``dtype``, ``device``,
    ``max_model_len``, ``block_size``, ``num_kvcache_blocks``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ``scheduling_policy``, ``seed``...
    """

    def __init__(self, model: str | Path | LoadedModel | None = None, **kwargs) -> None:
        if isinstance(model, LoadedModel):
            self.engine = LLMEngine(EngineConfig(model=str(model.path), **kwargs), model)
        else:
            self.engine = LLMEngine(
                EngineConfig(model=None if model is None else str(model), **kwargs)
            )

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.

        Every prompt is validated before any is queued, so a bad one leaves nothing behind.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(params, len(prompts))
        for prompt, p in zip(prompts, params, strict=True):
            self.engine.check_request(self.engine.encode_prompt(prompt)[1], p)
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or to a list of them, with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a growing output after each step that extends it, the last one finished."""
        request_id = self.engine.add_request(prompt, params, stream=True)
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort_request(request_id)

    def _run(
        self, prompts: Sequence[Prompt], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        request_ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_ids.append(self.engine.add_request(prompt, p))
            with tqdm(total=len(request_ids), disable=not use_tqdm, unit="req") as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            # An interrupt (or any error) must not leave requests holding KV blocks.
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
        return [results[r] for r in request_ids]

    @staticmethod
    def _params_per_prompt(
        params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * n
        if len(params) != n:
            raise ValueError(
                f"params must be one SamplingParams or one per prompt ({n}), got {len(params)}"
            )
        return list(params)
