"""Speculative decoding is lossless: greedy outputs equal plain greedy ones token for token, sampled
ones follow the model's own distribution, and every control layer sees one verified position per
emitted token. The real model throughout (its own 4-bit weights, and float32 where named)."""

import itertools

import pytest
import torch

from etinfer import ControlConfig, SamplingParams, SpeculativeConfig
from etinfer.engine.speculative.drafter import NgramProposer
from etinfer.model.catalog import default_model_path
from tests.conftest import PROMPTS, assert_pool_free

PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
    "and wrote the weather in a leather logbook that his grandfather had started."
)
# Copy-heavy prompts, where prompt lookup proposes often, beside ordinary ones.
COPYING = [
    f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:\n",
    "def add(a, b):\n    return a + b\n\n\ndef add_three(a, b, c):\n    return a + b + c\n\n\n"
    "def add_four(a, b, c, d):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
]
MIXED = [COPYING[0], PROMPTS[3], COPYING[1], PROMPTS[0], COPYING[2]]
# Drafting in every step, whatever the batch or the entropy: the mechanics under test.
ALWAYS = SpeculativeConfig(num_draft_tokens=4, adaptive=False, disable_batch_size=64)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
BOTH_WEIGHTS = pytest.mark.parametrize("quantization", ["none", "auto"])


def tokens(llm, prompts, params=GREEDY):
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(max_n=3, min_n=2)
    assert proposer.lookup([5, 1, 2, 9, 9, 1, 2, 7, 8, 1, 2], 3) == [7, 8, 1]
    assert proposer.lookup([1, 2, 3, 4, 2, 3], 5) == [4, 2, 3]  # the longest n-gram first
    assert proposer.lookup([1, 2, 3, 4], 2) == []  # no earlier occurrence
    assert proposer.lookup([7], 2) == []


@BOTH_WEIGHTS
def test_greedy_equals_plain_greedy_alone_and_in_mixed_batches(make_llm, quantization):
    plain = make_llm(quantization=quantization, max_num_seqs=8)
    speculative = make_llm(quantization=quantization, max_num_seqs=8, speculative=ALWAYS)
    expected = tokens(plain, MIXED)
    outs = speculative.generate(MIXED, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert tokens(speculative, [COPYING[0]]) == [expected[0]]  # batch 1
    copy = outs[0]
    assert copy.num_accepted_tokens >= 20 and copy.num_draft_tokens >= copy.num_accepted_tokens
    # One entropy, temperature and so on per emitted token, as without speculation.
    assert len(copy.entropies) == len(copy.temperatures) == len(copy.token_ids) == 40
    # Who wrote each token: the accepted drafts, and the model's own samples.
    assert copy.token_models.count("draft:ngram") == copy.num_accepted_tokens
    assert len(copy.token_models) == 40 and copy.token_models[0] == "target"
    assert_pool_free(speculative)


@BOTH_WEIGHTS
def test_greedy_equal_with_chunked_prefill_and_after_preemption(make_llm, quantization):
    # Prefill chunks of 5 tokens: the step's budget also bounds the drafts.
    chunked = {"quantization": quantization, "max_num_batched_tokens": 5}
    prompts = [COPYING[0], PROMPTS[1]]
    expected = tokens(make_llm(**chunked), prompts)
    assert tokens(make_llm(**chunked, speculative=ALWAYS), prompts) == expected
    # Eight blocks of 16 tokens hold fewer than two of these at full length.
    tight = {"quantization": quantization, "num_kvcache_blocks": 8, "enable_prefix_caching": False}
    prompts = [COPYING[2], COPYING[1], PROMPTS[0]]
    expected = tokens(make_llm(**tight), prompts)
    speculative = make_llm(**tight, speculative=ALWAYS)
    outs = speculative.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert_pool_free(speculative)


def test_rejected_drafts_give_their_blocks_back_and_the_prefix_cache_stays_right(make_llm):
    # Batch-invariant: a prompt served partly from the cache prefills in other chunks than a
    # whole one, which SDPA computes apart at about 1e-7, and 8-bit activations can turn that
    # into another near-tied token; through the decode kernel the two are bit for bit the same.
    llm = make_llm(speculative=ALWAYS, max_num_seqs=8, batch_invariant=True)
    engine = llm.engine
    excess = []

    def watch(step):
        for seq in engine.scheduler.running:
            excess.append(len(seq.block_table) - engine.kv.blocks_needed(seq.num_tokens))

    with engine.observing(watch):
        first = llm.generate(MIXED, GREEDY)
    assert max(excess) <= 0  # never a block past what the known tokens need
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in first) > 0  # some rejected
    assert_pool_free(llm)
    # Published blocks hold accepted tokens only: prompt + output as a new prompt hits the cache
    # and continues as plain greedy decoding of that prompt does.
    again = [list(o.prompt_token_ids) + o.token_ids for o in first[:2]]
    outs = llm.generate(again, GREEDY)
    assert sum(o.num_cached_tokens for o in outs) >= 32
    uncached = make_llm(enable_prefix_caching=False, batch_invariant=True)
    assert [o.token_ids for o in outs] == tokens(uncached, again)


def test_stop_strings_max_tokens_logprobs_and_streams_as_without_drafts(make_llm):
    plain, speculative = make_llm(), make_llm(speculative=ALWAYS)
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["logbook"], logprobs=2)
    expected = plain.generate([COPYING[0]], stop)[0]
    got = speculative.generate([COPYING[0]], stop)[0]
    assert (got.text, got.token_ids, got.finish_reason) == (
        expected.text,
        expected.token_ids,
        "stop",
    )
    assert [sorted(lp) for lp in got.logprobs] == [sorted(lp) for lp in expected.logprobs]
    assert got.num_accepted_tokens > 0
    short = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    assert len(speculative.generate([COPYING[2]], short)[0].token_ids) == 7
    streamed = list(speculative.stream(COPYING[0], GREEDY, delta=True))
    assert [t for d in streamed for t in d.token_ids] == tokens(plain, [COPYING[0]])[0]
    assert len(streamed) < 40  # steps that accepted drafts stream several tokens at once


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Goodness of fit, bins with an expected count under 5 merged into one."""
    small = [i for i, e in enumerate(expected) if e < 5]
    keep = [i for i in range(len(expected)) if i not in small]
    obs = [observed[i] for i in keep] + [sum(observed[i] for i in small)]
    exp = [expected[i] for i in keep] + [sum(expected[i] for i in small)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    dof = sum(1 for e in exp if e > 0) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)).item()


def test_sampled_tokens_follow_the_models_distribution(make_llm):
    """480 seeded runs of three tokens at temperature 1, top-k 3: the second token is verified
    against a draft, the third sampled after an accepted one. Their joint frequencies fit the
    model's own probabilities (computed by scoring each prefix), and each run equals the run
    of the same seed without drafts.

    Scoring is a prefill, sampling reads decode rows: two computations that agree to rounding,
    which moves near-tied logits (on an AVX2 host, 0.0006 apart at the third and fourth token
    after "... two" + 1296, in the opposite order in each). batch_invariant takes prefill rows
    through the decode kernel, so the probabilities scored are bit for bit those sampled from.

    The claim is the sampler's, whatever the weights: float32 ones run these prefill-heavy
    batches of 48 in 0.7x the time of torch's int4 kernel (13 against 19 s, AVX-512 host)."""
    prompt = "one two three four one two three four one two"
    top_k, runs = 3, 480
    exact = {"quantization": "none", "max_num_seqs": 48, "batch_invariant": True}
    plain = make_llm(**exact)
    ids = plain.tokenizer.encode(prompt)

    def top(prefix: list[int]) -> dict[int, float]:
        logits = plain.engine.score(prefix)[-1]
        values, indices = logits.topk(top_k)
        return dict(zip(indices.tolist(), values.softmax(-1).tolist(), strict=True))

    expected: dict[tuple[int, ...], float] = {}
    for a, pa in top(ids).items():
        for b, pb in top([*ids, a]).items():
            for c, pc in top([*ids, a, b]).items():
                expected[(a, b, c)] = pa * pb * pc * runs
    speculative = make_llm(**exact, speculative=ALWAYS)
    params = [
        SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, seed=s) for s in range(runs)
    ]
    outs = speculative.generate([prompt] * runs, params)
    drafted = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert 0 < accepted < drafted  # both the accept and the reject path ran
    counts = {key: 0 for key in expected}
    for out in outs:
        counts[tuple(out.token_ids)] += 1
    keys = list(expected)
    assert chi_square_p_value([counts[k] for k in keys], [expected[k] for k in keys]) > 0.001
    # Stronger still: a seeded request draws one number per emitted token from its own
    # generator, with or without drafts, so it samples the very same tokens.
    assert tokens(plain, [prompt] * 96, params[:96]) == [o.token_ids for o in outs[:96]]


def test_the_temperature_law_runs_per_verified_position(make_llm, loaded_model):
    """Entropy control on: each emitted token's temperature and entropy are what the controller
    gives at that position, as decoding the same tokens one step at a time gives them."""
    control = ControlConfig(sampling=True)
    speculative = make_llm(control=control, speculative=ALWAYS)
    # A sampled continuation may leave the text it was asked to copy from its first token, and
    # then no draft is accepted: the first of a few seeds whose continuation copies is checked.
    for seed in range(8):
        params = SamplingParams(max_tokens=32, seed=seed, ignore_eos=True)
        out = speculative.generate([COPYING[0]], params)[0]
        if out.num_accepted_tokens > 0:
            break
    assert out.num_accepted_tokens > 0
    plain = make_llm(control=control).engine
    plain.add_request(COPYING[0], params, forced_token_ids=out.token_ids)
    replay = None
    while plain.has_unfinished_requests():
        replay = next(iter(plain.step()), replay)
    assert replay.token_ids == out.token_ids
    assert replay.temperatures == pytest.approx(out.temperatures, abs=1e-5)
    assert replay.entropies == pytest.approx(out.entropies, abs=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"num_draft_tokens": 17}, "num_draft_tokens"),
        ({"method": "eagle"}, "speculative.method"),
        ({"adaptive": "sometimes"}, "adaptive"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_max"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**kwargs)


def test_command_line_form_round_trips():
    for config in (ALWAYS, SpeculativeConfig(adaptive="heuristic"), SpeculativeConfig()):
        parsed = SpeculativeConfig.parse(config.as_flag())
        assert (parsed.method, parsed.num_draft_tokens, parsed.schedule) == (
            config.method,
            config.num_draft_tokens,
            config.schedule,
        )
    assert SpeculativeConfig.parse("none") is None
    with pytest.raises(ValueError, match="speculative schedule"):
        SpeculativeConfig.parse("ngram:4:sometimes")


def test_pruning_telemetry_stays_one_entry_per_decoded_token(make_llm):
    llm = make_llm(control=ControlConfig(pruning=True), speculative=ALWAYS)
    out = llm.generate([COPYING[0]], GREEDY)[0]
    assert out.num_accepted_tokens > 0
    # As without drafts: one per decode step, one fewer than tokens (the first is the prefill's).
    assert len(out.blocks_kept) == len(out.dropped_mass) == len(out.token_ids) - 1


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_an_early_exit_drafter_is_lossless(make_llm, quantization):
    # The default weights' fitted exit (the adapter tests below share its fit); float32's would
    # be a fit for this test alone, and what is drafted does not decide what verification keeps.
    fitted = quantization == "auto"
    config = SpeculativeConfig(
        method="draft", adaptive=False, disable_batch_size=64, exit_adapter=fitted
    )
    drafted = make_llm(quantization=quantization, draft_model="self:26", speculative=config)
    prompts = [COPYING[0], PROMPTS[3]]
    outs = drafted.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == tokens(make_llm(quantization=quantization), prompts)
    assert tokens(drafted, prompts[1:]) == [outs[1].token_ids]  # batch 1
    assert sum(o.num_accepted_tokens for o in outs) > 0
    assert_pool_free(drafted)
    # Prefill chunks of 8 tokens (the budget bounds the drafts too) and a pool that preempts:
    # recomputed tokens run as prefill, which matches decode to rounding only, and the two
    # engines preempt at different steps. On the 4-bit default's bfloat16 activations that
    # rounding moves a near-tied token now and then (token 33 on an AVX2 host), so there prefill
    # rows attend as decode rows (batch_invariant); in float32 it did not.
    tight = {"quantization": quantization, "max_num_batched_tokens": 8, "num_kvcache_blocks": 7}
    tight |= {"enable_prefix_caching": False, "batch_invariant": quantization == "auto"}
    prompts = [COPYING[2], PROMPTS[3], PROMPTS[0]]
    # Unfitted (the bare exit, 39 % agreement): the adapter changes what is drafted, not whether
    # verification keeps the plain output, and its fit is a 2K-token prefill of its own.
    bare = SpeculativeConfig(
        method="draft", adaptive=False, disable_batch_size=64, exit_adapter=False
    )
    small = make_llm(**tight, draft_model="self:26", speculative=bare)
    outs = small.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == tokens(make_llm(**tight), prompts)
    assert sum(o.num_preemptions for o in outs) > 0
    assert_pool_free(small)


def test_the_exit_adapter_makes_the_exit_agree_with_the_model(make_llm):
    """On held-out text of the corpus it is fitted on, the fitted exit after 26 of 30 layers
    picks the model's top token far more often than the bare exit (62% against 39% measured)."""
    from etinfer.corpus import corpus_windows

    llm = make_llm(draft_model="self:26", speculative=SpeculativeConfig(method="draft"))
    engine, drafter = llm.engine, llm.engine.speculator.proposer
    model = engine.runner.model
    ids = next(itertools.islice(corpus_windows(llm.tokenizer, 512), 5, None))
    blocks = engine.kv.pool.allocate(32)
    early, last = engine.runner.exit_states(ids, blocks, 26)
    engine.kv.pool.free(blocks)
    top = model.compute_logits(model.final_norm(last)).argmax(-1)
    bare = model.compute_logits(model.final_norm(early)).argmax(-1)
    adapter = drafter.adapter
    fitted = model.compute_logits(
        torch.addmm(adapter.bias, model.final_norm(early, weight=False), adapter.weight)
    ).argmax(-1)
    assert (fitted == top).float().mean() > (bare == top).float().mean() + 0.1


def test_engines_with_the_same_exit_share_one_fit_equal_to_a_fresh_one(make_llm):
    """The adapter is fitted once per prepared weights and fit settings in a process: a second
    engine takes the first's, an engine whose cache stores another type fits its own, and a
    fit made again gives the shared adapter bit for bit (so sharing changes no draft)."""
    from etinfer.engine.speculative import early_exit

    settings = {"draft_model": "self:26", "speculative": SpeculativeConfig(method="draft")}
    first = make_llm(**settings).engine
    second = make_llm(**settings).engine
    adapter = first.speculator.proposer.adapter
    assert second.speculator.proposer.adapter is adapter
    other = make_llm(**settings, kv_cache_dtype="bfloat16").engine.speculator.proposer.adapter
    assert other is not adapter
    runner, pool = first.runner, first.kv.pool
    window = early_exit.fit_window(runner, pool)
    again = early_exit._fit(runner, pool, first.tokenizer, 26, window)
    assert torch.equal(again.weight, adapter.weight) and torch.equal(again.bias, adapter.bias)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"draft_model": "self:0"}, r"N in \[1, 29\]"),
        ({"draft_model": "self:30"}, r"N in \[1, 29\]"),
        ({"draft_model": "missing.gguf"}, "missing.gguf: no such file"),
        ({"draft_model": None}, "needs a draft_model"),
    ],
)
def test_bad_draft_models_name_the_field(make_llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_llm(speculative=SpeculativeConfig(method="draft"), **kwargs)


@pytest.mark.parametrize(
    "weights", [{"quantization": "none"}, {"quantization": "auto", "batch_invariant": True}]
)
def test_the_model_drafting_for_itself_has_every_draft_accepted(make_llm, weights):
    """A separate draft model over its own cache: the default model drafting for itself proposes
    what the model then computes, in a mixed batch and after preemptions. Its catch-up chunks
    run as prefill, which matches decode to float rounding only, unless prefill rows attend as
    decode rows (batch_invariant): on the 4-bit default's bfloat16 activations that rounding
    moves a near-tied token now and then, in float32 it did not."""
    config = SpeculativeConfig(method="draft", adaptive=False, disable_batch_size=64)
    draft = str(default_model_path())
    tight = {"num_kvcache_blocks": 7, "enable_prefix_caching": False}
    llm = make_llm(draft_model=draft, speculative=config, **tight, **weights)
    prompts = [COPYING[0], PROMPTS[3], PROMPTS[0]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == tokens(make_llm(**weights), prompts)
    drafted, accepted = (
        sum(getattr(o, f) for o in outs) for f in ("num_draft_tokens", "num_accepted_tokens")
    )
    assert accepted == drafted > 0
    assert sum(o.num_preemptions for o in outs) > 0
    assert_pool_free(llm)


def test_a_draft_model_with_another_vocabulary_is_refused(make_llm, tmp_path):
    from tests.model.test_hf_folder import VOCAB, write_tiny_model

    write_tiny_model(tmp_path, "llama-rope-llama3")
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB} tokens"):
        make_llm(draft_model=str(tmp_path), speculative=SpeculativeConfig(method="draft"))


def test_drafts_rest_where_they_do_not_pay_and_go_on_where_they_do(make_llm):
    """Timed as the engine runs: two layers of thirty, unfitted, agree with the model too rarely
    to pay for themselves, so they rest; prompt lookup on a passage to copy keeps drafting."""
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    exit_config = SpeculativeConfig(
        method="draft", adaptive="heuristic", disable_batch_size=64, exit_adapter=False
    )
    exit_drafts = make_llm(draft_model="self:2", speculative=exit_config)
    out = exit_drafts.generate([PROMPTS[3]], params)[0]
    assert out.token_ids == tokens(make_llm(), [PROMPTS[3]], params)[0]
    assert 0 < out.num_draft_tokens < 40  # a fixed length would draft 4 at each of 63 steps
    # What the finished request says of the drafter carries to the next: it tries one token,
    # and rests at least as long as the first came to.
    costs = exit_drafts.engine.speculator.costs
    assert costs.start_rest > 0
    again = exit_drafts.generate([PROMPTS[0]], params)[0]
    assert again.token_ids == tokens(make_llm(), [PROMPTS[0]], params)[0]
    assert 0 < again.num_draft_tokens < out.num_draft_tokens
    lookup = make_llm(speculative=SpeculativeConfig(adaptive="heuristic"))
    copied = lookup.generate([COPYING[0]], params)[0]
    assert copied.num_accepted_tokens >= 20
    assert lookup.engine.speculator.costs.start_rest == 0  # its drafts paid


def test_a_lookup_that_finds_nothing_costs_nothing(make_llm):
    """Prompt lookup asked for tokens where no earlier n-gram matches proposes none: no row
    verifies anything, so the step is no drafting step to weigh (an early exit asked for
    tokens has run its layers, proposed or not)."""
    llm = make_llm(speculative=SpeculativeConfig(adaptive="heuristic", disable_batch_size=64))
    engine = llm.engine
    assert not engine.speculator.proposer.asking_costs
    # Distinct ids: the sequence's last two tokens occur nowhere before them.
    engine.add_request(list(range(100, 140)), SamplingParams(temperature=0, max_tokens=8))
    while not engine.speculator.asked:  # the prefill, then a plain step timed first
        engine.step()
    (seq,) = engine.scheduler.running
    assert engine.speculator.asked == {0: 0} and seq.speculation.weighed_steps == 0
    assert engine.speculator.tokens_asked == 0
    assert engine.speculator.costs.per_draft is None  # timed as a plain step
    while engine.has_unfinished_requests():
        engine.step()
