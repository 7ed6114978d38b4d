"""The sketch scorer: its maps, the key copy the cache keeps, and what it ranks."""

from __future__ import annotations

import pytest
import torch

from etinfer import ControlConfig, PruningConfig, SamplingParams
from etinfer.bench.common.fidelity import corpus_tokens, teacher_forced
from etinfer.control.key_sketch import (
    SketchMaps,
    fit_maps,
    gram,
    sketch_block_scores,
    sketch_token_pattern,
)
from etinfer.model.block_layout import DecodeBlocks
from etinfer.model.key_copy import code_rows, from_rows
from etinfer.model.kv_cache import KVCache, quantize_rows

EAGER = dict(min_context=0, min_blocks=4, recent_blocks=1, dense_layers=1)


def correlated(n: int, dim: int, scales: torch.Tensor, seed: int) -> torch.Tensor:
    """[2, n, dim] vectors with per-direction spreads ``scales`` in a random basis."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, dim, generator=generator)).Q
    return (torch.randn(2, n, dim, generator=generator) * scales) @ basis.T


@pytest.mark.parametrize("whitened", [True, False])
def test_maps_of_full_rank_keep_every_score(whitened):
    dim = 16
    queries = correlated(300, dim, torch.linspace(0.2, 3.0, dim), seed=0)
    keys = correlated(400, dim, torch.linspace(3.0, 0.1, dim), seed=1)
    key_map, query_map = fit_maps(gram(queries), gram(keys), rank=dim, whitened=whitened)
    exact = queries @ keys.transpose(1, 2)
    mapped = (queries @ query_map) @ (keys @ key_map).transpose(1, 2)
    assert torch.allclose(mapped, exact, atol=1e-3 * exact.abs().max())


def test_query_aware_maps_keep_the_directions_queries_weigh():
    """Keys spread most where queries look least: the keys' own directions keep the wrong
    ones, the query-aware maps the ones that move the scores."""
    dim, rank = 16, 4
    read = torch.full((dim,), 0.01)
    read[rank : 2 * rank] = 3.0  # the queries read four directions...
    widest = torch.ones(dim)
    widest[:rank] = 10.0  # ...and the keys spread most along four others
    queries = correlated(500, dim, read, seed=2)
    keys = correlated(500, dim, widest, seed=2)
    exact = queries @ keys.transpose(1, 2)
    errors = {}
    for whitened in (True, False):
        key_map, query_map = fit_maps(gram(queries), gram(keys), rank, whitened=whitened)
        mapped = (queries @ query_map) @ (keys @ key_map).transpose(1, 2)
        errors[whitened] = (mapped - exact).square().mean() / exact.square().mean()
    assert errors[True] < 0.05 and errors[False] > 0.5


def test_block_scores_are_each_blocks_share_of_the_mass():
    """With a full-rank identity copy of 8-bit keys, a block's score is the log of the mass
    exact attention gives it (to the copy's rounding), and nothing past the context counts."""
    kv_heads, group, dim, size, blocks = 2, 3, 16, 4, 6
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(kv_heads, blocks * size, dim, generator=generator)
    codes, scales = quantize_rows(keys)
    codes = from_rows(codes, size)
    query = torch.randn(2, kv_heads * group, dim, generator=generator)
    tables = torch.tensor([[5, 2, 0, 1], [3, 4, 1, 0]])
    lens = torch.tensor([14, 6])
    layout = DecodeBlocks(tables, lens, size)
    identity = torch.eye(dim).expand(kv_heads, dim, dim)
    scores = sketch_block_scores(query, identity, codes, scales, layout, dim**-0.5)
    assert scores.shape == (2, kv_heads, group, 4)
    for seq in range(2):
        length = int(lens[seq])
        slots = (tables[seq, :, None] * size + torch.arange(size)).flatten()[:length]
        q = query[seq].view(kv_heads, group, dim)
        mass = (q @ keys[:, slots].transpose(1, 2) * dim**-0.5).softmax(-1)
        padded = torch.zeros(kv_heads, group, 4 * size)
        padded[..., :length] = mass
        expected = padded.view(kv_heads, group, 4, size).sum(-1).log()
        assert torch.allclose(scores[seq].exp(), expected.exp(), atol=2e-3)
    assert scores[1, :, :, 2:].isneginf().all()  # past a 6-token context


def test_single_tokens_are_the_forced_ones_and_the_best_others(monkeypatch):
    """Each row reads its sink and recent tokens and its KV head's best others by the most mass
    any query head of the group gives them, in order, as many as its budget; what the
    telemetry counts is the share of each block read."""
    kv_heads, group, rank, size = 2, 3, 8, 4
    generator = torch.Generator().manual_seed(5)
    codes = torch.randint(-127, 128, (kv_heads, 10 * size, rank), generator=generator)
    codes = codes.to(torch.int8)
    scales = torch.rand(kv_heads, 10 * size, generator=generator) * 0.1
    copy = from_rows(codes, size)
    query = torch.randn(2, kv_heads * group, rank, generator=generator)
    tables = torch.tensor([[7, 2, 9, 0, 5], [3, 1, 0, 0, 0]])
    lens, budgets = torch.tensor([19, 6]), torch.tensor([9, 9])
    layout = DecodeBlocks(tables, lens, size)
    identity = torch.eye(rank).expand(kv_heads, rank, rank)
    pattern, kept = sketch_token_pattern(query, identity, copy, scales, layout, 0.5, budgets, 2, 3)
    counts = pattern.crow.diff().view(2, kv_heads, group)
    assert counts[0].eq(9).all() and counts[1].eq(6).all()  # a context shorter than the budget
    for seq in range(2):
        length = int(lens[seq])
        slots = (tables[seq, :, None] * size + torch.arange(size)).flatten()[:length]
        for head in range(kv_heads):
            q = query[seq, head * group : (head + 1) * group]
            logits = q @ (codes[head, slots].float() * scales[head, slots, None]).T * 0.5
            score = (logits - logits.logsumexp(-1, keepdim=True)).amax(0)
            forced = [0, 1, *range(length - 3, length)]
            others = [t for t in score.argsort(descending=True).tolist() if t not in forced]
            chosen = sorted(forced + others[: int(counts[seq, head, 0]) - len(forced)])
            for j in range(group):
                row = (seq * kv_heads + head) * group + j
                cols = pattern.cols[pattern.crow[row] : pattern.crow[row + 1]]
                assert cols.tolist() == (head * 10 * size + slots[chosen]).tolist()
            share = torch.zeros(5 * size)
            share[chosen] = 1.0
            in_block = layout.block_tokens[seq].clamp(min=1)
            assert torch.allclose(kept[seq, head], share.view(5, size).sum(-1) / in_block)
    assert not pattern.outside.any()


def test_the_cache_writes_the_copy_of_the_keys_it_stored():
    generator = torch.Generator().manual_seed(4)
    maps = torch.randn(2, 2, 16, 4, generator=generator)
    cache = KVCache(2, 8, 4, 2, 16, torch.device("cpu"), torch.float16, summaries=True,
                    sketch_key_maps=maps)  # fmt: skip
    slots = torch.tensor([3, 9, 17])
    keys = torch.randn(3, 2, 16, generator=generator)
    cache.write(1, slots, None, keys, torch.randn(3, 2, 16, generator=generator))
    cache.update_sketch(slice(1, 2), slots)  # after a step's layers, for all of them at once
    stored = keys.to(torch.float16).float().transpose(0, 1)  # [kv_heads, 3, dim]
    codes, scales = quantize_rows(stored @ maps[1])
    assert torch.equal(code_rows(cache.key_sketch[1], 4)[:, slots], codes)
    assert torch.allclose(cache.sketch_scales[1][:, slots], scales)
    assert not cache.key_sketch[0].any()  # the other layer untouched


def sketch_config(**kwargs) -> PruningConfig:
    return PruningConfig(**EAGER | dict(scorer="sketch") | kwargs)


def test_decode_steps_keep_the_copy_current_on_both_paths(make_llm):
    """Steps the native decoder runs whole (dense below the gate) and steps pruned layer by
    layer both leave every key's copy as its maps make it from the stored key."""
    for min_context in (0, 10**6):
        llm = make_llm(control=ControlConfig(pruning=sketch_config(min_context=min_context)))
        engine = llm.engine
        prompt = corpus_tokens(llm.tokenizer)[:300]
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        request = engine.add_request(None, params, prompt_token_ids=prompt)
        for _ in range(20):
            engine.step()
        seq = engine._requests[request]
        cache = engine.runner.cache
        size = cache.block_size
        positions = torch.arange(seq.num_computed_tokens)
        table = torch.tensor(seq.block_table)
        slots = table[positions // size] * size + positions % size
        for layer in (0, len(cache.keys) - 1):
            keys, _ = cache.read(layer, slots)
            codes, _ = quantize_rows(keys @ cache.sketch_key_maps[layer])
            # Rounding of the projection may move a code by one where it sits on a half.
            kept = code_rows(cache.key_sketch[layer], codes.shape[-1])[:, slots]
            assert (kept.int() - codes.int()).abs().max() <= 1
        engine.abort_request(request)


def test_sketch_pruning_stays_closer_to_dense_than_key_bounds(make_llm):
    """At the same quarter of the blocks, ranking by the copy agrees with dense attention more
    than ranking by key bounds (BENCHMARKS.md: KL 0.0068 against 0.0189 at 6K tokens)."""
    llm = make_llm(max_num_seqs=4, control=ControlConfig(pruning=sketch_config()))
    corpus = corpus_tokens(llm.tokenizer)
    texts = [corpus[i * 7000 : i * 7000 + 1024 + 24] for i in range(2)]
    share = dict(budget_low=0.25, budget_high=0.25)
    stats = {}
    for scorer in ("sketch", "bound"):
        config = sketch_config(scorer=scorer, **share)
        stats[scorer] = teacher_forced(llm, texts, 1024, 24, config)
    assert stats["sketch"].blocks_kept == pytest.approx(stats["bound"].blocks_kept, abs=0.02)
    assert stats["sketch"].kl_mean < stats["bound"].kl_mean
    assert stats["sketch"].top1_agreement >= 0.8  # a broken selection falls far below


def test_maps_round_trip_and_mismatches_are_refused(tmp_path, make_llm):
    llm = make_llm(control=ControlConfig(pruning=sketch_config()))
    path = llm.engine.config.control.pruning_config.sketch_maps
    maps = SketchMaps.load(path)
    assert maps.rank == 24 and maps.key_maps.shape[:2] == (30, 3)
    assert (maps.query_maps.flatten(1).abs().sum(1) > 0).all()  # every layer fitted
    other = tmp_path / "other.pt"
    SketchMaps(maps.key_maps[..., :8], maps.query_maps[..., :8]).save(other)
    with pytest.raises(ValueError, match=r"sketch_maps .* holds maps of shape"):
        make_llm(control=ControlConfig(pruning=sketch_config(sketch_maps=str(other))))
    with pytest.raises(ValueError, match="sketch_rank"):
        PruningConfig(scorer="sketch", sketch_rank=0)
    with pytest.raises(ValueError, match="sketch_rank must be at most the head size 64"):
        make_llm(control=ControlConfig(pruning=sketch_config(sketch_rank=65)))
    with pytest.raises(ValueError, match="head_budgets"):
        PruningConfig(scorer="sketch", head_budgets=True)
