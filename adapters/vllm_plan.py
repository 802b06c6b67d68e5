"""The vLLM connector's bookkeeping, free of vLLM and torch: what to load and save per step.

The scheduler side of `adapters.vllm.KVStoreConnector` owns one `RequestPlan` per running
request. Objects are chunks of `chunk_tokens` prompt tokens (a multiple of vLLM's block
size); each holds every layer's K and V of its blocks (`paged` layout, layer first). Keys
follow kvstore-key-v1 over the token ids, so any vLLM instance, any process, any restart
computes the same ids (vLLM's own block hashes use a per-process seed unless
PYTHONHASHSEED is fixed). `cache_salt`, the LoRA name and the multimodal identifiers are
folded into the chain, so a salted or LoRA request never shares state with another.

    lookup   -> prefix hits (chunks)  -> tokens to load beyond vLLM's local prefix cache,
                leaving at least one prompt token to compute
    alloc    -> remember how many tokens to load
    step     -> loads: (object id, [(block index in chunk, vLLM block id)])
                saves: (object id, [vLLM block ids of the chunk]) for chunks whose tokens are
                all computed after this step and that the store does not hold yet
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.identity import ObjectId, StateDescriptor, chunk_keys


@dataclass(frozen=True, slots=True)
class LoadSpec:
    object_id: ObjectId
    blocks: tuple[tuple[int, int], ...]  # (block index inside the chunk, vLLM block id)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    object_id: ObjectId
    block_ids: tuple[int, ...]  # the chunk's vLLM block ids, in token order


@dataclass(slots=True)
class RequestPlan:
    """One request's keys and progress. Scheduler thread only."""

    request_id: str
    num_prompt_tokens: int
    ids: list[ObjectId]  # one per full prompt chunk
    chunk_tokens: int
    block_size: int
    num_stored_chunks: int = 0  # leading chunks the store holds (loaded, or saved by us)
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit when we looked up
    num_load_tokens: int = 0  # tokens vLLM agreed to let us load
    load_pending: bool = False
    block_ids: list[int] = field(default_factory=list)

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def matched_tokens(self, hits: int, num_computed_tokens: int) -> int:
        """Tokens to load beyond `num_computed_tokens` given `hits` leading stored chunks."""
        self.num_stored_chunks = hits
        self.num_local_tokens = num_computed_tokens
        matched = min(hits * self.chunk_tokens, self.num_prompt_tokens - 1)  # compute >= 1 token
        return max(0, matched - num_computed_tokens)

    def loads(self) -> list[LoadSpec]:
        """The blocks [local end, local end + load tokens) come from their chunks."""
        if not self.load_pending or self.num_load_tokens <= 0:
            return []
        self.load_pending = False
        first = self.num_local_tokens // self.block_size
        end_token = self.num_local_tokens + self.num_load_tokens
        last = -(-end_token // self.block_size)  # exclusive, rounded up: a partial block loads whole
        per_chunk: dict[int, list[tuple[int, int]]] = {}
        for block in range(first, min(last, len(self.block_ids))):
            chunk, inside = divmod(block, self.blocks_per_chunk)
            per_chunk.setdefault(chunk, []).append((inside, self.block_ids[block]))
        return [LoadSpec(self.ids[c], tuple(blocks)) for c, blocks in sorted(per_chunk.items())]

    def saves(self, num_computed_after_step: int) -> list[SaveSpec]:
        """Chunks fully computed once this step has run, that the store lacks."""
        done = min(num_computed_after_step, self.num_prompt_tokens) // self.chunk_tokens
        specs = []
        for chunk in range(self.num_stored_chunks, done):
            start = chunk * self.blocks_per_chunk
            blocks = self.block_ids[start:start + self.blocks_per_chunk]
            if len(blocks) < self.blocks_per_chunk:
                break  # not allocated yet (cannot happen for computed tokens; be safe)
            specs.append(SaveSpec(self.ids[chunk], tuple(blocks)))
        self.num_stored_chunks = max(self.num_stored_chunks, done)
        return specs


def request_extra_keys(cache_salt: str | None, lora_name: str | None) -> list[str]:
    """What makes two requests with the same tokens hold different state."""
    extras = []
    if cache_salt:
        extras.append(f"cache_salt:{cache_salt}")
    if lora_name:
        extras.append(f"lora:{lora_name}")
    return extras


def multimodal_chunk_keys(features, chunk_tokens: int) -> dict[int, list[str]]:
    """chunk index -> identifiers of the multimodal items whose placeholders overlap it.
    `features`: (offset, length, identifier) triples."""
    keyed: dict[int, list[str]] = {}
    for offset, length, identifier in features:
        for chunk in range(offset // chunk_tokens, (offset + max(length, 1) - 1) // chunk_tokens + 1):
            keyed.setdefault(chunk, []).append(f"mm:{identifier}")
    return keyed


def plan_request(request_id: str, token_ids, desc: StateDescriptor, block_size: int, extra_keys=(),
                 mm_features=()) -> RequestPlan:
    keys = chunk_keys(token_ids, desc, extra_keys=extra_keys,
                      chunk_extra_keys=multimodal_chunk_keys(mm_features, desc.chunk_tokens))
    return RequestPlan(request_id, len(token_ids), [k.object_id for k in keys], desc.chunk_tokens, block_size)
