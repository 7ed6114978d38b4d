"""Structured output in the engine: grammar masks on the real model, through every layer, with
the entropy signal kept the model's own."""

from __future__ import annotations

import copy
import gc
import json
import re
import weakref

import jsonschema
import pytest
import torch
import transformers

from etinfer import LLM, SamplingParams
from etinfer.bench.structured.schemas import JSON_OBJECT_PROMPT, SCHEMAS
from etinfer.config import EngineConfig, SpeculativeConfig
from etinfer.engine.llm_engine import LLMEngine
from etinfer.model.loader import LoadedModel
from etinfer.structured.compiler import shared_grammars
from etinfer.structured.masks import fill_allowed
from etinfer.structured.params import StructuredOutputsParams
from etinfer.structured.schema_support import bounded_fractions

PERSON = SCHEMAS[0][2]
ASK = [{"role": "user", "content": SCHEMAS[0][1]}]


def chat_ids(llm: LLM, messages=ASK) -> list[int]:
    return llm.tokenizer.encode_chat(messages)


def greedy(schema: dict = PERSON, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=96, structured={"json": schema}, **kwargs)


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


class GrammarMask(transformers.LogitsProcessor):
    """transformers' logits under the same compiled grammar: one matcher fed the tokens
    generate() picks, its mask applied as our sampler applies it."""

    def __init__(self, llm: LLM, params: StructuredOutputsParams, prompt_length: int) -> None:
        self.matcher = llm.engine.grammars.compiler.compile(params).matcher()
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_length:
            assert self.matcher.accept(int(input_ids[0, -1]))
        allowed = fill_allowed([self.matcher], scores.shape[-1])
        return scores.masked_fill(~allowed, -torch.inf)


def hf_constrained(hf_model, llm: LLM, ids: list[int], params: SamplingParams) -> list[int]:
    out = hf_model.generate(
        torch.tensor([ids]),
        max_new_tokens=params.max_tokens,
        do_sample=False,
        logits_processor=[GrammarMask(llm, params.structured, len(ids))],
        eos_token_id=list(llm.tokenizer.eos_token_ids),
        pad_token_id=llm.tokenizer.eos_token_ids[0],
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_greedy_constrained_output_equals_transformers_with_the_same_mask(float_llm, hf_reference):
    ids = chat_ids(float_llm)
    params = greedy()
    ours = float_llm.generate(ids, params)[0]
    theirs = hf_constrained(hf_reference, float_llm, ids, params)
    assert ours.token_ids == [t for t in theirs if t not in float_llm.tokenizer.eos_token_ids] + [
        t for t in ours.token_ids[-1:] if t in float_llm.tokenizer.eos_token_ids
    ]
    assert valid(ours.text, PERSON)


def test_tiny_model_constrained_greedy_equals_transformers(tiny_model: LoadedModel):
    """Random weights follow the grammar only because of the mask: every token is masked."""
    config = tiny_model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    hf_model.load_state_dict(tiny_model.weights, strict=False)
    hf_model.tie_weights()
    llm = LLM(tiny_model, quantization="none", dtype="float32", kv_cache_dtype="float32")
    ids = chat_ids(llm)
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured={"regex": r"[a-z]{3,8}( [a-z]{2,6}){2,5}\."}
    )
    ours = llm.generate(ids, params)[0]
    theirs = hf_constrained(hf_model, llm, ids, params)
    assert ours.token_ids == theirs[: len(ours.token_ids)]
    assert ours.finish_reason == "stop"


@pytest.mark.slow
def test_every_schema_validates_in_one_batch_with_free_requests(llm: LLM):
    constrained = [
        SamplingParams(temperature=0.7, max_tokens=256, seed=i, structured={"json": schema})
        for i, (_, _, schema) in enumerate(SCHEMAS)
    ]
    free = [SamplingParams(temperature=0.7, max_tokens=32, seed=7) for _ in range(4)]
    prompts = [chat_ids(llm, [{"role": "user", "content": p}]) for _, p, _ in SCHEMAS]
    outputs = llm.generate(prompts + prompts[:4], constrained + free)
    for (name, _, schema), out in zip(SCHEMAS, outputs, strict=False):
        assert out.finish_reason == "stop", name
        assert valid(out.text, schema), (name, out.text)
        assert len(out.constraint.forced) == len(out.token_ids)
    assert all(out.constraint is None for out in outputs[len(SCHEMAS) :])


def test_forced_tokens_carry_the_models_entropy_not_zero(llm: LLM):
    """On a step where the grammar allows one token, the sampled distribution is certain but
    the entropy the controls read is the model's own."""
    params = SamplingParams(
        temperature=0.0, max_tokens=16, structured={"choice": ["The answer is definitely yes"]}
    )
    out = llm.generate(chat_ids(llm), params)[0]
    assert out.text == "The answer is definitely yes"
    forced = [i for i, f in enumerate(out.constraint.forced) if f]
    assert len(forced) >= 3
    assert all(out.constraint.masked_entropies[i] < 1e-5 for i in forced)
    assert max(out.entropies[i] for i in forced) > 0.1  # the model was not certain of them
    assert all(out.constraint.removed_mass[i] >= 0 for i in forced)


def test_entropy_control_reads_the_models_entropy_under_a_mask(llm: LLM):
    """The feedback law moves the temperature from the model's entropy: the same request with
    and without a mask that allows everything the model would say sees the same entropies."""
    ids = chat_ids(llm)
    control = {"temperature": 0.7, "entropy_target": 1.0, "seed": 3, "max_tokens": 24}
    plain = llm.generate(ids, SamplingParams(**control))[0]
    loose = SamplingParams(**control, structured={"regex": r"(.|\n)*"})
    masked = llm.generate(ids, loose)[0]
    assert masked.token_ids == plain.token_ids
    assert masked.entropies == pytest.approx(plain.entropies, abs=1e-5)
    assert masked.temperatures == pytest.approx(plain.temperatures, abs=1e-5)


def test_constrained_outputs_are_the_same_alone_batched_preempted_and_speculative(
    make_llm, llm: LLM
):
    ids = chat_ids(llm)
    params = [greedy(), greedy(stop=["}"]), greedy(SCHEMAS[3][2])]
    alone = [llm.generate(ids, p)[0].token_ids for p in params]
    assert [o.token_ids for o in llm.generate([ids] * 3, params)] == alone
    # A pool so small that the three preempt one another (recompute keeps their matchers).
    small = make_llm(num_kvcache_blocks=10, block_size=16, max_num_seqs=3)
    outs = small.generate([ids] * 3, params)
    assert [o.token_ids for o in outs] == alone
    assert sum(o.num_preemptions for o in outs) > 0
    speculative = make_llm(speculative=SpeculativeConfig(method="ngram"))
    outs = speculative.generate([ids] * 3, params)
    assert [o.token_ids for o in outs] == alone


def test_n_samples_and_streaming_follow_the_grammar(llm: LLM):
    ids = chat_ids(llm)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured={"json": PERSON})
        for s in range(4)
    ]
    for out in llm.generate([ids] * 4, params):
        assert valid(out.text, PERSON), out.text
    streamed = list(llm.stream(ids, greedy(), delta=True))
    whole = streamed[0].accumulating(streamed[0])
    for delta in streamed[1:]:
        whole.merge(delta)
    assert whole.text == llm.generate(ids, greedy())[0].text
    assert len(whole.constraint.forced) == len(whole.token_ids)


def test_a_token_the_grammar_forbids_ends_the_request_at_a_dead_end(loaded_model):
    engine = LLMEngine(EngineConfig(model=str(loaded_model.path)), loaded_model)
    digits = StructuredOutputsParams(regex=r"[0-9]+")
    letter = engine.tokenizer.encode("x", add_special_tokens=False)
    engine.add_request(
        "Count:", SamplingParams(max_tokens=4, structured=digits), forced_token_ids=letter
    )
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].finish_reason == "grammar_dead_end"
    assert outputs[-1].token_ids == []


def test_engines_over_one_tokenizer_read_its_vocabulary_once(make_llm, llm: LLM):
    """A grammar backend holds what it read from the vocabulary, and compiled grammars are
    immutable, so engines over one tokenizer share both; a grammar one engine compiled is ready
    at once in another."""
    other = make_llm()
    params = StructuredOutputsParams(choice=["yes", "no"])
    compilers = [llm.engine.grammars.compiler, other.engine.grammars.compiler]
    grammars = [compiler.compile(params) for compiler in compilers]
    assert compilers[0].shared is compilers[1].shared
    assert grammars[0] is grammars[1]
    assert make_llm().engine.grammars.compiler.submit(params).done()
    ask = SamplingParams(temperature=0, max_tokens=4, structured=params)
    assert other.generate(["Is water wet?"], ask)[0].text in ("yes", "no")


def test_a_grammar_that_fails_to_compile_is_refused(loaded_model, llm: LLM):
    bad = StructuredOutputsParams(regex="[a-")
    with pytest.raises(ValueError, match=r"structured\.regex"):
        llm.generate("x", SamplingParams(structured=bad))
    assert not llm.engine.has_unfinished_requests()
    # A request accepted while its grammar compiles waits for it, then ends with "error". The
    # compile is held back until the request is in (engines share a backend already built, so
    # a bad regex would otherwise fail at once, and be refused as above).
    engine = LLMEngine(EngineConfig(model=str(loaded_model.path)), loaded_model)
    with engine.grammars.compiler.shared.building:  # the compile needs the backend, behind it
        engine.add_request("x", SamplingParams(structured=StructuredOutputsParams(regex="(a")))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.finish_reason for o in outputs] == ["error"]


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not'"),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' of more than one"),
        ({"type": "string", "format": "email", "maxLength": 9}, "format with minLength"),
        ({"type": "array", "items": {"type": "string", "format": "iri"}}, "format 'iri'"),
    ],
)
def test_schema_features_the_grammar_cannot_enforce_are_refused(llm: LLM, schema, message):
    with pytest.raises(ValueError, match="cannot enforce") as error:
        llm.engine.grammars.compiler.compile(StructuredOutputsParams(json=schema))
    assert message in str(error.value)
    # A property that happens to be called "not" is a name, not the keyword.
    named = {"type": "object", "properties": {"not": {"type": "integer"}}}
    llm.engine.grammars.compiler.compile(StructuredOutputsParams(json=named))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"json": {"type": "nope"}}, "not a valid JSON schema"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": {"type": "array", "minItems": -1}}, "minItems"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a"] * 2000}, "the limit is 1024"),
        ({"regex": "a" * 70_000}, "the limit is 65536"),
        ({"max_whitespace": -1, "json_object": True}, "max_whitespace"),
    ],
)
def test_bad_constraints_name_the_field_and_the_limit(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_a_schema_nested_past_the_limit_is_refused_without_recursion():
    schema: dict = {"type": "object"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(ValueError, match=r"nests \d+ levels deep; the limit is 32"):
        StructuredOutputsParams(json=schema)


def test_the_restricted_distribution_equals_the_masked_softmax():
    from etinfer.control.entropy import restricted, softmax_entropy

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=generator) * 4
    allowed = torch.rand(6, 500, generator=generator) < 0.3
    allowed[1] = False
    allowed[1, 7] = True  # one token: certain
    allowed[2] = False
    allowed[2, logits[2].argmin()] = True  # one token the model all but rules out
    allowed[3] = logits[3] < logits[3].quantile(0.05)  # the tail only
    ours = restricted(softmax_entropy(logits), logits, allowed)
    exact = softmax_entropy(logits.masked_fill(~allowed, -torch.inf), masked=True)
    assert torch.allclose(ours.entropy, exact.entropy, atol=1e-4)
    assert torch.equal(ours.top, exact.top)
    assert torch.allclose(ours.probs, exact.probs, atol=1e-6)
    assert torch.allclose(ours.log_normalizer, exact.log_normalizer, atol=1e-4)
    assert ours.entropy[1] < 1e-6


@pytest.mark.slow
def test_every_control_layer_and_ead_keep_outputs_valid(make_llm, llm: LLM):
    """The full system (entropy scheduling, pruning, entropy-stabilised sampling) and Entropy
    Adaptive Decoding's small model: the grammar holds whoever writes the token."""
    from etinfer import ControlConfig
    from etinfer.control.switching import SwitchingConfig

    prompts = [chat_ids(llm, [{"role": "user", "content": p}]) for _, p, _ in SCHEMAS[:6]]
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=256, structured={"json": schema})
        for i, (_, _, schema) in enumerate(SCHEMAS[:6])
    ]
    full = make_llm(control=ControlConfig.full())
    ead = make_llm(
        draft_model="self:22",
        control=ControlConfig(switching=SwitchingConfig(threshold=1.5, hysteresis=0.25)),
    )
    full_outs, ead_outs = full.generate(prompts, params), ead.generate(prompts, params)
    for (name, _, schema), out in zip(SCHEMAS[:6] * 2, full_outs + ead_outs, strict=True):
        assert out.finish_reason == "stop" and valid(out.text, schema), (name, out.text)
    assert any(m != "target" for out in ead_outs for m in out.token_models)  # the small one wrote


def test_jump_forward_verifies_forced_text_in_fewer_steps_with_the_same_output(make_llm, llm):
    ids = chat_ids(llm)
    params = [greedy(), greedy(SCHEMAS[8][2]), greedy(SCHEMAS[12][2])]
    steps: dict[bool, list] = {False: [], True: []}
    outputs = {}
    for jump, counted in steps.items():
        engine = make_llm(jump_forward=jump)
        with engine.engine.observing(counted.append):
            outputs[jump] = [engine.generate(ids, p)[0] for p in params]
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    entropies = {jump: [h for o in outs for h in o.entropies] for jump, outs in outputs.items()}
    assert entropies[True] == pytest.approx(entropies[False], abs=1e-4)
    assert len(steps[True]) < 0.9 * len(steps[False]), {k: len(v) for k, v in steps.items()}


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("2020-07-12T15:50:22Z", True),
        ("2020-07-12t15:50:22.123456789+01:00", True),  # either case (RFC 3339, 5.6)
        ("2016-12-31T23:59:60z", True),  # a leap second
        ("2024-02-29T10:00:00-05:30", True),
        ("2020-07-12T15:50:22.1234567890Z", False),  # the bound
        ("2021-04-31T00:00:00Z", False),  # April has 30 days
        ("2021-02-30T00:00:00Z", False),
        ("2020-07-12T24:00:00Z", False),
        ("2020-07-12T15:50:22", False),  # no offset
    ],
)
def test_the_bounded_date_time_takes_rfc_3339s_values(value, valid):
    pattern = bounded_fractions({"format": "date-time"})["pattern"]
    assert bool(re.search(pattern, value)) == valid


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_a_date_times_fraction_of_a_second_stops_at_nine_digits(loaded_model, backend):
    """RFC 3339 bounds no fraction; the grammar does (a sampled one ran to max_tokens): a forced
    tenth digit is a dead end, nine digits close the object."""
    config = EngineConfig(model=str(loaded_model.path), structured_backend=backend)
    engine = LLMEngine(config, loaded_model)
    schema = {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}}
    finished = {}
    for digits in (9, 10):
        text = json.dumps({"at": f"2020-07-12T15:50:22.{'1' * digits}Z"})
        forced = engine.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(max_tokens=len(forced) + 1, structured={"json": schema})
        engine.add_request("Time:", params, forced_token_ids=forced)
        while engine.has_unfinished_requests():
            finished.update((digits, o.finish_reason) for o in engine.step() if o.finished)
    assert finished == {9: "stop", 10: "grammar_dead_end"}


@pytest.fixture(scope="module")
def guidance_llm(make_llm) -> LLM:
    return make_llm(structured_backend="llguidance", max_num_seqs=16)


@pytest.mark.slow
def test_the_llguidance_backend_holds_every_schema_too(guidance_llm: LLM):
    # Greedy: sampled at 0.7, a number's fraction digits can run past max_tokens (neither
    # backend bounds them), and which seed does so moves with the host's rounding (the "point"
    # schema did held to AVX2). The sampled schemas are xgrammar's test above.
    prompts = [chat_ids(guidance_llm, [{"role": "user", "content": p}]) for _, p, _ in SCHEMAS]
    params = [
        SamplingParams(temperature=0.0, max_tokens=256, structured={"json": schema})
        for _, _, schema in SCHEMAS
    ]
    for (name, _, schema), out in zip(SCHEMAS, guidance_llm.generate(prompts, params), strict=True):
        assert out.finish_reason == "stop" and valid(out.text, schema), (name, out.text)


def test_the_llguidance_backend_takes_every_kind_and_refuses_what_it_cannot(guidance_llm: LLM):
    ids = chat_ids(guidance_llm)
    kinds = {
        "choice": (["yes", "no"], lambda t: t in ("yes", "no")),
        "regex": (r"[0-9]{3}-[0-9]{4}", lambda t: len(t) == 8 and t[3] == "-"),
        "grammar": (
            'root ::= "a" ("b" | "c")*',
            lambda t: t[0] == "a" and set(t[1:]) <= {"b", "c"},
        ),
        "json_object": (True, lambda t: isinstance(json.loads(t), dict)),
    }
    ok = chat_ids(guidance_llm, [{"role": "user", "content": JSON_OBJECT_PROMPT}])
    for kind, (spec, check) in kinds.items():
        params = SamplingParams(temperature=0.0, max_tokens=64, structured={kind: spec})
        out = guidance_llm.generate(ok if kind == "json_object" else ids, params)[0]
        assert check(out.text), (kind, out.text)
    compiler = guidance_llm.engine.grammars.compiler
    with pytest.raises(ValueError, match=r"structured\.json cannot be compiled"):
        compiler.compile(StructuredOutputsParams(json={"type": "string", "format": "iri"}))
    with pytest.raises(ValueError, match=r"structured\.regex cannot be compiled"):
        compiler.compile(StructuredOutputsParams(regex="(a"))


def test_shared_grammars_live_as_long_as_their_tokenizer(loaded_model):
    """What engines share is keyed by their tokenizer, weakly: once no engine holds a tokenizer,
    its backend and grammars go with it (a reference back to the key would keep it forever)."""
    tokenizer = copy.copy(loaded_model.tokenizer)
    shared = shared_grammars("xgrammar", tokenizer, loaded_model.config.vocab_size)
    params = StructuredOutputsParams(choice=["yes", "no"])
    grammar = shared.compile(params)
    assert shared.cached(params.key) is grammar
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None
