"""The native forms of block-sparse decode's bookkeeping (``native/block_sparse.c``,
``native/block_summaries.c``, ``native/key_sketch.c``, ``native/token_choice.c``): the CSR
pattern of the blocks each decode row reads, the key-bound and digest scores of every block,
the blocks' scores from the low-rank key copy and the pattern of the single tokens it ranks
best, the mask of each row's best blocks, and the mass attention gave each block.

Each replaces some twenty torch operations a layer, which at 8K tokens of context cost more than
the attention that pruning saves. Their torch forms (``attention/pattern.py``,
``control/block_selection.py``, ``control/key_sketch.py``) remain for other devices and where
the kernels are off; the tests hold each pair to the same answers. Every function returns None
where the native form does not apply, and its caller then takes the torch one.
"""

from __future__ import annotations

import torch

from etinfer.model import native_kernels
from etinfer.model.key_copy import copy_shape

# The types key bounds are read in: float32, or a 16-bit cache's own type.
BOUND_KINDS = {
    dtype: native_kernels.KV_KINDS[dtype]
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
}
# The largest rank the native sketch scores take (native/key_sketch.c's: its integer dot products
# stay exact).
MAX_SKETCH_RANK = 512


def _native(*tensors: torch.Tensor):
    """The loaded kernels where every tensor is on the CPU, else None."""
    if any(t.device.type != "cpu" for t in tensors):
        return None
    return native_kernels.library()


def decode_pattern(
    tables: torch.Tensor,  # [rows, width] block ids
    context_lens: torch.Tensor,  # [rows]
    block_size: int,
    num_kv_heads: int,
    group: int,
    num_blocks: int,
    block_mask: torch.Tensor | None,  # [rows, kv_heads, width] bool, or None for every block
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(visible, crow, cols, outside)`` as ``attention/pattern.py``'s ``visible_blocks`` and
    ``build_decode_pattern`` compute them, bit for bit."""
    native = _native(tables, context_lens)
    if native is None:
        return None
    rows, width = tables.shape
    query_rows = rows * num_kv_heads * group
    capacity = query_rows * width * block_size
    if capacity >= 2**31:  # the entries' int32 offsets: the torch form checks the exact count
        return None
    tables = tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    mask = None if block_mask is None else block_mask.to(torch.uint8).contiguous()
    visible = torch.empty(rows, num_kv_heads, width, dtype=torch.bool)
    crow = torch.empty(query_rows + 1, dtype=torch.int32)
    # Room for every block of every row; only the entries written are kept (views).
    cols = torch.empty(capacity, dtype=torch.int32)
    outside = torch.empty(capacity, dtype=torch.uint8)
    entries = native.decode_pattern(
        tables.data_ptr(),
        lens.data_ptr(),
        None if mask is None else mask.data_ptr(),
        rows,
        num_kv_heads,
        width,
        group,
        block_size,
        num_blocks,
        sliding_window or 0,
        visible.data_ptr(),
        crow.data_ptr(),
        cols.data_ptr(),
        outside.data_ptr(),
        capacity,
    )
    if entries < 0:
        raise IndexError(f"decode pattern: a block id outside [0, {num_blocks}) in {tables}")
    return visible, crow, cols[:entries], outside[:entries]


def key_bound_scores(
    query: torch.Tensor,  # [rows, heads, dim] float32
    key_bounds: torch.Tensor,  # [kv_heads, num_blocks, 2, dim]: maxima, then minima
    tables: torch.Tensor,  # [rows, width] block ids
) -> torch.Tensor | None:
    """``[rows, kv_heads, group, width]``: per query head, the upper bound of ``q.k`` over each
    block's keys, as ``control.block_selection.key_bound_scores`` computes it."""
    return _block_scores(
        query,
        key_bounds,
        tables,
        BOUND_KINDS,
        lambda native, q, tables, sizes, out, threads: native.key_bound_scores(
            q, key_bounds.data_ptr(), BOUND_KINDS[key_bounds.dtype], tables, *sizes, out, threads
        ),
    )


def key_digest_scores(
    query: torch.Tensor,  # [rows, heads, dim] float32
    key_moments: torch.Tensor,  # [kv_heads, num_blocks, 2, dim] float32: sums, then squares
    tables: torch.Tensor,  # [rows, width] block ids
    tokens: torch.Tensor,  # [rows, width] keys in each entry
    spread: float,
) -> torch.Tensor | None:
    """``[rows, kv_heads, group, width]``: per query head, each block's ``q.mu + spread *
    ||q * sigma||``, as ``control.block_scores.key_digest_scores`` computes it."""
    tokens = tokens.to(torch.int64).contiguous()
    return _block_scores(
        query,
        key_moments,
        tables,
        {torch.float32},
        lambda native, q, tables, sizes, out, threads: native.key_digest_scores(
            q, key_moments.data_ptr(), tables, tokens.data_ptr(), *sizes, spread, out, threads
        ),
    )


def project_queries(query: torch.Tensor, query_map: torch.Tensor) -> torch.Tensor | None:
    """``[seqs, kv_heads, group, rank]``: each query head's query ``[seqs, heads, dim]`` on its
    KV head's directions ``[kv_heads, dim, rank]`` (float32), as the native decoder projects
    them inside its step: a pruned step chooses the same tokens whichever path it takes."""
    native = _native(query, query_map)
    if native is None or query.dtype != torch.float32 or query_map.dtype != torch.float32:
        return None
    seqs, heads, dim = query.shape
    kv_heads, _, rank = query_map.shape
    query, query_map = query.contiguous(), query_map.contiguous()
    out = torch.empty(seqs, kv_heads, heads // kv_heads, rank)
    native.project_queries(
        query.data_ptr(), query_map.data_ptr(), seqs, kv_heads, heads // kv_heads, dim, rank,
        out.data_ptr(),
    )  # fmt: skip
    return out


def sketch_block_scores(
    projected: torch.Tensor,  # [seqs, kv_heads, group, rank] float32
    codes: torch.Tensor,  # the layer's key copy, int8 (model/key_copy.py)
    code_scales: torch.Tensor,  # [kv_heads, num_slots] float32
    tables: torch.Tensor,  # [seqs, width] block ids (padding past the context is not read)
    lens: torch.Tensor,  # [seqs] tokens in context
    block_size: int,
    scale: float,
) -> torch.Tensor | None:
    """``[seqs, kv_heads, group, width]``: per query head, each block's share of the softmax
    mass under the key copy's scores, in logs (-inf where an entry holds no context), as
    ``control.key_sketch.sketch_block_scores`` computes it in torch."""
    held = _sketch_inputs(projected, codes, code_scales, tables, lens, block_size)
    if held is None:
        return None
    native, tensors, sizes = held
    seqs, kv_heads, group, _, width, _ = sizes
    out = torch.empty(seqs, kv_heads, group, width)
    status = native.sketch_block_scores(
        *(t.data_ptr() for t in tensors), *sizes, block_size, scale, out.data_ptr(),
        _sketch_threads(sizes),
    )  # fmt: skip
    _sketch_status(status, sizes, block_size, tables)
    return out if status == 0 else None


def sketch_token_pattern(  # the inputs of sketch_block_scores, then the choice's
    projected: torch.Tensor,
    codes: torch.Tensor,
    code_scales: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block_size: int,
    scale: float,
    budgets: torch.Tensor,  # [seqs] tokens each sequence keeps (at least its forced ones)
    sink: int,  # the first tokens, always kept
    recent: int,  # the last tokens, always kept
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(crow, cols, kept)``: the cache rows each decode row reads where single tokens are
    kept (the sink and recent tokens and, per KV head, the best others by the most mass any
    query head of its group gives them under the key copy's scores), in the CSR layout of
    ``attention/pattern.py``, and the share of each table entry's context tokens kept
    ``[seqs, kv_heads, width]``, as ``control.key_sketch.sketch_token_pattern`` computes them in
    torch (the same tokens, but for exact ties of scores)."""
    if budgets.device.type != "cpu":
        return None
    held = _sketch_inputs(projected, codes, code_scales, tables, lens, block_size)
    if held is None:
        return None
    native, tensors, sizes = held
    seqs, kv_heads, group, _, width, _ = sizes
    budgets = budgets.to(torch.int64).expand(seqs).contiguous()
    crow = torch.empty(seqs * kv_heads * group + 1, dtype=torch.int32)
    pointers, threads = [t.data_ptr() for t in tensors], _sketch_threads(sizes)
    # First the rows' offsets alone (cheap), for cols' size; then the scores and the choice.
    total = native.sketch_token_pattern(
        *pointers, *sizes, block_size, scale, None, threads, budgets.data_ptr(), sink, recent,
        crow.data_ptr(), None,
    )  # fmt: skip
    if total < 0:  # more entries or cache rows than int32 holds
        return None
    cols = torch.empty(total, dtype=torch.int32)
    kept = torch.empty(seqs, kv_heads, width)
    status = native.sketch_token_pattern(
        *pointers, *sizes, block_size, scale, kept.data_ptr(), threads, budgets.data_ptr(), sink,
        recent, crow.data_ptr(), cols.data_ptr(),
    )  # fmt: skip
    _sketch_status(status, sizes, block_size, tables)
    return (crow, cols, kept) if status >= 0 else None


def _sketch_inputs(projected, codes, code_scales, tables, lens, block_size: int):
    """What the sketch kernels share: None where the native form does not apply (another device,
    a rank above MAX_SKETCH_RANK, other dtypes); else the library, the tensors as it reads them
    (projected, codes, code_scales, tables, lens: the caller holds them in names until the call
    returns, as a temporary's memory could be reused before it) and the sizes (seqs, kv_heads,
    group, rank, width, num_slots)."""
    native = _native(projected, codes, code_scales, tables, lens)
    seqs, kv_heads, group, rank = projected.shape
    if native is None or rank > MAX_SKETCH_RANK or projected.dtype != torch.float32:
        return None
    if codes.dtype != torch.int8 or code_scales.dtype != torch.float32:
        return None
    num_slots = code_scales.shape[-1]
    layout = copy_shape(kv_heads, num_slots // block_size, block_size, rank)
    if codes.shape != layout or code_scales.shape != (kv_heads, num_slots):
        raise ValueError(
            f"sketch scores: codes {tuple(codes.shape)} and scales {tuple(code_scales.shape)} "
            f"for queries projected to {tuple(projected.shape)}"
        )
    tensors = (
        *(t.contiguous() for t in (projected, codes, code_scales)),
        *(t.to(torch.int64).contiguous() for t in (tables, lens)),
    )
    return native, tensors, (seqs, kv_heads, group, rank, tables.shape[1], num_slots)


def _sketch_threads(sizes) -> int:
    return min(torch.get_num_threads(), sizes[0] * sizes[1])


def _sketch_status(status: int, sizes, block_size: int, tables: torch.Tensor) -> None:
    """The sketch kernels' failures raised (-1: a block id of the context outside the cache;
    -3: no scratch); -2 (sizes they do not take) is the caller's None."""
    if status == -1:
        blocks = sizes[-1] // block_size
        raise IndexError(f"sketch scores: a block id outside [0, {blocks}) in {tables}")
    if status == -3:
        raise MemoryError(f"sketch scores: no scratch for {sizes[2]} rows of {sizes[4]} blocks")


def _block_scores(query, summary, tables, kinds, call) -> torch.Tensor | None:
    """What the block scorers share: None where the native form does not apply (another
    device, a head size not a multiple of 8, a summary of another type or layout); else ``out``
    [rows, kv_heads, group, width] as ``call(native, query, tables, sizes, out, threads)`` fills
    it, given the pointers and ``sizes`` (rows, kv_heads, group, width, num_blocks, dim)."""
    rows, heads, dim = query.shape
    kv_heads, num_blocks = summary.shape[:2]
    native = _native(query, summary, tables)
    if native is None or dim % 8 or query.dtype != torch.float32:
        return None
    if summary.dtype not in kinds or not summary.is_contiguous():
        return None
    query, tables = query.contiguous(), tables.to(torch.int64).contiguous()
    width, threads = tables.shape[1], min(torch.get_num_threads(), rows * kv_heads)
    out = torch.empty(rows, kv_heads, heads // kv_heads, width)
    sizes = (rows, kv_heads, heads // kv_heads, width, num_blocks, dim)
    if call(native, query.data_ptr(), tables.data_ptr(), sizes, out.data_ptr(), threads) != 0:
        raise IndexError(f"block scores: a block id outside [0, {num_blocks}) in {tables}")
    return out


def keep_largest(scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor | None:
    """``[..., width]`` bool: the ``budgets[...]`` largest scores of each row (ties at the
    threshold in index order, NaN as -inf), as a top-k and a scatter compute it."""
    native = _native(scores, budgets)
    if native is None or scores.dtype != torch.float32:
        return None
    width = scores.shape[-1]
    flat = scores.reshape(-1, width).contiguous()
    counts = budgets.expand(scores.shape[:-1]).reshape(-1).to(torch.int64).contiguous()
    mask = torch.empty(flat.shape, dtype=torch.bool)
    scratch = torch.empty(width)
    native.keep_largest(
        flat.data_ptr(),
        counts.data_ptr(),
        flat.shape[0],
        width,
        mask.data_ptr(),
        scratch.data_ptr(),
    )
    return mask.view(scores.shape)


def observe_block_mass(
    mass: torch.Tensor,  # [kv_heads, blocks] float32, contiguous
    pattern,  # the decode pattern attention read (``attention/pattern.py``)
    weights: torch.Tensor,  # [nnz] float32 unnormalised weights of its entries
    denominators: torch.Tensor,  # [rows] float32
    block_size: int,
    group: int,
) -> bool:
    """Each attended block's share of attention into ``mass`` (``observe_mass``'s arithmetic);
    False (nothing done) where the native form does not apply."""
    native = _native(mass, weights)
    tensors = (mass, weights, denominators)
    if native is None or any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return False
    native.observe_block_mass(
        mass.data_ptr(), pattern.crow.data_ptr(), pattern.cols.data_ptr(), weights.data_ptr(),
        denominators.data_ptr(), denominators.shape[0], block_size, group,
    )  # fmt: skip
    return True
