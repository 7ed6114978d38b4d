"""Text-quality metrics: hand-computed cases, loop rules, and Self-BLEU against a slow reference."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from studies.common.quality import (
    distinct_n,
    diversity,
    is_looping,
    loop_rate,
    rep_n,
    self_bleu,
    summarize,
)

small_tokens = st.lists(st.integers(0, 4), max_size=12)
small_corpus = st.lists(small_tokens, max_size=5)


def test_rep_n_by_hand():
    assert rep_n([1, 2, 1, 2], 2) == pytest.approx(1 - 2 / 3)
    assert rep_n([1, 1, 1, 1], 1) == pytest.approx(0.75)
    assert rep_n([1, 2, 3], 3) == 0.0
    assert rep_n([1, 2], 3) == 0.0


def test_distinct_n_counts_across_sequences():
    # bigrams: (1,2) (2,3) | (1,2) (2,4) (4,1): 4 unique of 5.
    assert distinct_n([[1, 2, 3], [1, 2, 4, 1]], 2) == pytest.approx(4 / 5)
    assert distinct_n([[1], [2]], 2) == 0.0
    assert distinct_n([], 2) == 0.0


def test_diversity_by_hand():
    assert diversity([1, 2, 3, 4, 5, 6]) == 1.0
    # [1,1,1,1]: rep-2 = 1 - 1/3, rep-3 = 1 - 1/2, rep-4 = 0.
    assert diversity([1, 1, 1, 1]) == pytest.approx(1 / 3 * 1 / 2)
    # [1,2,3,1,2,4]: rep-2 = 1 - 4/5, rep-3 = 0, rep-4 = 0.
    assert diversity([1, 2, 3, 1, 2, 4]) == pytest.approx(4 / 5)


def test_suffix_phrase_repeated_twice_is_looping():
    assert is_looping([9, 8, 1, 2, 3, 1, 2, 3])
    assert is_looping([7, 1, 2, 3, 4, 1, 2, 3, 4], min_phrase=4)


def test_phrase_repeated_earlier_but_not_at_the_end_is_not_looping():
    tokens = [1, 2, 3, 1, 2, 3, 4, 5, 6]
    assert not is_looping(tokens)
    assert is_looping(tokens, repeat_threshold=1)


def test_phrases_shorter_than_min_phrase_do_not_count():
    assert not is_looping([1, 2, 1, 2], min_phrase=3)
    assert not is_looping([5] * 2)
    assert is_looping([1, 2, 1, 2], min_phrase=2)


def test_max_phrase_bounds_the_suffix_phrase():
    tokens = [1, 2, 3, 4, 1, 2, 3, 4]
    assert is_looping(tokens, max_phrase=4)
    assert not is_looping(tokens, max_phrase=3)


def test_phrase_counted_more_than_threshold_anywhere_is_looping():
    tokens = [1, 2, 3, 9] * 4 + [5, 6, 7]
    assert not is_looping(tokens, repeat_threshold=4)
    assert is_looping(tokens, repeat_threshold=3)


def test_loop_rate():
    assert loop_rate([[1, 2, 3, 1, 2, 3], [1, 2, 3, 4]]) == 0.5
    assert loop_rate([[1, 2, 1, 2]], min_phrase=2) == 1.0
    assert loop_rate([]) == 0.0


def _loops_by_brute_force(tokens, min_phrase, repeat_threshold):
    """Every phrase length, every position: the definition, not the shortcut."""
    for n in range(min_phrase, len(tokens) // 2 + 1):
        if tokens[-2 * n : -n] == tokens[-n:]:
            return True
    for n in range(min_phrase, len(tokens) + 1):
        grams = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
        if any(count > repeat_threshold for count in grams.values()):
            return True
    return False


@given(st.lists(st.integers(0, 2), max_size=20), st.integers(1, 4), st.integers(0, 4))
def test_is_looping_matches_brute_force(tokens, min_phrase, repeat_threshold):
    expected = _loops_by_brute_force(tokens, min_phrase, repeat_threshold)
    assert is_looping(tokens, min_phrase, repeat_threshold=repeat_threshold) == expected


def test_self_bleu_of_identical_sequences_is_one():
    assert self_bleu([[1, 2, 3, 4, 5]] * 3) == pytest.approx(1.0)


def test_self_bleu_of_disjoint_vocabularies_is_near_zero():
    sequences = [list(range(k * 100, k * 100 + 20)) for k in range(4)]
    assert self_bleu(sequences) < 0.01


def test_self_bleu_by_hand():
    # Unigram precision 3/4, bigram 2/3, equal lengths: sqrt(1/2) for both.
    assert self_bleu([[1, 2, 3, 4], [1, 2, 3, 5]], max_n=2) == pytest.approx(math.sqrt(0.5))
    # [1,2]: precision 1, brevity exp(1 - 4/2); [1,2,3,4]: precision 2/4, no penalty.
    assert self_bleu([[1, 2], [1, 2, 3, 4]], max_n=1) == pytest.approx((math.exp(-1) + 0.5) / 2)


def test_self_bleu_ties_in_reference_length_take_the_shorter():
    # [1,2] sits between references of 1 and 3 tokens: the shorter wins, so no penalty.
    expected = (1 + math.exp(1 - 2) + 2 / 3) / 3
    assert self_bleu([[1, 2], [1], [1, 2, 3]], max_n=1) == pytest.approx(expected)


def test_self_bleu_needs_two_sequences():
    assert self_bleu([]) == 0.0
    assert self_bleu([[1, 2, 3]]) == 0.0


def _sentence_bleu_slowly(hypothesis, references, max_n):
    if not hypothesis:
        return 0.0
    log_total = 0.0
    for n in range(1, max_n + 1):
        hyp = Counter(tuple(hypothesis[i : i + n]) for i in range(len(hypothesis) - n + 1))
        refs = [Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1)) for r in references]
        clipped = sum(min(count, max(ref[g] for ref in refs)) for g, count in hyp.items())
        log_total += math.log((clipped or 0.1) / max(1, sum(hyp.values()))) / max_n
    c = len(hypothesis)
    r = min(references, key=lambda ref: (abs(len(ref) - c), len(ref)))
    brevity = 1.0 if c > len(r) else math.exp(1 - len(r) / c)
    return brevity * math.exp(log_total)


def _self_bleu_slowly(sequences, max_n):
    if len(sequences) < 2:
        return 0.0
    scores = [
        _sentence_bleu_slowly(s, sequences[:i] + sequences[i + 1 :], max_n)
        for i, s in enumerate(sequences)
    ]
    return sum(scores) / len(scores)


@given(small_corpus, st.integers(1, 4))
def test_self_bleu_matches_slow_reference(sequences, max_n):
    assert self_bleu(sequences, max_n) == pytest.approx(_self_bleu_slowly(sequences, max_n))


@given(small_corpus, st.lists(st.booleans(), max_size=5))
def test_all_metrics_lie_in_unit_interval(sequences, flags):
    flags = (flags + [False] * len(sequences))[: len(sequences)]
    summary = summarize(sequences, hit_max_tokens=flags)
    assert all(0.0 <= value <= 1.0 for value in summary.values())
    assert all(0.0 <= diversity(t) <= 1.0 for t in sequences)


def test_summarize_keys_and_values():
    sequences = [[1, 2, 3, 1, 2, 3], [4, 5, 6, 7]]
    summary = summarize(sequences)
    assert set(summary) == {
        "loop_rate",
        "distinct_2",
        "distinct_3",
        "rep_2",
        "rep_3",
        "rep_4",
        "diversity",
        "self_bleu",
    }
    assert summary["loop_rate"] == 0.5
    assert summary["rep_2"] == pytest.approx((1 - 3 / 5) / 2)
    assert summarize(sequences, hit_max_tokens=[True, False])["max_tokens_rate"] == 0.5
    with pytest.raises(ValueError):
        summarize(sequences, hit_max_tokens=[True])


def test_self_bleu_scales_to_a_realistic_batch():
    rng = random.Random(0)
    sequences = [[rng.randrange(2000) for _ in range(256)] for _ in range(200)]
    assert 0.0 <= self_bleu(sequences) <= 1.0
