"""The vLLM connector's bookkeeping, free of vLLM and torch: what to load and save per step.

The scheduler side of `adapters.vllm.KVStoreConnector` owns one `RequestPlan` per running
request. Objects are chunks of `chunk_tokens` prompt tokens (a multiple of vLLM's block
size), one per KV cache group (a hybrid model has several: full attention, sliding window);
each holds every layer of its group, K and V, for the chunk's blocks (`paged` layout, layer
first). Keys follow kvstore-key-v1 over the token ids, so any vLLM instance, any process,
any restart computes the same ids (vLLM's own block hashes use a per-process seed unless
PYTHONHASHSEED is fixed). `cache_salt`, the LoRA name and the multimodal identifiers are
folded into the chain, so a salted or LoRA request never shares state with another.

    lookup   -> prefix hits (chunks every group holds) -> tokens to load beyond vLLM's
                local prefix cache, leaving at least one prompt token to compute
    alloc    -> remember how many tokens to load
    step     -> loads: (group, object id, [(block index in chunk, vLLM block id)]), the
                null block (a sliding window's out-of-window blocks) left out
                saves: (group, object id, [vLLM block ids of the chunk], chunk, route) for
                chunks whose tokens are all computed after this step and that the store does
                not hold; the route (vLLM's block hashes of the chunk, for KV events) is
                added by the connector, which holds the request

Sliding windows: vLLM frees a sliding-window group's blocks once they leave the window and
reuses them, without telling the connector. A block id this plan still holds for a chunk not
yet saved is stale once vLLM hands the same id out again (`forget_reused`, every step), and
a chunk with a stale or null block is never saved: it would hold another request's KV.

Mamba groups (recurrent state, `mamba(...)` layout, vLLM's mamba_cache_mode "align"): one
object per chunk boundary and group, the state after the chunk's last token, which vLLM
offers by block id in the step that computes it (`boundary_state_offloads`). A chunk whose
end has a state offered for every Mamba group is saved as one store group: its attention
objects and those states (SaveSpec.joint). A hit of H tokens needs every attention chunk
before H and the store group of the chunk ending at H (`state_members`); it loads the states
into the block vLLM allocated at index H / block_size - 1 of each Mamba group's table, and
the last chunk with them as one group read (LoadSpec.joint), so KV and state arrive
together or not at all. Mamba block tables are never read by position otherwise: vLLM
nulls and moves those blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.groups import Member
from kvstore.identity import ObjectId, StateDescriptor, chunk_keys

NULL_BLOCK = 0  # vLLM's block pool hands out its first block as the shared null block


@dataclass(frozen=True, slots=True)
class LoadSpec:
    object_id: ObjectId
    blocks: tuple[tuple[int, int], ...]  # (block index inside the chunk, vLLM block id); Mamba: ((0, its block),)
    group: int = 0  # the KV cache group
    joint: int | None = None  # the chunk whose store group this object is read with (None: read alone)
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class SaveSpec:
    object_id: ObjectId
    block_ids: tuple[int, ...]  # the chunk's vLLM block ids, in token order; Mamba: (the state's block,)
    group: int = 0
    joint: int | None = None  # the chunk whose store group this object is put with (None: put alone)
    request_id: str = ""
    chunk: int = 0  # the prompt chunk: this object holds its blocks (Mamba: the state at its end)
    route: bytes | None = None  # packed kvstore.route.Route: vLLM's names for those blocks (adapters.vllm_routes)


@dataclass(slots=True)
class RequestPlan:
    """One request's keys and progress. Scheduler thread only."""

    request_id: str
    num_prompt_tokens: int
    ids: list[list[ObjectId]]  # per group, one per full prompt chunk
    chunk_tokens: int
    block_size: int
    num_stored_chunks: int = 0  # leading chunks the store holds (loaded, or saved by us)
    num_local_tokens: int = 0  # vLLM's own prefix-cache hit when we looked up
    num_load_tokens: int = 0  # tokens vLLM agreed to let us load
    load_pending: bool = False
    num_unsaved_chunks: int = 0  # computed chunks not saved: a sliding window moved past their blocks
    block_ids: list[list[int]] = field(default_factory=list)  # per group, vLLM's block table
    descriptors: list[StateDescriptor] = field(default_factory=list)  # per group
    state_blocks: dict[int, int] = field(default_factory=dict)  # Mamba group -> block to load the hit's state into

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    @property
    def mamba(self) -> list[int]:
        """The Mamba groups (recurrent state at chunk boundaries)."""
        return [g for g, desc in enumerate(self.descriptors) if desc.layout.name == "mamba"]

    @property
    def attention(self) -> list[int]:
        return [g for g, desc in enumerate(self.descriptors) if desc.layout.name != "mamba"] or [0]

    @property
    def lookup_ids(self) -> list[ObjectId]:
        """Every attention group's chunk ids, group after group (one batched lookup)."""
        return [oid for g in self.attention for oid in self.ids[g]]

    def hits_of(self, found: list[bool]) -> int:
        """Leading chunks that every attention group holds, from `found` in `lookup_ids` order."""
        hits, start = None, 0
        for g in self.attention:
            mine = found[start:start + len(self.ids[g])]
            start += len(self.ids[g])
            held = next((i for i, ok in enumerate(mine) if not ok), len(mine))
            hits = held if hits is None else min(hits, held)
        return hits or 0

    def state_candidates(self, hits: int, num_computed_tokens: int) -> list[int]:
        """Hit lengths in chunks (1..hits) a Mamba model could take: past vLLM's own prefix
        and leaving one prompt token to compute."""
        return [k for k in range(1, hits + 1)
                if num_computed_tokens < k * self.chunk_tokens <= self.num_prompt_tokens - 1]

    def state_members(self, k: int) -> list[Member]:
        """The store group of chunk k - 1: its attention objects, then the state at its end."""
        return [Member(self.ids[g][k - 1], self.descriptors[g]) for g in self.attention + self.mamba]

    def matched_tokens(self, hits: int, num_computed_tokens: int, exact: bool = False) -> int:
        """Tokens to load beyond `num_computed_tokens` given `hits` leading stored chunks.
        exact: the hit must end at a chunk boundary (a Mamba state's): none if it cannot."""
        self.num_stored_chunks = max(self.num_stored_chunks, hits)
        self.num_local_tokens = num_computed_tokens
        matched = min(hits * self.chunk_tokens, self.num_prompt_tokens - 1)  # compute >= 1 token
        if exact and matched != hits * self.chunk_tokens:
            return 0
        return max(0, matched - num_computed_tokens)

    def set_state_blocks(self, tables) -> None:
        """After vLLM allocated a hit: the block of each Mamba group that receives the state."""
        end = self.num_local_tokens + self.num_load_tokens
        self.state_blocks = {g: tables[g][end // self.block_size - 1] for g in self.mamba
                             if end % self.chunk_tokens == 0 and len(tables[g]) >= end // self.block_size}

    def set_blocks(self, groups, replace: bool) -> None:
        """vLLM's new block ids, one list per group (all of them when `replace`)."""
        if replace or not self.block_ids:
            self.block_ids = [list(ids) for ids in groups]
        else:
            for mine, new in zip(self.block_ids, groups):
                mine += new

    def forget_reused(self, reused: set[int], groups) -> None:
        """Null the not yet saved blocks of `groups` whose ids vLLM handed out again (call
        before `set_blocks` adds this step's own new ids)."""
        start = self.num_stored_chunks * self.blocks_per_chunk
        for g in groups:
            table = self.block_ids[g] if g < len(self.block_ids) else []
            for i in range(start, len(table)):
                if table[i] in reused:
                    table[i] = NULL_BLOCK

    def loads(self) -> list[LoadSpec]:
        """The blocks [local end, local end + load tokens) come from their chunks; in a Mamba
        model the last chunk comes with the states, read as one group."""
        if not self.load_pending or self.num_load_tokens <= 0:
            return []
        self.load_pending = False
        first = self.num_local_tokens // self.block_size
        end_token = self.num_local_tokens + self.num_load_tokens
        last = -(-end_token // self.block_size)  # exclusive, rounded up: a partial block loads whole
        mamba = self.mamba
        joint = end_token // self.chunk_tokens - 1 if mamba else None
        specs = []
        for g in self.attention:
            table = self.block_ids[g]
            per_chunk: dict[int, list[tuple[int, int]]] = {} if joint is None else {joint: []}
            for block in range(first, min(last, len(table))):
                if table[block] == NULL_BLOCK:
                    continue  # outside a sliding window: vLLM does not want it
                chunk, inside = divmod(block, self.blocks_per_chunk)
                per_chunk.setdefault(chunk, []).append((inside, table[block]))
            specs += [LoadSpec(self.ids[g][c], tuple(blocks), g, c if c == joint else None, self.request_id)
                      for c, blocks in sorted(per_chunk.items())]
        for g in mamba:
            if g not in self.state_blocks:
                raise ValueError(f"no block allocated for group {g}'s state at token {end_token}")
            specs.append(LoadSpec(self.ids[g][joint], ((0, self.state_blocks[g]),), g, joint, self.request_id))
        return specs

    def saves(self, num_computed_after_step: int, offers=()) -> list[SaveSpec]:
        """Chunks fully computed once this step has run, that the store lacks. A chunk whose
        blocks are not all held (a sliding window moved past them) ends the saving for this
        request: later chunks could never be reached by a prefix lookup. `offers`: vLLM's
        boundary-state hand-offs of this step, (group, block, boundary tokens); a chunk
        ending where every Mamba group offers its state is saved with those states as one
        store group."""
        done = min(num_computed_after_step, self.num_prompt_tokens) // self.chunk_tokens
        mamba = self.mamba
        at: dict[int, dict[int, int]] = {}
        for group, block, boundary in offers:
            if group in mamba and block != NULL_BLOCK and boundary % self.chunk_tokens == 0:
                at.setdefault(boundary // self.chunk_tokens - 1, {})[group] = block
        specs = []
        for chunk in range(self.num_stored_chunks, done):
            start = chunk * self.blocks_per_chunk
            tables = {g: self.block_ids[g][start:start + self.blocks_per_chunk] for g in self.attention}
            if any(len(blocks) < self.blocks_per_chunk or NULL_BLOCK in blocks for blocks in tables.values()):
                self.num_unsaved_chunks += done - chunk
                break
            states = at.get(chunk, {})
            joint = chunk if mamba and len(states) == len(mamba) else None
            rid = self.request_id
            specs += [SaveSpec(self.ids[g][chunk], tuple(blocks), g, joint, rid, chunk) for g, blocks in tables.items()]
            if joint is not None:
                specs += [SaveSpec(self.ids[g][chunk], (states[g],), g, joint, rid, chunk) for g in mamba]
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


def plan_request(request_id: str, token_ids, groups: list[tuple[StateDescriptor, list[str]]], block_size: int,
                 extra_keys=(), mm_features=()) -> RequestPlan:
    """`groups`: each KV cache group's descriptor and its own extra keys."""
    chunk_tokens = groups[0][0].chunk_tokens
    mm = multimodal_chunk_keys(mm_features, chunk_tokens)
    ids = [[k.object_id for k in chunk_keys(token_ids, desc, extra_keys=[*extra_keys, *own], chunk_extra_keys=mm)]
           for desc, own in groups]
    return RequestPlan(request_id, len(token_ids), ids, chunk_tokens, block_size,
                       descriptors=[desc for desc, _ in groups])
