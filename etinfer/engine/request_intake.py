"""Requests in: checked, encoded, given an id and a ``Sequence`` the engine can schedule.

Everything a request can get wrong is found here, before it is registered, so a refused
request leaves nothing behind; each layer that is on gives the sequence its state
(``engine/layers.py``), and the engine then starts its grammar (if it has one) and queues it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time

from etinfer.config import EngineConfig
from etinfer.engine.detokenizer import Detokenizer
from etinfer.engine.layers import start_layers
from etinfer.engine.request_validator import Prompt, RequestValidator
from etinfer.engine.sequence import Sequence
from etinfer.model.tokenizer import Tokenizer
from etinfer.sampling_params import SamplingParams


class RequestIntake:
    def __init__(
        self,
        tokenizer: Tokenizer,
        validator: RequestValidator,
        config: EngineConfig,
    ) -> None:
        self.tokenizer = tokenizer
        self.validator = validator
        self.config = config  # which layers are on
        self.requests: dict[str, Sequence] = {}  # every request not yet finished, by id
        self._arrivals = itertools.count()
        self._ids = itertools.count()

    def new_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        *,
        request_id: str | None,
        stream: bool,
        delta: bool,
        arrival_time: float | None,
        prompt_token_ids: list[int] | None,
        forced_token_ids: list[int] | None,
        priority: int,
        slo: float | None,
    ) -> Sequence:
        """The request as a sequence (see ``LLMEngine.add_request``), not yet registered;
        ValueError naming the field for anything it gets wrong."""
        self.validator.check_scheduling(priority, slo)
        if delta and not stream:
            raise ValueError("delta outputs need stream=True")
        params = self._with_control(params or SamplingParams())
        if prompt_token_ids is None:
            text, ids = self.validator.encode_prompt(prompt)
        else:
            text, ids = (prompt if isinstance(prompt, str) else None), prompt_token_ids
        self.validator.check_request(ids, params)
        if forced_token_ids is not None:  # validated as token ids of a prompt would be
            _, forced_token_ids = self.validator.encode_prompt(forced_token_ids)
        if request_id is None:
            request_id = self._new_request_id()
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(
            request_id,
            next(self._arrivals),
            ids,
            params,
            Detokenizer(self.tokenizer, params, ids),
            prompt=text,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            stream=stream,
            delta=delta,
            forced_token_ids=forced_token_ids,
            priority=priority,
            slo=slo,
        )
        start_layers(self.config, seq)
        return seq

    def _with_control(self, params: SamplingParams) -> SamplingParams:
        """With the sampling layer on, a request that picked no temperature controller of its
        own (and is not greedy) gets entropy control with the engine's target."""
        control = self.config.control
        if control.sampling and params.controller == "fixed" and not params.greedy:
            return dataclasses.replace(params, entropy_target=control.entropy_target)
        return params

    def _new_request_id(self) -> str:
        """A counter value no live request uses (a caller may have picked it as an id)."""
        while (request_id := str(next(self._ids))) in self.requests:
            pass
        return request_id
