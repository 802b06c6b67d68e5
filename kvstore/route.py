"""How a router names an object's blocks: the engine's own block hashes and what it hashed.

A prefix-aware router matches the block hashes an engine publishes in its KV events
(vllm/distributed/kv_events.py `BlockStored`). When kvstore publishes that it holds an
object, the router can only use the event if it names the blocks the same way. So an
adapter that knows them hands them to the store with the put, as the hint `route`:

    Hints(route=Route(block_hashes=[h1, h2], parent_block_hash=h0, token_ids=[...],
                      block_size=16, group_idx=0))

One object often holds several engine blocks (a 256-token chunk of 16-token blocks: 16
hashes). The daemon keeps the route with the object on every tier (host, NVMe, peers) and
copies it into the object's `BlockStored` and `BlockRemoved` events (server/events/wire.py).
An object put without a route is published under its own id (32 bytes) as its one block
hash; object ids are `kvstore.identity.chunk_keys` over the token ids, a documented hash a
router can compute with this package (or ask the admin API's lookup).

A route is packed once (msgpack, at most MAX_ROUTE_BYTES) and travels and rests packed:
a chunk's token ids as Python ints would cost ~9 KB per object in the host index, packed
they cost ~3 bytes a token. `Route.unpack` validates; the daemon unpacks a put's route
once, to refuse a bad one by name.

Pure: no I/O.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

from kvstore.errors import InvalidArgument

# A route is metadata beside an object of megabytes. 64 KiB holds a chunk of ~16,000 token
# ids with 256 block hashes; a put_many window keeps its routes under 1 MiB of a frame's
# 4 MiB (client/batched.py).
MAX_ROUTE_BYTES = 64 * 1024
# vLLM's hashes are 32-byte digests (sha256) or, with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, 64-bit
# integers; older engines published Python's signed hash(). Anything else is not a block hash.
MAX_HASH_BYTES = 64
MIN_INT_HASH, MAX_INT_HASH = -(1 << 63), (1 << 64) - 1
MAX_TOKEN_ID = (1 << 32) - 1
MAX_BLOCKS = 4096
# vLLM's extra keys per block: the LoRA name, (mm_identifier, offset) pairs, a cache salt,
# prompt-embedding digests: scalars in lists at most this deep.
MAX_EXTRA_DEPTH = 3
MAX_LABEL_CHARS = 256

_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name", "extra_keys",
           "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lookahead_token_ids")


@dataclass(frozen=True, slots=True)
class Route:
    """An object's blocks as the engine names them. Only block_hashes is required.

    block_hashes: the engine's hashes of the blocks the object holds, in order (bytes of at
        most 64, or integers of 64 bits).
    parent_block_hash: the hash of the block before the first (None: the prefix starts here).
    token_ids: the tokens of those blocks (len(block_hashes) * block_size of them), when known.
    block_size: tokens per engine block (None: the object's chunk_tokens / len(block_hashes)).
    lora_name, extra_keys (one entry per block, or None), group_idx (the engine's KV cache
    group), kv_cache_spec_kind, kv_cache_spec_sliding_window, lookahead_token_ids (per block
    the tokens past it that its hash covers, with vLLM's lookahead hashing): as in vLLM's
    BlockStored.
    """

    block_hashes: tuple
    parent_block_hash: bytes | int | None = None
    token_ids: tuple | None = None
    block_size: int | None = None
    lora_name: str | None = None
    extra_keys: tuple | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lookahead_token_ids: tuple | None = None

    def __post_init__(self) -> None:
        hashes = _sequence("block_hashes", self.block_hashes)
        if not 1 <= len(hashes) <= MAX_BLOCKS:
            raise InvalidArgument(f"route block_hashes must hold 1..{MAX_BLOCKS} hashes, got {len(hashes)}")
        for value in hashes:
            _check_hash("block_hashes", value)
        object.__setattr__(self, "block_hashes", hashes)
        if self.parent_block_hash is not None:
            _check_hash("parent_block_hash", self.parent_block_hash)
        if self.token_ids is not None:
            tokens = _sequence("token_ids", self.token_ids)
            try:  # in C: a chunk's 256 token ids checked one by one in Python cost ~25 us a put
                struct.pack(f"<{len(tokens)}I", *tokens)
            except struct.error:
                raise InvalidArgument(f"route token_ids must be integers in 0..{MAX_TOKEN_ID}") from None
            object.__setattr__(self, "token_ids", tokens)
        if self.lookahead_token_ids is not None:
            lookahead = _sequence("lookahead_token_ids", self.lookahead_token_ids)
            if len(lookahead) != len(hashes):
                raise InvalidArgument(f"route lookahead_token_ids has {len(lookahead)} lists for {len(hashes)} "
                                      "block hashes (one per block)")
            lists = tuple(_sequence("lookahead_token_ids", tokens) for tokens in lookahead)
            try:
                for tokens in lists:
                    struct.pack(f"<{len(tokens)}I", *tokens)
            except struct.error:
                raise InvalidArgument(f"route lookahead_token_ids must be integers in 0..{MAX_TOKEN_ID}") from None
            object.__setattr__(self, "lookahead_token_ids", lists)
        for name in ("block_size", "group_idx", "kv_cache_spec_sliding_window"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_TOKEN_ID):
                raise InvalidArgument(f"route {name} must be an integer >= 0, got {value!r}"[:200])
        if self.block_size == 0:
            raise InvalidArgument("route block_size must be >= 1")
        for name in ("lora_name", "kv_cache_spec_kind"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_LABEL_CHARS):
                raise InvalidArgument(f"route {name} must be a string of at most {MAX_LABEL_CHARS} characters")
        if self.extra_keys is not None:
            extra = _sequence("extra_keys", self.extra_keys)
            if len(extra) != len(hashes):
                raise InvalidArgument(f"route extra_keys has {len(extra)} entries for {len(hashes)} block hashes "
                                      "(one per block, None where a block has none)")
            object.__setattr__(self, "extra_keys", tuple(_frozen_extra(e, 0) for e in extra))

    def pack(self) -> bytes:
        """The route as it travels and rests: a msgpack map of the fields that are set."""
        doc = {}
        for name in _FIELDS:
            value = getattr(self, name)
            if value is not None:
                doc[name] = value
        data = msgpack.packb(doc, use_bin_type=True)
        if len(data) > MAX_ROUTE_BYTES:
            raise InvalidArgument(f"a route packs to {len(data)} bytes, over the limit of {MAX_ROUTE_BYTES}")
        return data

    @classmethod
    def unpack(cls, data: bytes) -> Route:
        """A packed route, validated (InvalidArgument naming the problem)."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_ROUTE_BYTES:
            raise InvalidArgument(f"a packed route must be bytes of at most {MAX_ROUTE_BYTES}")
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=False)
        except Exception:
            raise InvalidArgument("a packed route is not msgpack") from None
        if not isinstance(doc, dict) or not set(doc) <= set(_FIELDS) or "block_hashes" not in doc:
            raise InvalidArgument(f"a packed route must be a map of {list(_FIELDS)} with block_hashes")
        return cls(**doc)

    def event_fields(self) -> dict:
        """The route's fields as vLLM's BlockStored names them (lists, not tuples)."""
        return {"block_hashes": list(self.block_hashes), "parent_block_hash": self.parent_block_hash,
                "token_ids": list(self.token_ids or ()), "block_size": self.block_size, "lora_name": self.lora_name,
                "extra_keys": None if self.extra_keys is None else [_listed(e) for e in self.extra_keys],
                "group_idx": self.group_idx, "kv_cache_spec_kind": self.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": self.kv_cache_spec_sliding_window,
                "lookahead_token_ids": None if self.lookahead_token_ids is None
                else [list(tokens) for tokens in self.lookahead_token_ids]}


def published_hash(value, int_form: bool):
    """A block hash as KV events publish it: with int_form (vLLM's default,
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) bytes become their last 8 bytes, big-endian, as
    kv_cache_utils.maybe_convert_block_hash makes them; integers stay."""
    if int_form and isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value[-8:], "big")
    return value


def route_fields(packed: bytes) -> dict:
    """A packed route's fields by name, without validating them again (the daemon checked
    the route when it came in): what the event stream reads on its hot path."""
    return msgpack.unpackb(packed, raw=False, use_list=True)


def route_json(packed: bytes) -> dict:
    """A packed route as JSON can show it (the admin API): bytes as hex, unset fields left out."""
    return {name: _json(value) for name, value in Route.unpack(packed).event_fields().items()
            if value is not None and value != []}


def _json(value):
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    if isinstance(value, list):
        return [_json(v) for v in value]
    return value


class PackedRoute(bytes):
    """Packed route bytes known to be valid: checked once, however many hints carry them."""
    __slots__ = ()


def packed_route(value) -> PackedRoute | None:
    """A hint's route as it is kept: None, a Route (packed here) or packed bytes (checked
    unless they are a PackedRoute already)."""
    if value is None or isinstance(value, PackedRoute):
        return value
    if isinstance(value, Route):
        return PackedRoute(value.pack())
    if isinstance(value, (bytes, bytearray)):
        Route.unpack(value)
        return PackedRoute(value)
    raise InvalidArgument(f"hint route must be a kvstore.route.Route, got {type(value).__name__}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sequence(name: str, value) -> tuple:
    if isinstance(value, (list, tuple, range)):
        return tuple(value)
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors
        return tuple(value.tolist())
    raise InvalidArgument(f"route {name} must be a list, got {type(value).__name__}")


def _check_hash(name: str, value) -> None:
    if isinstance(value, (bytes, bytearray)):
        if 1 <= len(value) <= MAX_HASH_BYTES:
            return
    elif _is_int(value) and MIN_INT_HASH <= value <= MAX_INT_HASH:
        return
    raise InvalidArgument(f"route {name}: a block hash is bytes (1..{MAX_HASH_BYTES}) or a 64-bit integer, "
                          f"got {value!r}"[:200])


def _frozen_extra(value, depth: int):
    """An extra key, lists made tuples (a Route is hashable); InvalidArgument if not scalars."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)) and depth < MAX_EXTRA_DEPTH:
        return tuple(_frozen_extra(v, depth + 1) for v in value)
    raise InvalidArgument(f"route extra_keys hold strings, bytes, numbers and lists of them, got {value!r}"[:200])


def _listed(value):
    return [_listed(v) for v in value] if isinstance(value, tuple) else value
