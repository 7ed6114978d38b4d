"""Prefill attention over the paged cache, one layer, side by side: SDPA over the gathered prefix
(what the engine runs for a dense chunk over a float32 or int8 cache) against the GPU's
paged-prefill kernel with IEEE float32 dots (what sparse prefill's pieces run over such caches)
and, over a 16-bit cache, with dots in the cache's type on tensor cores (what the engine runs for
both there), on random keys and values in shuffled blocks: a chunk of ``--queries`` after
``--prefix`` cached positions. Each arm's time a call, the median of ``--repeats`` after two
warm-ups, and its largest difference from SDPA; ``--tiles`` adds each kernel arm at other launch
shapes.

    ETINFER_DEVICE=cuda etinfer bench prefill-attention --prefix 6144 --queries 2048

Without a GPU it runs in Triton's interpreter at a toy size only (``TRITON_INTERPRET=1``).
The run's result holds each arm's time a call, its ratio to SDPA's and its largest difference
(its ``details``: the device and the arms' figures by name).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from etinfer.bench.common.results import Figure, add_result_option, recorded
from etinfer.bench.common.timing import median_ms
from etinfer.config import KV_CACHE_DTYPES, EngineConfig
from etinfer.model import gpu
from etinfer.model.attention.metadata import prefill_mask
from etinfer.model.attention.sdpa import grouped_attention
from etinfer.model.gpu.paged_prefill import SIXTEEN_BIT, PrefillTiles, paged_prefill
from etinfer.model.kv_cache import KVCache
from etinfer.options import positive_int

SDPA = "sdpa over the gathered prefix"


def run(args: argparse.Namespace) -> tuple[list[Figure], dict]:
    if not gpu.available():
        raise SystemExit("bench prefill-attention needs Triton (the GPU's kernel)")
    device = EngineConfig(device=args.device).torch_device()
    generator = torch.Generator().manual_seed(0)
    context = args.prefix + args.queries
    blocks = -(-context // args.block_size)
    cache = KVCache(1, blocks + 8, args.block_size, args.kv_heads, args.dim, device,
                    KV_CACHE_DTYPES[args.cache_dtype])  # fmt: skip
    rows = cache.num_slots

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device)

    cache.write(
        0,
        torch.arange(rows, device=device),
        None,
        *(random(rows, args.kv_heads, args.dim) for _ in "kv"),
    )
    order = torch.randperm(blocks + 8, generator=generator)[:blocks].to(device)
    slots = order[:, None] * args.block_size + torch.arange(args.block_size, device=device)
    slots = slots.flatten()[:context]
    q = random(args.queries, args.heads, args.dim)
    scale = args.dim**-0.5
    mask = prefill_mask(args.prefix, args.queries, None, device)

    def sdpa() -> torch.Tensor:
        k, v = cache.read(0, slots)
        # No prefix (``--prefix 0``): no mask, causal over the chunk itself.
        causal = mask is None
        out = grouped_attention(q.transpose(0, 1)[None], k[None], v[None], mask, causal, scale)
        return out[0].transpose(0, 1)

    def kernel(tensor_cores: bool, tiles: PrefillTiles | None) -> Callable[[], torch.Tensor]:
        keys, values = cache.layer_keys[0], cache.layer_values[0]
        scales = cache.layer_scales(0)
        return lambda: paged_prefill(
            q, keys, values, *scales, slots, scale, tensor_cores=tensor_cores, tiles=tiles
        )

    arms: dict[str, Callable[[], torch.Tensor]] = {SDPA: sdpa}
    dots = ["float32"] + (["16-bit"] if cache.dtype in SIXTEEN_BIT else [])
    for tiles in [None, *args.tiles]:
        shape = "" if tiles is None else f", tiles {tiles.queries}x{tiles.keys}x{tiles.warps}"
        for kind in dots:
            arms[f"paged-prefill kernel, {kind} dots{shape}"] = kernel(kind == "16-bit", tiles)
    reference = sdpa()
    figures = {}
    for name, call in arms.items():
        figures[name] = {
            "ms": median_ms(call, args.repeats, device=device, warmups=2),
            "max_difference": (call() - reference).abs().max().item(),
        }
        print(f"{name}: {figures[name]['ms']:.3f} ms a call, "
              f"largest difference from SDPA {figures[name]['max_difference']:.1e}")  # fmt: skip
    return arm_figures(figures, args), {"device": str(device), "arms": figures}


def arm_figures(arms: dict[str, dict[str, float]], args: argparse.Namespace) -> list[Figure]:
    """Each arm's time a call, its ratio to SDPA's and its largest difference from SDPA's."""
    setting = {"prefix": args.prefix, "queries": args.queries, "kv_cache_dtype": args.cache_dtype}
    found = []
    for name, arm in arms.items():
        labels = {"arm": name} | setting
        found.append(Figure("prefill attention", arm["ms"], "ms", labels, n=args.repeats))
        if name != SDPA:
            ratio = arm["ms"] / arms[SDPA]["ms"]
            found.append(Figure("prefill attention", ratio, "x", labels | {"vs": "sdpa"}))
            found.append(Figure("largest difference", arm["max_difference"], "", labels))
    return found


def tiles_option(text: str) -> PrefillTiles:
    """``--tiles`` values: ``64x64x4`` (powers of two, queries and keys 16 or more)."""
    try:
        tiles = PrefillTiles(*(int(part) for part in text.split("x")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not QUERIESxKEYSxWARPS") from None
    if any(n < 1 or n & (n - 1) for n in tiles) or min(tiles.queries, tiles.keys) < 16:
        raise argparse.ArgumentTypeError(f"{text!r}: powers of two, queries and keys >= 16")
    return tiles


def add_command(kinds: argparse._SubParsersAction) -> None:
    parser = kinds.add_parser(
        "prefill-attention", help="one layer's prefill attention: SDPA against the GPU kernel"
    )
    parser.add_argument("--device", default="auto", help="auto (ETINFER_DEVICE), cuda, cpu")
    parser.add_argument("--prefix", type=int, default=6144, help="cached positions before")
    parser.add_argument("--queries", type=positive_int, default=2048, help="the chunk's queries")
    parser.add_argument("--heads", type=positive_int, default=9)
    parser.add_argument("--kv-heads", type=positive_int, default=3)
    parser.add_argument("--dim", type=positive_int, default=64)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--cache-dtype", default="bfloat16", choices=sorted(KV_CACHE_DTYPES))
    parser.add_argument("--repeats", type=positive_int, default=10)
    parser.add_argument(
        "--tiles", nargs="*", type=tiles_option, default=[], metavar="QxKxW",
        help="more launch shapes of the kernel: queries a program, keys an iteration, warps",
    )  # fmt: skip
    add_result_option(parser)
    parser.set_defaults(func=recorded("prefill-attention", run))
