"""lm-evaluation-harness scores a model through the server as it would any OpenAI-compatible
one: ``local-completions`` (its remote tokenizer on /tokenize, /detokenize and
/tokenizer_info) for a loglikelihood task and a multiple-choice task, ``local-chat-completions``
for a generation task. The tasks are small files the test writes (YAML and JSONL; nothing from
the hub). On float32 weights the loglikelihoods equal transformers' on the same file."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from etinfer.server import create_app
from tests.server.conftest import API_KEY, ServerThread, make_engine

lm_eval = pytest.importorskip("lm_eval")

LOGLIKELIHOOD = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three,", "continuation": " four, five"},
    {"context": "The sun rises in the ", "continuation": "east"},  # the space moves over
    {"context": "Water boils at 100 degrees", "continuation": " Celsius at sea level."},
]
MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Rome"], "label": 0},
    {"question": "Ice is water that is", "choices": ["boiling", "frozen"], "label": 1},
    {"question": "The opposite of up is", "choices": ["down", "left", "red"], "label": 0},
]
GENERATION = [
    {"question": "What is the capital of France? Answer in one word.", "answer": "Paris"},
    {"question": "Write the number after 3, as a digit only.", "answer": "4"},
]
TASKS = {
    "etinfer_loglikelihood": (
        LOGLIKELIHOOD,
        """output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
metric_list:
  - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
  - {metric: acc, aggregation: mean, higher_is_better: true}
""",
    ),
    "etinfer_choice": (
        MULTIPLE_CHOICE,
        """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}
""",
    ),
    "etinfer_generation": (
        GENERATION,
        """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 12}
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true}
""",
    ),
}


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, (rows, spec) in TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        header = (
            f"task: {name}\ndataset_path: json\n"
            f"dataset_kwargs: {{data_files: {{test: {data}}}}}\ntest_split: test\n"
        )
        (folder / f"{name}.yaml").write_text(header + spec)
    return folder


@pytest.fixture(scope="module")
def float_server(loaded_model):
    engine = make_engine(
        loaded_model, quantization="none", dtype="float32", kv_cache_dtype="float32"
    )
    with ServerThread(create_app(engine, api_key=API_KEY)) as running:
        yield running


def evaluate(server: ServerThread, task_folder: Path, model: str, tasks: list[str]) -> dict:
    from lm_eval.tasks import TaskManager

    endpoint = "completions" if model == "local-completions" else "chat/completions"
    name = "SmolLM2-135M-Instruct.Q4_1"
    args = f"model={name},base_url={server.url}/v1/{endpoint},num_concurrent=1,max_retries=1"
    if model == "local-completions":
        args += f",tokenizer_backend=remote,auth_token={API_KEY}"
    os.environ["OPENAI_API_KEY"] = API_KEY
    return lm_eval.simple_evaluate(
        model=model,
        model_args=args,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(task_folder)),
        apply_chat_template=model == "local-chat-completions",
        log_samples=True,
    )


def reference_loglikelihood(hf_reference, tokenizer, context: str, continuation: str):
    """What lm-eval computes from a model's own logits: the continuation's summed log-probability
    and whether each of its tokens was the argmax, tokens split as lm-eval splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.no_grad():
        scores = hf_reference(torch.tensor([whole])).logits[0].log_softmax(-1)
    rows = scores[start - 1 : len(whole) - 1]
    targets = torch.tensor(whole[start:])
    total = rows.gather(1, targets[:, None]).sum().item()
    return total, bool((rows.argmax(-1) == targets).all())


@pytest.mark.slow
def test_loglikelihood_and_multiple_choice_equal_transformers(
    float_server, task_folder, hf_reference, loaded_model, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = ["etinfer_loglikelihood", "etinfer_choice"]
    results = evaluate(float_server, task_folder, "local-completions", tasks)
    for task in tasks:
        samples = results["samples"][task]
        assert len(samples) == len(TASKS[task][0])
        for sample in samples:
            for (context, continuation), (score, greedy) in zip(
                sample["arguments"], sample["filtered_resps"], strict=True
            ):
                expected, expected_greedy = reference_loglikelihood(
                    hf_reference, loaded_model.tokenizer, context, continuation
                )
                assert score == pytest.approx(expected, abs=1e-4)
                assert greedy == expected_greedy
    assert results["results"]["etinfer_choice"]["acc,none"] >= 2 / 3
    assert 1 < results["results"]["etinfer_loglikelihood"]["perplexity,none"] < 100


@pytest.mark.slow
def test_a_generation_task_through_chat_completions(float_server, task_folder, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = evaluate(float_server, task_folder, "local-chat-completions", ["etinfer_generation"])
    samples = results["samples"]["etinfer_generation"]
    replies = [sample["filtered_resps"][0] for sample in samples]
    assert len(replies) == 2 and all(isinstance(r, str) and r for r in replies)
    assert "Paris" in replies[0]
    assert "exact_match,none" in results["results"]["etinfer_generation"]
