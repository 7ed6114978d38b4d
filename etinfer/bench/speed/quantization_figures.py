"""The figures of ``bench quantization``, as its result carries them: for each engine (our modes,
transformers, llama.cpp) the decode rate at each batch, the prefill rate, load time and resident
memory, each the best round with the range over the rounds; our rates over llama.cpp's and over
our float ``none`` mode's; top-1 agreement and KL against the float32 path, and top-1 agreement
with llama.cpp."""

from __future__ import annotations

from etinfer.bench.common.results import Figure, Label
from etinfer.bench.speed.llama_cpp_driver import DECODE_CONTEXT

THEIRS = ("transformers", "llama.cpp")


def engine_labels(name: str) -> dict[str, Label]:
    """An engine's labels: ours by its mode (``auto``, ``int4+no-native``...)."""
    return {"engine": name} if name in THEIRS else {"engine": "etinfer", "mode": name}


def figures(
    rounds: dict[str, list[dict]], best: dict[str, dict], setting: dict, model: dict
) -> list[Figure]:
    """``rounds``: every round's figures by engine; ``best``: the best round of each, with the
    fidelity figures the run added; ``setting``: threads, the ISA our engines were held to
    (``--isa``) and the prompt's length."""
    found = []
    for name, result in best.items():
        labels = engine_labels(name) | model | {"threads": setting["threads"]}
        if setting["isa"] and name != "llama.cpp":  # llama.cpp's ISA is fixed when it is built
            labels["isa"] = f"held to {setting['isa']}"
        found += _speed(name, rounds[name], result, labels, best, setting["prompt_len"])
        found += fidelity_figures(result, labels)
    return found


def _speed(
    name: str, rounds: list[dict], result: dict, labels: dict, best: dict, prompt_len: int
) -> list[Figure]:
    n = len(rounds)

    def ranged(subject: str, value: float, unit: str, values: list[float], **more) -> Figure:
        spread = {"min": min(values), "max": max(values)}
        return Figure(subject, value, unit, labels | more, spread, n)

    found = []
    for batch, rate in result["decode_tok_s"].items():
        every = [r["decode_tok_s"][batch] for r in rounds]
        step = {"batch": int(batch), "context": DECODE_CONTEXT}
        found.append(ranged("decode", rate, "tok/s", every, **step))
        # Every engine against llama.cpp; our quantized modes against our float one too.
        references = ["llama.cpp"] + (["none"] if name not in THEIRS else [])
        for reference in references:
            theirs = best.get(reference, {}).get("decode_tok_s", {}).get(batch)
            if theirs and name != reference:
                ratio = labels | step | {"vs": reference}
                found.append(Figure("decode", rate / theirs, "x", ratio, n=n))
    found += [
        ranged("prefill", result["prefill_tok_s"], "tok/s", [r["prefill_tok_s"] for r in rounds],
               tokens=prompt_len),
        ranged("load time", result["load_s"], "s", [r["load_s"] for r in rounds]),
        ranged("resident memory", result["rss_mib"], "MiB", [r["rss_mib"] for r in rounds]),
    ]  # fmt: skip
    return found


def fidelity_figures(result: dict, labels: dict) -> list[Figure]:
    found = []
    if "top1_agreement" in result:
        versus = labels | {"vs": "float32"}
        found.append(Figure("top-1 agreement", 100 * result["top1_agreement"], "%", versus))
        found.append(Figure("kl", result["kl_mean"], "nats", versus))
    if "rows_alone_top1" in result:  # each row computed alone, as a decode step does
        alone = labels | {"path": "rows alone", "vs": "float32"}
        found.append(Figure("top-1 agreement", 100 * result["rows_alone_top1"], "%", alone))
        found.append(Figure("kl", result["rows_alone_kl"], "nats", alone))
    if "top1_vs_llama_cpp" in result:
        versus = labels | {"vs": "llama.cpp"}
        found.append(Figure("top-1 agreement", 100 * result["top1_vs_llama_cpp"], "%", versus))
    if "self_top1" in result:  # llama.cpp one token a call against its batched logits
        itself = labels | {"arm": "one token a call", "vs": "llama.cpp batched"}
        found.append(Figure("top-1 agreement", 100 * result["self_top1"], "%", itself))
        found.append(Figure("kl", result["self_kl"], "nats", itself))
    return found
