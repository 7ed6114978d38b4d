"""Names the table definitions share: host kinds, models, engines, and the words of a cell that
has no figure."""

from benchmarks.layout import Pick

AVX2 = "AVX2"  # a CPU without AVX-512
HELD = "AVX2 (held)"  # an AVX-512 CPU computing as an AVX2-only one does
AVX512 = "AVX-512"
H100 = "NVIDIA H100 80GB HBM3"
H200 = "NVIDIA H200"

SMOLLM = "SmolLM2-135M Q4_1"
GEMMA = "Gemma 3 270M Q4_K_M"
LLAMA_1B = "1.1B Llama shape, random weights, Q4_0"
# ``bench quantization --random-shape``'s files, as their labels name them
GEMMA_FILE = "gemma-3-270m-q4_k_m"  # the same file as GEMMA, as a run's labels name it
SMOLLM_FILE = "SmolLM2-135M-Instruct Q4_1"  # the same file as SMOLLM, as a run's labels name it
LLAMA32_1B = "llama-3.2-1b-random Q4_0"
LLAMA3_8B = "llama-3-8b-random Q4_0"
LLAMA_CPP = "llama.cpp"
NOT_MEASURED = "not measured"


def ratio_vs(subject: str, vs: str, **labels) -> Pick:
    """A ratio figure of ``subject`` against ``vs``."""
    return Pick(subject=subject, unit="x", labels={"vs": vs, **labels})


def figure(subject: str, unit: str, **labels) -> Pick:
    return Pick(subject=subject, unit=unit, labels=labels)
