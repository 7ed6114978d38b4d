"""The merges rebuilt from a GGUF file's SentencePiece vocabulary, kept on disk once built.

A SentencePiece vocabulary holds no merges: rebuilding them (``sentencepiece.gemma_merges``)
for Gemma 3's 262,144 pieces takes seconds, where llama.cpp loads the whole file in about 0.5
s. They are kept as pairs of token ids (a 2 MB array for Gemma 3, read back in milliseconds)
rather than as a whole serialised tokenizer: `tokenizers` reads its own JSON of that vocabulary
in 1.1-1.5 s, and builds the same tokenizer from the vocabulary and merges handed to it in
Python in a third of that. The name carries a hash of everything the build reads (the
vocabulary and the source of the code that rebuilds it), so a changed file or a changed
rebuild never reads stale merges.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from etinfer.model.sentencepiece import Merges

logger = logging.getLogger(__name__)


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "etinfer" / "tokenizers"


def cached_merges(
    tokens: list[str],
    inputs: Iterable[object],
    sources: Iterable[Path],
    build: Callable[[], Merges],
) -> Merges:
    """``build()``'s merges of ``tokens``, from the cache where a build from the same
    ``tokens`` and ``inputs`` (hashed by their ``repr``) by the same ``sources`` was kept;
    else built and kept (where the cache cannot be written, built each time)."""
    key = hashlib.sha256("\0".join(tokens).encode())  # a tenth of the time of its repr
    for item in (*(path.read_bytes() for path in sources), len(tokens), *inputs):
        key.update(b"\0")
        key.update(repr(item).encode())
    path = cache_folder() / f"{key.hexdigest()[:24]}.npy"
    if path.exists():
        try:
            pairs = np.load(path, allow_pickle=False)
            if pairs.ndim != 2 or pairs.shape[1] != 2:
                raise ValueError(f"pairs of shape {pairs.shape}")
            # Flat lists of ids (no list a pair), and an id past the vocabulary raises
            # IndexError here, rebuilt below.
            left, right = (map(tokens.__getitem__, column.tolist()) for column in pairs.T)
            return list(zip(left, right, strict=True))
        except Exception as error:  # a damaged file: built again below, and replaced
            logger.warning("merges cache %s unreadable (%s): rebuilding it", path, error)
    merges = build()
    ids = {token: i for i, token in enumerate(tokens)}
    pairs = np.array([(ids[left], ids[right]) for left, right in merges], np.int32).reshape(-1, 2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed: a process reading at once never sees half.
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as f:
            np.save(f, pairs)
        os.replace(f.name, path)
    except OSError as error:
        logger.info("merges not cached (%s): they are rebuilt at each load", error)
    return merges
