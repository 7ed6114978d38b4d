"""Incremental text of one sequence and its stop strings."""

from __future__ import annotations

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
        self._stop = params.stop
        self._include_stop = params.include_stop_str_in_output
        # While streaming, text that could still turn out to be the start of a stop string is
        # held back (as vLLM does), so a client never sees text that is later taken back.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._sent = 0  # characters handed out by `new_text`

    def append(self, token_id: int) -> bool:
        """Add one generated token; True when the text now contains a stop string."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return False
        previous = len(self.text)
        self.text += chunk
        match = None
        for stop in self._stop:
            index = self.text.find(stop, max(0, previous - len(stop) + 1))
            if index >= 0 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return False
        index, stop = match
        self.text = self.text[: index + (len(stop) if self._include_stop else 0)]
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
        if finished or not self._holdback:
            return len(self.text)
        return max(0, len(self.text) - self._holdback)
