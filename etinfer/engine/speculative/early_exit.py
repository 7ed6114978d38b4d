"""The model's first N layers as its own drafter (``draft_model="self:N"``): an early exit.

No second model with SmolLM2's tokenizer ships in a package, so the small model is cut from the
large one: its first N layers, then the final norm and the output head. It shares the weights,
and the keys and values it writes for those N layers at the drafted positions are the very ones
verification computes there (the same decode-row computation), so nothing is stored twice.

An untrained exit predicts poorly: the residual stream after N layers is not yet in the basis the
head reads. An exit adapter, fitted in closed form, maps it there: ridge least squares from the
normalised stream after N layers to the final normed hidden state (what the head reads), over
positions of teacher-forced text from ``etinfer/corpus.py`` (Python's reference documentation, in
the standard library), as ``etinfer calibrate`` does. Fitting takes one prefill of that text at
load.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from etinfer.control.entropy import softmax_entropy
from etinfer.corpus import corpus_windows
from etinfer.engine.kv_cache.block_pool import BlockPool
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.scheduler import ScheduledBatch
from etinfer.engine.sequence import Sequence
from etinfer.model.llama import LlamaWeights
from etinfer.model.tokenizer import Tokenizer

ADAPTER_TOKENS = 2048  # positions the adapter is fitted on: 577 unknowns per output, 3.5x over
_RIDGE = 1e-3  # relative to the mean diagonal of the normal equations


def parse_self_draft(draft_model: str, num_layers: int) -> int:
    """N of ``self:N``, checked against the model's layers."""
    text = draft_model.removeprefix("self:")
    if not text.isdigit() or not 1 <= int(text) <= num_layers - 1:
        raise ValueError(
            f"draft_model 'self:N' needs N in [1, {num_layers - 1}] (the model has {num_layers} "
            f"layers), got {draft_model!r}"
        )
    return int(text)


@dataclass
class ExitAdapter:
    weight: torch.Tensor  # [hidden, hidden]: normalised stream after N layers -> final normed
    bias: torch.Tensor  # [hidden]


# Adapters fitted in this process, per prepared weights (shared by engines over the same model
# and settings, ``llama.prepared``) and per everything else the fit's prefill computes with:
# benchmarks and tests build many engines with the same exit, and each fit is a 2,048-token
# prefill (2.4 s on two CPU cores). The fit is deterministic, so a second one would give the
# same adapter bit for bit.
_FITTED: weakref.WeakKeyDictionary[LlamaWeights, dict[tuple, ExitAdapter]] = (
    weakref.WeakKeyDictionary()
)


def fit_window(runner: ModelRunner, pool: BlockPool) -> int:
    """Tokens a fitting prefill takes at once: 512, or what the pool holds (empty at load)."""
    return min(512, pool.num_free_blocks * runner.block_size)


def fit_exit_adapter(
    runner: ModelRunner, pool: BlockPool, tokenizer: Tokenizer, layer: int
) -> ExitAdapter:
    window, attention = fit_window(runner, pool), runner.attention
    batch_invariant = attention.options.batch_invariant
    key = (layer, window, runner.block_size, runner.cache.dtype, batch_invariant)
    if batch_invariant:
        # The fit's rows are then decode rows, which the pruning selector may narrow.
        key += (getattr(attention.selector, "config", None),)
    fitted = _FITTED.setdefault(runner.model.weights, {})
    if key not in fitted:
        fitted[key] = _fit(runner, pool, tokenizer, layer, window)
    return fitted[key]


def _fit(
    runner: ModelRunner, pool: BlockPool, tokenizer: Tokenizer, layer: int, window: int
) -> ExitAdapter:
    """Ridge least squares over ``ADAPTER_TOKENS`` positions of the corpus, ``window`` at a
    time."""
    inputs, targets, have = [], [], 0
    for ids in corpus_windows(tokenizer, window):
        if have >= ADAPTER_TOKENS:
            break
        blocks = pool.allocate(-(-len(ids) // runner.block_size))
        try:
            early, last = runner.exit_states(ids, blocks, layer)
        finally:
            pool.free(blocks)
        inputs.append(runner.model.final_norm(early, weight=False))
        targets.append(runner.model.final_norm(last))
        have += len(ids)
    x = torch.cat(inputs).double()
    x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype, device=x.device)], 1)
    gram = x.T @ x
    gram += torch.eye(len(gram), dtype=x.dtype, device=x.device) * _RIDGE * gram.diagonal().mean()
    solution = torch.linalg.solve(gram, x.T @ torch.cat(targets).double())
    dtype = targets[0].dtype
    return ExitAdapter(solution[:-1].to(dtype), solution[-1].to(dtype))


def build_early_exit(
    draft_model: str,
    runner: ModelRunner,
    pool: BlockPool,
    tokenizer: Tokenizer,
    *,
    adapter: bool = True,
    entropy_threshold: float | None = None,
) -> EarlyExitDrafter:
    """The small model ``self:N`` names, its adapter fitted now (at load) unless not wanted."""
    layer = parse_self_draft(draft_model, len(runner.model.layers))
    fitted = fit_exit_adapter(runner, pool, tokenizer, layer) if adapter else None
    return EarlyExitDrafter(runner, layer, fitted, entropy_threshold)


class EarlyExitDrafter:
    """Greedy drafts from the first ``layer`` layers, one position at a time for every sequence
    drafting, each stopping at its length limit or, with ``entropy_threshold``, at the first
    position where the exit's own entropy exceeds it (it would likely be rejected). Each
    position runs the rows before it again (k(k+1)/2 rows for k drafts): a few rows cost about
    what one does, since the weights are read once per pass."""

    asking_costs = True  # its layers run for each token asked, even past its first unsure one

    def __init__(
        self,
        runner: ModelRunner,
        layer: int,
        adapter: ExitAdapter | None,
        entropy_threshold: float | None,
    ) -> None:
        self.runner, self.layer, self.adapter = runner, layer, adapter
        self.entropy_threshold = entropy_threshold

    @torch.inference_mode()
    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """The exit's logits at each sequence's last row of ``batch``."""
        model = self.runner.model
        hidden = self.runner.early_exit(batch, self.layer)
        if self.adapter is None:
            return model.compute_logits(model.final_norm(hidden))
        return model.compute_logits(
            torch.addmm(
                self.adapter.bias, model.final_norm(hidden, weight=False), self.adapter.weight
            )
        )

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        alive = [i for i, limit in enumerate(limits) if limit > 0]
        while alive:
            batch = ScheduledBatch(
                seqs=[seqs[i] for i in alive],
                num_tokens=[1 + len(drafts[i]) for i in alive],
                drafts=[drafts[i] for i in alive],
            )
            logits = self.logits(batch)
            tokens = logits.argmax(-1).tolist()
            confident = [True] * len(alive)
            if self.entropy_threshold is not None:
                entropy = softmax_entropy(logits).entropy
                confident = (entropy <= self.entropy_threshold).tolist()
            still = []
            for i, token, sure in zip(alive, tokens, confident, strict=True):
                if sure:
                    drafts[i].append(token)
                    if len(drafts[i]) < limits[i]:
                        still.append(i)
            alive = still
        return drafts
