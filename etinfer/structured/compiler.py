"""Constraints compiled off the step loop, each once: a thread pool and a cache by key.

A request's grammar compiles on a worker thread while the engine keeps stepping the others;
the request joins the scheduler when its grammar is ready (``LLMEngine`` holds it until then),
so a slow schema delays only its own request. Requests that ask for the same constraint share
one compiled grammar (each gets its own matcher).
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from etinfer.model.tokenizer import Tokenizer
from etinfer.structured.backend import CompiledGrammar, GrammarBackend
from etinfer.structured.params import BACKENDS, StructuredOutputsParams

# A schema that takes longer than this to compile is refused (its compilation runs on; a
# later request for it finds the result cached). Real schemas compile in milliseconds.
DEFAULT_COMPILE_TIMEOUT = 10.0
CACHE_SIZE = 256
# Backends by tokenizer, shared by every engine over it: a backend holds only what it read from
# the vocabulary (0.3 s for SmolLM2's 49K tokens), which each engine of a benchmark or a test
# read again. An engine already compiles on two threads through one backend. A backend lives as
# long as its tokenizer (the loaded model), not the engine. Built on first use, on a compile
# thread under a lock of its own: submitting from the event loop never waits on it.
_BACKENDS: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[str, int], GrammarBackend]] = (
    weakref.WeakKeyDictionary()
)
_BACKENDS_LOCK = threading.Lock()


class GrammarCompiler:
    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, backend: str = "xgrammar", workers: int = 2
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"structured output backend must be one of {BACKENDS}, got {backend!r}"
            )
        self._tokenizer, self._vocab_size, self._backend_name = tokenizer, vocab_size, backend
        self._lock = threading.Lock()  # the cache's
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="etinfer-grammar")
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar for ``params``, cached or compiling."""
        with self._lock:
            future = self._cache.get(params.key)
            if future is None:
                future = self._cache[params.key] = self._pool.submit(self._compile, params)
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(params.key)
            return future

    def compile(
        self, params: StructuredOutputsParams, timeout: float = DEFAULT_COMPILE_TIMEOUT
    ) -> CompiledGrammar:
        """Wait for ``params``' grammar; ValueError when it cannot be compiled in ``timeout``."""
        try:
            return self.submit(params).result(timeout)
        except FutureTimeout:
            raise ValueError(
                f"structured.{params.kind} took over {timeout:g} s to compile; "
                "simplify the constraint"
            ) from None

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        return self._get_backend().compile(params)

    def _get_backend(self) -> GrammarBackend:
        return shared_backend(self._backend_name, self._tokenizer, self._vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def shared_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> GrammarBackend:
    """The backend ``name`` over ``tokenizer``'s first ``vocab_size`` ids, built once."""
    with _BACKENDS_LOCK:
        built = _BACKENDS.setdefault(tokenizer, {})
        key = (name, vocab_size)
        if key not in built:
            built[key] = _load_backend(name)(tokenizer, vocab_size)
        return built[key]


def _load_backend(name: str) -> type[GrammarBackend]:
    """The backend class, imported on first use: neither library is needed until a request
    asks for structured output."""
    try:
        if name == "llguidance":
            from etinfer.structured.llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend
        from etinfer.structured.xgrammar_backend import XGrammarBackend

        return XGrammarBackend
    except ImportError as e:
        install = {
            "xgrammar": "pip install --no-deps xgrammar apache-tvm-ffi (it imports transformers)",
            "llguidance": "pip install llguidance",
        }[name]
        raise ValueError(f"structured output with {name} needs {e.name}: {install}") from e
