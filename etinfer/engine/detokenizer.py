"""Incremental text of one sequence and its stop strings."""

from __future__ import annotations

from etinfer.engine.stop_strings import compile_stop_strings
from etinfer.model.tokenizer import Tokenizer
from etinfer.sampling_params import SamplingParams


class Detokenizer:
    def __init__(
        self, tokenizer: Tokenizer, params: SamplingParams, prompt_token_ids: list[int]
    ) -> None:
        self._backend = tokenizer.backend
        # The prompt is the stream's context, so the first generated token decodes as it would
        # inside the whole text (this matters for tokenizers that strip a leading space).
        self._stream = tokenizer.decode_stream(
            prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self._stops = compile_stop_strings(tuple(params.stop))
        self._stop_state = 0  # where the text's tail stands in the stop strings' automaton
        self._include_stop = params.include_stop_str_in_output
        self.text = ""
        self._sent = 0  # characters handed out by `new_text`

    def append(self, token_id: int) -> bool:
        """Add one generated token; True when the text now contains a stop string."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return False
        previous = len(self.text)
        self.text += chunk
        if self._stops is None:
            return False
        self._stop_state, match = self._stops.scan(chunk, self._stop_state)
        if match is None:
            return False
        end = previous + match.end
        self.text = self.text[: end if self._include_stop else end - match.length]
        self._stop_state = 0  # the text is final: nothing more to hold back
        return True

    def visible_text(self, finished: bool) -> str:
        return self.text[: self._visible_end(finished)]

    def new_text(self, finished: bool) -> str:
        """The visible text not handed out by an earlier call (a stop string never cuts into
        it: the holdback keeps any text that could start one)."""
        end = max(self._sent, self._visible_end(finished))
        text, self._sent = self.text[self._sent : end], end
        return text

    def _visible_end(self, finished: bool) -> int:
        # While streaming, the tail that could still be the start of a stop string is held back
        # (as vLLM does), so a client never sees text that is later taken back; the automaton
        # knows its exact length, where a fixed holdback would delay every chunk.
        if finished or self._stops is None:
            return len(self.text)
        return len(self.text) - self._stops.depth[self._stop_state]
