"""The replica routing policy alone (no Ray): where a request would finish soonest."""

from __future__ import annotations

from etinfer.cluster.routing_policy import RequestShape, RoutingConfig, RoutingPolicy

SHORT = {"prompt": "Hello there", "max_tokens": 20}
SYSTEM = "You are a careful assistant who answers in full sentences. " * 40  # ~600 tokens


def chat(question: str, max_tokens: int = 20) -> dict:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
    }


def report(policy: RoutingPolicy, replica: str, work: list[tuple[int, int]], at: float) -> None:
    policy.update(replica, {"time": at, "work_left": [list(w) for w in work]})


def test_requests_chosen_before_any_was_sent_spread_over_idle_replicas():
    policy = RoutingPolicy()
    chosen = [policy.choose(["a", "b"], SHORT, f"r{i}").replica for i in range(8)]
    assert chosen.count("a") == chosen.count("b") == 4


def test_a_long_request_ahead_weighs_less_than_many_short_ones_for_a_short_request():
    # Processor sharing: a new 20-token request beside one 1,000-token request shares 20
    # steps with it; beside three 10-token ones it waits for all 30 of their tokens.
    policy = RoutingPolicy(RoutingConfig(prefill_cost=0.0))
    report(policy, "long", [(0, 1000)], at=1.0)
    report(policy, "many", [(0, 10), (0, 10), (0, 10)], at=1.0)
    decision = policy.choose(["long", "many"], SHORT, "r")
    assert decision.replica == "long"
    assert decision.finish_times == {"long": 40.0, "many": 50.0}


def test_a_report_counts_the_requests_sent_before_it_and_keeps_the_later_ones():
    policy = RoutingPolicy(RoutingConfig(prefill_cost=0.0))
    policy.choose(["a"], SHORT, "r1")
    state = policy.replicas["a"]
    assert list(state.sent) == ["r1"]
    report(policy, "a", [(0, 20)], at=state.sent["r1"][0] + 1)
    assert state.sent == {} and state.work_left == [20.0]
    report(policy, "a", [], at=0.5)  # older than the last: ignored
    assert state.work_left == [20.0]


def test_a_cached_prompt_opening_draws_its_request_until_the_backlog_outweighs_it():
    policy = RoutingPolicy()
    first = policy.choose(["a", "b"], chat("What is 2 + 2?"), "r1")
    policy.routed("r1", first.replica, chat("What is 2 + 2?"))
    other = "b" if first.replica == "a" else "a"
    # Both idle again: the replica that holds the system prompt wins, for its prefill saved.
    report(policy, first.replica, [], at=1e12)
    decision = policy.choose(["a", "b"], chat("And 3 + 3?"), "r2")
    assert decision.replica == first.replica and decision.reason == "prefix"
    # Far more work waiting there than the ~30 prefill units it saves: the other one.
    report(policy, first.replica, [(0, 400)] * 4, at=2e12)
    report(policy, other, [], at=2e12)
    decision = policy.choose(["a", "b"], chat("And 4 + 4?"), "r3")
    assert decision.replica == other and decision.reason == "backlog"


def test_a_request_sent_elsewhere_than_chosen_counts_where_it_went():
    policy = RoutingPolicy()
    assert policy.choose(["a", "b"], SHORT, "r1").replica == "a"
    policy.routed("r1", "b", SHORT)  # "a" refused it (full)
    assert "r1" not in policy.replicas["a"].sent and "r1" in policy.replicas["b"].sent


def test_prompts_of_every_shape_are_read():
    assert RequestShape.of({"prompt": "x" * 64}, 16).prompt_tokens == 16
    ids = RequestShape.of({"prompt": list(range(40)), "max_tokens": 5}, 16)
    assert (ids.prompt_tokens, len(ids.chunks), ids.max_tokens) == (40, 2, 5)
    batch = RequestShape.of({"prompt": ["a" * 128, "b"]}, 16)
    assert batch.prompt_tokens == 32 and batch.max_tokens == 16
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert RequestShape.of(parts, 16).prompt_tokens > 0
    # The Responses API's: its input as a chat's messages, a call's arguments and a result too.
    text = RequestShape.of({"input": "x" * 64}, 16)
    items = RequestShape.of(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "x" * 64},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "y" * 64},
            ],
        },
        16,
    )
    assert 16 < text.prompt_tokens < items.prompt_tokens
