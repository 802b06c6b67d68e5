"""Triton kernels for `gpu.sparse`: page summaries and varlen page scoring.

Top-k and the `Selection` objects stay in `gpu.sparse.select_top_k` (one torch.topk over all
requests); the kernels here produce what it consumes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.gpu.sparse import check_ragged
from kvstore.errors import InvalidArgument

SUMMARY_TILE = 256  # channels (kv_heads * head_dim) per program
SCORE_PAGES = 16  # pages per program


@triton.jit
def _summary_kernel(
    k_ptr, ids_ptr, out_ptr, n, stride_layer, stride_page, out_rows,
    T: tl.constexpr, BLOCK_T: tl.constexpr, HD: tl.constexpr, TILE: tl.constexpr,
    AT_PAGE: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = pid // n
    i = pid % n
    page = tl.load(ids_ptr + i).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (t < T)[:, None] & (c < HD)[None, :]
    src = layer.to(tl.int64) * stride_layer + page * stride_page + t[:, None] * HD + c[None, :]
    k = tl.load(k_ptr + src, mask=mask, other=0.0).to(tl.float32)
    kmin = tl.min(tl.where(mask, k, float("inf")), axis=0)
    kmax = tl.max(tl.where(mask, k, float("-inf")), axis=0)
    row = page if AT_PAGE else i.to(tl.int64)
    dst = (layer.to(tl.int64) * out_rows + row) * (2 * HD) + c
    tl.store(out_ptr + dst, kmin, mask=c < HD)
    tl.store(out_ptr + dst + HD, kmax, mask=c < HD)


@triton.jit
def _score_kernel(
    q_ptr, s_ptr, table_ptr, cu_ptr, out_ptr,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0)
    start = tl.load(cu_ptr + r)
    end = tl.load(cu_ptr + r + 1)
    idx = start + tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = idx < end
    pages = tl.load(table_ptr + idx, mask=pmask, other=0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = pmask[:, None] & (d < D)[None, :]
    acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for h in tl.static_range(KV_HEADS):
        base = pages[:, None] * (2 * KV_HEADS * D) + h * D + d[None, :]
        kmin = tl.load(s_ptr + base, mask=mask, other=0.0)
        kmax = tl.load(s_ptr + base + KV_HEADS * D, mask=mask, other=0.0)
        for g in tl.static_range(GROUP):
            q_off = (r.to(tl.int64) * KV_HEADS * GROUP + h * GROUP + g) * D + d
            q = tl.load(q_ptr + q_off, mask=d < D, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(tl.maximum(q * kmin, q * kmax), axis=1)
    tl.store(out_ptr + idx, acc, mask=pmask)


def _summaries_into(k_cache: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor, at_page: bool) -> None:
    layers, _, tokens, kv_heads, head_dim = k_cache.shape
    if k_cache.shape[1] and not k_cache[0, 0].is_contiguous():
        raise InvalidArgument("each page of the key cache must be contiguous")
    n = page_ids.numel()
    if n == 0:
        return
    hd = kv_heads * head_dim
    tile = min(SUMMARY_TILE, triton.next_power_of_2(hd))
    _summary_kernel[(layers * n, triton.cdiv(hd, tile))](
        k_cache, page_ids.contiguous(), out, n, k_cache.stride(0), k_cache.stride(1), out.shape[1],
        T=tokens, BLOCK_T=triton.next_power_of_2(tokens), HD=hd, TILE=tile, AT_PAGE=at_page,
    )


def page_summaries(k_cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Triton twin of `gpu.sparse.page_summaries`."""
    layers, _, _, kv_heads, head_dim = k_cache.shape
    shape = (layers, page_ids.numel(), 2, kv_heads, head_dim)
    out = torch.empty(shape, dtype=torch.float32, device=k_cache.device)
    _summaries_into(k_cache, page_ids, out, at_page=False)
    return out


def update_summaries(k_cache: torch.Tensor, summaries: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Triton twin of `gpu.sparse.update_summaries` (summaries must be contiguous fp32)."""
    if summaries.dtype != torch.float32 or not summaries.is_contiguous():
        raise InvalidArgument("summaries must be a contiguous fp32 [layers, pages, 2, kv_heads, head_dim]")
    _summaries_into(k_cache, page_ids, summaries, at_page=True)


def score_pages(queries: torch.Tensor, summaries: torch.Tensor, page_table: torch.Tensor,
                cu_pages: torch.Tensor) -> torch.Tensor:
    """Triton twin of `gpu.sparse.score_pages` (one launch for every request)."""
    num, q_heads, head_dim = queries.shape
    check_ragged(page_table, cu_pages, num)
    kv_heads = summaries.shape[2]
    if q_heads % kv_heads:
        raise InvalidArgument(f"{q_heads} query heads do not group over {kv_heads} kv heads")
    scores = torch.empty(page_table.numel(), dtype=torch.float32, device=queries.device)
    if page_table.numel() == 0:
        return scores
    widest = int((cu_pages[1:] - cu_pages[:-1]).max())
    block_p = min(SCORE_PAGES, triton.next_power_of_2(widest))
    _score_kernel[(num, triton.cdiv(widest, block_p))](
        queries.contiguous(), summaries.float().contiguous(), page_table.contiguous(),
        cu_pages.contiguous(), scores,
        KV_HEADS=kv_heads, GROUP=q_heads // kv_heads, D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_P=block_p,
    )
    return scores
