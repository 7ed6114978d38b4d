"""Tokenizers rebuilt from a GGUF file's vocabulary, kept on disk once built.

A SentencePiece vocabulary holds no merges: rebuilding them (``sentencepiece.spm_merges``) for
Gemma 3's 262,144 pieces took 3.9 of the 4.8 s its file took to load, where llama.cpp loads it
in about 0.5 s. The built tokenizer, serialised by `tokenizers` itself, reads back in a fraction
of that. The name carries a hash of everything the build reads (the vocabulary and the source of
the code that rebuilds it), so a changed file or a changed rebuild never reads a stale one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

logger = logging.getLogger(__name__)


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "etinfer" / "tokenizers"


def cached_tokenizer(
    inputs: Iterable[object], sources: Iterable[Path], build: Callable[[], HFTokenizer]
) -> HFTokenizer:
    """``build()``'s tokenizer, from the cache where a build from the same ``inputs`` (each
    hashed by its ``repr``) by the same ``sources`` was kept; else built and kept (where the
    cache cannot be written, built each time)."""
    key = hashlib.sha256()
    for item in (*(path.read_bytes() for path in sources), *inputs):
        key.update(repr(item).encode())
        key.update(b"\0")
    path = cache_folder() / f"{key.hexdigest()[:24]}.json"
    if path.exists():
        try:
            return HFTokenizer.from_file(str(path))
        except Exception as error:  # a damaged file: built again below, and replaced
            logger.warning("tokenizer cache %s unreadable (%s): rebuilding it", path, error)
    tokenizer = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed: a process reading at once never sees half.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".json", delete=False) as f:
            f.write(tokenizer.to_str())
        os.replace(f.name, path)
    except OSError as error:
        logger.info("tokenizer not cached (%s): it is rebuilt at each load", error)
    return tokenizer
