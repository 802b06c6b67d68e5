"""Paged KV cache: fixed-size pages, a free list, and one block table per sequence.

K and V are two tensors, each [layers, num_pages, page_tokens, kv_heads, head_dim], the layout
`gpu.paged` gathers from and scatters into (`cache.k`, `cache.v`). Token t of a sequence lives
in page `block_table[t // page_tokens]` at offset `t % page_tokens`; its flat "slot" in a layer
is `page * page_tokens + offset`. Pages are handed out whole and returned whole when the
sequence is freed, as in vLLM and nano-vllm.

Not thread-safe: the engine's step loop is the only caller.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument, LimitExceeded


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_pages: int = 512
    page_tokens: int = 16
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"CacheConfig.{name} must be positive")


class PagedKVCache:
    def __init__(self, config: CacheConfig):
        self.config = config
        shape = (config.num_layers, config.num_pages, config.page_tokens,
                 config.num_kv_heads, config.head_dim)
        # zeros, not empty: padded gathers read unused slots, and masked garbage could be NaN
        self.k = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self.v = torch.zeros(shape, dtype=config.dtype, device=config.device)
        self._free: deque[int] = deque(range(config.num_pages))
        self._tables: dict[int, list[int]] = {}

    @property
    def page_tokens(self) -> int:
        return self.config.page_tokens

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.page_tokens)

    def block_table(self, seq_id: int) -> list[int]:
        """The pages of seq_id in token order (a copy)."""
        return list(self._table(seq_id))

    def capacity(self, seq_id: int) -> int:
        return len(self._table(seq_id)) * self.config.page_tokens

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        have = len(self._tables.get(seq_id, ()))
        return self.pages_for(num_tokens) - have <= len(self._free)

    def allocate(self, seq_id: int, num_tokens: int) -> None:
        """Grow seq_id's block table to hold num_tokens tokens (creates it if new)."""
        if not self.can_allocate(seq_id, num_tokens):
            raise LimitExceeded(f"KV cache full: {num_tokens} tokens need "
                                f"{self.pages_for(num_tokens)} pages, {len(self._free)} free; "
                                "finish or release sequences, or raise num_pages")
        table = self._tables.setdefault(seq_id, [])
        while len(table) < self.pages_for(num_tokens):
            table.append(self._free.popleft())

    def free(self, seq_id: int) -> None:
        """Return seq_id's pages. Idempotent."""
        self._free.extend(self._tables.pop(seq_id, ()))

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (int64, on the cache's device) of tokens [start, end) of seq_id."""
        table = self._table(seq_id)
        if not 0 <= start <= end <= len(table) * self.config.page_tokens:
            raise InvalidArgument(f"token range [{start}, {end}) outside the "
                                  f"{len(table) * self.config.page_tokens} tokens allocated")
        pos = torch.arange(start, end)
        pages = torch.tensor(table, dtype=torch.long)[pos // self.config.page_tokens]
        return (pages * self.config.page_tokens + pos % self.config.page_tokens).to(
            self.config.device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V as [num_pages * page_tokens, kv_heads, head_dim]."""
        return self.k[layer].flatten(0, 1), self.v[layer].flatten(0, 1)

    def read(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """A new tensor [layers, 2, end - start, kv_heads, head_dim] with the KV of those tokens."""
        slots = self.slots(seq_id, start, end)
        k = self.k.flatten(1, 2)[:, slots]
        v = self.v.flatten(1, 2)[:, slots]
        return torch.stack((k, v), dim=1)

    def write(self, seq_id: int, start: int, kv: torch.Tensor) -> None:
        """Copy kv [layers, 2, tokens, kv_heads, head_dim] into tokens [start, start + tokens)."""
        c = self.config
        expected = (c.num_layers, 2, kv.shape[2], c.num_kv_heads, c.head_dim)
        if kv.dim() != 5 or tuple(kv.shape) != expected:
            raise InvalidArgument(f"KV shape {tuple(kv.shape)} does not match the cache, "
                                  f"expected {expected}")
        slots = self.slots(seq_id, start, start + kv.shape[2])
        kv = kv.to(device=c.device, dtype=c.dtype)
        self.k.flatten(1, 2)[:, slots] = kv[:, 0]
        self.v.flatten(1, 2)[:, slots] = kv[:, 1]

    def check_integrity(self) -> None:
        """Raise RuntimeError unless every page is free or owned by exactly one sequence."""
        owned = [p for table in self._tables.values() for p in table]
        every = owned + list(self._free)
        if sorted(every) != list(range(self.config.num_pages)):
            raise RuntimeError(f"page accounting broken: {len(owned)} owned, "
                               f"{len(self._free)} free, {self.config.num_pages} total, "
                               f"{len(every) - len(set(every))} duplicated")

    def _table(self, seq_id: int) -> list[int]:
        table = self._tables.get(seq_id)
        if table is None:
            raise InvalidArgument(f"sequence {seq_id} has no pages in the KV cache")
        return table
