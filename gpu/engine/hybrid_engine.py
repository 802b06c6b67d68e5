"""A one-request-at-a-time engine for `HybridModel`, with its store hooks.

It keeps, per sequence, pages of attention KV (a `PagedKVCache` with one layer per attention
layer), the fp32 recurrent state, and a snapshot of that state at every chunk boundary it
passed. `generate(prompt, n, connector)` asks the connector how much of the prompt the store
holds (KV chunks plus the snapshot at the hit boundary, the codecs of `codecs()`), loads it,
computes the rest and greedy-decodes, then saves the chunks and snapshots of its prompt. The
connector stores each chunk with the snapshot at its end as one store group and reads the
hit's last chunk and snapshot with one group read (connector_objects): the engine is
handed the KV and the state after it together, or nothing.

Like the Llama engine (`chunked`), it computes a prompt in chunk-aligned pieces, one forward
per piece, so a chunk's KV and the snapshot after it depend only on the tokens before and in
it: a reader that loads them gets the bytes it would have computed. Chunks completed while
decoding were computed a token at a time and would differ in the last bits; they are not
saved.

Store hooks (what `gpu.engine.store_codecs` calls):
    export_kv / import_kv              KV of attention layers [layers, 2, tokens, kv_heads, head_dim]
    export_recurrent / import_recurrent  the fp32 state after a boundary token count
An import of KV alone advances nothing: the prefix counts as computed only once the recurrent
state at its end is imported too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.errors import InvalidArgument
from kvstore.identity import DEFAULT_CHUNK_TOKENS, StateDescriptor
from kvstore.layout import Layout

from .chunked import pieces
from .engine import EngineStats
from .hybrid import HybridConfig, HybridModel
from .kv_cache import CacheConfig, PagedKVCache
from .store_codecs import PagedKVCodec, RecurrentCodec, paged_layout

if TYPE_CHECKING:
    from .connector import MatchResult


@dataclass(slots=True, eq=False)
class HybridSequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    state: torch.Tensor  # fp32 [delta layers, heads, d_v, d_k] after num_computed tokens
    num_computed: int = 0
    kv_tokens: int = 0  # tokens whose attention KV is in the cache (computed or imported)
    snapshots: dict = field(default_factory=dict)  # boundary token count -> fp32 state


@dataclass(frozen=True, slots=True)
class HybridResult:
    token_ids: list[int]
    ttft_s: float
    loaded_tokens: int
    match: MatchResult | None = None  # the connector's decision for the prompt (None: no connector)


# Prefill rate assumed until the engine has measured its own (the reference delta-rule scan
# steps token by token: ~900 tokens/s for the default config on 2 CPU cores).
DEFAULT_PREFILL_TOKENS_PER_S = 500.0


class HybridEngine:
    def __init__(self, config: HybridConfig = HybridConfig(), num_pages: int = 512,
                 page_tokens: int = 16, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 model: HybridModel | None = None):
        self.model = model or HybridModel(config)
        self.config = self.model.config
        self.chunk_tokens = chunk_tokens
        self.cache = PagedKVCache(CacheConfig(
            num_layers=len(self.config.attention_layers), num_kv_heads=self.config.num_kv_heads,
            head_dim=self.config.head_dim, num_pages=num_pages, page_tokens=page_tokens))
        self.stats = EngineStats()  # prefill only (generate's prompt part)
        self._seqs: dict[int, HybridSequence] = {}
        self._next_id = 0

    def estimate_prefill_s(self, num_tokens: int) -> float:
        """The connector's prefill_s: this engine's measured prefill rate (a default first)."""
        return num_tokens / self.stats.prefill_tokens_per_s(DEFAULT_PREFILL_TOKENS_PER_S)

    def add_request(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        if not prompt_ids or max_new_tokens < 1:
            raise InvalidArgument("a request needs a prompt token and max_new_tokens >= 1")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.cache.allocate(seq_id, len(prompt_ids) + max_new_tokens)
        self._seqs[seq_id] = HybridSequence(seq_id, list(prompt_ids), len(prompt_ids),
                                            max_new_tokens, self.model.initial_state())
        return seq_id

    def sequence(self, seq_id: int) -> HybridSequence:
        if seq_id not in self._seqs:
            raise InvalidArgument(f"unknown or released sequence {seq_id}")
        return self._seqs[seq_id]

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        self.cache.free(seq_id)

    # -- store hooks ----------------------------------------------------------------------

    def export_kv(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.sequence(seq_id).kv_tokens:
            raise InvalidArgument(f"export [{start}, {end}): KV of sequence {seq_id} is not there")
        return self.cache.read(seq_id, start, end)

    def import_kv(self, seq_id: int, kv: torch.Tensor, start: int) -> None:
        seq = self.sequence(seq_id)
        end = start + kv.shape[2]
        if seq.num_computed or not 0 <= start <= seq.kv_tokens or end > seq.num_prompt_tokens:
            raise InvalidArgument(f"import [{start}, {end}) must continue the imported prompt KV "
                                  "of a sequence that has computed nothing")
        self.cache.write(seq_id, start, kv)
        seq.kv_tokens = max(seq.kv_tokens, end)

    def export_recurrent(self, seq_id: int, boundary: int) -> torch.Tensor | None:
        return self.sequence(seq_id).snapshots.get(boundary)

    def import_recurrent(self, seq_id: int, state: torch.Tensor, boundary: int) -> None:
        seq = self.sequence(seq_id)
        if seq.num_computed or boundary > seq.kv_tokens or boundary >= seq.num_prompt_tokens:
            raise InvalidArgument(f"a snapshot at {boundary} needs the KV before it imported, and "
                                  "at least one prompt token after it")
        seq.state = state.to(torch.float32).clone()
        seq.snapshots[boundary] = seq.state.clone()
        seq.num_computed = boundary

    # -- compute --------------------------------------------------------------------------

    def _compute(self, seq: HybridSequence) -> int:
        """Compute every token not computed yet, one forward per chunk-aligned piece; returns
        the greedy next token."""
        for lo, hi in pieces(seq.num_computed, len(seq.token_ids), self.chunk_tokens):
            boundaries = (hi,) if hi % self.chunk_tokens == 0 else ()
            logits, seq.state, snaps = self.model.forward(seq.token_ids[lo:hi], lo, self.cache,
                                                          seq.seq_id, seq.state, boundaries)
            seq.snapshots.update(snaps)
            seq.num_computed = seq.kv_tokens = hi
        return int(logits.argmax())

    def run(self, seq_id: int) -> list[int]:
        """Prefill what is not computed, then greedy-decode max_new_tokens; returns them."""
        seq = self.sequence(seq_id)
        while len(seq.token_ids) - seq.num_prompt_tokens < seq.max_new_tokens:
            seq.token_ids.append(self._compute(seq))
        return seq.token_ids[seq.num_prompt_tokens:]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, connector=None) -> HybridResult:
        """One request start to finish; with a connector, load the prefix it holds first and
        save the chunks computed at the end."""
        started = time.perf_counter()
        seq_id = self.add_request(prompt_ids, max_new_tokens)
        loaded, match = 0, None
        try:
            if connector is not None and connector.get_num_new_matched_tokens(seq_id, prompt_ids).num_tokens:
                loaded = connector.start_load_kv(seq_id)
            match = connector.match(seq_id) if connector is not None else None
            seq = self.sequence(seq_id)
            computed = time.perf_counter()
            seq.token_ids.append(self._compute(seq))
            self.stats.prefill_s += time.perf_counter() - computed
            self.stats.num_prefill_tokens += seq.num_prompt_tokens - loaded
            ttft = time.perf_counter() - started
            tokens = self.run(seq_id)
            if connector is not None:  # the prompt's full chunks: computed in one piece each
                connector.request_finished(seq_id, seq.token_ids, seq.num_prompt_tokens)
            return HybridResult(tokens, ttft, loaded, match)
        finally:
            self.release(seq_id)

    def codecs(self, namespace: str = "default") -> list:
        """The codecs a `KVConnector` needs for this engine: KV chunks, then snapshots."""
        c = self.config
        common = dict(namespace=namespace, model=c.name, model_revision=c.revision,
                      chunk_tokens=self.chunk_tokens)
        kv = StateDescriptor(kind="kv", dtype="fp32", layout=paged_layout(
            len(c.attention_layers), self.cache.page_tokens, c.num_kv_heads, c.head_dim), **common)
        recurrent = StateDescriptor(kind="recurrent", dtype="fp32", layout=Layout.make(
            "recurrent", layers=len(c.delta_layers), heads=c.num_heads, k_dim=c.head_dim,
            v_dim=c.head_dim), **common)
        return [PagedKVCodec(self, kv, torch.float32), RecurrentCodec(self, recurrent)]
