"""The one computation of a chunk's KV that every path of the reference engine shares.

A chunk of C tokens is computed as one forward of exactly those C tokens, for one sequence
alone, attending over the KV of the chunks before it (`LlamaModel.forward` on a one-segment
batch). Its bytes then depend only on the model, dtype, device and the tokens before and in
it, so a reader gets from the store exactly what it would have computed itself:

- `Engine` with `prefill_align` (what `StoreEngine` sets to the chunk size) prefills in
  chunk-aligned pieces and runs each piece of a batched prefill step as its own forward
  (batch-invariant: another request in the same step changes no bit);
- `SparseDecoder.prefill` computes its prompt with `prefill` below (the same pieces);
- `StoreEngine` recomputes a chunk completed while decoding (its KV was computed a token at
  a time) with `prefill` before it saves it;
- `HybridEngine` computes its prompt in the same chunk-aligned pieces.

The piece that holds a prompt's last token may be shorter than a chunk; it is never stored
(only full chunks are), and every path computes it the same way after the same full chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument

from .batch import Segment, build_batch
from .kv_cache import CacheConfig, PagedKVCache
from .model import LlamaModel


def pieces(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) cut at every multiple of chunk_tokens."""
    cuts = list(range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens))
    return list(zip([start] + cuts, cuts + [end]))


@dataclass(frozen=True, slots=True)
class ChunkedPrefill:
    kv: torch.Tensor  # [layers, 2, end - start, kv_heads, head_dim] of the tokens computed
    logits: torch.Tensor  # [vocab] float32, of the last token
    last_q: torch.Tensor  # [layers, heads, head_dim], the last token's query, RoPE applied


@torch.inference_mode()
def prefill(model: LlamaModel, token_ids: list[int], chunk_tokens: int, page_tokens: int,
            context: torch.Tensor | None = None) -> ChunkedPrefill:
    """Compute tokens [start, len(token_ids)) in chunk-aligned pieces, one sequence alone,
    after `context` ([layers, 2, start, kv_heads, head_dim], the KV of tokens [0, start) as
    the canonical computation gave it; None: start = 0). Runs on a scratch paged cache."""
    start = 0 if context is None else context.shape[2]
    if chunk_tokens % page_tokens or start % chunk_tokens or not start < len(token_ids):
        raise InvalidArgument(f"chunked prefill of [{start}, {len(token_ids)}): the context must "
                              f"end on a chunk boundary ({chunk_tokens}, a multiple of the page "
                              f"size {page_tokens}) before the last token")
    c = model.config
    cache = PagedKVCache(CacheConfig(
        num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        num_pages=-(-len(token_ids) // page_tokens), page_tokens=page_tokens,
        dtype=model.dtype, device=model.device))
    cache.allocate(0, len(token_ids))
    if start:
        cache.write(0, 0, context)
    logits, queries = None, []
    for lo, hi in pieces(start, len(token_ids), chunk_tokens):
        queries.clear()
        logits = model.forward(build_batch([Segment(0, lo, token_ids[lo:hi])], cache), cache, queries)
    return ChunkedPrefill(cache.read(0, start, len(token_ids)), logits[0],
                          torch.stack(queries)[:, 0])
