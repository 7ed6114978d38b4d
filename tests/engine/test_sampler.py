import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from etinfer.control.entropy import entropy
from etinfer.control.temperature import temperature_law
from etinfer.engine.sampling.sampler import Sampler
from etinfer.engine.sampling.sampling_batch import SamplingBatch, apply_filters
from etinfer.sampling_params import SamplingParams

VOCAB = 50


def batch(params, generators=None):
    generators = generators or [None] * len(params)
    states = [temperature_law(p).initial_state(p) for p in params]
    return SamplingBatch.build(params, states, generators, VOCAB, torch.device("cpu"))


def sampler(seed=0):
    return Sampler(torch.Generator().manual_seed(seed))


def logits(rows=3, seed=1):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def direct_entropy(row: torch.Tensor) -> float:
    p = row.double().softmax(-1)
    return -sum(float(x) * math.log(float(x)) for x in p if x > 0)


def test_entropy_matches_direct_computation():
    z = logits()
    out = sampler()(z, batch([SamplingParams(temperature=0)] * 3))
    for i in range(3):
        assert out.entropies[i] == pytest.approx(direct_entropy(z[i]), abs=1e-5)
    assert out.tempered_entropies == [0.0, 0.0, 0.0]
    assert out.temperatures == [0.0, 0.0, 0.0]
    assert out.token_ids == z.argmax(-1).tolist()


def test_tempered_entropy_is_that_of_the_sampled_distribution():
    z = logits()
    params = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=3),
    ]
    out = sampler()(z, batch(params))
    assert out.tempered_entropies[0] == pytest.approx(direct_entropy(z[0] / 0.5), abs=1e-5)
    assert out.tempered_entropies[1] == pytest.approx(direct_entropy(z[1] / 2.0), abs=1e-5)
    top3 = z[2].topk(3).values
    assert out.tempered_entropies[2] == pytest.approx(direct_entropy(top3), abs=1e-5)
    assert out.temperatures == pytest.approx([0.5, 2.0, 1.0])


def test_entropy_ignores_masked_entries():
    logp = torch.tensor([[0.0, -torch.inf, -torch.inf]])
    assert entropy(logp).item() == 0.0


def kept(z, params):
    return apply_filters(z, batch(params)) > -torch.inf


def test_top_k_keeps_exactly_k_tokens_per_row():
    z = logits()
    mask = kept(z, [SamplingParams(top_k=1), SamplingParams(top_k=7), SamplingParams()])
    assert mask.sum(-1).tolist() == [1, 7, VOCAB]
    assert mask[1, z[1].topk(7).indices].all()


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    z = logits(rows=1)
    mask = kept(z, [SamplingParams(top_p=0.6)])[0]
    probs = z[0].softmax(-1)
    order = probs.argsort(descending=True)
    n = int(mask.sum())
    assert set(order[:n].tolist()) == set(mask.nonzero().flatten().tolist())
    assert probs[order[:n]].sum() >= 0.6
    assert probs[order[: n - 1]].sum() < 0.6


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    z = logits(rows=1)
    mask = kept(z, [SamplingParams(min_p=0.2)])[0]
    probs = z[0].softmax(-1)
    assert torch.equal(mask, probs >= 0.2 * probs.max())


def test_filters_compose_in_order_top_k_then_top_p():
    z = logits(rows=1)
    mask = kept(z, [SamplingParams(top_k=5, top_p=0.999999)])[0]
    assert int(mask.sum()) <= 5


def test_sampled_tokens_come_only_from_the_kept_set():
    z = logits(rows=1).expand(400, VOCAB).contiguous()
    out = sampler()(z, batch([SamplingParams(top_k=3)] * 400))
    assert set(out.token_ids) <= set(z[0].topk(3).indices.tolist())
    assert len(set(out.token_ids)) == 3


def test_sampling_follows_the_tempered_distribution():
    z = logits(rows=1)
    n = 20000
    out = sampler()(z.expand(n, VOCAB).contiguous(), batch([SamplingParams(temperature=1.0)] * n))
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB).double() / n
    assert torch.allclose(counts, z[0].double().softmax(-1), atol=0.015)


def test_seed_reproduces_tokens_regardless_of_the_batch():
    z = logits(rows=4)
    params = SamplingParams(temperature=1.0, seed=1234)

    def tokens(rows, sampler_seed):
        generators = [torch.Generator().manual_seed(1234) for _ in rows]
        return sampler(sampler_seed)(z[rows], batch([params] * len(rows), generators)).token_ids

    alone = tokens([2], sampler_seed=0)
    in_batch = tokens([0, 1, 2, 3], sampler_seed=99)
    assert alone[0] == in_batch[2]
    unseeded = [sampler(s)(z, batch([SamplingParams()] * 4)).token_ids for s in range(5)]
    assert len({tuple(t) for t in unseeded}) > 1  # the engine's own generator does vary


def test_logprobs_hold_the_sampled_token_and_the_top_n():
    z = logits(rows=2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    out = sampler()(z, batch(params))
    rows = out.logprobs.to_host(out.token_ids, [3, None], str)
    assert rows[1] is None
    entry = rows[0]
    logp = z[0].log_softmax(-1)
    top = logp.topk(3)
    assert list(entry) == top.indices.tolist()
    assert [e.rank for e in entry.values()] == [1, 2, 3]
    assert [e.logprob for e in entry.values()] == pytest.approx(top.values.tolist())


def test_logprobs_add_a_sampled_token_outside_the_top_n_with_its_rank():
    z = torch.zeros(1, VOCAB)
    z[0, :3] = torch.tensor([5.0, 4.0, 3.0])
    out = sampler()(z, batch([SamplingParams(temperature=0, logprobs=0)]))
    (entry,) = out.logprobs.to_host(out.token_ids, [0], str)
    assert list(entry) == [0] and entry[0].rank == 1
    out = sampler()(
        z, batch([SamplingParams(top_k=3, logprobs=1, seed=3)], [torch.Generator().manual_seed(3)])
    )
    (entry,) = out.logprobs.to_host(out.token_ids, [1], str)
    token = out.token_ids[0]
    assert entry[token].rank == token + 1


def reference_removed(logits, top_k, top_p):
    """Top-k then top-p on a full sort, the plain way (as transformers orders them), in float64;
    also which tokens sit on the top-p boundary (mass before them within rounding of top_p)."""
    order = logits.argsort(descending=True)
    sorted_logits = logits[order].double()
    removed = torch.arange(logits.numel()) >= top_k
    probs = sorted_logits.masked_fill(removed, -torch.inf).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    boundary = (mass_before - top_p).abs() < 1e-5
    if top_p < 1:
        removed |= mass_before >= top_p
    unsort = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel()))
    return removed[unsort], boundary[unsort]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(300, 3000),
    st.lists(
        st.tuples(st.integers(0, 400), st.sampled_from([1.0, 0.999, 0.95, 0.5, 0.05])),
        min_size=6,
        max_size=6,
    ),
    st.floats(0.05, 4.0),
    st.integers(0, 2**31),
)
def test_filters_on_candidates_equal_a_full_sort(rows, vocab, settings_, scale, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings_[:rows]]
    filtered = apply_filters(
        logits,
        SamplingBatch.build(params, [None] * rows, [None] * rows, vocab, torch.device("cpu")),
    )
    for i, p in enumerate(params):
        expected, boundary = reference_removed(logits[i], p.top_k or vocab, p.top_p)
        differs = (filtered[i] == -torch.inf) != expected
        assert not (differs & ~boundary).any(), (p.top_k, p.top_p)


@pytest.mark.parametrize(
    "settings_",
    [
        {"edt_theta": 1.0},
        {"mirostat_tau": 5.0},
        {"min_p": 0.1},
        {"top_p": 0.5},
        {"entropy_target": 2.0},
        {"entropy_target": 2.0, "entropy_control": "lagged"},
        {"entropy_target": 2.0, "entropy_control": "exact"},
    ],
)
def test_a_near_certain_step_stays_finite_under_every_sampler(settings_):
    z = torch.zeros(1, VOCAB)
    z[0, 3] = 60.0
    params = SamplingParams(**settings_)
    out = sampler()(
        z,
        SamplingBatch.build(
            [params],
            [temperature_law(params).initial_state(params)],
            [None],
            VOCAB,
            torch.device("cpu"),
        ),
    )
    assert out.token_ids == [3]
    assert all(math.isfinite(x) for x in out.tempered_entropies + out.temperatures + out.entropies)
    assert params.temperature_min <= out.temperatures[0] <= params.temperature_max
