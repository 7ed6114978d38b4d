"""The offline API: ``LLM(...).generate(prompts, params)``, ``.chat(...)``, ``.stream(...)``."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from etinfer.calibrate import build_engine
from etinfer.config import EngineConfig
from etinfer.engine.request_validator import Prompt
from etinfer.memory import release_freed_memory
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
            self.engine = build_engine(EngineConfig(model=str(model.path), **kwargs), model)
        else:
            path = None if model is None else str(model)
            self.engine = build_engine(EngineConfig(model=path, **kwargs))
        # Outputs of this LLM's requests, routed here by whichever call steps the engine, so
        # interleaved streams and generate() calls never consume each other's outputs.
        self._outputs: dict[str, deque[RequestOutput]] = {}
        release_freed_memory()  # what reading the model left behind

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: int | Sequence[int] = 0,
        slo: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.

        Every prompt is validated before any is queued, so a bad one leaves nothing behind.
        ``priority`` (lower first, as in vLLM) and ``slo`` (seconds to finish) are one value for
        every prompt or one per prompt; the entropy scheduling policy reads them.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(params, len(prompts))
        priorities = self._per_prompt("priority", priority, len(prompts))
        slos = self._per_prompt("slo", slo, len(prompts))
        encoded = [self.engine.validator.encode_prompt(p)[1] for p in prompts]
        for ids, p, rank, deadline in zip(encoded, params, priorities, slos, strict=True):
            self.engine.validator.check_request(ids, p)
            self.engine.validator.check_scheduling(rank, deadline)
        # Grammars compile (all started at once, cached) before any request queues: a bad one
        # raises here.
        compiler = self.engine.grammars.compiler
        constraints = [p.structured for p in params if p.structured is not None]
        for constraint in constraints:
            compiler.submit(constraint)
        for constraint in constraints:
            compiler.compile(constraint)
        request_ids: list[str] = []
        try:
            for prompt, ids, p, rank, deadline in zip(
                prompts, encoded, params, priorities, slos, strict=True
            ):
                request_ids.append(
                    self._submit(
                        prompt, p, stream=False, prompt_token_ids=ids, priority=rank, slo=deadline
                    )
                )
            with tqdm(total=len(request_ids), disable=not use_tqdm, unit="req") as bar:
                pending = set(request_ids)
                while pending and self.engine.has_unfinished_requests():
                    self._step()
                    done = {r for r in pending if self._outputs[r]}
                    pending -= done
                    bar.update(len(done))
            if not self.engine.has_unfinished_requests():
                release_freed_memory()  # the requests' buffers, which glibc would keep
            return [self._outputs[r].pop() for r in request_ids]
        finally:
            # An interrupt (or any error) must not leave requests holding KV blocks.
            for request_id in request_ids:
                self.engine.abort_request(request_id)
                self._outputs.pop(request_id, None)

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
        self, prompt: Prompt, params: SamplingParams | None = None, *, delta: bool = False
    ) -> Iterator[RequestOutput]:
        """Yield an output after each step that extends the request, the last one finished: the
        whole output so far (a snapshot, whose cost grows with its length), or with ``delta``
        only what the step added (constant cost per step; ``RequestOutput.merge`` adds deltas
        up)."""
        request_id = self._submit(prompt, params, stream=True, delta=delta)
        buffer = self._outputs[request_id]
        try:
            while True:
                while not buffer:
                    if not self.engine.has_unfinished_requests():
                        return  # aborted from elsewhere
                    self._step()
                out = buffer.popleft()
                yield out
                if out.finished:
                    return
        finally:
            self.engine.abort_request(request_id)  # no-op once finished
            self._outputs.pop(request_id, None)

    def _submit(self, prompt: Prompt, params: SamplingParams | None, **kwargs) -> str:
        request_id = self.engine.add_request(prompt, params, **kwargs)
        self._outputs[request_id] = deque()
        return request_id

    def _step(self) -> None:
        for out in self.engine.step():
            buffer = self._outputs.get(out.request_id)
            if buffer is not None:
                buffer.append(out)

    @staticmethod
    def _per_prompt(name: str, value: object, n: int) -> list:
        if not isinstance(value, Sequence):
            return [value] * n
        if len(value) != n:
            raise ValueError(f"{name} must be one value or one per prompt ({n}), got {len(value)}")
        return list(value)

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
