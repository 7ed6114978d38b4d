"""Kernels in C (``native/*.c``), compiled for this machine on first use and called through
ctypes: decode attention, the cache write, the residual add with an RMS norm; pruning's patterns
and block scores (``block_kernels.py``); rotation, per-head norms, the gated MLP's activation and
a decode step's layers in one call (``native_decoder.py``); GGUF string arrays' walk.

Why C and not a torch extension: the kernels take raw pointers and need no torch headers, so
they compile in well under a second (a torch extension takes most of a minute on 2 cores), and
a ctypes call costs a few microseconds. Built with ``-march=native`` (``x86-64-v3`` when ATen is
held to AVX2) into the user's cache, under a name that carries the source's hash, the flags, the
compiler and the CPU's flags: a cache shared by machines with different instruction sets never
runs code built for another.

Without a C compiler, or with ``ETINFER_NATIVE=0``, ``available()`` is False and callers take
their torch path (tested against these kernels).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path
from shutil import which

import torch

logger = logging.getLogger("etinfer.model")

_NAMES = (
    "kernels", "block_sparse", "block_summaries", "key_sketch", "decoder", "row_scores",
    "gguf_strings", "token_choice",
)  # fmt: skip
_SOURCES = [Path(__file__).parent / "native" / f"{name}.c" for name in _NAMES]
_FLAGS = ["-O3", "-fno-math-errno", "-shared", "-fPIC"]
# OpenMP: the kernels share work on torch's own threads (the libgomp torch loaded first is the
# one the library links), where threads started by the library fought torch's spinning ones. A
# compiler without it (clang lacking libomp) builds them without: the pragmas are ignored and
# each call runs on one thread, with the same results.
_OPENMP = ["-fopenmp"]
# Entries per thread below which decode attention runs on one. On torch's threads a split costs
# a few microseconds, so even batch 1 (about 3K entries a layer at 300 tokens) gains: 1.1 ms
# against 1.5 for a step's 30 calls, held to AVX2.
_ENTRIES_PER_THREAD = 1024
# The element types of a KV cache the kernels read and write, by their number in kernels.c (int8
# with a float32 scale per row).
KV_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    """The C compiler the kernels are built with (``CC`` first), if any."""
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and which(c)), None)


def target() -> list[str]:
    """For this CPU, unless ATen is held to AVX2 (as `--isa avx2` in the benchmarks does): then
    for AVX2 and FMA alone (x86-64-v3), so that a measurement held to AVX2 is one."""
    held = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2"
    return ["-march=x86-64-v3" if held else "-march=native"]


def build_library(sources: list[Path], target: list[str]) -> Path:
    """``sources`` compiled for ``target`` into a shared library in the user's cache (built
    once: the name carries a hash of the sources, the flags, the compiler and the CPU's flags),
    with OpenMP where the compiler has it. Raises NoCompiler, or CalledProcessError when the
    build fails."""
    cc = compiler()
    if cc is None:
        raise NoCompiler("no C compiler found")
    try:
        return _build(cc, sources, [*_FLAGS, *_OPENMP, *target])
    except subprocess.CalledProcessError as error:
        library = _build(cc, sources, [*_FLAGS, *target])
        said = (error.stderr or "").strip().splitlines()
        logger.warning("native kernels built without OpenMP, on one thread: %s", said[-1:])
        return library


def _build(compiler: str, sources: list[Path], flags: list[str]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = sorted({h for source in sources for h in source.parent.glob("*.h")})
    texts = [path.read_text() for path in [*sources, *headers]]
    key = hashlib.sha256(
        "\n".join([*texts, " ".join(flags), version, cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "etinfer" / "native"
    library = cache / f"kernels-{key}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: processes building at once never load half a file.
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        with tempfile.TemporaryDirectory(dir=cache) as work:
            # Each source compiled at once in a process of its own, then linked: the first run
            # on a fresh machine waits for the slowest file, not for all of them in turn.
            objects = [Path(work) / f"{source.stem}.o" for source in sources]
            _run_all(
                [compiler, *flags, "-c", "-o", str(obj), str(source)]
                for source, obj in zip(sources, objects, strict=True)
            )
            _run_all([[compiler, *flags, "-o", str(partial), *map(str, objects), "-lm"]])
        os.replace(partial, library)
    finally:
        partial.unlink(missing_ok=True)
    return library


def _run_all(commands) -> None:
    """Run ``commands`` side by side; raise CalledProcessError for the first that failed."""
    running = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for command in commands
    ]
    said = [process.communicate() for process in running]
    for process, (out, err) in zip(running, said, strict=True):
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, out, err)


class NoCompiler(RuntimeError):
    """No C compiler on this machine (``CC``, cc, gcc or clang)."""


# Each exported function's result type, then its arguments' (void: None).
_P, _I, _F, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SKETCH = (_P,) * 5 + (_I,) * 7 + (_F, _P, _I)  # the sketch kernels' shared arguments
_SIGNATURES: dict[str, tuple] = {
    "decode_attention": (_C, *(_P,) * 6, *(_I,) * 5, _F, *(_P,) * 4, _I, _C, _P, _P),
    "write_cache": (_C, *(_P,) * 5, *(_I,) * 6, _C, _P, _P),
    "residual_rms_norm": (None, _P, _P, _C, _P, _I, _I, _F, _P, _P, _C),
    "decode_pattern": (_I, *(_P,) * 3, *(_I,) * 7, *(_P,) * 4, _I),
    "key_bound_scores": (_C, _P, _P, _C, _P, *(_I,) * 6, _P, _I),
    "key_digest_scores": (_C, *(_P,) * 4, *(_I,) * 6, _F, _P, _I),
    "sketch_block_scores": (_C, *_SKETCH),
    "sketch_token_pattern": (_C, *_SKETCH, _P, _I, _I, _P, _P),
    "project_queries": (None, _P, _P, *(_I,) * 5, _P),
    "token_offsets": (_C, _P, _P, *(_I,) * 5, _P),
    "keep_largest": (None, _P, _P, _I, _I, _P, _P),
    "update_block_summaries": (None, *(_P,) * 4, _C, _P, *(_I,) * 5, _P, _I, _P, _C, *(_P,) * 3),
    "observe_block_mass": (None, *(_P,) * 5, *(_I,) * 3),
    "score_rows": (_C, _P, _I, _I, _P, _I, _I, *(_P,) * 4),
    "top_ids": (_C, _P, _I, _I, _I, _I, _P),
    "rotate_heads": (None, _P, *(_I,) * 4, _P, _P),
    "norm_heads": (None, _P, *(_I,) * 4, _P, _F),
    "gated_activation": (None, _P, _I, _I, _I, _P),
    "decoder_work_floats": (_I, _P, _I, _I),
    "decode_layers": (_C, _P, _P, _I, _P),
    "gguf_strings_end": (_I, _P, _I, _I, _I),
    "gguf_strings_join": (_C, _P, _I, _I, _P),
}


def compiled(target: list[str]) -> ctypes.CDLL:
    """The kernels built for ``target`` (e.g. ``["-march=x86-64-v3"]``, beside the fixed
    optimisation flags) and loaded, their signatures declared. The engine's build is
    ``compiled(target())``; the tests build others, to check the code generated for other
    hosts. Raises NoCompiler, or CalledProcessError or OSError when the build or the load
    fails."""
    library = ctypes.CDLL(str(build_library(_SOURCES, target)))
    for name, (restype, *argtypes) in _SIGNATURES.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def enabled() -> bool:
    """False where the user turned the kernels off (``ETINFER_NATIVE=0``)."""
    return os.environ.get("ETINFER_NATIVE", "1") != "0"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The engine's build of the kernels, or None where they are off or cannot be built."""
    if not enabled():
        return None
    try:
        return compiled(target())
    except NoCompiler:
        logger.info("no C compiler found: the native kernels' work runs as torch operations")
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        logger.warning("native kernels not built (%s): their work runs as torch operations", detail)
    return None


def available() -> bool:
    return library() is not None


def takes(head_dim: int, group: int) -> bool:
    """Whether the decode kernel takes this head size and number of query heads per KV head
    (the limits of native/kernels.c)."""
    return head_dim % 8 == 0 and head_dim <= 256 and 1 <= group <= 16


def residual_rms_norm(
    x: torch.Tensor,  # [rows, hidden] float32
    residual: torch.Tensor | None,  # [rows, hidden] bfloat16 or float32
    weight: torch.Tensor,  # [hidden] float32
    eps: float,
    out_dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` (float32) and its RMS norm times ``weight`` in ``out_dtype`` (bfloat16
    or float32), in one pass."""
    native = library()
    assert native is not None, "check available() first"
    rows, hidden = x.shape
    # Held in names until the call returns: a temporary's memory could be reused before it.
    x, weight = x.contiguous(), weight.contiguous()
    residual = None if residual is None else residual.contiguous()
    out = x if residual is None else torch.empty_like(x)
    h = torch.empty(rows, hidden, dtype=out_dtype)
    native.residual_rms_norm(
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        residual is not None and residual.dtype == torch.float32,
        weight.data_ptr(),
        rows,
        hidden,
        eps,
        out.data_ptr(),
        h.data_ptr(),
        out_dtype == torch.float32,
    )
    return out, h


def write_cache(
    key_cache: torch.Tensor,  # [kv_heads, slots, dim] of a KV_KINDS dtype, contiguous
    value_cache: torch.Tensor,
    keys: torch.Tensor,  # [rows, kv_heads, dim] float32, heads contiguous within a row
    values: torch.Tensor,
    slots: torch.Tensor,  # [rows] int64
    key_scales: torch.Tensor | None = None,  # [kv_heads, slots] float32, for an int8 cache
    value_scales: torch.Tensor | None = None,
) -> bool:
    """Each row's keys and values into its slot, converted to the cache's dtype (rounded to
    nearest even, as ``Tensor.to`` does; int8 with a scale a row, as ``kv_cache.quantize_rows``
    computes it); False (nothing written) where the tensors are not laid out as the kernel reads
    them."""
    native = library()
    kv_heads, num_slots, dim = key_cache.shape
    if key_cache.dtype not in KV_KINDS or value_cache.dtype != key_cache.dtype:
        return False
    if (key_cache.dtype == torch.int8) != (key_scales is not None and value_scales is not None):
        raise ValueError("an int8 cache is written with its scales, and only an int8 cache")
    for rows in (keys, values):
        if rows.shape != (slots.shape[0], kv_heads, dim) or rows.dtype != torch.float32:
            return False
        if rows.stride()[1:] != (dim, 1):
            return False
    if native is None or slots.dtype != torch.int64 or not slots.is_contiguous():
        return False
    status = native.write_cache(
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        slots.data_ptr(),
        slots.shape[0],
        kv_heads,
        num_slots,
        dim,
        keys.stride(0),
        values.stride(0),
        KV_KINDS[key_cache.dtype],
        None if key_scales is None else key_scales.data_ptr(),
        None if value_scales is None else value_scales.data_ptr(),
    )
    if status != 0:
        raise IndexError(f"a cache slot outside [0, {num_slots}) in {slots.tolist()}")
    return True


def attention_threads(entries: int) -> int:
    """The threads decode attention shares a call's ``entries`` pattern entries among."""
    return min(torch.get_num_threads(), 1 + entries // _ENTRIES_PER_THREAD)


def decode_attention(
    q: torch.Tensor,  # [rows, dim] float32
    keys: torch.Tensor,  # [cache rows, dim] of a KV_KINDS dtype
    values: torch.Tensor,
    crow: torch.Tensor,  # [rows + 1] int32
    cols: torch.Tensor,  # [nnz] int32
    outside: torch.Tensor,  # [nnz] uint8, 1 where the entry is outside the context
    group: int,  # consecutive rows that read the same entries (query heads of one KV head)
    scale: float,
    key_scales: torch.Tensor | None = None,  # [cache rows] float32, for an int8 cache
    value_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax attention of each query row over its pattern's cache rows: the output [rows, dim],
    each row's largest score and softmax denominator, and each entry's ``exp(score - max)``."""
    native = library()
    assert native is not None, "check available() first"
    rows, dim = q.shape
    # The buffers' sizes, which the C side cannot see (it checks the pattern's values); the
    # dtypes and layouts are the caller's (paged attention's cache and pattern always match).
    if crow.shape[0] != rows + 1 or outside.shape != cols.shape or keys.shape != values.shape:
        raise ValueError(
            "decode attention: crow must hold rows + 1 offsets, outside a flag an entry"
        )
    if keys.shape[1] != dim:
        raise ValueError(f"decode attention: keys and values must be [cache rows, {dim}]")
    if keys.dtype not in KV_KINDS or values.dtype != keys.dtype:
        raise ValueError(
            f"decode attention: keys and values of one dtype among {list(KV_KINDS)}, got "
            f"{keys.dtype} and {values.dtype}"
        )
    scaled = key_scales is not None and value_scales is not None
    if (keys.dtype == torch.int8) != scaled or (
        scaled and not key_scales.shape == value_scales.shape == keys.shape[:1]
    ):
        raise ValueError("decode attention: an int8 cache comes with a scale a row, only it")
    q = q.contiguous()
    out = torch.empty_like(q)
    stats = torch.empty(2, rows, dtype=torch.float32)
    weights = torch.empty(cols.shape[0], dtype=torch.float32)
    threads = attention_threads(cols.shape[0])
    status = native.decode_attention(
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        crow.data_ptr(),
        cols.data_ptr(),
        outside.data_ptr(),
        rows,
        dim,
        cols.shape[0],
        keys.shape[0],
        group,
        scale,
        out.data_ptr(),
        stats[0].data_ptr(),
        stats[1].data_ptr(),
        weights.data_ptr(),
        threads,
        KV_KINDS[keys.dtype],
        None if key_scales is None else key_scales.data_ptr(),
        None if value_scales is None else value_scales.data_ptr(),
    )
    if status == -2:
        raise IndexError(
            f"decode attention: a pattern entry outside [0, {keys.shape[0]}) rows, or offsets "
            f"that do not count the {cols.shape[0]} entries in order"
        )
    if status != 0:
        raise ValueError(
            f"decode attention: {group} rows a group, head size {dim}, or rows of one group "
            "with different entries are outside what the kernel takes"
        )
    return out, stats[0], stats[1], weights
