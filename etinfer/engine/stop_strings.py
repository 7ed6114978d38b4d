"""Stop strings as one Aho-Corasick automaton, so that matching them costs a step the same
whether a request has one stop string or many.

Scanning the text a step added walks one transition per character (failure links included,
amortised); the work never depends on how many stop strings there are, and a request's whole
set is compiled once and shared by its choices. The state after a scan also says how much of
the text's tail could still begin a stop string, which is exactly what a stream must hold back.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import NamedTuple


class StopMatch(NamedTuple):
    end: int  # index in the scanned chunk just past the stop string's last character
    length: int  # the stop string's length in characters


class StopStrings:
    """The automaton of one set of stop strings; the scan state lives with each sequence."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        # Trie: goto[state] maps a character to the next state; depth[state] is the length of
        # the prefix the state stands for.
        self._goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends = [0]  # the length of the stop string ending exactly at a state, or 0
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self._goto[state].get(ch)
                if nxt is None:
                    nxt = self._goto[state][ch] = len(self._goto)
                    self._goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    ends.append(0)
                state = nxt
            ends[state] = len(stop)
        # Failure links in breadth-first order; a state's match is its own stop string or else
        # the longest one ending at its suffix (the earliest start among those ending here).
        self._fail = [0] * len(self._goto)
        self._match = ends
        queue = deque(self._goto[0].values())
        while queue:
            state = queue.popleft()
            for ch, nxt in self._goto[state].items():
                fail = self._fail[state]
                while fail and ch not in self._goto[fail]:
                    fail = self._fail[fail]
                self._fail[nxt] = self._goto[fail].get(ch, 0)
                if not self._match[nxt]:
                    self._match[nxt] = self._match[self._fail[nxt]]
                queue.append(nxt)

    def scan(self, chunk: str, state: int) -> tuple[int, StopMatch | None]:
        """Feed ``chunk`` from ``state``: the new state, and the first stop string to complete
        (the longest if several end on the same character), if any."""
        goto, fail, match = self._goto, self._fail, self._match
        for i, ch in enumerate(chunk):
            while state and ch not in goto[state]:
                state = fail[state]
            state = goto[state].get(ch, 0)
            if match[state]:
                return state, StopMatch(i + 1, match[state])
        return state, None


@lru_cache(maxsize=32)
def compile_stop_strings(stops: tuple[str, ...]) -> StopStrings | None:
    """The automaton for ``stops`` (None without any), shared by the sequences that use the
    same set; a few recent sets are kept (compiling one takes milliseconds, keeping a large
    one, megabytes)."""
    return StopStrings(stops) if stops else None
