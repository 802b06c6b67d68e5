"""Where sparse decode gets the pages it selected: every page at hand, or the store.

A page source returns, for one layer and a list of page indices of the request (page p covers
tokens [p * page_tokens, (p + 1) * page_tokens)), their K and V as
[n, 2, page_tokens, kv_heads, head_dim] in the engine's dtype (a new tensor), and says how many
bytes one page moves (`page_bytes`).

`StorePages` maps pages to (chunk, layer, block) segments of the request's stored KV chunks
and reads only those byte ranges through `KVConnector.read_segments`. If the store fails (down,
miss, evicted) it recomputes the prompt's KV once (`recompute()`), and serves every later
page from that: decode goes on, with the same tokens.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvstore.client.gpu import host_tensor

from .store_codecs import PagedKVCodec


class ResidentPages:
    """Every page is already on the device: KV [layers, 2, tokens, kv_heads, head_dim]."""

    all_resident = True

    def __init__(self, kv: torch.Tensor, page_tokens: int):
        self.kv = kv
        self.page_tokens = page_tokens
        self.page_bytes = kv[0, :, :page_tokens].numel() * kv.element_size()

    def fetch(self, layer: int, pages: list[int]) -> torch.Tensor:
        pt = self.page_tokens
        return torch.stack([self.kv[layer, :, p * pt:(p + 1) * pt] for p in pages])


class StorePages:
    """Pages read from the store's chunk objects by ranged reads."""

    all_resident = False

    def __init__(self, connector, codec: PagedKVCodec, request_id, token_ids: list[int],
                 recompute: Callable[[], torch.Tensor]):
        self.connector = connector
        self.codec = codec
        self.request_id = request_id
        self.token_ids = token_ids
        self.page_tokens = int(codec.descriptor.layout.param("block"))
        self.page_bytes = codec.descriptor.layout.segment_bytes(codec.descriptor.dtype)
        self.num_fallbacks = 0
        self._blocks = codec.descriptor.layout.num_blocks(codec.descriptor.chunk_tokens)
        self._recompute = recompute
        self._fallback: ResidentPages | None = None

    def fetch(self, layer: int, pages: list[int]) -> torch.Tensor:
        if self._fallback is None:
            wanted: dict[int, list[tuple[int, int]]] = {}
            for p in pages:
                wanted.setdefault(p // self._blocks, []).append((layer, p % self._blocks))
            got = self.connector.read_segments(self.request_id, self.token_ids, wanted)
            if got is not None:
                raw = np.concatenate([got[(p // self._blocks, layer, p % self._blocks)] for p in pages])
                return self.codec.decode_segments(host_tensor(raw))
            self.num_fallbacks += 1
            self._fallback = ResidentPages(self._recompute(), self.page_tokens)
        return self._fallback.fetch(layer, pages)
