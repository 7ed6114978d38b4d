"""The layers an engine runs, built from the switches of its config, each handed what it needs.

This is the one place that reads which optional layers are on. The laws come from
``etinfer/control/`` (a scheduling policy, a block selector whose budgets are planned while
pruning is on, a step shaper; the temperature law each request picks acts in the sampler), and
the layers with engine-side mechanics from their own folders: ``engine/kv_compression/`` and
``engine/speculative/`` (drafting with verification, and Entropy Adaptive Decoding), and
structured output's jump-forward (``structured/jump_forward.py``). Each layer that is on also
gives every request entering the engine its state object (``start_layers``), hung on the
sequence under the layer's name. Which layers combine with each other and with the model is
``etinfer/compatibility.py``'s table, checked here first. Removing such a layer is removing its
folder, its lines here, its rows in that table and its switch in ``config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from etinfer.compatibility import check_compatible
from etinfer.config import EngineConfig
from etinfer.control.block_budgets import check_context
from etinfer.control.block_selection import BLOCK_SELECTORS, BlockSelector, PruningConfig
from etinfer.control.calibration import Calibration
from etinfer.control.drafting import DraftCosts, SpeculationState, SpeculativeShaper
from etinfer.control.key_sketch import SketchMaps
from etinfer.control.kv_compression import KVCompressionState
from etinfer.control.pruning_state import PruningState
from etinfer.control.scheduling import SCHEDULING_POLICIES, SchedulingPolicy
from etinfer.control.shaping import STEP_SHAPERS, StepShaper
from etinfer.control.switching import SwitchingState, SwitchState
from etinfer.engine.kv_cache.manager import KVCacheManager
from etinfer.engine.kv_compression.compressor import KVCompressor
from etinfer.engine.runner.model_runner import ModelRunner
from etinfer.engine.runner.options import RunnerOptions
from etinfer.engine.sequence import Sequence
from etinfer.engine.speculative.speculator import Speculator
from etinfer.engine.speculative.switching import ModelSwitcher
from etinfer.model.config import ModelConfig
from etinfer.model.loader import LoadedModel
from etinfer.structured.jump_forward import JumpForward
from etinfer.structured.masks import StructuredState


@dataclass
class EngineLayers:
    policy: SchedulingPolicy
    pruning: PruningConfig | None  # block budgets are planned while it is set
    selector: BlockSelector
    shaper: StepShaper
    compressor: KVCompressor | None
    runner: ModelRunner
    switcher: ModelSwitcher | None
    speculator: Speculator | None
    jump_forward: JumpForward | None  # structured output's forced text as drafts

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        loaded: LoadedModel,
        kv: KVCacheManager,
        *,
        max_model_len: int,
        calibration: Calibration | None,
    ) -> EngineLayers:
        check_compatible(config, loaded.config)  # the model's features are known now
        control = config.control
        policy = SCHEDULING_POLICIES.create(
            config.policy_name,
            config=control.scheduling_config,
            chunk_tokens=config.max_num_batched_tokens,
        )
        pruning = control.pruning_config
        selector = (
            BLOCK_SELECTORS.create("dense")
            if pruning is None
            else pruning_selector(pruning, loaded.config, max_model_len)
        )
        costs = DraftCosts()  # measured by the speculator, read by its law
        shaper = (
            SpeculativeShaper(config.speculative, costs)
            if config.speculative is not None
            else STEP_SHAPERS.create(config.step_shaper)
        )
        device = config.torch_device()
        compressor = None
        if control.kv_compression_config is not None:
            compressor = KVCompressor(control.kv_compression_config, loaded.config, kv, device)
        options = RunnerOptions.of(
            config,
            loaded.config,
            max_model_len=max_model_len,
            num_blocks=kv.pool.num_blocks,
            calibration_temperature=1.0 if calibration is None else calibration.temperature,
        )
        runner = ModelRunner(
            model=loaded, options=options, selector=selector, query_capturer=compressor
        )
        # Both fit their small model (an early exit's adapter) now, at load.
        switcher = None
        if control.switching_config is not None:
            switcher = ModelSwitcher(config, runner, kv.pool, loaded.tokenizer)
        speculator = None
        if config.speculative is not None:
            speculator = Speculator(config, runner, kv, loaded.tokenizer, costs)
        jump_forward = None
        if config.jump_forward:
            jump_forward = JumpForward(
                kv,
                loaded.tokenizer,
                max_model_len=max_model_len,
                max_num_batched_tokens=config.max_num_batched_tokens,
            )
        return cls(
            policy,
            pruning,
            selector,
            shaper,
            compressor,
            runner,
            switcher,
            speculator,
            jump_forward,
        )


def pruning_selector(
    config: PruningConfig, model: ModelConfig, max_model_len: int
) -> BlockSelector:
    """The entropic selector for ``config`` on ``model``: its score scale, and the layers that
    see the whole context (where the reused-mass scorer's selection layers lie)."""
    check_context(config, max_model_len)
    sketch = None
    if config.sketched:
        sketch = sketch_maps(config, model)
    return BLOCK_SELECTORS.create(
        "entropic",
        config=config,
        scale=model.scale,
        full_layers=full_context_layers(model),
        sketch=sketch,
    )


def sketch_maps(config: PruningConfig, model: ModelConfig) -> SketchMaps:
    """The sketch scorer's maps from ``config.sketch_maps``, checked against ``model``."""
    if config.sketch_maps is None:
        raise ValueError(
            f"control.pruning.scorer {config.scorer!r} needs its maps (control.pruning."
            "sketch_maps): an engine built by build_engine (LLM, etinfer serve) fits them once "
            "per model file"
        )
    maps = SketchMaps.load(config.sketch_maps)
    rank = config.rank_for(model.head_dim)
    expected = (model.num_layers, model.num_kv_heads, model.head_dim, rank)
    if tuple(maps.key_maps.shape) != expected:
        raise ValueError(
            f"control.pruning.sketch_maps {config.sketch_maps} holds maps of shape "
            f"{tuple(maps.key_maps.shape)}; this model and sketch_rank need {expected}"
        )
    return maps


def full_context_layers(model: ModelConfig) -> list[int]:
    """The layers that see the whole context (the others slide over a window)."""
    return [layer for layer in range(model.num_layers) if layer not in model.local_layers]


def start_layers(config: EngineConfig, seq: Sequence) -> None:
    """Give a request entering an engine built with ``config`` the state of each layer that is
    on for it; a layer that is off leaves its attribute None. (Sparse prefill's state is per
    prefill: its selector sets it where a long prompt's prefill begins.)"""
    control = config.control
    if control.pruning_config is not None:
        seq.pruning = PruningState()
    if config.speculative is not None:
        seq.speculation = SpeculationState()
    if control.switching_config is not None:
        seq.switching = SwitchingState(SwitchState.initial(control.switching_config))
    if control.kv_compression_config is not None:
        seq.kv_compression = KVCompressionState()
    if seq.params.structured is not None:  # the request's own switch
        seq.structured = StructuredState()
