"""The speculative study's ratios: the median over rounds of two rates measured in the same
round, not the ratio of two bests from different rounds."""

from studies.seed_systems.speculative import figures


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
