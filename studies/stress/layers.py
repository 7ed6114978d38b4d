"""The stress test on the newer layers that read predictive entropy: speculative decoding's
draft length (the entropy schedule stops drafting after an uncertain token) and Entropy Adaptive
Decoding's switch (the small model writes while the rolling entropy stays low). An over-confident
signal should draft longer runs that the model then rejects, and hand more tokens to the small
model; an under-confident one the reverse.

The workload is the ablation mix's greedy requests on shorter documents (as ``bench switching``
runs it): passkey retrieval, continuation of human-written text and chat instructions. Each
layer runs every stress point with and without the refitted calibration, beside the engine
without the layer. Speculative decoding is lossless, so only its drafts and time move (its
tokens are checked against the plain engine's); switching changes the text, scored against the
large model alone.
"""

from __future__ import annotations

import argparse
import math
import statistics

from etinfer.control.config import ControlConfig
from etinfer.control.drafting import SpeculativeConfig
from etinfer.control.record import TARGET_MODEL
from etinfer.control.stress import StressConfig
from etinfer.llm import LLM
from etinfer.model.loader import LoadedModel
from studies.common.mixed_workload import Sizes, answers, build
from studies.common.quality import rouge_l, task_quality, words
from studies.seed_systems import switching

SIZES = Sizes(
    document_tokens=(512, 768),
    max_tokens={"retrieval": 10, "continuation": 48, "free": 48, "instruction": 48, "chat": 48},
    rate=math.inf,
    cap=2,
)
EXIT_LAYERS = 22  # bench switching's small model: the first 22 of 30 layers
LAYERS: dict[str, dict] = {
    # Drafts run only below SpeculativeConfig.disable_batch_size decoding sequences.
    "speculative": {"speculative": SpeculativeConfig(), "max_num_seqs": 2},
    "switching": {"draft_model": f"self:{EXIT_LAYERS}", "control": ControlConfig(switching=True)},
}
ARMS = ("uncalibrated", "calibration")


def run(
    loaded: LoadedModel,
    points: dict[str, StressConfig | None],
    calibrations: dict[float, str],
    args: argparse.Namespace,
) -> dict:
    """Per layer, arm and stress point: the figures of each repeat; and the references."""
    tokenizer = loaded.tokenizer
    requests = [r for r in build(tokenizer, "mixed", SIZES, args.seed) if r.greedy]
    references = {}
    for name, kwargs in {"plain": {"max_num_seqs": 2}, "large alone": {}}.items():
        outs, wall, _ = switching.run_requests(LLM(loaded, **kwargs), requests)
        references[name] = (outs, wall)
    eos = tokenizer.eos_token_ids
    answered = {name: answers(requests, outs, eos) for name, (outs, _) in references.items()}
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for layer, kwargs in LAYERS.items():
            for arm in ARMS:
                for point, stress in points.items():
                    scale = 1.0 if stress is None else stress.logit_scale
                    calibration = calibrations[scale] if arm == "calibration" else None
                    llm = LLM(loaded, stress=stress, calibration=calibration, **kwargs)
                    outs, wall, _ = switching.run_requests(llm, requests)
                    ours = answers(requests, outs, eos)
                    figures = (
                        _drafting(outs, references["plain"][0])
                        if layer == "speculative"
                        else _switching(requests, outs, ours, answered["large alone"], tokenizer)
                    )
                    figures["wall_s"] = wall
                    rows.append(
                        {"layer": layer, "arm": arm, "stress": point, "repeat": repeat, **figures}
                    )
    return {
        "workload": {"requests": len(requests), "sizes": vars(SIZES) | {"rate": "all at once"}},
        "exit_layers": EXIT_LAYERS,
        "reference_wall_s": {name: wall for name, (_, wall) in references.items()},
        "reference_quality": task_quality(requests, answered["large alone"], tokenizer),
        "rows": rows,
    }


def _drafting(outs: list, plain: list) -> dict:
    drafted = sum(o.num_draft_tokens for o in outs)
    return {
        "drafts_per_token": drafted / sum(len(o.token_ids) for o in outs),
        "acceptance": sum(o.num_accepted_tokens for o in outs) / drafted if drafted else None,
        "tokens_equal_plain": all(
            o.token_ids == p.token_ids for o, p in zip(outs, plain, strict=True)
        ),
    }


def _switching(requests: list, outs: list, ours: list, large: list, tokenizer) -> dict:
    scores = task_quality(requests, ours, tokenizer)
    return {
        # Of all the tokens written, as the switching bench counts it.
        "large_share": sum(m == TARGET_MODEL for o in outs for m in o.token_models)
        / sum(len(o.token_models) for o in outs),
        "passkey_accuracy": scores["passkey_accuracy"],
        "rouge_l_human": scores["rouge_l_human"],
        "rouge_l_large": statistics.fmean(
            rouge_l(words(tokenizer.decode(a)), words(tokenizer.decode(b)))
            for a, b in zip(ours, large, strict=True)
        ),
    }
