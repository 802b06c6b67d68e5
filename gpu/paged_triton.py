"""Triton kernel for `gpu.paged`: one launch moves a whole batch of chunks.

Grid: (num_chunks * layers * blocks, tiles per page). A program owns one (chunk, layer, block)
segment and one tile of its page; it copies that tile of K and, for paged layouts, of V. The
program index walks segments in the layout's order, so neighbouring programs write neighbouring
bytes of the chunk. Elements move as same-width integers: any dtype, bits untouched.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from kvstore.gpu.paged import PagedGeometry, as_bits
from kvstore.layout import Layout

TILE_BYTES = 16384  # per program and part: 16 KiB keeps many loads in flight per SM


@triton.jit
def _page_copy_kernel(
    k_ptr, v_ptr, chunk_ptr, ids_ptr, stride_layer, stride_page, layers, blocks,
    PAGE_ELEMS: tl.constexpr, TILE: tl.constexpr, HAS_V: tl.constexpr,
    LAYER_FIRST: tl.constexpr, SCATTER: tl.constexpr,
):
    pid = tl.program_id(0)
    per_chunk = layers * blocks
    chunk = pid // per_chunk
    seg = pid % per_chunk  # segment index inside the chunk, in layout order
    if LAYER_FIRST:
        layer = seg // blocks
        block = seg % blocks
    else:
        block = seg // layers
        layer = seg % layers
    page = tl.load(ids_ptr + chunk * blocks + block).to(tl.int64)
    offs = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offs < PAGE_ELEMS
    # a scalar `page >= 0` in a mask trips the interpreter: broadcast it to the tile first
    page_mask = mask & (tl.full([TILE], 0, tl.int64) + page >= 0)
    src = layer.to(tl.int64) * stride_layer + page * stride_page + offs
    parts: tl.constexpr = 2 if HAS_V else 1
    dst = (chunk.to(tl.int64) * per_chunk + seg) * (parts * PAGE_ELEMS) + offs
    if SCATTER:
        tl.store(k_ptr + src, tl.load(chunk_ptr + dst, mask=page_mask), mask=page_mask)
        if HAS_V:
            x = tl.load(chunk_ptr + dst + PAGE_ELEMS, mask=page_mask)
            tl.store(v_ptr + src, x, mask=page_mask)
    else:
        tl.store(chunk_ptr + dst, tl.load(k_ptr + src, mask=page_mask, other=0), mask=mask)
        if HAS_V:
            x = tl.load(v_ptr + src, mask=page_mask, other=0)
            tl.store(chunk_ptr + dst + PAGE_ELEMS, x, mask=mask)


def _launch(chunks: torch.Tensor, caches: Sequence[torch.Tensor], page_ids: torch.Tensor,
            geo: PagedGeometry, scatter: bool) -> None:
    num_chunks, blocks = page_ids.shape
    if num_chunks == 0 or caches[0].shape[1] == 0:
        return
    bits = [as_bits(c) for c in caches]
    tile = min(triton.next_power_of_2(geo.page_elements), max(1, TILE_BYTES // caches[0].element_size()))
    grid = (num_chunks * geo.layers * blocks, triton.cdiv(geo.page_elements, tile))
    _page_copy_kernel[grid](
        bits[0], bits[-1], as_bits(chunks), page_ids.contiguous(),
        bits[0].stride(0), bits[0].stride(1), geo.layers, blocks,
        PAGE_ELEMS=geo.page_elements, TILE=tile, HAS_V=geo.parts == 2,
        LAYER_FIRST=geo.layer_first, SCATTER=scatter,
    )


def gather_chunks(
    caches: Sequence[torch.Tensor], page_ids: torch.Tensor, layout: Layout | str
) -> torch.Tensor:
    """Triton twin of `gpu.paged.gather_chunks`."""
    geo = PagedGeometry.from_layout(layout)
    geo.check(caches, page_ids)
    out = torch.empty(page_ids.shape[0], geo.chunk_elements(page_ids.shape[1]),
                      dtype=caches[0].dtype, device=caches[0].device)
    _launch(out, caches, page_ids, geo, scatter=False)
    return out


def scatter_chunks(
    chunks: torch.Tensor, caches: Sequence[torch.Tensor], page_ids: torch.Tensor, layout: Layout | str
) -> None:
    """Triton twin of `gpu.paged.scatter_chunks` (in place)."""
    geo = PagedGeometry.from_layout(layout)
    geo.check_chunks(chunks, caches, page_ids)
    _launch(chunks.contiguous(), caches, page_ids, geo, scatter=True)
