"""Entropic block pruning in the engine, on the real model: switches, equivalence, telemetry."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from etinfer import ControlConfig, PruningConfig, SamplingParams
from etinfer.bench.common.fidelity import corpus_tokens, teacher_forced

CONTEXT = 480  # tokens of real text: 30 blocks, enough for pruning to drop some
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Pruning from short contexts on, so that a test context of a few hundred tokens is pruned.
EAGER = dict(min_context=0, min_blocks=4, recent_blocks=1, dense_layers=1)


@pytest.fixture(scope="module")
def texts(llm) -> list[list[int]]:
    corpus = corpus_tokens(llm.tokenizer)
    return [corpus[i * 5000 : i * 5000 + CONTEXT + 24] for i in range(2)]


def test_control_switches_select_the_attention_layer(make_llm):
    assert make_llm(control=ControlConfig.baseline()).engine.config.control.pruning_config is None
    pruned = make_llm(control=ControlConfig(pruning=True)).engine
    assert pruned.config.control.pruning_config == PruningConfig()
    assert make_llm(control=ControlConfig.full()).engine.config.control.pruning_config is not None


@pytest.mark.parametrize("scorer", ["bound", "digest", "reused-mass", "sketch", "sketch-tokens"])
def test_keeping_every_block_generates_exactly_what_dense_does(llm, make_llm, texts, scorer):
    keep_all = PruningConfig(**EAGER | dict(budget_low=1.0, budget_high=1.0, scorer=scorer))
    pruned = make_llm(max_num_seqs=16, control=ControlConfig(pruning=keep_all))
    prompts = [t[:CONTEXT] for t in texts]
    dense_out = llm.generate(prompts, GREEDY)
    pruned_out = pruned.generate(prompts, GREEDY)
    for d, p in zip(dense_out, pruned_out, strict=True):
        assert p.token_ids == d.token_ids
        assert p.blocks_kept and all(share == 1.0 for share in p.blocks_kept)
        assert max(p.dropped_mass) == 0.0


@pytest.mark.parametrize(
    ("scorer", "law"),
    [
        ("bound", "entropy"),
        ("reused-mass", "entropy"),
        ("digest", "entropy"),
        ("sketch", "entropy"),
        ("sketch-tokens", "entropy"),
        ("bound", "fixed"),
        ("reused-mass", "attention-entropy"),
    ],
)
def test_pruning_reads_fewer_blocks_and_stays_close_to_dense(make_llm, texts, scorer, law):
    config = PruningConfig(**EAGER, scorer=scorer, budget_law=law, token_budget=160)
    pruned = make_llm(max_num_seqs=16, control=ControlConfig(pruning=config))
    stats = teacher_forced(pruned, texts, CONTEXT, 24, config)
    assert stats.steps == 2 * 23  # every forced token after the first ran as a decode step
    assert stats.blocks_kept < 0.7
    # Loose bounds that a broken selection (wrong blocks, or attention to padding) fails.
    assert stats.top1_agreement >= 0.8
    assert stats.kl_mean < 0.1
    assert 0.9 < stats.perplexity_ratio < 1.2
    # Back to dense on the same engine: what it computes is dense attention again.
    same = teacher_forced(
        pruned,
        texts,
        CONTEXT,
        24,
        replace(config, budget_low=1.0, budget_high=1.0, budget_law="entropy"),
    )
    # (Not bit for bit: the prompt's last, partial block is recomputed in a chunk of its own.)
    assert same.kl_max < 1e-4


def test_switching_pruning_needs_an_engine_built_with_it(llm):
    with pytest.raises(ValueError, match="build the engine with pruning on"):
        llm.engine.set_pruning(PruningConfig())


def test_telemetry_reports_a_dropped_mass_bound_per_token(make_llm, texts):
    pruned = make_llm(control=ControlConfig(pruning=PruningConfig(**EAGER)))
    steps = []
    with pruned.engine.observing(steps.append):
        out = pruned.generate([texts[0][:CONTEXT]], GREEDY)[0]
    # The first token comes from the prefill; each later one from a pruned decode step.
    assert len(out.blocks_kept) == len(out.dropped_mass) == len(out.token_ids) - 1
    assert all(0 < share < 1 for share in out.blocks_kept)
    assert all(0 <= mass <= 1 for mass in out.dropped_mass)
    attention = steps[-1].attention
    for kept, total in zip(attention.kept, attention.total, strict=True):
        assert all(k <= t for k, t in zip(kept, total, strict=True))
    assert attention.kept[0] == attention.total[0]  # the first layer stays dense
    assert sum(map(sum, attention.kept)) < sum(map(sum, attention.total))


def test_short_contexts_attend_densely_by_default(make_llm):
    pruned = make_llm(control=ControlConfig(pruning=True))
    out = pruned.generate(["The capital of France is"], GREEDY)[0]
    assert out.blocks_kept == [1.0] * (GREEDY.max_tokens - 1)


@pytest.mark.model
def test_fidelity_benchmark_runs_end_to_end(tmp_path):
    """``python -m studies fidelity`` at toy sizes: every part runs and the report has its
    fields."""
    toy = "--batches 1 --fidelity-batches 1 --fidelity-context 200 --fidelity-steps 6"
    configs = "--fidelity-configs bound --oracle --passkey-configs bound --passkey-lengths 200"
    # Each arm prefills its context itself: from the prefix cache a later arm's prefill is one
    # short chunk after a cached prefix, a different attention path, whose last bits move
    # bfloat16's (CUDA's default) logits (KL 0.0018 on an H200), though nothing is pruned.
    configs += " --no-enable-prefix-caching"
    command = [sys.executable, "-m", "studies", "fidelity"]
    where = ["--output-dir", str(tmp_path), "--result", str(tmp_path / "result.json")]
    result = subprocess.run(
        [*command, *toy.split(), *configs.split(), *where],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "pruning.json").read_text())
    fidelity, oracle = report["fidelity"]
    assert oracle["scorer"] == "bound oracle" and oracle["steps"] == 5
    assert fidelity["steps"] == 5 and 0 <= fidelity["top1_agreement"] <= 1
    assert fidelity["step_ms"] > 0 and fidelity["step_ratio"] > 0
    # Under the default minimum context nothing is pruned: pruned equals dense.
    assert fidelity["kl_max"] < 1e-6 and fidelity["blocks_kept"] == 1.0
    assert len(report["passkey"]) == 2 * 5  # two haystacks, five depths
    assert {"haystack", "length", "depth", "dense", "bound", "bound oracle"} <= set(
        report["passkey"][0]
    )
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["benchmark"] == "fidelity" and result["command"].startswith("python -m studies")
    passkeys = [f["labels"] for f in result["figures"] if f["subject"] == "passkeys found"]
    # The rankings asked for (the oracle here) apply to the passkeys too.
    arms = ("dense", "bound", "bound oracle")
    assert {(f["arm"], f["workload"]) for f in passkeys} == {
        (arm, haystack) for arm in arms for haystack in ("repeated", "varied")
    }


def test_only_the_digests_cache_keeps_the_keys_moments(make_llm):
    reused = make_llm(control=ControlConfig(pruning=True)).engine
    assert reused.runner.cache.key_moments is None  # no upkeep at every write for nothing
    with pytest.raises(ValueError, match="keys' moments"):
        reused.set_pruning(PruningConfig(scorer="digest"))
    digest = make_llm(control=ControlConfig(pruning=PruningConfig(scorer="digest"))).engine
    assert digest.runner.cache.key_moments is not None
    digest.set_pruning(PruningConfig())  # every other scorer's summaries are kept too
