"""Find and load a model: a GGUF file, a Hugging Face folder, or the embedded default."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from etinfer.model.catalog import resolve
from etinfer.model.config import ModelConfig
from etinfer.model.gguf_file import load_gguf
from etinfer.model.hf_folder import load_hf_folder
from etinfer.model.quantized import Weight
from etinfer.model.tokenizer import Tokenizer

logger = logging.getLogger("etinfer.model")
_MADV_DONTNEED = 4  # Linux's value on every architecture


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    weights: dict[str, Weight]  # Hugging Face names, [out, in] layout
    tokenizer: Tokenizer
    # The weights as engines over this model prepared them for their kernels (model/llama.py's
    # ``prepared``), each kept while an engine holds it: engines built over one model share them.
    prepared: weakref.WeakValueDictionary = field(
        default_factory=weakref.WeakValueDictionary, repr=False, compare=False
    )
    # A GGUF file's memory mapping, which its weights in blocks are views of (None for a folder).
    file_mapping: np.memmap | None = field(default=None, repr=False, compare=False)
    # Prepared forms held past their engines while a caller builds engine after engine
    # (``keeping_prepared``); None otherwise. Typed as objects: llama.py, which prepares them,
    # imports this module.
    _held: list[object] | None = field(default=None, init=False, repr=False, compare=False)

    def add_prepared(self, key: tuple, form: object) -> None:
        self.prepared[key] = form
        if self._held is not None:
            self._held.append(form)

    @contextlib.contextmanager
    def keeping_prepared(self) -> Iterator[None]:
        """Within this block, every prepared form stays alive when its engines go. A caller that
        builds engines one after another (a benchmark's arms, a test session) then prepares each
        form once: a float32 form takes 1.6-2.5 s on two cores, a 4-bit one 0.4 s."""
        if self._held is not None:  # an enclosing block holds them already
            yield
            return
        self._held = list(self.prepared.values())
        try:
            yield
        finally:
            self._held = None

    def release_file_pages(self) -> None:
        """Give the mapped file's pages back to the OS (Linux), once an engine has prepared its
        copy of the weights: they stay in the page cache, and a block read later (an embedding
        row, a row of the head) is paged in again. Without this the process would hold both the
        file's blocks and the prepared layout, about twice the file."""
        if self.file_mapping is None or not sys.platform.startswith("linux"):
            return
        libc = ctypes.CDLL(None, use_errno=True)
        address, length = self.file_mapping.ctypes.data, self.file_mapping.nbytes
        if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_DONTNEED):
            logger.debug("madvise: %s", os.strerror(ctypes.get_errno()))


def load_model(model: str | Path | None = None) -> LoadedModel:
    """A GGUF file, a Hugging Face folder, or an installed model by name (``catalog.py``;
    default: the embedded SmolLM2)."""
    with collection_paused():
        return _load(resolve(model))


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic collector paused: reading a vocabulary makes hundreds of thousands of
    objects that all live on (Gemma 3's 262,144 pieces, its merges), and the collector walked
    the growing heap again and again, a fifth of that file's load."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _load(path: Path) -> LoadedModel:
    if path.is_dir():
        config, weights, tokenizer = load_hf_folder(path)
        return LoadedModel(path, config, weights, tokenizer)
    if path.suffix == ".gguf":
        config, weights, tokenizer, mapping = load_gguf(path)
        return LoadedModel(path, config, weights, tokenizer, file_mapping=mapping)
    raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model folder")
