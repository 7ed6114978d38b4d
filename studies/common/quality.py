"""Text-quality metrics without humans, for comparing samplers on the same prompts.

All metrics read token ids, not strings, so they need no tokenizer and treat every model alike.
They follow the conventions of the min-p and ANCHORS papers:

- rep-n = 1 - unique n-grams / total n-grams within one generation (its repetitiveness);
- diversity = product over n = 2, 3, 4 of (1 - rep-n);
- a generation is looping when it ends in a phrase repeated back to back, or repeats one phrase
  an absurd number of times anywhere (see ``is_looping``);
- Self-BLEU (Texygen, Zhu et al. 2018) = mean sentence BLEU of each generation against all the
  others: high means the samples resemble one another (low diversity across samples).
"""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from collections.abc import Sequence

from etinfer.bench.common.stats import mean
from etinfer.model.tokenizer import Tokenizer
from studies.common.mixed_workload import AblationRequest

Tokens = Sequence[int]


def _ngrams(tokens: Tokens, n: int) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def rep_n(tokens: Tokens, n: int) -> float:
    """1 - unique n-grams / total n-grams of one sequence; 0.0 when it holds no n-gram."""
    grams = _ngrams(tokens, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def distinct_n(sequences: Sequence[Tokens], n: int) -> float:
    """Corpus-level distinct-n: unique n-grams over all sequences / total n-grams over all."""
    grams = [g for tokens in sequences for g in _ngrams(tokens, n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def diversity(tokens: Tokens) -> float:
    """Product over n = 2, 3, 4 of (1 - rep-n): 1.0 for a sequence that repeats no bigram."""
    return math.prod(1.0 - rep_n(tokens, n) for n in (2, 3, 4))


def is_looping(
    tokens: Tokens, min_phrase: int = 3, max_phrase: int | None = None, repeat_threshold: int = 50
) -> bool:
    """Whether a generation is stuck in a loop.

    It is when either
    1. it ends in one phrase repeated back to back: ``tokens[-2n:-n] == tokens[-n:]`` for some
       phrase length n with min_phrase <= n <= min(max_phrase, len(tokens) // 2); or
    2. some phrase of min_phrase tokens occurs more than ``repeat_threshold`` times anywhere
       (any longer phrase repeated that often contains such a phrase, so checking min_phrase
       alone suffices).
    Phrases shorter than min_phrase never count: [1, 2, 1, 2] is not looping at min_phrase=3.
    Costs O(len(tokens) * max_phrase).
    """
    longest = len(tokens) // 2 if max_phrase is None else min(max_phrase, len(tokens) // 2)
    for n in range(min_phrase, longest + 1):
        if tokens[-2 * n : -n] == tokens[-n:]:
            return True
    counts = Counter(_ngrams(tokens, min_phrase))
    return any(count > repeat_threshold for count in counts.values())


def loop_rate(sequences: Sequence[Tokens], **kwargs: int | None) -> float:
    """Share of sequences for which ``is_looping(sequence, **kwargs)`` holds; 0.0 if none."""
    return _mean([float(is_looping(tokens, **kwargs)) for tokens in sequences])


def _max_count_in_others(counts: list[Counter]) -> list[dict[tuple[int, ...], int]]:
    """For each sequence i and n-gram g of it, the largest count of g in any sequence j != i.

    Keeps, per n-gram, the largest count, its holder and the second largest count, so each
    lookup is O(1) instead of a scan over every other sequence.
    """
    best: dict[tuple[int, ...], tuple[int, int, int]] = {}  # gram -> (top, holder, second)
    for i, counter in enumerate(counts):
        for gram, count in counter.items():
            top, holder, second = best.get(gram, (0, -1, 0))
            best[gram] = (count, i, top) if count > top else (top, holder, max(second, count))
    return [
        {g: best[g][2] if best[g][1] == i else best[g][0] for g in counter}
        for i, counter in enumerate(counts)
    ]


def self_bleu(sequences: Sequence[Tokens], max_n: int = 4) -> float:
    """Mean sentence BLEU-max_n of each sequence against all the other sequences (Texygen).

    Sentence BLEU: geometric mean, uniform weights, of the clipped n-gram precisions for
    n = 1..max_n (each hypothesis n-gram count clipped by its largest count in one reference),
    with Chen & Cherry (2014) smoothing method 1 (a zero numerator becomes 0.1), times the
    brevity penalty against the reference length closest to the hypothesis's (ties: shorter).
    An empty hypothesis scores 0. Fewer than two sequences: 0.0.
    """
    if len(sequences) < 2:
        return 0.0
    lengths = [len(tokens) for tokens in sequences]
    log_precisions = [0.0] * len(sequences)
    for n in range(1, max_n + 1):
        counts = [Counter(_ngrams(tokens, n)) for tokens in sequences]
        for i, ref_max in enumerate(_max_count_in_others(counts)):
            clipped = sum(min(c, ref_max[g]) for g, c in counts[i].items())
            total = max(1, lengths[i] - n + 1)
            log_precisions[i] += math.log((clipped or 0.1) / total) / max_n
    scores = []
    for i, length in enumerate(lengths):
        if length == 0:
            scores.append(0.0)
            continue
        ref_length = min((abs(r - length), r) for j, r in enumerate(lengths) if j != i)[1]
        brevity = 1.0 if length > ref_length else math.exp(1 - ref_length / length)
        scores.append(brevity * math.exp(log_precisions[i]))
    return _mean(scores)


def summarize(sequences: Sequence[Tokens], hit_max_tokens: Sequence[bool] | None = None) -> dict:
    """All metrics of one sampler's generations; rep-n and diversity averaged over sequences.

    ``hit_max_tokens`` (one flag per sequence: stopped by the length limit, not by EOS) adds
    ``max_tokens_rate``, the share of generations that never finished.
    """
    summary = {
        "loop_rate": loop_rate(sequences),
        "distinct_2": distinct_n(sequences, 2),
        "distinct_3": distinct_n(sequences, 3),
        **{f"rep_{n}": _mean([rep_n(t, n) for t in sequences]) for n in (2, 3, 4)},
        "diversity": _mean([diversity(t) for t in sequences]),
        "self_bleu": self_bleu(sequences),
    }
    if hit_max_tokens is not None:
        if len(hit_max_tokens) != len(sequences):
            raise ValueError("hit_max_tokens needs one flag per sequence")
        summary["max_tokens_rate"] = _mean([float(hit) for hit in hit_max_tokens])
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def words(text: str) -> list[str]:
    """Lower-cased alphanumeric runs: the tokenisation of Google's rouge-score package."""
    return re.findall(r"[a-z0-9]+", text.lower())


def rouge_l(candidate: Sequence, reference: Sequence) -> float:
    """ROUGE-L F1 (Lin, 2004): the longest common subsequence against both lengths.

    Two empty sequences are identical (1.0); one empty against a non-empty one scores 0.
    """
    if not candidate or not reference:
        return float(not candidate and not reference)
    previous = [0] * (len(reference) + 1)
    for a in candidate:
        row = [0]
        for j, b in enumerate(reference):
            row.append(previous[j] + 1 if a == b else max(previous[j + 1], row[j]))
        previous = row
    lcs = previous[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(candidate), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def case_scores(
    requests: list[AblationRequest], answers: list, tokenizer: Tokenizer, outputs: Sequence = ()
) -> dict[str, list[float]]:
    """Each scored case's score, by ground-truth metric: ``passkey`` (1 where the answer's first
    integer is the key), ``rouge_l_human`` (against the human text that follows) and, from the
    ``outputs``, ``likelihood`` (the mean log-probability the model gave the forced human
    tokens of a likelihood request)."""
    cases: dict[str, list[float]] = {"passkey": [], "rouge_l_human": [], "likelihood": []}
    for i, (request, answer) in enumerate(zip(requests, answers, strict=True)):
        if request.task == "retrieval":
            found = re.search(r"\d+", tokenizer.decode(answer))
            cases["passkey"].append(float(found is not None and int(found.group()) == request.key))
        elif request.reference is not None:
            said, truth = (
                words(tokenizer.decode(answer)),
                words(tokenizer.decode(request.reference)),
            )
            cases["rouge_l_human"].append(rouge_l(said, truth))
        elif request.task == "likelihood" and outputs:
            out = outputs[i]
            given = [
                entry[token].logprob
                for entry, token in zip(out.logprobs, out.token_ids, strict=True)
            ]
            cases["likelihood"].append(sum(given) / len(given))
    return cases


def task_quality(
    requests: list[AblationRequest], answers: list, tokenizer: Tokenizer, outputs: Sequence = ()
) -> dict:
    return case_figures(case_scores(requests, answers, tokenizer, outputs))


def case_figures(cases: dict[str, list[float]]) -> dict:
    """The run's quality figures from its ``case_scores``."""
    figures = {
        "passkey_accuracy": mean(cases["passkey"]),
        "rouge_l_human": mean(cases["rouge_l_human"]),
    }
    if cases["likelihood"]:
        figures["likelihood_perplexity"] = math.exp(-mean(cases["likelihood"]))
    return figures


def quality_score(ours: dict[str, list[float]], base: dict[str, list[float]]) -> float | None:
    """Table 1's quality: the mean over ground-truth metrics of the arm's score over the
    baseline's (for likelihood, the baseline's perplexity over the arm's), skipping a metric
    with no cases or one the baseline scores 0 on; None where none is left."""
    parts = []
    for metric in ("passkey", "rouge_l_human"):
        if ours[metric] and mean(base[metric]):
            parts.append(mean(ours[metric]) / mean(base[metric]))
    if ours["likelihood"]:
        parts.append(math.exp(mean(ours["likelihood"]) - mean(base["likelihood"])))
    return sum(parts) / len(parts) if parts else None


def quality_interval(
    ours: dict[str, list[float]], base: dict[str, list[float]], draws: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """A 95 % interval of ``quality_score`` by the paired bootstrap: each metric's cases drawn
    again with replacement, the same draw for the arm and the baseline (the same prompts)."""
    rng = random.Random(seed)
    scores = []
    for _ in range(draws):
        picks = {metric: [rng.randrange(len(v)) for _ in v] for metric, v in base.items()}
        score = quality_score(_drawn(ours, picks), _drawn(base, picks))
        if score is not None:
            scores.append(score)
    if not scores:
        return None
    scores.sort()
    return scores[int(0.025 * len(scores))], scores[int(0.975 * len(scores)) - 1]


def _drawn(cases: dict[str, list[float]], picks: dict[str, list[int]]) -> dict[str, list[float]]:
    return {metric: [values[i] for i in picks[metric]] for metric, values in cases.items()}
