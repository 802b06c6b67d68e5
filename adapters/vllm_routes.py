"""The vLLM connector's objects named as vLLM names their blocks in its own KV events.

A prefix-aware router matches the block hashes vLLM publishes when it caches blocks
(vllm/v1/core/block_pool.py `BlockPool.cache_full_blocks` -> `BlockStored`, annotated by
`KVCacheManager.take_events`). The connector saves a chunk of `chunk_tokens` tokens per KV
cache group as one object; the route it puts with it (kvstore.route.Route) says what vLLM's
BlockStored for the same blocks of the same group says:

- block_hashes: the request's block hashes (`request.block_hashes`, computed at
  hash_block_size) viewed at the group's block size (`resolve_block_hashes`), each converted
  by `maybe_convert_block_hash` (64-bit ints unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0);
- parent_block_hash: the converted hash of the block before the chunk, None for the first;
- token_ids: the chunk's tokens; block_size: the group's; group_idx: the group's index;
- lora_name: `request.lora_request.name`; extra_keys: `to_event_extra_keys` of vLLM's
  per-block hash extra keys (LoRA, multimodal items and offsets, cache salt, prompt-embeds
  digests); kv_cache_spec_kind and kv_cache_spec_sliding_window: of the group's spec.

A Mamba group's state object (the state after a chunk's last token, which vLLM keeps in the
block at that token) is named by that one block, with the Mamba group's index and kind: the
block vLLM's event for that group names when it caches the state.

Not carried: vLLM's `lookahead_token_ids` (speculative decoding's lookahead hashing): vLLM
0.33 keeps the legacy hashes whenever a KV connector is configured (config/vllm.py,
`num_hash_lookahead_tokens` is 0 with a kv_transfer_config), so this connector's blocks never
have them (a Route can carry them for other producers). Routes are built on the scheduler,
which holds the requests, packed (~1 KB for 256 tokens of 16 blocks), and travel in the
step's metadata to the workers, which put them with the objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstore.route import Route

log = logging.getLogger("kvstore.adapters.vllm")


@dataclass(frozen=True, slots=True)
class GroupEvents:
    """What vLLM's events say of one KV cache group."""

    block_size: int
    kind: str  # KVCacheSpecKind's value: "full_attention", "sliding_window", "mamba", ...
    sliding_window: int | None


class RouteNamer:
    """Routes of the connector's chunk and state objects. Scheduler thread only."""

    def __init__(self, kv_cache_config, chunk_tokens: int, lookahead_tokens: int = 0):
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        self.groups = [GroupEvents(g.kv_cache_spec.block_size, get_kv_cache_spec_kind(g.kv_cache_spec).value,
                                   get_kv_cache_spec_sliding_window(g.kv_cache_spec))
                       for g in kv_cache_config.kv_cache_groups]
        self.hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or self.groups[0].block_size
        self.chunk_tokens = chunk_tokens
        self.lookahead_tokens = lookahead_tokens
        self.num_unnamed = 0  # objects saved without a route (vLLM had not hashed their blocks)

    def route_of(self, request, group: int, chunk: int) -> bytes | None:
        """The packed route of group `group`'s object for chunk `chunk` of `request`: the
        chunk's blocks, or for a Mamba group the block holding the state at its end. None
        (the object is published by its id) when vLLM has not hashed those blocks."""
        events = self.groups[group]
        per_chunk = self.chunk_tokens // events.block_size
        first, count = chunk * per_chunk, per_chunk
        if events.kind == "mamba":
            first, count = first + per_chunk - 1, 1
        try:
            return self._route(request, group, first, count)
        except Exception:  # a name is no reason to lose the object: it is put without one
            log.exception("kvstore: naming chunk %d of %s for KV events failed", chunk, request.request_id)
            self.num_unnamed += 1
            return None

    def _route(self, request, group: int, first: int, count: int) -> bytes | None:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes, to_event_extra_keys

        events = self.groups[group]
        size = events.block_size
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, size)
        if len(hashes) < first + count:
            self.num_unnamed += 1
            return None
        lora = request.lora_request
        return Route(block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:first + count]],
                     parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
                     token_ids=request.all_token_ids[first * size:(first + count) * size], block_size=size,
                     lora_name=lora.name if lora is not None else None,
                     extra_keys=to_event_extra_keys(self._extra_keys(request, first, count, size)),
                     group_idx=group, kv_cache_spec_kind=events.kind,
                     kv_cache_spec_sliding_window=events.sliding_window).pack()

    def _extra_keys(self, request, first: int, count: int, size: int) -> list:
        """Per block, the extra keys vLLM hashed it with (BlockPool._generate_event_extra_keys)."""
        from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys,
                                                 generate_lookahead_block_hash_extra_keys)

        keys, mm = [], 0
        for block in range(first, first + count):
            start, end = block * size, (block + 1) * size
            if self.lookahead_tokens:
                extra, mm = generate_lookahead_block_hash_extra_keys(request, start, end,
                                                                     end + self.lookahead_tokens, mm)
            else:
                extra, mm = generate_block_hash_extra_keys(request, start, end, mm)
            keys.append(extra)
        return keys
