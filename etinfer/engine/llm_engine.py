"""The engine: requests in, one scheduled and computed step at a time, outputs out.

Each step runs the paper's loop (section 3.4): the engine records the entropy its sampler
measured into one control record, asks each control law for its decision, applies them, and
measures again::

    record = scheduler.control_record()       # every live sequence's predictive entropy
    batch = scheduler.schedule(record)          # the policy: which sequences advance
    decisions = self._decide(record, batch)     # budgets, temperature states, the step's shape
    speculator.draft(batch, decisions.shape)    # speculative decoding: drafts to verify
    result = runner.execute(batch, decisions)   # forward (a selector per layer), logits
    emitted = sample_verified(...)              # sample, verify; entropy into the profiles

It knows token ids only; the tokenizer is used at the edges (encoding prompts, detokenizing
outputs, stop strings).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from etinfer.config import EngineConfig
from etinfer.control.block_selection import BlockSelector, PruningConfig
from etinfer.control.calibration import Calibration
from etinfer.control.record import TARGET_MODEL, ControlRecord, StepDecisions
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.layers import EngineLayers, pruning_selector
from etinfer.engine.observer import Observers, StepObserver, StepRecord
from etinfer.engine.request_intake import RequestIntake
from etinfer.engine.request_validator import Prompt, RequestValidator
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.sampling.sampler import SamplerOutput
from etinfer.engine.sampling.step_sampling import sample_verified
from etinfer.engine.scheduler import ScheduledBatch, Scheduler
from etinfer.engine.sequence import Sequence, StopRule
from etinfer.engine.startup import startup_line
from etinfer.engine.step_faults import StepProgress, fault_message, requests_left_unknown
from etinfer.model.attention.pattern import check_batch_invariant_fits
from etinfer.model.kv_cache import kv_bytes_per_token
from etinfer.model.loader import LoadedModel, load_model
from etinfer.outputs import RequestOutput
from etinfer.sampling_params import SamplingParams
from etinfer.structured.compiler import GrammarCompiler
from etinfer.structured.masks import fill_allowed
from etinfer.structured.waiting_room import GrammarWaitingRoom

logger = logging.getLogger("etinfer.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded`` reuses a model already read (its weights are shared, not copied)."""
        loaded = loaded or load_model(config.model)
        self.config = config
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.calibration = None
        if config.calibration is not None:
            vocab, stress = loaded.config.vocab_size, config.stress
            self.calibration = Calibration.for_model(config.calibration, vocab, stress)
        self.max_model_len = config.resolve_max_model_len(loaded.config.max_position_embeddings)
        self.block_size = config.block_size
        if config.batch_invariant:
            check_batch_invariant_fits(
                config.max_num_batched_tokens,
                config.block_size,
                loaded.config.num_heads,
                self.max_model_len,
            )
        self.num_blocks = config.resolve_num_blocks(
            kv_bytes_per_token(loaded.config, config.torch_kv_cache_dtype())
        )
        self.kv = KVCacheManager(self.num_blocks, self.block_size, config.enable_prefix_caching)
        self.validator = RequestValidator(
            self.tokenizer, loaded.config.vocab_size, self.max_model_len, self.kv
        )
        layers = EngineLayers.build(
            config, loaded, self.kv, max_model_len=self.max_model_len, calibration=self.calibration
        )
        self.scheduler = Scheduler(
            self.kv,
            layers.policy,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.pruning, self.selector, self.shaper = layers.pruning, layers.selector, layers.shaper
        self.runner, self.compressor = layers.runner, layers.compressor
        self.switcher, self.speculator = layers.switcher, layers.speculator
        self.jump_forward = layers.jump_forward
        self.models = {TARGET_MODEL: self.runner}  # what a step shape may name
        forms = self.runner.model.weights.forms
        decode_path = self.runner.model.decode_path(self.runner.cache)
        logger.info(startup_line(config, loaded, forms, self.num_blocks, decode_path))
        self.observers = Observers()
        # Structured output: requests wait here while their grammars compile.
        self.grammars = GrammarWaitingRoom(
            GrammarCompiler(
                self.tokenizer, loaded.config.vocab_size, backend=config.structured_backend
            )
        )
        self.intake = RequestIntake(self.tokenizer, self.validator, config)
        self._requests = self.intake.requests  # every request not yet finished, by id
        self._progress = StepProgress()  # the step running, or the last one

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        stream: bool = False,
        delta: bool = False,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        forced_token_ids: list[int] | None = None,
        priority: int = 0,
        slo: float | None = None,
    ) -> str:
        """Queue a request. With ``stream`` every step that extends it yields an output: the
        whole output so far, or with ``delta`` only what the step added (constant work per
        step, where a whole output costs its length); otherwise it yields one when it finishes.
        ``prompt_token_ids``, when given, are the already-validated encoding of ``prompt``
        (which is then kept only for the output). ``forced_token_ids`` are appended as if
        sampled, one per step, before sampling resumes: each runs as a decode step and counts
        towards ``max_tokens``. ``priority`` (lower first, as in vLLM) and ``slo`` (seconds
        from arrival to finish) are read by the entropy scheduling policy; FCFS ignores them."""
        seq = self.intake.new_sequence(
            prompt,
            params,
            request_id=request_id,
            stream=stream,
            delta=delta,
            arrival_time=arrival_time,
            prompt_token_ids=prompt_token_ids,
            forced_token_ids=forced_token_ids,
            priority=priority,
            slo=slo,
        )
        compiling = seq.params.structured is not None and self.grammars.enter(seq)
        self._requests[seq.request_id] = seq
        if not compiling:
            self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its KV blocks at once."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.grammars.remove(request_id)  # if it was still waiting for its grammar
        return self._retire(seq)

    def score(self, prompt: Prompt) -> torch.Tensor:
        """Logits [tokens, vocab] at every position of ``prompt`` in one prefill (teacher
        forcing): row i is the distribution of token i + 1. Runs between steps, on free blocks."""
        _, ids = self.validator.encode_prompt(prompt, max_prompt_tokens=self.max_model_len)
        needed = self.kv.blocks_needed(len(ids))
        if needed > self.kv.pool.num_free_blocks:
            raise ValueError(f"scoring {len(ids)} tokens needs {needed} free KV blocks")
        blocks = self.kv.pool.allocate(needed)
        try:
            return self.runner.score(ids, blocks)
        finally:
            self.kv.pool.free(blocks)

    def set_pruning(
        self, config: PruningConfig | None, selector: BlockSelector | None = None
    ) -> None:
        """Prune decode attention from the next step on with the entropic selector for
        ``config``, or with ``selector`` (built for ``config``: it plans the budgets and picks
        the blocks; benchmarks pass an oracle); None attends densely. The engine must have been
        built with pruning on: its cache keeps the block summaries selectors score, and its
        requests carry pruning's state."""
        if config is not None and self.config.control.pruning_config is None:
            raise ValueError(
                "this engine was built without pruning: build the engine with pruning on "
                "(control=ControlConfig(pruning=...))"
            )
        if config is not None:
            built = self.config.control.pruning_config
            if config.sketched and config.sketch_maps is None:
                config = replace(config, sketch_maps=built.sketch_maps)  # the engine's own maps
            self.runner.set_selector(
                selector or pruning_selector(config, self.model_config, self.max_model_len)
            )
            self.selector = self.runner.attention.selector
        self.pruning = config

    def add_observer(self, observer: StepObserver, *, logits: bool = False) -> None:
        """Call ``observer`` with a ``StepRecord`` after every step; with ``logits`` the record
        carries the step's logits."""
        self.observers.add(observer, logits=logits)

    def remove_observer(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    @contextlib.contextmanager
    def observing(self, observer: StepObserver, *, logits: bool = False) -> Iterator[None]:
        """``observer`` watches the steps run inside the ``with`` block."""
        self.add_observer(observer, logits=logits)
        try:
            yield
        finally:
            self.remove_observer(observer)

    def request_ids(self) -> list[str]:
        """Every request not yet finished (running, waiting, or waiting for its grammar)."""
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or len(self.grammars) > 0

    # -- the loop -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; its outputs. A fault in the step ends only the requests whose state
        it left unknown (``engine/step_faults.py``), each with finish_reason "error"."""
        progress = self._progress = StepProgress()
        try:
            self._step(progress)
        except Exception as error:  # any fault: contained to the requests it touched
            logger.exception("engine step failed in %s", progress.stage)
            progress.outputs += self._fail_step(progress, error)
        return progress.outputs

    def _step(self, progress: StepProgress) -> None:
        started, started_cpu = time.perf_counter(), time.process_time()
        if len(self.grammars):
            progress.outputs += self._admit_compiled()
        progress.stage = "scheduling"
        record = self.scheduler.control_record()
        batch = progress.batch = self.scheduler.schedule(record)
        if not batch.seqs:
            self.grammars.wait(timeout=0.05)  # nothing to run but grammars compiling
            return
        progress.stage = "deciding"
        decisions = self._decide(record, batch)
        progress.stage = "drafting"
        if self.speculator is not None:
            self.speculator.draft(batch, decisions.shape)
        if self.jump_forward is not None:
            self.jump_forward.draft(batch)
        free_blocks = self.kv.pool.num_free_blocks
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        small: set[int] = set()
        progress.stage = "forward"
        if self.switcher is not None:
            result, small = self.switcher.execute(self.runner, batch, decisions)
        else:
            result = self._model(decisions.shape.model).execute(batch, decisions)
        emitted = None
        if result.logits is not None:
            emitted = sample_verified(
                batch, result.logits, decisions.temperature_states, self._sample, self._take
            )
        for scores in result.prompt_scores:
            scores.record(self.tokenizer.token_text)
        progress.stage = "committing"
        for seq, start, n in zip(batch.seqs, starts, batch.num_tokens, strict=True):
            self.kv.commit(seq, start, n)
        progress.stage = "compaction"
        if self.compressor is not None:
            self.compressor.compress_due(batch.seqs, self.runner.cache)
        progress.stage = "recording"
        if self.speculator is not None and emitted is not None:
            self.speculator.record(record.step, batch, emitted)
        if self.switcher is not None:
            self.switcher.update(batch, starts, small)
        if result.attention is not None:
            result.attention.record(batch, starts, emitted)
        progress.stage = "finishing"
        self._finish_sampled(batch, progress.outputs)
        progress.stage = "observing"
        if self.observers:
            self.observers.notify(
                StepRecord.of(
                    record,
                    decisions,
                    batch,
                    starts,
                    result,
                    emitted,
                    free_blocks=free_blocks,
                    since=(started, started_cpu),
                    logits=self.observers.want_logits,
                )
            )

    def _fail_step(self, progress: StepProgress, error: Exception) -> list[RequestOutput]:
        """End the requests the fault left unknown (those the step had already finished get
        their own outputs) and give their blocks back."""
        message = fault_message(progress.stage, error)
        outputs = []
        for seq in requests_left_unknown(progress, self.scheduler.running):
            if seq.finish_reason is None:
                seq.finish_reason, seq.error = "error", message
            outputs.append(self._retire(seq))
        return outputs

    def _retire(self, seq: Sequence, now: float | None = None) -> RequestOutput:
        """Finish ``seq`` (its finish reason set) wherever it waits or runs: its blocks back,
        the engine rid of it; its last output."""
        seq.metrics.finished_time = time.perf_counter() if now is None else now
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)
        return seq.step_output() if seq.stream else seq.output()

    def _decide(self, record: ControlRecord, batch: ScheduledBatch) -> StepDecisions:
        """Each law's decision for the scheduled batch, from the record alone."""
        decoding = batch.seqs[: batch.num_decode]
        budgets = None
        if self.pruning is not None:
            budgets = self.selector.plan_budgets(record, decoding, self.block_size)
        if budgets is not None:
            for seq, budget in zip(decoding, budgets, strict=True):
                seq.pruning.block_budget = budget  # the rate limit's reference next step
        return StepDecisions(
            shape=self.shaper.shape(record, batch.seqs),
            block_budgets=budgets,
            temperature_states=[record[batch.seqs[i]].temperature_state for i in batch.sampled],
        )

    def _model(self, name: str) -> ModelRunner:
        if name not in self.models:
            raise ValueError(
                f"the step shaper chose model {name!r}; this engine has: {', '.join(self.models)}"
            )
        return self.models[name]

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammars finished compiling join the scheduler; those whose grammars
        failed finish (with reason "error")."""
        ready, failed = self.grammars.leave()
        for seq in ready:
            self.scheduler.add(seq)
        return [self._retire(seq) for seq in failed]

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], states: list[float | None]
    ) -> SamplerOutput:
        """The runner's sampler, with each constrained sequence's grammar mask."""
        self._progress.stage = "sampling"
        allowed = fill_allowed([seq.matcher for seq in seqs], logits.shape[-1])
        return self.runner.sample(logits, seqs, states, allowed)

    def _take(self, seqs: list[Sequence], out: SamplerOutput) -> None:
        """Append one sampled token to each of ``seqs``, with what the sampler measured."""
        self._progress.stage = "measuring"
        now = time.perf_counter()
        logprobs = self._logprobs(seqs, out)
        stop = StopRule(self.tokenizer.eos_token_ids, self.max_model_len)
        for row, seq in enumerate(seqs):
            seq.append_sampled(out, row, None if logprobs is None else logprobs[row], now, stop)

    def _finish_sampled(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        """Into ``outputs``: each sampled sequence's output, finishing those that ended."""
        now = time.perf_counter()
        for seq in (batch.seqs[i] for i in batch.sampled):
            if seq.finish_reason is not None:
                outputs.append(self._retire(seq, now))
            elif seq.stream:
                outputs.append(seq.step_output())

    def _logprobs(self, seqs: list[Sequence], out: SamplerOutput) -> list | None:
        if out.logprobs is None:
            return None
        counts = [seq.params.logprobs for seq in seqs]
        return out.logprobs.to_host(out.token_ids, counts, self.tokenizer.token_text)
