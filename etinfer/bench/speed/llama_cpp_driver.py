"""The llama.cpp side of ``bench quantization``: a program run by the Python that
``--llama-cpp-python`` names (llama-cpp-python's own environment, which has neither torch nor
etinfer); it prints its figures as one JSON line, then writes teacher-forced logits if asked."""

DECODE_CONTEXT = 128  # tokens each decoding sequence holds: the short-chat regime

LLAMA_CPP = f"""
import json, os, sys, time, numpy, psutil, llama_cpp
from llama_cpp import Llama
path, prompt_len, threads, steps = sys.argv[1], *map(int, sys.argv[2:5])
batches = [int(b) for b in sys.argv[5].split(",")]
start = time.perf_counter()
# Its scores hold n_batch rows: room for the decode run after DECODE_CONTEXT tokens too.
window = max(prompt_len, {DECODE_CONTEXT} + steps + 16)
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=window + 64,
            n_batch=window, n_ubatch=window, verbose=False)
load_s = time.perf_counter() - start
rss = psutil.Process().memory_info().rss
text = llm.tokenize(b" The history of science" * 2000, add_bos=False)
tokens = text[:prompt_len]
llm.eval(tokens[:64]); llm.reset()
start = time.perf_counter(); llm.eval(tokens); prefill_s = time.perf_counter() - start
llm.reset(); llm.eval(tokens[:{DECODE_CONTEXT}])
times = []
for _ in range(steps):
    token = int(llm.scores[llm.n_tokens - 1].argmax())
    start = time.perf_counter(); llm.eval([token]); times.append(time.perf_counter() - start)
times.sort()
decode = {{"1": 1 / times[len(times) // 2]}}

def batched_decode(size, context={DECODE_CONTEXT}):
    # Several sequences in one context (llama.cpp's own batched decoding, as its batched-bench
    # does): windows of the text starting 7 tokens apart, prefilled together, then one token
    # each a step, timed with the reading of each row's greedy token (a step's whole work, as
    # ours is timed with its sampling).
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = size * (context + steps + 16)
    params.n_batch = size * context
    params.n_ubatch = min(size * context, 2048)  # its compute buffer grows with the micro-batch
    params.n_seq_max = size
    params.n_threads = params.n_threads_batch = threads
    # The model as the high-level object loaded it (llama-cpp-python has no public handle).
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    batch = llama_cpp.llama_batch_init(size * context, 0, size)
    def fill(rows):  # (token, position, sequence, wants logits)
        for i, (token, pos, seq, logits) in enumerate(rows):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(rows)
    def argmax(i):
        row = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(numpy.ctypeslib.as_array(row, shape=(llm.n_vocab(),)).argmax())
    fill([(text[s * 7 + p], p, s, p == context - 1) for s in range(size) for p in range(context)])
    assert llama_cpp.llama_decode(ctx, batch) == 0
    last = [argmax(s * context + context - 1) for s in range(size)]
    times = []
    for step in range(steps):
        fill([(last[s], context + step, s, True) for s in range(size)])
        start = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, batch) == 0
        last = [argmax(s) for s in range(size)]
        times.append(time.perf_counter() - start)
    llama_cpp.llama_batch_free(batch); llama_cpp.llama_free(ctx)
    times.sort()
    return size / times[len(times) // 2]

for size in batches:
    if size > 1:
        decode[str(size)] = batched_decode(size)
print(json.dumps({{"load_s": load_s, "rss_mib": rss / 2**20,
                  "prefill_tok_s": prompt_len / prefill_s, "decode_tok_s": decode}}))
if len(sys.argv) > 6:  # teacher-forced logits of our windows, for top-1 and KL against ours
    # Twice where asked: each window in one batch (its prefill path), then one token a call
    # (its decode path), which llama.cpp computes with other kernels.
    windows_path, *logits_paths = sys.argv[6:]
    del llm
    for logits_path, n_batch in zip(logits_paths, (512, 1)):
        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                    n_batch=n_batch, n_ubatch=n_batch, logits_all=True, verbose=False)
        rows = []
        for window in json.load(open(windows_path)):
            llm.reset(); llm.eval(window); rows.append(numpy.array(llm.scores[: len(window) - 1]))
        numpy.save(logits_path, numpy.concatenate(rows).astype(numpy.float32))
        del llm
"""
