import pytest

from etinfer import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, r"temperature must be in \[0, inf\]"),
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("temperature", "hot", "temperature must be a finite number"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("top_k", -1, r"top_k must be in \[0, inf\]"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("min_p", 1.2, r"min_p must be in \[0, 1\]"),
        ("max_tokens", 0, r"max_tokens must be in \[1, inf\]"),
        ("max_tokens", True, "max_tokens must be an integer"),
        ("logprobs", 21, r"logprobs must be in \[0, 20\]"),
        ("seed", -3, r"seed must be in \[0, "),
        ("stop", [""], "stop must be a non-empty string"),
        ("stop", 5, "stop must be a non-empty string"),
        ("stop_token_ids", [-1], r"stop_token_ids must be in \[0, inf\]"),
    ],
)
def test_invalid_field_names_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_valid_params_are_normalised():
    params = SamplingParams(temperature=0, stop="END", top_k=5, logprobs=0)
    assert params.greedy
    assert params.stop == ["END"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("block_size", 0, "block_size"),
        ("max_num_seqs", 0, "max_num_seqs"),
        ("max_num_batched_tokens", -5, "max_num_batched_tokens"),
        ("dtype", "float64", "dtype must be one of"),
        ("device", "tpu", "device must be"),
        ("scheduling_policy", "lottery", "unknown scheduling policy 'lottery'; known: fcfs"),
        ("control", "full", "control must be a ControlConfig"),
        ("num_kvcache_blocks", 0, "num_kvcache_blocks"),
    ],
)
def test_engine_config_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})
