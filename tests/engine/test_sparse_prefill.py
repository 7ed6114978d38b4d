"""Sparse prefill (EntropyInfer): the budget law, the attention it computes, and the real model
under it."""

import math

import pytest
import torch

from etinfer import ControlConfig, SamplingParams
from etinfer.bench.common.fidelity import (
    corpus_tokens,
    passkey_accuracy,
    passkey_answers,
    passkey_cases,
    passkey_found,
)
from etinfer.config import EngineConfig
from etinfer.control.sparse_prefill import (
    HeadBudgets,
    SparsePrefillConfig,
    SparsePrefillSelector,
    segment_budgets,
)
from etinfer.model.attention.metadata import PrefillChunk
from etinfer.model.attention.options import AttentionOptions
from etinfer.model.attention.registry import create_backend
from etinfer.model.attention.sparse_prefill import SparsePrefill
from etinfer.model.block_layout import PrefillPiece
from etinfer.model.gpu.paged_prefill import SIXTEEN_BIT
from tests.model.test_paged_attention import (
    BLOCK,
    CACHE_DTYPES,
    DIM,
    HEADS,
    KV_HEADS,
    scattered_cache,
)

B0 = float(SparsePrefillConfig().base_budget)


DEFAULTS = SparsePrefillConfig()


def law(entropies, config=DEFAULTS):
    """Budgets of one KV head over consecutive segments."""
    budgets, state = segment_budgets(
        torch.tensor(entropies)[:, None], HeadBudgets.initial(1, config), config
    )
    return budgets[:, 0].tolist(), state


def test_a_head_below_the_threshold_in_every_segment_keeps_the_base_budget():
    budgets, state = law([1e-7, 0.0, 5e-6, 1e-8])
    assert budgets == [B0] * 4 and bool(state.rigid[0])


def test_a_dynamic_budget_follows_the_relative_change_of_entropy():
    # r = 0.5 (above delta 0.4): +alpha * B0 * 0.1; then r = 1.5 clamps to 1.4: +0.5 * B0;
    # a fall clamps r to 0: -0.2 * B0, floored at B0.
    budgets, state = law([1.0, 1.5, 3.75, 1.0, 1.0])
    expected = [B0, B0 + 0.05 * B0, B0 + 0.55 * B0, B0 + 0.35 * B0, B0 + 0.15 * B0]
    assert budgets == pytest.approx(expected)
    assert not bool(state.rigid[0])


def test_budgets_stay_within_base_and_its_multiple():
    budgets, _ = law([0.1 * 2**i for i in range(12)])
    assert max(budgets) == pytest.approx(3 * B0) and min(budgets) >= B0


def test_a_head_that_was_once_dynamic_stays_dynamic():
    budgets, state = law([1e-7, 2.0, 1e-7, 1e-7])
    assert not bool(state.rigid[0]) and budgets[0] == B0


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("base_budget", 200, "[272, inf]"),  # under sink 16 + window 256
        ("segment_size", 0, "[1, inf]"),
        ("max_budget_factor", 0.5, "[1, inf]"),
        ("entropy_threshold", -1.0, "[0, inf]"),
    ],
)
def test_invalid_settings_name_the_field_and_the_limit(field, value, limit):
    with pytest.raises(
        ValueError, match=rf"{field} must be in \{limit[0]}{limit[1:-1]}\{limit[-1]}"
    ):
        SparsePrefillConfig(**{field: value})


def test_segments_must_be_whole_blocks():
    config = ControlConfig(sparse_prefill=SparsePrefillConfig(segment_size=200))
    with pytest.raises(
        ValueError, match=r"sparse_prefill\.segment_size must be a multiple of the block size 16"
    ):
        EngineConfig(control=config)


@pytest.mark.parametrize("layer", ["sparse_prefill", "pruning"])
def test_batch_invariant_refuses_layers_that_choose_blocks(layer):
    with pytest.raises(ValueError, match=rf"batch_invariant and control\.{layer}"):
        EngineConfig(control=ControlConfig(**{layer: True}), batch_invariant=True)


def small_selector() -> SparsePrefillSelector:
    """64-token segments over 16-token blocks, one layer, one KV head."""
    config = SparsePrefillConfig(
        segment_size=64, window=32, sink=16, base_budget=64, min_context=128
    )
    return SparsePrefillSelector(
        config,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        block_size=16,
        max_model_len=512,
    )


def test_a_chunk_is_cut_at_segment_boundaries():
    selector = small_selector()
    pieces = selector._pieces(position=100, rows=120)
    assert [(p.start, p.rows.start, p.rows.stop) for p in pieces] == [
        (100, 0, 28),
        (128, 28, 92),
        (192, 92, 120),
    ]


def test_a_segment_split_across_chunks_moves_the_law_once():
    selector = small_selector()
    profile = selector.begin(None, 0, 100, num_tokens=400)
    # The segment at 64 began in the chunk before: its rest keeps that segment's budget.
    pieces = selector._pieces(position=100, rows=60)  # [100, 128), [128, 160)
    budgets = selector._advance(profile, 0, pieces, torch.tensor([[1.0], [2.0]]))
    assert budgets[0] == [64.0] and profile.states[0].entropy.tolist() == [2.0]
    assert profile.entropy[:, 0, 0].isnan().tolist() == [i != 2 for i in range(8)]
    # A chunk that does not start where the last one ended (a recompute) starts afresh.
    assert selector.begin(profile, 100, 160, 400) is profile
    assert selector.begin(profile, 160, 200, 400) is profile
    assert selector.begin(profile, 0, 100, 400) is not profile


def reference(q, keys, values, query_pos, visible):
    """Explicit attention of queries at ``query_pos`` over keys where ``visible[kv_head]``
    [queries, keys] allows it."""
    group = HEADS // KV_HEADS
    scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(group, 1)) / DIM**0.5
    scores = scores.masked_fill(~visible.repeat_interleave(group, 0), -torch.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.repeat_interleave(group, 1))
    return out


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_sparse_prefill_attention_reads_the_kept_blocks_and_the_local_window(dtype, backend):
    """On the torch path, and through the GPU's prefill kernel (compiled on a GPU, in Triton's
    interpreter without one), which reads the listed positions where the cache holds them: over
    a 16-bit cache on tensor cores, its queries and weights rounded to the cache's type."""
    device = "cpu"
    tolerance = 1e-5
    if backend == "triton":
        pytest.importorskip("triton")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype in SIXTEEN_BIT:
            if dtype == torch.bfloat16 and device == "cpu":
                pytest.skip("Triton's interpreter gets bfloat16 dots wrong")
            tolerance = 4 * torch.finfo(dtype).eps
    length, start = 48, 32  # a chunk of 16 queries after 32 cached positions: 12 blocks of 4
    cache, (table,) = scattered_cache([length], dtype=dtype, device=device)
    slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(length)])
    keys, values = (c.transpose(0, 1).cpu() for c in cache.read(0, slots.to(device)))
    q = torch.randn(length - start, HEADS, DIM)
    options = AttentionOptions(
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, backend=backend
    )
    attention = SparsePrefill(create_backend(options, torch.device(device)), selector=None)
    chunk = PrefillChunk(0, length - start, slots.to(device), None)
    # Two pieces: the first reads blocks {0, 3} (head 0) and {1} (head 1), then positions 24..;
    # the second attends densely.
    kept = [torch.tensor([0, 3], device=device), torch.tensor([1], device=device)]
    pieces = [PrefillPiece(slice(0, 8), 32, kept, 24), PrefillPiece(slice(8, 16), 40)]
    out = attention.pieces(0, q.to(device), cache, chunk, pieces, None).cpu()
    kept = [k.cpu() for k in kept]

    query_pos, key_pos = torch.arange(start, length), torch.arange(length)
    causal = key_pos[None] <= query_pos[:, None]
    visible = causal.repeat(KV_HEADS, 1, 1)
    first = torch.zeros(KV_HEADS, length, dtype=torch.bool)
    for head, blocks in enumerate(kept):
        for b in blocks.tolist():
            first[head, b * BLOCK : (b + 1) * BLOCK] = True
    first[:, 24:] = True
    visible[:, :8] &= first[:, None, :]
    torch.testing.assert_close(
        out, reference(q, keys, values, query_pos, visible), rtol=tolerance, atol=tolerance
    )


@pytest.fixture(scope="module")
def corpus(loaded_model):
    return corpus_tokens(loaded_model.tokenizer)


def test_a_short_prompt_takes_the_dense_path_unchanged(llm, make_llm):
    sparse = make_llm(control=ControlConfig(sparse_prefill=True))
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = "Write a short story about a lighthouse keeper."
    dense_out, sparse_out = llm.generate([prompt], params)[0], sparse.generate([prompt], params)[0]
    assert sparse_out.token_ids == dense_out.token_ids
    assert sparse_out.attention_profile is None
    assert sparse_out.metrics.prefill_attention_skipped == 0.0


def test_budgets_covering_the_whole_context_equal_dense(make_llm, corpus):
    # Float32 weights: prefill at about 1.4x the 4-bit kernel's rate on an AVX2 host, and the
    # claim is the attention's, whatever the weights.
    whole = SparsePrefillConfig(base_budget=8192, min_context=256)
    sparse = make_llm(quantization="none", control=ControlConfig(sparse_prefill=whole))
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = corpus[:2100]
    out = sparse.generate([prompt], params)[0]
    dense = make_llm(quantization="none")
    assert out.token_ids == dense.generate([prompt], params)[0].token_ids
    assert out.metrics.prefill_attention_skipped == 0.0
    # The estimate still ran: every segment after the first has an entropy per layer and head.
    assert not out.attention_profile.entropy[1:8].isnan().any()


def test_a_long_prompt_skips_attention_work_and_still_finds_the_passkey(make_llm, loaded_model):
    config = SparsePrefillConfig()
    # Float32 weights: prefill at about twice the 4-bit kernels' rate on an AVX2 host.
    sparse = make_llm(
        quantization="none",
        control=ControlConfig(sparse_prefill=config),
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    # The deepest of three needles: the one a 135M model finds dense in this 3K corpus prompt
    # (it misses the other two even dense, and sparse prefill is held to what dense finds).
    cases = passkey_cases(loaded_model.tokenizer, (3072,), "corpus", seed=1)[3:4]
    dense = make_llm(quantization="none", max_num_seqs=4)
    assert passkey_accuracy(dense, cases) == [True]
    answers = passkey_answers(sparse, cases)
    assert passkey_found(sparse.tokenizer, cases, answers) == [True]

    out = answers[0]  # what its prefill read and skipped
    profile = out.attention_profile
    assert 0.2 < out.metrics.prefill_attention_skipped < 1.0
    # Estimated segments have finite entropies; the budgets of sparse segments stay in range.
    segments = -(-len(cases[0].prompt) // config.segment_size)
    assert not profile.entropy[1:segments].isnan().any()
    budgets = profile.budgets[~profile.budgets.isnan()]
    assert budgets.numel() and budgets.min() >= B0 and budgets.max() <= 3 * B0


def test_a_prompt_from_the_prefix_cache_reads_the_cache_sparse_prefill_wrote(make_llm, corpus):
    sparse = make_llm(quantization="none", control=ControlConfig(sparse_prefill=True))  # as above
    params = SamplingParams(temperature=0, max_tokens=8)
    prompt = corpus[5000:7600]
    first = sparse.generate([prompt], params)[0]
    again = sparse.generate([prompt], params)[0]
    assert again.num_cached_tokens > 2000
    assert again.token_ids == first.token_ids
    assert math.isclose(again.metrics.prefill_attention_skipped, 0.0)
