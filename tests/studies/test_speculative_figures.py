"""The speculative study's ratios: the median over rounds of two rates measured in the same
round, not the ratio of two bests from different rounds."""

import pytest

from studies.seed_systems.speculative import asked_figures, figures


def test_ratio_is_the_median_of_same_round_ratios_with_their_range():
    plain, lookup = ("chat", "plain", 1), ("chat", "ngram entropy (default)", 1)
    # A lucky first round of plain: its best over lookup's best would read 0.9x.
    rounds = [{plain: 40.0, lookup: 36.0}, {plain: 30.0, lookup: 31.5}, {plain: 32.0, lookup: 33.6}]
    results = {key: {"tok_s": max(r[key] for r in rounds), "acceptance": None} for key in rounds[0]}
    found = [f for f in figures(results, rounds) if f.unit == "x"]
    assert len(found) == 1
    ratio = found[0]
    assert ratio.labels["arm"] == "ngram entropy (default)" and ratio.labels["vs"] == "plain"
    assert ratio.value == 1.05
    assert ratio.spread == {"min": 0.9, "max": 1.05} and ratio.n == 3


def test_tokens_asked_of_the_drafter_median_over_rounds_and_the_first_round():
    key = ("copy", "self:10 entropy", 1)
    asked = [{key: 7.8}, {key: 0.8}, {key: 0.8}, {key: 1.6}]
    median_figure, first = asked_figures(asked)
    assert median_figure.subject == "drafter tokens asked" and median_figure.unit == "per 100"
    assert median_figure.value == pytest.approx(1.2)  # the median of four: (0.8 + 1.6) / 2
    assert median_figure.spread == {"min": 0.8, "max": 7.8}
    assert first.value == 7.8 and first.labels["round"] == "first"
    assert asked_figures([]) == []
