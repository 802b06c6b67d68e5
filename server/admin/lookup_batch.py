"""POST /v1/lookup/batch: how much of each of many candidate prefixes this node holds.

A prefix-aware router scores nodes (or engines) by the longest prefix of a request each
holds, and may weigh several candidates per call (prefixes of queued requests, one per
LoRA). Each prefix comes one of two ways:

    {"block_hashes": [h0, h1, ...]}           the engine's block hashes, as the routes of
                                              the puts named them (or an object's own id, for
                                              one put without a route)
    {"tokens": [...], "descriptor": {...}}    token ids, as POST /v1/lookup: kvstore's chunks

and gets back, per tier (host, nvme, remote: fastest first), how many leading blocks and
tokens load from that tier or a faster one; the longest held prefix, its bytes and
estimated load time (IndexOps.load_estimate_s, as /v1/lookup); and each block's tier.

Which objects a block hash names comes from the event stream's record of what it published
(server/events/holdings.py), so that form needs `[events] enabled = true`. A block is held
when at least `objects_per_block` objects name it (default 1; the engine's TP ranks or KV
cache groups that share a hash are one object each) and every object naming it is held in
some tier; its tier is the slowest of theirs, since the engine needs them all. The
holdings know only objects the node has published and not yet dropped: a shard that left
every tier is forgotten, which objects_per_block catches. The holdings index a hash in the
form the stream published it (`[events] int_block_hashes`: a bytes hash's int form) and
take a hash asked for in either form.

All objects of a call are placed by one batched IndexOps.placements (in slices of
PLACE_SLICE, never one per prefix); no namespace is opened. Work is done in steps of about
SLICE_BLOCKS blocks with the event loop free in between, so a large call delays other
requests by a few milliseconds at a time. Objects may move between steps: a large call's
answer is a view over a few milliseconds, not an instant.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from kvstore.errors import InvalidArgument
from kvstore.identity import ID_BYTES, StateDescriptor, check_name, chunk_keys
from kvstore.route import MAX_HASH_BYTES, MAX_INT_HASH, MIN_INT_HASH, route_fields
from kvstore.server.admin.http import NotEnabled, json_body, json_response
from kvstore.server.admin.parts import EVENTS, INDEX
from kvstore.server.admin.lookup import MAX_LOOKUP_TOKENS, descriptor, extra_keys, tokens
from kvstore.server.later import resolve

# A router asks once per request with its candidates: a handful, rarely dozens. 64 also
# bounds what one call can make the daemon do before the limits below.
MAX_PREFIXES = 64
# 1M tokens (/v1/lookup's bound) in vLLM's default blocks of 16 tokens.
MAX_BLOCKS_PER_PREFIX = MAX_LOOKUP_TOKENS // 16
# Blocks (hashes, or chunks of the tokens form) in one call, all prefixes together: ~2 us
# of Python each to check, resolve and score (a shared 2-core machine), so at most ~0.3 s
# of work per call, spread over steps of SLICE_BLOCKS. Two prefixes of 1M tokens.
MAX_BLOCKS_PER_CALL = 1 << 17
# objects_per_block: TP ranks x KV cache groups of one engine; past this it is a typo.
MAX_OBJECTS_PER_BLOCK = 1024
# Blocks resolved, and objects placed, between two yields to the event loop: steps of
# ~5-10 ms. A prefix is checked and scored in one step each (~25 ms at the most; a tokens
# prefix of 1M tokens ~100 ms, as for /v1/lookup).
SLICE_BLOCKS = 4096
PLACE_SLICE = 16384

TIERS = ("host", "nvme", "remote")  # fastest first
_RANK = {tier: rank for rank, tier in enumerate(TIERS)}
_MISS = len(TIERS)  # the rank of a block not held (and of a tier None)
_NAMES = TIERS + (None,)
_BY_HASHES, _BY_TOKENS = {"block_hashes", "objects_per_block"}, {"tokens", "descriptor", "extra_keys"}


@dataclass(frozen=True, slots=True)
class ByHashes:
    hashes: list  # bytes or int, as the holdings index them
    objects_per_block: int


@dataclass(frozen=True, slots=True)
class ByTokens:
    tokens: list[int]
    descriptor: StateDescriptor
    extra_keys: list[str]


@dataclass(slots=True)
class Blocks:
    """One prefix resolved: per block the positions of its objects in the call's Objects
    (() when it cannot be held) and its tokens."""
    unit: str  # "block" (an engine block) or "chunk" (a kvstore chunk)
    objects: list[tuple[int, ...]]
    tokens: list[int]


class Objects:
    """The call's objects, each once, with the descriptor they must have (None: any)."""

    def __init__(self):
        self.ids: list[bytes] = []
        self.expect: list[StateDescriptor | None] = []
        self._position: dict[tuple, int] = {}

    def add(self, digest: bytes, expect: StateDescriptor | None = None) -> int:
        key = (digest, expect)
        position = self._position.get(key)
        if position is None:
            position = self._position[key] = len(self.ids)
            self.ids.append(digest)
            self.expect.append(expect)
        return position


async def lookup_batch(request: web.Request) -> web.Response:
    body = await json_body(request, {"namespace", "prefixes"})
    namespace = check_name("namespace", body.get("namespace"))
    prefixes = await _prefixes(body.get("prefixes"), namespace)
    events = request.app[EVENTS]
    if any(isinstance(p, ByHashes) for p in prefixes) and not events.enabled:
        raise NotEnabled("lookup by block_hashes needs [events] enabled = true: the daemon indexes the "
                         "engine's block hashes only then (the tokens form works without)")
    objects = Objects()
    resolved = []
    for prefix in prefixes:
        if isinstance(prefix, ByHashes):
            resolved.append(await _by_hashes(prefix, namespace, events.holdings, objects))
        else:
            resolved.append(_by_tokens(prefix, objects))
            await asyncio.sleep(0)  # chunk_keys over up to 1M tokens: ~50 ms
    index = request.app[INDEX]
    tiers, sizes = await _place(index, namespace, objects)
    ranks = rank_of(tiers)
    results = []
    for blocks in resolved:
        results.append(score(blocks, ranks, sizes, index.load_estimate_s))
        if len(blocks.objects) > SLICE_BLOCKS:
            await asyncio.sleep(0)
    return json_response({"namespace": namespace, "results": results})


def score(blocks: Blocks, ranks: list[int], sizes: list, load_estimate_s) -> dict:
    """One prefix's answer from its objects' tier ranks (rank_of) and sizes.
    load_estimate_s(num_objects, host_bytes, nvme_bytes, remote_bytes): /v1/lookup's estimate."""
    block_ranks = [max(map(ranks.__getitem__, objs)) if objs else _MISS for objs in blocks.objects]
    num, reach, i = len(block_ranks), [], 0
    for rank in range(len(TIERS)):  # the leading blocks of this rank or a faster one
        while i < num and block_ranks[i] <= rank:
            i += 1
        reach.append(i)
    hits = reach[-1]
    used = {j for objs in blocks.objects[:hits] for j in objs}
    by_rank = [0] * len(TIERS)
    for j in used:
        by_rank[ranks[j]] += sizes[j]
    return {
        "unit": blocks.unit,
        "num_blocks": num,
        "hit_blocks": hits,
        "hit_tokens": sum(blocks.tokens[:hits]),
        "hit_bytes": sum(by_rank),
        "est_load_s": load_estimate_s(len(used), *by_rank) if used else 0.0,
        "up_to_tier": {tier: {"blocks": n, "tokens": sum(blocks.tokens[:n])} for tier, n in zip(TIERS, reach)},
        "tiers": [_NAMES[r] for r in block_ranks],
    }


def rank_of(tiers: list) -> list[int]:
    """Each tier's place in TIERS (_MISS for None)."""
    return [_RANK.get(tier, _MISS) for tier in tiers]


async def _by_hashes(prefix: ByHashes, namespace: str, holdings, objects: Objects) -> Blocks:
    known: dict[bytes, tuple[int, int]] = {}  # object -> (its position in objects, tokens per block)
    blocks = Blocks("block", [], [])
    for i, block_hash in enumerate(prefix.hashes):
        if i and not i % SLICE_BLOCKS:
            await asyncio.sleep(0)
        digests = holdings.objects_of(namespace, block_hash)
        if not digests and isinstance(block_hash, bytes) and len(block_hash) == ID_BYTES:
            held = holdings.get(namespace, block_hash)  # put without a route: named by its id
            digests = (block_hash,) if held is not None and held.route is None else ()
        if len(digests) == 1:  # the common case, kept short: ~1 us a block
            position, count = known.get(digests[0]) or _learn(holdings, namespace, digests[0], objects, known)
            positions = (position,)
        else:
            found = [known.get(d) or _learn(holdings, namespace, d, objects, known) for d in digests]
            positions, count = tuple(p for p, _ in found), min((c for _, c in found), default=0)
        held = count and len(positions) >= prefix.objects_per_block
        blocks.objects.append(positions if held else ())
        blocks.tokens.append(count if held else 0)
    return blocks


def _learn(holdings, namespace: str, digest: bytes, objects: Objects, known: dict) -> tuple[int, int]:
    """An object's position in the call's objects and the tokens in each block it names, as
    its events say (0: no longer held)."""
    held = holdings.get(namespace, digest)
    if held is None:
        count = 0
    elif held.route is None:
        count = held.block_size
    else:
        fields = route_fields(held.route)
        count = fields.get("block_size") or max(1, held.block_size // len(fields["block_hashes"]))
    known[digest] = found = (objects.add(digest), count)
    return found


def _by_tokens(prefix: ByTokens, objects: Objects) -> Blocks:
    desc = prefix.descriptor
    keys = chunk_keys(prefix.tokens, desc, extra_keys=prefix.extra_keys)
    return Blocks("chunk", [(objects.add(k.object_id, desc),) for k in keys], [desc.chunk_tokens] * len(keys))


async def _place(index, namespace: str, objects: Objects) -> tuple[list, list]:
    tiers, sizes = [], []
    for start in range(0, len(objects.ids), PLACE_SLICE):
        if start:
            await asyncio.sleep(0)
        expect = objects.expect[start:start + PLACE_SLICE]
        found = await resolve(index.placements(namespace, objects.ids[start:start + PLACE_SLICE],
                                               expect if any(e is not None for e in expect) else None))
        tiers += found.tiers
        sizes += found.sizes
    return tiers, sizes


# --- the request --------------------------------------------------------------------------

async def _prefixes(value, namespace: str) -> list[ByHashes | ByTokens]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_PREFIXES:
        raise InvalidArgument(f"prefixes must be a list of 1..{MAX_PREFIXES} prefixes")
    prefixes, num_blocks = [], 0
    for i, item in enumerate(value):
        prefix = _prefix(f"prefixes[{i}]", item, namespace)
        num_blocks += (len(prefix.hashes) if isinstance(prefix, ByHashes)
                       else len(prefix.tokens) // prefix.descriptor.chunk_tokens)
        if num_blocks > MAX_BLOCKS_PER_CALL:
            raise InvalidArgument(f"prefixes hold more than {MAX_BLOCKS_PER_CALL} blocks (hashes, or chunks of "
                                  "tokens) in all; split the call")
        prefixes.append(prefix)
        await asyncio.sleep(0)  # up to 65,536 hashes or 1M tokens checked per prefix
    return prefixes


def _prefix(where: str, value, namespace: str) -> ByHashes | ByTokens:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where} must be an object: block_hashes, or tokens and descriptor")
    fields = _BY_HASHES if "block_hashes" in value else _BY_TOKENS
    unknown = sorted(set(value) - fields)
    if unknown:
        raise InvalidArgument(f"{where}: unknown field(s) {unknown}; a prefix is {sorted(_BY_HASHES)} "
                              f"or {sorted(_BY_TOKENS)}")
    nulls = sorted(k for k, v in value.items() if v is None)
    if nulls:
        raise InvalidArgument(f"{where}: field(s) {nulls} must not be null; leave them out instead")
    if fields is _BY_HASHES:
        return ByHashes(_hashes(where, value["block_hashes"]),
                        _objects_per_block(where, value.get("objects_per_block", 1)))
    if "tokens" not in value or "descriptor" not in value:
        raise InvalidArgument(f"{where} needs block_hashes, or tokens and descriptor")
    desc = _named(f"{where}.descriptor", descriptor, value["descriptor"])
    prefix = ByTokens(_named(f"{where}.tokens", tokens, value["tokens"]), desc,
                      _named(f"{where}.extra_keys", extra_keys, value.get("extra_keys")))
    if desc.namespace != namespace:
        raise InvalidArgument(f"{where}.descriptor.namespace is {desc.namespace!r}, not the call's "
                              f"namespace {namespace!r}")
    if len(prefix.tokens) // desc.chunk_tokens > MAX_BLOCKS_PER_PREFIX:
        raise InvalidArgument(f"{where} is more than {MAX_BLOCKS_PER_PREFIX} chunks of "
                              f"descriptor.chunk_tokens {desc.chunk_tokens}")
    return prefix


def _named(where: str, check, value):
    """check(value), its InvalidArgument saying which field of which prefix it is about."""
    try:
        return check(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc}") from None


def _hashes(where: str, value) -> list:
    if not isinstance(value, list) or len(value) > MAX_BLOCKS_PER_PREFIX:
        raise InvalidArgument(f"{where}.block_hashes must be a list of at most {MAX_BLOCKS_PER_PREFIX} hashes")
    hashes = []
    for j, item in enumerate(value):
        if type(item) is int and MIN_INT_HASH <= item <= MAX_INT_HASH:
            hashes.append(item)
            continue
        if type(item) is str and len(item) <= 2 * MAX_HASH_BYTES:
            try:
                digest = bytes.fromhex(item)
            except ValueError:
                digest = b""
            if digest and 2 * len(digest) == len(item):  # fromhex skips spaces: none here
                hashes.append(digest)
                continue
        raise InvalidArgument(f"{where}.block_hashes[{j}]: a block hash is an integer of 64 bits or "
                              f"1..{MAX_HASH_BYTES} bytes in hex, got {item!r}"[:300])
    return hashes


def _objects_per_block(where: str, value) -> int:
    if type(value) is not int or not 1 <= value <= MAX_OBJECTS_PER_BLOCK:
        raise InvalidArgument(f"{where}.objects_per_block must be an integer in 1..{MAX_OBJECTS_PER_BLOCK}")
    return value
