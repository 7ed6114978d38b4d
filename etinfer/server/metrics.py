"""Prometheus metrics under the ``etinfer:`` prefix, named and meant as vLLM's ``vllm:`` ones so
existing dashboards read them, plus the entropy signal's own.

Each server has its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from etinfer.engine.observer import StepRecord
from etinfer.outputs import FINISH_REASONS, RequestOutput

# vLLM's buckets, so percentiles computed from either line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Nats; a uniform distribution over SmolLM2's 49,152 tokens has 10.8.
ENTROPY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0,
                   11.0)  # fmt: skip
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class EngineStats:
    """The engine's state after a step, as its thread saw it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # share of KV blocks held by requests (cached free ones excluded)
    prefix_cache_queries: int = 0  # prompt tokens looked up, so far (as is the one below)
    prefix_cache_hits: int = 0  # prompt tokens found
    num_applied: int = 0  # requests the engine thread has taken in so far
    kv_free_blocks: int = 0


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(
                f"etinfer:{name}", doc, labels, registry=self.registry, buckets=buckets
            )
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"etinfer:{name}", doc, labels, registry=self.registry).labels(
                model_name
            )

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"etinfer:{name}", doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token, from arrival.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens.", ITL_BUCKETS
        )
        self.e2e_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last token.", REQUEST_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS
        )
        self.num_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Preemptions of running requests.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        # vLLM's names: acceptance rate = accepted / draft tokens.
        self.spec_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Tokens drafted for speculative verification."
        )
        self.spec_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Drafted tokens the model accepted."
        )
        self.token_entropy = histogram(
            "token_entropy_nats",
            "Entropy of the model's distribution (temperature 1) at each generated token.",
            ENTROPY_BUCKETS,
        )
        self.entropic_time = counter(
            "entropic_time_nats",
            "Entropic time of finished requests: the sum of their irreversible entropy drops.",
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS
        )
        self.step_time = histogram(
            "engine_step_seconds", "Wall time of one engine step.", ITL_BUCKETS
        )
        self.blocks_kept = histogram(
            "blocks_kept_ratio",
            "With pruning on: share of the context's KV blocks each decode step attended to.",
            RATIO_BUCKETS,
        )
        self.prefill_attention_skipped = histogram(
            "prefill_attention_skipped_ratio",
            "With sparse prefill on: share of dense prefill attention each long prompt skipped.",
            RATIO_BUCKETS,
        )
        self._request_success = Counter(
            "etinfer:request_success",
            "Finished requests, by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        # Every finish reason's series from the start, at zero: a labelled counter has no sample
        # until its first increment, and a scraper's rate() needs the zero before it.
        for reason in FINISH_REASONS:
            self._request_success.labels(model_name, reason)
        self._model_name = model_name
        self._last = EngineStats()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_engine(self, stats: EngineStats, num_pending: int) -> None:
        """``num_pending``: requests accepted but not yet taken in by the engine thread."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting + num_pending)
        self.kv_usage.set(stats.kv_usage)
        last = self._last
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self._last = stats

    def observe_step(self, step: StepRecord) -> None:
        """An engine observer (it runs on the engine's thread): what each step computed."""
        self.iteration_tokens.observe(sum(step.num_tokens))
        self.step_time.observe(step.wall_time)
        self.num_preemptions.inc(len(step.preempted))
        self.spec_draft_tokens.inc(step.num_draft_tokens)
        self.spec_accepted_tokens.inc(step.num_accepted_tokens)
        if step.measured is not None:
            self.generation_tokens.inc(len(step.sampled))
            for h in step.measured.entropies:
                if math.isfinite(h):
                    self.token_entropy.observe(h)

    def record_output(
        self, delta: RequestOutput, now: float, last_token_time: float | None
    ) -> float | None:
        """Count one request's delta, which reached the event loop at ``now`` (a step's end,
        ``time.perf_counter()``); ``last_token_time`` is when its previous tokens did (None
        before its first). Returns what the next call takes as ``last_token_time``."""
        new = len(delta.token_ids)
        if new:
            if last_token_time is None:
                self.prompt_tokens.inc(len(delta.prompt_token_ids))
                self.time_to_first_token.observe(delta.metrics.time_to_first_token)
                if delta.metrics.queue_time is not None:
                    self.queue_time.observe(delta.metrics.queue_time)
            else:
                gap = (now - last_token_time) / new
                for _ in range(new):
                    self.inter_token_latency.observe(gap)
            last_token_time = now
        for ratio in delta.blocks_kept or ():
            self.blocks_kept.observe(ratio)
        if delta.finished:
            if delta.metrics.total_time is not None:
                self.e2e_latency.observe(delta.metrics.total_time)
            self.entropic_time.inc(delta.entropic_time)
            if delta.attention_profile is not None:
                self.prefill_attention_skipped.observe(delta.metrics.prefill_attention_skipped)
            self._request_success.labels(self._model_name, delta.finish_reason).inc()
        return last_token_time
