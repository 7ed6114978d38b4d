"""Constraints compiled off the step loop, each once: a thread pool and a cache by key.

A request's grammar compiles on a worker thread while the engine keeps stepping the others;
the request joins the scheduler when its grammar is ready (``LLMEngine`` holds it until then),
so a slow schema delays only its own request. Requests that ask for the same constraint share
one compiled grammar (each gets its own matcher), and so do engines over the same tokenizer.
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
# later request for it finds the result cached). The benchmark's twenty JSON schemas take 20 ms
# to 1.2 s each with xgrammar on a 2-core host.
DEFAULT_COMPILE_TIMEOUT = 10.0
CACHE_SIZE = 256


class SharedGrammars:
    """What every engine over one tokenizer shares for one backend: the backend, which holds
    only what it read from the vocabulary (0.3-1.3 s for SmolLM2's 49K tokens), and the grammars
    it compiled, which are immutable (each request matches with a matcher of its own). Engines
    of a benchmark or a test would otherwise read the vocabulary and compile each schema again.

    The backend is built on first use, on a compile thread: looking up a compiled grammar, as
    submitting from the event loop does, never waits on it."""

    def __init__(self, name: str, tokenizer: Tokenizer, vocab_size: int) -> None:
        # A weak reference: this object is a value of ``_SHARED``, whose key is the tokenizer,
        # and a strong one would keep that key alive forever. Engines hold the tokenizer.
        self._name, self._tokenizer, self._vocab_size = name, weakref.ref(tokenizer), vocab_size
        self._backend: GrammarBackend | None = None
        self.building = threading.Lock()  # held while the backend is built or fetched
        self._lock = threading.Lock()  # the compiled grammars'
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()

    @property
    def backend(self) -> GrammarBackend:
        with self.building:
            if self._backend is None:
                tokenizer = self._tokenizer()
                assert tokenizer is not None, "compiling for an engine that holds its tokenizer"
                self._backend = backend_class(self._name)(tokenizer, self._vocab_size)
            return self._backend

    def cached(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            grammar = self._compiled.get(key)
            if grammar is not None:
                self._compiled.move_to_end(key)
            return grammar

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """``params``' grammar, compiled unless an engine already did (a constraint that fails
        is not kept: each engine keeps its own failures)."""
        grammar = self.cached(params.key)
        if grammar is None:
            grammar = self.backend.compile(params)
            with self._lock:
                self._compiled[params.key] = grammar
                while len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        return grammar


# By tokenizer: shared as long as the tokenizer (the loaded model) lives, not the engine.
_SHARED: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[str, int], SharedGrammars]] = (
    weakref.WeakKeyDictionary()
)
_SHARED_LOCK = threading.Lock()


def shared_grammars(name: str, tokenizer: Tokenizer, vocab_size: int) -> SharedGrammars:
    """The grammars of backend ``name`` over ``tokenizer``'s first ``vocab_size`` ids."""
    with _SHARED_LOCK:
        by_backend = _SHARED.setdefault(tokenizer, {})
        key = (name, vocab_size)
        if key not in by_backend:
            by_backend[key] = SharedGrammars(name, tokenizer, vocab_size)
        return by_backend[key]


class GrammarCompiler:
    """An engine's compiler: its own threads, and the compilations it started or saw fail, over
    the grammars shared by every engine over its tokenizer."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, backend: str = "xgrammar", workers: int = 2
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"structured output backend must be one of {BACKENDS}, got {backend!r}"
            )
        self.shared = shared_grammars(backend, tokenizer, vocab_size)
        self._lock = threading.Lock()  # the cache's
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="etinfer-grammar")
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar for ``params``: done when any engine compiled it, else compiling."""
        grammar = self.shared.cached(params.key)
        if grammar is not None:
            done: Future[CompiledGrammar] = Future()
            done.set_result(grammar)
            return done
        with self._lock:
            future = self._cache.get(params.key)
            if future is None:
                future = self._cache[params.key] = self._pool.submit(self.shared.compile, params)
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

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def backend_class(name: str) -> type[GrammarBackend]:
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
