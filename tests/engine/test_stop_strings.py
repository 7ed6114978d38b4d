"""The stop-string automaton against a brute-force search, and at a hundred thousand strings."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from etinfer.engine.stop_strings import StopMatch, StopStrings, compile_stop_strings
from etinfer.sampling_params import SamplingParams

# A small alphabet makes overlaps (and so failure links) common.
texts = st.text(alphabet="abcé ", max_size=30)
stop_sets = st.lists(st.text(alphabet="abcé ", min_size=1, max_size=5), min_size=1, max_size=6)


def first_match(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(end, length) of the stop string that completes first, the longest on a tie."""
    found = [
        (start + len(s), -len(s))
        for s in stops
        for start in range(len(text) - len(s) + 1)
        if text.startswith(s, start)
    ]
    if not found:
        return None
    end, negative_length = min(found)
    return end, -negative_length


def partial_tail(text: str, stops: list[str]) -> int:
    """The longest tail of ``text`` that begins some stop string."""
    return max(
        (k for k in range(1, len(text) + 1) for s in stops if s.startswith(text[-k:])), default=0
    )


@settings(max_examples=400, deadline=None)
@given(stops=stop_sets, text=texts, cuts=st.lists(st.integers(0, 30), max_size=5))
def test_scan_finds_what_brute_force_finds_in_any_chunking(stops, text, cuts):
    automaton = StopStrings(tuple(stops))
    bounds = [0, *sorted(c for c in cuts if c <= len(text)), len(text)]
    state, seen = 0, ""
    for lo, hi in itertools.pairwise(bounds):
        chunk = text[lo:hi]
        state, match = automaton.scan(chunk, state)
        if match is not None:
            assert (len(seen) + match.end, match.length) == first_match(text, stops)
            return
        seen += chunk
        # What a stream must hold back: exactly the tail that could still start a stop string.
        assert automaton.depth[state] == partial_tail(seen, stops)
    assert first_match(text, stops) is None


def test_a_hundred_thousand_stop_strings_match_correctly():
    stops = tuple(f"<stop {i}>" for i in range(100_000))
    automaton = compile_stop_strings(stops)
    state, match = automaton.scan("text before <stop 99999> and after", 0)
    assert match == StopMatch(end=len("text before <stop 99999>"), length=len("<stop 99999>"))
    # The partial match is what is held back, not the longest string's length minus one.
    # (What matching costs per token, 1.3 µs at 1 or 100,000 strings: `etinfer bench abuse`.)
    state, match = automaton.scan("so far <stop 12", 0)
    assert match is None and automaton.depth[state] == len("<stop 12")


def test_sequences_stop_on_the_string_that_completes_first(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    greedy = SamplingParams(temperature=0, max_tokens=12)
    text = llm.generate(prompt, greedy)[0].text
    assert " 7, 8, 9" in text  # the greedy continuation counts on
    # " 7, 8, 9" starts first, but " 8," completes first.
    params = SamplingParams(temperature=0, max_tokens=12, stop=[" 7, 8, 9", " 8,"])
    out = llm.generate(prompt, params)[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(" 8,")]


def test_a_stream_shows_no_text_that_a_stop_string_takes_back(llm):
    prompt = "Count: 1, 2, 3, 4, 5, 6,"
    # " 7, 8, 9" is held back from " 7" on (it could begin the stop string), then cut off.
    params = SamplingParams(temperature=0, max_tokens=12, stop=[" 7, 8, 9", " 8,"])
    whole = llm.generate(prompt, params)[0].text
    deltas = [out.text for out in llm.stream(prompt, params, delta=True)]
    assert "".join(deltas) == whole and " 7" not in "".join(deltas[:-1])
    assert whole.endswith(" 7,")
