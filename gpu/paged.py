"""Gather and scatter between an engine's paged cache and the store's chunk layout (reference).

Engine side
    paged KV: K and V are two tensors, each [layers, pages, page_tokens, kv_heads, head_dim]
    (vLLM keeps them separate; an engine with one [2, layers, ...] tensor passes cache[0] and
    cache[1], which are views). MLA: one tensor [layers, pages, page_tokens, latent_dim + rope_dim].
    So `caches` is `(k_cache, v_cache)` for a `paged(...)` layout and `(latent_cache,)` for
    `mla(...)`. Each page ([page_tokens, ...]) must be contiguous; layer and page strides are free.

Store side
    One chunk of `chunk_tokens = blocks * page_tokens` tokens is one object laid out as in
    `kvstore.layout`: segments (layer, block), in layer_first or block_first order; a paged
    segment is K then V of that block ([2, block, kv_heads, head_dim]), an MLA segment is
    [block, latent_dim + rope_dim]. The layout's `block` must equal the engine's page_tokens.
    A batch of chunks is a tensor [num_chunks, chunk_elements] in the cache's dtype (view it as
    uint8 for the object's bytes).

`page_ids` [num_chunks, blocks] (int32 or int64, on the caches' device) gives, for block b of
chunk c, the engine page that holds it; a negative id (-1) means "not here": gather writes zeros
there, scatter leaves the cache untouched (a sparse load that brings only selected blocks). Page ids in one scatter must be distinct (the
kernel does not check: duplicates leave either value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvstore.errors import InvalidArgument
from kvstore.layout import Layout


@dataclass(frozen=True, slots=True)
class PagedGeometry:
    """What the gather/scatter kernels need from a layout."""

    layers: int
    page_tokens: int
    parts: int  # 2 (K and V) for paged, 1 for mla
    token_shape: tuple[int, ...]  # (kv_heads, head_dim) or (latent_dim + rope_dim,)
    layer_first: bool

    @classmethod
    def from_layout(cls, layout: Layout | str) -> PagedGeometry:
        layout = Layout.parse(layout) if isinstance(layout, str) else layout
        p = dict(layout.params)
        if layout.name == "paged":
            shape, parts = (int(p["kv_heads"]), int(p["head_dim"])), 2
        elif layout.name == "mla":
            shape, parts = (int(p["latent_dim"]) + int(p["rope_dim"]),), 1
        else:
            raise InvalidArgument(f"gather/scatter need a paged or mla layout, got {layout}")
        return cls(int(p["layers"]), int(p["block"]), parts, shape, p["order"] == "layer_first")

    @property
    def page_elements(self) -> int:
        n = self.page_tokens
        for d in self.token_shape:
            n *= d
        return n

    @property
    def segment_elements(self) -> int:
        return self.parts * self.page_elements

    def chunk_elements(self, blocks: int) -> int:
        return self.layers * blocks * self.segment_elements

    def check_caches(self, caches: Sequence[torch.Tensor]) -> None:
        """Raise InvalidArgument unless `caches` fit this geometry (see module docstring)."""
        if len(caches) != self.parts:
            raise InvalidArgument(f"expected {self.parts} cache tensor(s), got {len(caches)}")
        first = caches[0]
        for cache in caches:
            pages = cache.shape[1] if cache.dim() > 1 else 0
            want = (self.layers, pages, self.page_tokens, *self.token_shape)
            if tuple(cache.shape) != want:
                raise InvalidArgument(
                    f"cache shape {tuple(cache.shape)} does not match the layout: want {want}"
                )
            if cache.dtype != first.dtype or cache.device != first.device or cache.stride() != first.stride():
                raise InvalidArgument("K and V caches must share shape, dtype, device and strides")
        if first.shape[1] and not first[0, 0].is_contiguous():
            raise InvalidArgument("each page of the cache must be contiguous")

    def check(self, caches: Sequence[torch.Tensor], page_ids: torch.Tensor) -> None:
        """Validate caches and page ids (one device sync: the largest page id is checked)."""
        self.check_caches(caches)
        if page_ids.dim() != 2 or page_ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgument(
                f"page_ids must be int32/int64 [chunks, blocks], got {page_ids.dtype} {tuple(page_ids.shape)}"
            )
        if page_ids.device != caches[0].device:
            raise InvalidArgument(f"page_ids on {page_ids.device}, caches on {caches[0].device}")
        num_pages = caches[0].shape[1]
        if page_ids.numel() and int(page_ids.max()) >= num_pages:
            raise InvalidArgument(f"page id {int(page_ids.max())} outside the cache's {num_pages} pages")

    def check_chunks(
        self, chunks: torch.Tensor, caches: Sequence[torch.Tensor], page_ids: torch.Tensor
    ) -> None:
        """Validate a chunk batch that is about to be scattered."""
        self.check(caches, page_ids)
        num_chunks, blocks = page_ids.shape
        want = (num_chunks, self.chunk_elements(blocks))
        if tuple(chunks.shape) != want or chunks.dtype != caches[0].dtype or chunks.device != caches[0].device:
            raise InvalidArgument(
                f"chunks must be {caches[0].dtype} {list(want)} on {caches[0].device}, "
                f"got {chunks.dtype} {list(chunks.shape)} on {chunks.device}"
            )


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as an integer dtype of the same width: copying bits needs no float
    support for the dtype (fp8 has none for indexing on some backends)."""
    return t.view(_BITS[t.element_size()])


def _segments_view(chunks: torch.Tensor, geo: PagedGeometry, blocks: int) -> torch.Tensor:
    """[chunks, layers, blocks, parts, page_elements] view of a chunk batch."""
    c = chunks.shape[0]
    if geo.layer_first:
        return chunks.view(c, geo.layers, blocks, geo.parts, geo.page_elements)
    return chunks.view(c, blocks, geo.layers, geo.parts, geo.page_elements).transpose(1, 2)


def gather_chunks(
    caches: Sequence[torch.Tensor], page_ids: torch.Tensor, layout: Layout | str
) -> torch.Tensor:
    """Copy pages out of the engine cache into a new [num_chunks, chunk_elements] tensor."""
    geo = PagedGeometry.from_layout(layout)
    geo.check(caches, page_ids)
    num_chunks, blocks = page_ids.shape
    out = torch.empty(num_chunks, geo.chunk_elements(blocks), dtype=caches[0].dtype, device=caches[0].device)
    view = _segments_view(as_bits(out), geo, blocks)
    valid = page_ids >= 0
    safe = page_ids.clamp_min(0).long()
    for part, cache in enumerate(as_bits(c) for c in caches):
        pages = cache[:, safe].reshape(geo.layers, num_chunks, blocks, geo.page_elements)
        pages = torch.where(valid[None, :, :, None], pages, torch.zeros((), dtype=pages.dtype))
        view[:, :, :, part] = pages.transpose(0, 1)
    return out


def scatter_chunks(
    chunks: torch.Tensor, caches: Sequence[torch.Tensor], page_ids: torch.Tensor, layout: Layout | str
) -> None:
    """Copy a chunk batch into the engine cache at `page_ids` (in place; -1 blocks skipped)."""
    geo = PagedGeometry.from_layout(layout)
    geo.check_chunks(chunks, caches, page_ids)
    blocks = page_ids.shape[1]
    view = _segments_view(as_bits(chunks.contiguous()), geo, blocks)
    valid = page_ids >= 0
    targets = page_ids[valid].long()
    for part, cache in enumerate(as_bits(c) for c in caches):
        src = view[:, :, :, part].transpose(0, 1)[:, valid]  # [L, n_valid, E]
        cache[:, targets] = src.reshape(geo.layers, -1, geo.page_tokens, *geo.token_shape)
