"""Prompt log-probabilities (SamplingParams.prompt_logprobs): equal to transformers' on the
same file in float32, the same however the prompt is chunked, never taken from the prefix
cache, scored once through a preemption, and refused past their limit; the head's fused scores
equal those of its written logits."""

import pytest
import torch

from etinfer import SamplingParams
from tests.conftest import PROMPTS

LONG = " ".join(PROMPTS)  # about 70 tokens: several chunks at 16 tokens a step


def prompt_scores(llm, prompt, k=3):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k)
    return llm.generate([prompt], params)[0]


def test_prompt_logprobs_equal_transformers_in_float32(make_llm, hf_reference):
    llm = make_llm(
        quantization="none", dtype="float32", kv_cache_dtype="float32",
        max_num_batched_tokens=16,  # the prompt in chunks: each chunk's last row scores too
    )  # fmt: skip
    out = prompt_scores(llm, LONG)
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids) > 48
    with torch.no_grad():
        expected = hf_reference(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = ids[position]
        assert token in entry and len(entry) in (3, 4)  # the top 3, and the prompt's token
        for candidate, logprob in entry.items():
            assert logprob.logprob == pytest.approx(
                expected[position - 1, candidate].item(), abs=1e-4
            )
        rank = int((expected[position - 1] > expected[position - 1, token]).sum()) + 1
        assert entry[token].rank == rank


def test_the_same_scores_chunked_cached_or_preempted(make_llm):
    whole = prompt_scores(make_llm(), LONG)
    chunked = prompt_scores(make_llm(max_num_batched_tokens=16), LONG)
    assert [e and sorted(e) for e in chunked.prompt_logprobs] == [
        e and sorted(e) for e in whole.prompt_logprobs
    ]
    for a, b in zip(chunked.prompt_logprobs[1:], whole.prompt_logprobs[1:], strict=True):
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=2e-3)
    llm = make_llm()
    llm.generate([LONG], SamplingParams(max_tokens=1))  # its blocks now in the prefix cache
    again = prompt_scores(llm, LONG)
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(whole.prompt_logprobs)
    without = llm.generate([LONG], SamplingParams(max_tokens=1))[0]
    assert without.num_cached_tokens > 0 and without.prompt_logprobs is None


def test_a_preempted_prompt_is_scored_once(make_llm):
    """Eight blocks of 16 tokens hold fewer than two of these requests at full length: some
    are preempted and computed again, their prompts with them."""
    tiny = make_llm(num_kvcache_blocks=8, enable_prefix_caching=False)
    prompts = [PROMPTS[3], PROMPTS[0], PROMPTS[7], PROMPTS[2]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    outs = tiny.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) > 0
    for out in outs:
        alone = prompt_scores(make_llm(), out.prompt, 1)
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert [e and sorted(e) for e in out.prompt_logprobs] == [
            e and sorted(e) for e in alone.prompt_logprobs
        ]


def test_prompt_logprobs_past_the_limit_are_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.parametrize("count", [0, 1, 5, 20])
def test_the_native_scores_equal_torch(count, monkeypatch):
    """Two passes over each row in C against the log-sum-exp, comparison and top-k of torch,
    on rows with ties and a width that is no multiple of the kernel's 16."""
    from etinfer.engine.sampling import prompt_logprobs
    from etinfer.model import native_kernels

    if not native_kernels.available():
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50_001, generator=generator) * 4
    logits[3, :40] = logits[3].max() + 1  # forty tied maxima
    targets = torch.randint(0, 50_001, (37,), generator=generator)
    targets[3] = 7
    native = prompt_logprobs._scored(logits, targets, count)
    monkeypatch.setattr(native_kernels, "library", lambda: None)
    expected = prompt_logprobs._scored(logits.clone(), targets, count)
    torch.testing.assert_close(native.token_logprob, expected.token_logprob, atol=2e-5, rtol=0)
    assert torch.equal(native.token_rank, expected.token_rank)
    torch.testing.assert_close(native.top_logprobs, expected.top_logprobs, atol=2e-5, rtol=0)
    untied = [r for r in range(37) if r != 3]
    assert torch.equal(native.top_ids[untied], expected.top_ids[untied])
    if count:
        assert set(native.top_ids[3].tolist()) <= set(range(40))


def test_the_heads_candidates_are_torchs_largest():
    """The integer-kernel head's candidates for recomputation, found natively in one pass: the
    same values as torch's top-k (ids among ties may differ), on rows of Gemma 3's width and
    a width no multiple of the kernel's 8, with tied logits as bfloat16 outputs give."""
    from etinfer.model import linear, native_kernels

    if not native_kernels.available():
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(1)
    for rows, width in ((1, 262_144), (9, 50_001), (3, 37)):
        logits = (torch.randn(rows, width, generator=generator) * 4).bfloat16().float()
        ids = linear._largest_ids(logits, 32)
        expected = logits.topk(32, dim=-1).values
        assert ids.shape == (rows, 32) and len(set(ids[0].tolist())) == 32
        assert torch.equal(logits.gather(1, ids), expected)


def assert_fused_scores_equal_written(model, rows: int = 70):
    """The output head's scores folded in as its kernel makes them (``score_tokens``) against
    its logits written out, the candidates and the scored token recomputed exactly, and scored
    by ``_scored``; scored tokens both the greedy ones (among the candidates) and random ones
    (outside them), with a row count no multiple of the kernel's four."""
    from etinfer.engine.sampling import prompt_logprobs

    head = model.lm_head
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, model.config.hidden_size, generator=generator)
    with torch.inference_mode():
        logits = head.layer(x).float()
        targets = logits.argmax(1)
        targets[::2] = torch.randint(0, logits.shape[1], (len(targets[::2]),), generator=generator)
        for count in (0, 1, 5, 20):
            fused = model.score_tokens(x, targets, count)
            assert fused is not None, "the head runs fused"
            written = logits.clone()
            top = written.topk(max(head.candidates, count), dim=1).indices
            written.scatter_(1, top, head.exact(x, top))
            written.scatter_(1, targets[:, None], head.exact(x, targets[:, None]))
            expected = prompt_logprobs._scored(written, targets, count)
            logprob, rank, top_ids, top_logprobs = fused
            torch.testing.assert_close(logprob, expected.token_logprob, atol=1e-5, rtol=0)
            assert torch.equal(rank, expected.token_rank)
            assert torch.equal(top_ids, expected.top_ids)
            torch.testing.assert_close(top_logprobs, expected.top_logprobs, atol=1e-5, rtol=0)


def test_the_heads_fused_scores_equal_its_written_logits(llm):
    assert_fused_scores_equal_written(llm.engine.runner.model)


def test_heads_without_a_fused_form_score_their_written_logits(float_llm):
    model = float_llm.engine.runner.model
    assert model.score_tokens(torch.zeros(2, model.config.hidden_size), torch.zeros(2), 1) is None
