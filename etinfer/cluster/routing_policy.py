"""Where a request will finish soonest: the routing policy, free of Ray so it is tested alone.

Continuous batching shares a replica's steps among its sequences, which makes it close to a
processor-sharing queue. There a new request of size ``s`` beside requests with ``r_i`` work
left finishes after ``s + sum_i min(r_i, s)`` units of the replica's work: every request shorter
than it finishes first, every longer one shares each of its steps. Sizes are in decode-token
units; a prompt token costs ``prefill_cost`` of one (a prompt is computed many tokens per
step). A replica's backlog is what it last reported (its running and waiting requests' work
left, which the engine knows, the output part as the scheduler plans it: every token
``max_tokens`` allows) plus the requests sent to it since.

Prefix affinity is a discount, not a rule: a replica that has seen the prompt's opening text
will compute fewer prompt tokens, which shrinks ``s`` there, so a cached prefix wins exactly
when the prefill it saves outweighs the backlog it joins. The index is of text (or of token ids,
where a request sends them), as in the cache-aware routers of SGLang and vLLM's router: the
router never tokenizes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

CHARS_PER_TOKEN = 4  # English text under a BPE vocabulary like SmolLM2's, about
PREFIX_CHUNK_TOKENS = 16  # the engine's block size


@dataclass(frozen=True)
class RoutingConfig:
    prefill_cost: float = 0.05  # decode tokens one prompt token costs (chunked prefill, CPU)
    prefix_capacity: int = 8192  # prefix chunks remembered per replica
    default_max_tokens: int = 256  # for requests that leave max_tokens unset
    tie_margin: float = 0.25  # estimates this close to the best tie: live queue length decides


@dataclass
class ReplicaState:
    """The router's picture of one replica."""

    work_left: list[float] = field(default_factory=list)  # as last reported, in decode tokens
    reported_at: float = 0.0  # time.time() of that report, on the replica's clock
    # Requests sent since, by id: (time, size), until a report taken after them counts them.
    sent: dict[str, tuple[float, float]] = field(default_factory=dict)
    prefixes: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def report(self, work_left: list[float], reported_at: float) -> None:
        if reported_at <= self.reported_at:
            return
        self.work_left, self.reported_at = work_left, reported_at
        self.sent = {rid: (t, size) for rid, (t, size) in self.sent.items() if t > reported_at}

    def finish_time(self, size: float) -> float:
        """Units of this replica's work until a new request of ``size`` would finish."""
        backlog = self.work_left + [s for _, s in self.sent.values()]
        return size + sum(min(r, size) for r in backlog)

    def matched_chunks(self, chunks: list[int]) -> int:
        matched = 0
        for key in chunks:
            if key not in self.prefixes:
                break
            matched += 1
        return matched

    def remember(self, chunks: list[int], capacity: int) -> None:
        for key in chunks:
            self.prefixes[key] = None
            self.prefixes.move_to_end(key)
        while len(self.prefixes) > capacity:
            self.prefixes.popitem(last=False)


def prompt_units(body: dict) -> tuple[str | tuple[int, ...], float]:
    """A request's prompt as the router compares it, and the tokens one unit of it is worth:
    the text as the chat template orders it (a quarter of a token a character), or token ids.
    A batch of prompts is routed on its first."""
    if "input" in body:  # the Responses API: its instructions and items, as a chat's messages
        items = body["input"]
        if isinstance(items, str):
            items = [{"role": "user", "content": items}]
        system = [{"role": "system", "content": body.get("instructions") or ""}]
        body = {"messages": system + [_as_message(item) for item in items]}
    if "messages" in body:
        parts = []
        for message in body["messages"]:
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts: their text, in order
                content = "".join(part.get("text", "") for part in content)
            parts.append(f"{message.get('role', '')}\n{content}\n")
        return "".join(parts), 1 / CHARS_PER_TOKEN
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, 1 / CHARS_PER_TOKEN
    return tuple(prompt), 1.0


def _as_message(item: dict) -> dict:
    """A Responses input item's role and text (a call's arguments, a result's output)."""
    text = item.get("content", item.get("output", item.get("arguments", "")))
    return {"role": item.get("role", item.get("type", "")), "content": text}


def prefix_chunks(prompt: str | tuple[int, ...], tokens_per_unit: float) -> list[int]:
    """Chained hashes of the prompt's whole chunks of about 16 tokens: equal keys mean equal
    openings, as the engine's block hashes do for tokens."""
    size = round(PREFIX_CHUNK_TOKENS / tokens_per_unit)
    keys, key = [], 0
    for start in range(0, len(prompt) - size + 1, size):
        key = hash((key, prompt[start : start + size]))
        keys.append(key)
    return keys


@dataclass(frozen=True)
class RequestShape:
    """What the router reads of a request: its prompt's length and opening, its output bound."""

    prompt_tokens: float
    chunks: list[int]
    chunk_tokens: float
    max_tokens: int

    @classmethod
    def of(cls, body: dict, default_max_tokens: int) -> RequestShape:
        prompt, tokens_per_unit = prompt_units(body)
        bound = body.get("max_completion_tokens") or body.get("max_tokens")
        chunks = prefix_chunks(prompt, tokens_per_unit)
        size = round(PREFIX_CHUNK_TOKENS / tokens_per_unit) * tokens_per_unit
        return cls(len(prompt) * tokens_per_unit, chunks, size, bound or default_max_tokens)


@dataclass(frozen=True)
class Decision:
    replica: str
    reason: str  # "backlog": the least work ahead; "prefix": a cached opening outweighed it
    finish_times: dict[str, float]
    # The replicas whose estimate is within ``tie_margin`` of the best, best first: among them
    # Serve takes the one with the fewest requests in flight, which it counts live.
    ties: list[str]


class RoutingPolicy:
    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self.replicas: dict[str, ReplicaState] = {}

    def update(self, replica: str, stats: dict | None) -> None:
        """Take a replica's routing stats (``EngineReplica.record_routing_stats``)."""
        state = self.replicas.setdefault(replica, ReplicaState())
        if stats:
            state.report([self.work(p, d) for p, d in stats["work_left"]], stats["time"])

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def choose(self, candidates: list[str], body: dict, request_id: str) -> Decision:
        """The candidate where the request would finish first. It counts there from now on:
        Serve may ask for many requests before it has sent any (``routed`` corrects it)."""
        self.withdraw(request_id)  # asked again: its earlier choice was not taken
        shape = RequestShape.of(body, self.config.default_max_tokens)
        cold = self.work(shape.prompt_tokens, shape.max_tokens)
        times, plain, sizes = {}, {}, {}
        for name in candidates:
            state = self.replicas.setdefault(name, ReplicaState())
            sizes[name] = self.size(state, shape)
            times[name] = state.finish_time(sizes[name])
            plain[name] = state.finish_time(cold)
        best = min(candidates, key=lambda name: (times[name], plain[name]))
        # "prefix" where the cached opening decided it: without it another was as good.
        others = [plain[name] for name in candidates if name != best]
        prefix = times[best] < plain[best] and others and min(others) <= plain[best]
        reason = "prefix" if prefix else "backlog"
        self.replicas[best].sent[request_id] = (time.time(), sizes[best])
        margin = times[best] * (1 + self.config.tie_margin)
        close = (name for name in candidates if name != best and times[name] <= margin)
        ties = [best, *sorted(close, key=times.get)]
        return Decision(best, reason, times, ties)

    def routed(self, request_id: str, replica: str, body: dict) -> None:
        """Serve sent the request to ``replica``: it counts there until a report includes
        it, and the replica now holds its prompt's opening."""
        state = self.replicas.setdefault(replica, ReplicaState())
        shape = RequestShape.of(body, self.config.default_max_tokens)
        if request_id not in state.sent:  # another than the chosen one (that one was full)
            self.withdraw(request_id)
            state.sent[request_id] = (time.time(), self.size(state, shape))
        state.remember(shape.chunks, self.config.prefix_capacity)

    def withdraw(self, request_id: str) -> None:
        for state in self.replicas.values():
            state.sent.pop(request_id, None)

    def size(self, state: ReplicaState, shape: RequestShape) -> float:
        cached = state.matched_chunks(shape.chunks) * shape.chunk_tokens
        return self.work(shape.prompt_tokens - cached, shape.max_tokens)

    def work(self, prefill_tokens: float, decode_tokens: float) -> float:
        """Decode-token units of work."""
        return prefill_tokens * self.config.prefill_cost + decode_tokens
