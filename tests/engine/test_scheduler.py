"""Scheduler mechanics on sequences alone: no model runs here."""

from etinfer.control.scheduling import FCFSPolicy
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.scheduler import Scheduler
from etinfer.engine.sequence import Sequence, SequenceStatus
from etinfer.sampling_params import SamplingParams

BLOCK = 4


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=32, prefix_caching=True):
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    return Scheduler(kv, FCFSPolicy(), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


_arrivals = iter(range(10**9))


def make_seq(prompt_len, start_token=100):
    index = next(_arrivals)
    tokens = list(range(start_token, start_token + prompt_len))
    return Sequence(
        f"r{index}",
        index,
        tokens,
        SamplingParams(),
        None,
        prompt=None,
        arrival_time=float(index),
        stream=False,
    )


def run_step(scheduler, batch, new_token=1):
    """What the engine does after the model ran: computed tokens advance, finished prompts get a
    token."""
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += n
        scheduler.kv.publish_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(new_token)


def test_token_budget_splits_long_prompts_into_chunks():
    scheduler = make_scheduler(budget=10)
    seq = make_seq(25)
    scheduler.add(seq)
    chunks = []
    while seq.num_computed_tokens < 25:
        batch = scheduler.schedule(scheduler.control_record())
        chunks.append(batch.num_tokens[0])
        run_step(scheduler, batch)
    assert chunks == [10, 10, 5]
    assert len(seq.block_table) == 7  # 26 tokens (25 + the sampled one) in blocks of 4


def test_decode_rows_come_first_and_budget_is_shared():
    scheduler = make_scheduler(budget=8)
    a = make_seq(3)
    scheduler.add(a)
    run_step(scheduler, scheduler.schedule(scheduler.control_record()))  # a is now decoding
    b = make_seq(20)
    scheduler.add(b)
    batch = scheduler.schedule(scheduler.control_record())
    assert batch.seqs == [a, b]
    assert batch.num_tokens == [1, 7]
    assert batch.num_decode == 1


def test_max_num_seqs_caps_running_sequences():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(2) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule(scheduler.control_record())
    assert batch.seqs == seqs[:2]
    assert scheduler.waiting == [seqs[2]]


def test_preemption_takes_the_newest_and_keeps_its_place():
    # 4 blocks of 4 tokens: two prompts of 8 tokens fill the pool.
    scheduler = make_scheduler(num_blocks=4, budget=64)
    old, new = make_seq(8), make_seq(8, start_token=500)
    scheduler.add(old)
    scheduler.add(new)
    run_step(
        scheduler, scheduler.schedule(scheduler.control_record())
    )  # both hold 2 full blocks, no room left
    late = make_seq(3, start_token=900)
    scheduler.add(late)
    batch = scheduler.schedule(
        scheduler.control_record()
    )  # old's 9th token needs a third block: the newest one goes
    assert batch.preempted == [new]
    assert batch.seqs == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.block_table == [] and new.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    # It is ahead of the request that arrived after it.
    assert scheduler.policy.order(scheduler.waiting) == [new, late]


def test_a_lone_sequence_that_outgrows_the_pool_preempts_itself():
    scheduler = make_scheduler(num_blocks=2, budget=64)
    seq = make_seq(8)
    scheduler.add(seq)
    run_step(scheduler, scheduler.schedule(scheduler.control_record()))
    batch = scheduler.schedule(scheduler.control_record())
    assert batch.seqs == [] and batch.preempted == [seq]


def test_waiting_requests_are_not_admitted_when_blocks_are_short():
    scheduler = make_scheduler(num_blocks=3, budget=64)
    first, second = make_seq(8), make_seq(8, start_token=300)
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduler.schedule(scheduler.control_record())
    assert batch.seqs == [first]  # first holds 3 blocks (9 slots for 8 tokens + 1)
    assert scheduler.waiting == [second]


def run_twice(prompt_len):
    """Compute a prompt, finish it, then schedule the same prompt again."""
    scheduler = make_scheduler()
    first = make_seq(prompt_len)
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule(scheduler.control_record()))
    scheduler.finish(first)
    again = make_seq(prompt_len)
    scheduler.add(again)
    return scheduler, again, scheduler.schedule(scheduler.control_record())


def test_prefix_cache_hit_skips_computed_blocks():
    scheduler, again, batch = run_twice(10)
    assert again.num_cached_tokens == 8  # two full blocks of 4
    assert batch.num_tokens == [2]
    assert scheduler.kv.prefix_cache_hits == 8
    assert scheduler.kv.prefix_cache_queries == 20


def test_fully_cached_prompt_still_computes_its_last_token():
    _, again, batch = run_twice(8)
    assert again.num_cached_tokens == 4  # the last block is recomputed, not shared
    assert batch.num_tokens == [4]


def test_finish_frees_blocks_from_either_queue():
    scheduler = make_scheduler(num_blocks=8, max_num_seqs=1)
    running, waiting = make_seq(5), make_seq(5)
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule(scheduler.control_record())
    scheduler.finish(waiting)
    scheduler.finish(running)
    assert not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_free_blocks == 8
