"""The benchmarks' one request driver: the same requests, to an engine in this process or to an
OpenAI-compatible server.

A :class:`Request` arrives ``arrival_s`` seconds after the start of the run; its prompt is token
ids or the text of a user's chat message. Each request's fate is a :class:`RequestRecord`, its
times in seconds from its arrival (vLLM's benchmark's figures: TTFT, end-to-end, queue time;
TPOT excludes the first token).

**In process** (``drive_engine``): each request is added to the ``LLMEngine`` once the run's
clock passes its arrival, and the engine steps while it has work. The run's clock is

- ``wall``: real time. A request is added with its nominal arrival instant, so one that arrives
  while a step runs has waited for it.
- ``cpu``: the CPU time this process spends in engine steps; idle gaps are skipped. With one
  torch thread it is the time the run would take on this machine with nothing else running: on
  a shared machine another job can double wall-clock step times from one run to the next, and
  on this clock that noise mostly goes (what remains comes through shared caches and memory
  bandwidth). The engine stamps arrivals itself, so its own (wall-clock) metrics stay real.

Step times come from the engine's step observer, and latencies are read on the run's clock: an
instant the engine stamped during a step reads as that step's end (first token, finish) or start
(first scheduling).

**Over HTTP** (``drive_server``): each request is sent at its arrival through the official
``openai`` async client, streamed with usage in the last chunk: token ids to /v1/completions,
chat text to /v1/chat/completions; ``SamplingParams`` fields OpenAI has no name for (such as
``ignore_eos``) go as extra body fields. A client measures inter-token latencies too: the gaps
between chunks with text.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from tqdm.auto import tqdm

from etinfer.engine.llm_engine import LLMEngine
from etinfer.engine.observer import StepRecord
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams

CLOCKS = ("cpu", "wall")
# Sent under OpenAI's own names; every other field that differs from its default goes as an
# extra body field, which the server reads into SamplingParams.
OPENAI_PARAMS = ("max_tokens", "temperature")


@dataclass(frozen=True)
class Request:
    arrival_s: float  # seconds after the start of the run
    prompt: list[int] | str  # token ids, or the text of a user's chat message
    params: SamplingParams
    forced: list[int] = field(default_factory=list)  # fed as decode steps first (in process)


@dataclass
class RequestRecord:
    """One request's fate; times in seconds from its arrival."""

    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    queue_time: float | None = None
    error: str | None = None
    itl: list[float] | None = None  # gaps between chunks with text, where a client measures them

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e is not None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class EngineRun:
    outputs: list[RequestOutput | None]  # in request order; None where the engine refused one
    records: list[RequestRecord]  # latencies on the run's clock, in request order
    makespan: float  # start of the run to its last completion, on the run's clock
    wall: float  # the same on the wall clock
    cpu: float  # CPU seconds this process spent in engine steps


class RunClock:
    """The run's clock, advanced by each engine step as its observer, and the steps on it: each
    one's end on the wall clock (for finding the step of an instant the engine stamped), and its
    start and end on the run's clock."""

    def __init__(self, kind: str) -> None:
        if kind not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {kind!r}")
        self.kind = kind
        self.wall_start = time.perf_counter()
        self.cpu = 0.0
        self._now = 0.0
        self.wall_ends: list[float] = []
        self.starts: list[float] = []
        self.ends: list[float] = []

    def __call__(self, step: StepRecord) -> None:
        wall_end = time.perf_counter()  # observers run as the step ends, after its last stamp
        if self.kind == "cpu":
            start, self._now = self._now, self._now + step.cpu_time
        else:
            self._now = wall_end - self.wall_start
            start = self._now - step.wall_time
        self.cpu += step.cpu_time
        self.wall_ends.append(wall_end)
        self.starts.append(start)
        self.ends.append(self._now)

    def now(self) -> float:
        return self._now if self.kind == "cpu" else time.perf_counter() - self.wall_start

    def arrival_time(self, arrival_s: float) -> float | None:
        """The arrival instant the engine is told: none on the cpu clock (it stamps its own)."""
        return None if self.kind == "cpu" else self.wall_start + arrival_s

    def wait_for(self, arrival_s: float) -> None:
        """Idle until ``arrival_s``: the cpu clock jumps there, as nothing spends CPU time."""
        if self.kind == "cpu":
            self._now = arrival_s
        else:
            time.sleep(max(0.0, self.wall_start + arrival_s - time.perf_counter()))

    def _step_of(self, instant: float) -> int:
        return bisect.bisect_left(self.wall_ends, instant)

    def record(self, out: RequestOutput, arrival_s: float) -> RequestRecord:
        m = out.metrics
        return RequestRecord(
            len(out.token_ids),
            self.ends[self._step_of(m.first_token_time)] - arrival_s,
            self.ends[self._step_of(m.finished_time)] - arrival_s,
            self.starts[self._step_of(m.first_scheduled_time)] - arrival_s,
        )


def drive_engine(
    engine: LLMEngine,
    requests: Sequence[Request],
    clock: str = "wall",
    bar: tqdm | None = None,
    concurrency: int | None = None,
) -> EngineRun:
    """Run ``requests`` (in arrival order) on ``engine``; ``bar`` counts those done. A request
    the engine refuses (it could never fit) becomes a failed record. ``concurrency``: a closed
    loop of that many clients instead of the arrival times (vLLM's benchmark at request rate
    inf with that max concurrency): a request arrives as soon as fewer than that many run, and
    its latencies count from then."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, got {concurrency}")
    run = RunClock(clock)
    outputs: list[RequestOutput | None] = [None] * len(requests)
    records = [RequestRecord() for _ in requests]
    arrived = [r.arrival_s for r in requests]  # when each arrived, on the run's clock
    arrivals = deque(enumerate(requests))
    running = 0

    def due() -> bool:
        if concurrency is not None:
            return running < concurrency
        return arrivals[0][1].arrival_s <= run.now()

    with engine.observing(run):
        while arrivals or engine.has_unfinished_requests():
            while arrivals and due():
                i, request = arrivals.popleft()
                if concurrency is not None:
                    arrived[i] = run.now()
                try:
                    engine.add_request(
                        _prompt_ids(engine, request.prompt),
                        request.params,
                        request_id=str(i),
                        arrival_time=run.arrival_time(arrived[i]),
                        forced_token_ids=request.forced or None,
                    )
                    running += 1
                except ValueError as e:  # refused: it could never fit (the pool is too small)
                    records[i].error = str(e)
            if engine.has_unfinished_requests():
                for out in engine.step():
                    i = int(out.request_id)
                    outputs[i], records[i] = out, run.record(out, arrived[i])
                    running -= 1
                    if bar is not None:
                        bar.update()
            elif arrivals:
                run.wait_for(arrivals[0][1].arrival_s)
    return EngineRun(outputs, records, run.now(), time.perf_counter() - run.wall_start, run.cpu)


def _prompt_ids(engine: LLMEngine, prompt: list[int] | str) -> list[int]:
    if isinstance(prompt, str):
        return engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return prompt


def warm_up(engine: LLMEngine) -> None:
    """One short request, so the first measured step does not pay for lazy initialisation."""
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def drive_server(
    base_url: str,
    requests: Sequence[Request],
    *,
    model: str | None = None,
    api_key: str | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` (in arrival order) to the server at ``base_url`` (without ``/v1``);
    ``model`` None asks for the first one it serves. The records, and the seconds from the start
    to the last reply's end."""
    if any(r.forced for r in requests):
        raise ValueError("forced tokens need the in-process driver: the API has no field for them")
    return asyncio.run(_drive_server(base_url, requests, model, api_key))


async def _drive_server(
    base_url: str, requests: Sequence[Request], model: str | None, api_key: str | None
) -> tuple[list[RequestRecord], float]:
    import openai

    async with openai.AsyncOpenAI(
        base_url=base_url.rstrip("/") + "/v1",
        api_key=api_key or "none",
        max_retries=0,
        timeout=3600,
    ) as client:
        model = model or (await client.models.list()).data[0].id
        start = time.perf_counter()
        tasks = []
        for request in requests:
            arrival = start + request.arrival_s
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(_stream(client, model, request, arrival)))
        records = await asyncio.gather(*tasks)
        return list(records), time.perf_counter() - start


async def _stream(client, model: str, request: Request, arrival: float) -> RequestRecord:
    """Stream one request, noting when each chunk with text and the end arrive."""
    record = RequestRecord(itl=[])
    arguments = _arguments(request.params)
    last = None
    chunks = 0
    chat = isinstance(request.prompt, str)
    try:
        if chat:
            messages = [{"role": "user", "content": request.prompt}]
            stream = await client.chat.completions.create(
                model=model, messages=messages, **arguments
            )
        else:
            stream = await client.completions.create(
                model=model, prompt=request.prompt, **arguments
            )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
            choice = chunk.choices[0] if chunk.choices else None
            if not (choice and (choice.delta.content if chat else choice.text)):
                continue
            if last is None:
                record.ttft = now - arrival
            else:
                record.itl.append(now - last)
            last = now
            chunks += 1
        record.e2e = time.perf_counter() - arrival
        record.output_tokens = record.output_tokens or chunks
    except Exception as e:  # a failed request is counted, not fatal to the run
        record.error = f"{type(e).__name__}: {e}"
    return record


def _arguments(params: SamplingParams) -> dict:
    default = SamplingParams()
    extra = {
        f.name: getattr(params, f.name)
        for f in fields(params)
        if f.name not in OPENAI_PARAMS and getattr(params, f.name) != getattr(default, f.name)
    }
    return {
        **{name: getattr(params, name) for name in OPENAI_PARAMS},
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": extra,
    }
