"""The human-written text etinfer reads wherever it needs real text and may download nothing.

It is the Python Language Reference as CPython ships it: ``pydoc_data.topics`` holds the
"topics" pages of the reference manual (about 465,000 characters of English prose and examples,
written by the Python documentation authors), and every Python installation carries it.
Calibration fits on it, the early-exit adapter of speculative decoding and EAD is fitted on it,
and the benchmarks draw their long prompts from it. Text a model generated itself would not do:
its own samples are calibrated by construction.
"""

from __future__ import annotations

import pydoc_data.topics
from collections.abc import Iterator

from etinfer.model.tokenizer import Tokenizer

CORPUS = "CPython's pydoc_data.topics (the Python Language Reference topics)"


def topics() -> list[str]:
    """The topics' texts, in a fixed order (by name)."""
    return [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]


def corpus_text() -> str:
    """The whole corpus as one text, topic after topic."""
    return "\n\n".join(topics())


def corpus_windows(tokenizer: Tokenizer, window: int) -> Iterator[list[int]]:
    """Token windows of ``window`` tokens over the corpus, topic by topic, in a fixed order."""
    for text in topics():
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - window + 1, window):
            yield ids[start : start + window]
