"""The engine's own thread, and the event loop's view of the requests it runs.

``LLMEngine`` is not thread-safe, so exactly one thread touches it. That thread takes the
commands the event loop queued (add, abort), runs a step, and hands the outputs back with
``call_soon_threadsafe``. The event loop never waits on a step: it keeps accepting requests,
answering errors and streaming tokens while the model computes.

Every engine request streams deltas (what each step added), whatever the client asked for, so
per-token latencies can be measured and no step's work grows with a request's length. The event
loop adds each request's deltas up into one output, in place: a slow reader finds all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from etinfer.engine.llm_engine import LLMEngine
from etinfer.memory import release_freed_memory
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams
from etinfer.server.metrics import EngineStats, ServerMetrics

logger = logging.getLogger("etinfer.server")


class QueueFull(Exception):
    """The waiting queue has no room for a request."""


class EngineError(RuntimeError):
    """A request could not be run: the engine failed a step, refused it, or is shutting down."""


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.perf_counter() when the HTTP request arrived
    priority: int = 0  # lower first, as in vLLM
    slo: float | None = None  # seconds from arrival


class RequestGroup:
    """The engine requests behind one HTTP request, one per choice. Lives on the event loop."""

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.outputs: list[RequestOutput | None] = [None] * len(request_ids)
        self.error: EngineError | None = None
        self._fresh: set[int] = set()
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self.outputs)

    async def updates(self) -> AsyncIterator[list[int]]:
        """The indices of the choices whose output changed, each time some did, until every
        choice has finished. Raises ``EngineError`` if the engine could not run them."""
        while not self.finished:
            await self._event.wait()
            self._event.clear()
            if self.error is not None:
                raise self.error
            fresh = sorted(self._fresh)
            self._fresh.clear()
            if fresh:
                yield fresh

    def _update(self, index: int, delta: RequestOutput) -> None:
        whole = self.outputs[index]
        if whole is None:
            self.outputs[index] = RequestOutput.accumulating(delta)
        else:
            whole.merge(delta)
        self._fresh.add(index)
        self._event.set()

    def _fail(self, error: EngineError) -> None:
        self.error = error
        self._event.set()


@dataclass
class _Route:
    group: RequestGroup
    index: int
    prompt_tokens: int
    max_tokens: int
    last_token_time: float | None = None  # when its latest token reached the event loop


_STOP = ("stop", None)


class EngineLoop:
    def __init__(
        self, engine: LLMEngine, metrics: ServerMetrics, *, max_waiting_requests: int
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_waiting_requests = max_waiting_requests
        self.stats = EngineStats()
        self._commands: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}  # event loop only
        self._num_submitted = 0  # event loop only
        self._num_applied = 0  # engine thread only; the event loop reads it through stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the event loop's side --------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.add_observer(self.metrics.observe_step)
        self._thread = threading.Thread(target=self._run, name="etinfer-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.remove_observer(self.metrics.observe_step)
        for route in self._routes.values():
            route.group._fail(EngineError("the server is shutting down"))
        self._routes.clear()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Engine requests submitted and neither finished nor aborted."""
        return len(self._routes)

    @property
    def num_waiting(self) -> int:
        """Requests not yet scheduled: the engine's waiting ones and those still on their way
        to its thread (both counted at the same instant by the stats)."""
        return self.stats.num_waiting + self._num_submitted - self.stats.num_applied

    def work_left(self) -> list[tuple[int, int]]:
        """Each unfinished request's work left, (prompt tokens to compute, output tokens it
        may still generate; the scheduler plans for all of them): what a router weighs to tell
        where a new request would finish first. Requests still on their way to the engine's
        thread count too."""
        work = []
        for route in self._routes.values():
            output = route.group.outputs[route.index]
            generated = len(output.token_ids) if output is not None else 0
            work.append((0 if generated else route.prompt_tokens, route.max_tokens - generated))
        return work

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue the requests of one HTTP request, all or none."""
        if not self.alive:
            raise EngineError("the engine is not running")
        if self.num_waiting + len(requests) > self.max_waiting_requests:
            raise QueueFull(
                f"the server is overloaded: {self.num_waiting} requests are waiting "
                f"(at most {self.max_waiting_requests}); retry later"
            )
        group = RequestGroup([r.request_id for r in requests])
        for index, request in enumerate(requests):
            self._routes[request.request_id] = _Route(
                group, index, len(request.prompt_token_ids), request.params.max_tokens
            )
        self._num_submitted += len(requests)
        self._commands.put(("add", requests))
        return group

    def abort(self, group: RequestGroup) -> None:
        """Stop the group's unfinished requests and free their KV blocks (at the engine thread's
        next turn, before its next step). A no-op for a finished group."""
        ids = [rid for rid in group.request_ids if self._routes.pop(rid, None) is not None]
        if ids:
            self._commands.put(("abort", ids))

    def _deliver(
        self,
        now: float,
        outputs: list[tuple[str, RequestOutput | EngineError]],
        stats: EngineStats,
    ) -> None:
        self.stats = stats
        self.metrics.record_engine(stats, self._num_submitted - stats.num_applied)
        for request_id, item in outputs:
            route = self._routes.get(request_id)
            if route is None:
                continue  # aborted: its client is gone
            if not isinstance(item, EngineError) and item.finish_reason == "error":
                # This request's step (or its grammar) failed; other requests go on.
                item = EngineError(item.error or "the engine failed this request")
            if isinstance(item, EngineError):
                self.abort(route.group)  # its other choices too: the reply has failed
                route.group._fail(item)
                continue
            route.last_token_time = self.metrics.record_output(item, now, route.last_token_time)
            route.group._update(route.index, item)
            if item.finished:
                del self._routes[request_id]

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            # Block only when there is nothing to compute; otherwise take what has arrived.
            commands = [] if engine.has_unfinished_requests() else [self._commands.get()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            outputs: list[tuple[str, RequestOutput | EngineError]] = []
            for kind, payload in commands:
                if kind == "stop":
                    self._abort_all()
                    return
                if kind == "add":
                    outputs += self._add(payload)
                else:
                    for request_id in payload:
                        engine.abort_request(request_id)
            stepped = engine.has_unfinished_requests()
            if stepped:
                try:
                    outputs += [(out.request_id, out) for out in engine.step()]
                except Exception as e:
                    # The engine contains a step's faults itself (engine/step_faults.py); this
                    # is the last resort: fail every request, free their blocks, go on.
                    logger.exception("engine step failed")
                    error = EngineError(f"the engine failed a step: {e}")
                    outputs += [(rid, error) for rid in self._abort_all()]
            self._publish(outputs)
            if stepped and not engine.has_unfinished_requests():
                release_freed_memory()  # run dry: the requests' buffers back to the system

    def _add(self, requests: list[EngineRequest]) -> list[tuple[str, EngineError]]:
        failed = []
        for request in requests:
            self._num_applied += 1
            try:
                self.engine.add_request(
                    request.prompt if request.prompt is not None else request.prompt_token_ids,
                    request.params,
                    request_id=request.request_id,
                    stream=True,
                    delta=True,
                    arrival_time=request.arrival_time,
                    prompt_token_ids=request.prompt_token_ids,
                    priority=request.priority,
                    slo=request.slo,
                )
            except ValueError as e:  # validated before submission; this is a safety net
                failed.append((request.request_id, EngineError(str(e))))
        return failed

    def _abort_all(self) -> list[str]:
        ids = self.engine.request_ids()
        for request_id in ids:
            self.engine.abort_request(request_id)
        return ids

    def _publish(self, outputs: list[tuple[str, RequestOutput | EngineError]]) -> None:
        engine = self.engine
        stats = EngineStats(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            kv_usage=engine.kv.pool.usage,
            prefix_cache_queries=engine.kv.prefix_cache_queries,
            prefix_cache_hits=engine.kv.prefix_cache_hits,
            num_applied=self._num_applied,
            kv_free_blocks=engine.kv.pool.num_free_blocks,
        )
        # A closed event loop raises: nobody is left to read them.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver, time.perf_counter(), outputs, stats)
