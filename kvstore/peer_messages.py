"""Typed messages between daemons (the peer protocol), shared by both ends.

Same frames, ids and field codecs as the local protocol (kvstore.protocol, kvstore.messages).
A request or reply with payload bytes after it says how many in its top-level
"payload_bytes" field; the transport strips it before a message is decoded here. Every
request names its namespace: a node answers only for the namespace asked. The replies are
typed in kvstore/peer_replies.py (PeerGetReply ... PeerPinReply); the maps below are their
wire form.

    peer_get     {namespace, object_id}            -> {"meta": meta | None} (+ meta.size bytes)
                 {..., ranges}                     -> {"meta", "ranges_checksum"} (+ the ranges, packed)
    peer_put     {namespace, object_id, **meta}    (+ size bytes) -> {"stored": bool}
    peer_lookup  {namespace, ids}                  -> {"metas": [meta | None, ...]}
    peer_delete  {namespace, ids}                  -> {"found": [bool, ...]}
    peer_pin     {namespace, ids, ttl_s, unpin}    -> {"pinned": [bool, ...]}
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

from kvstore.ranges import CODEC as RANGES
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.fields import CHECKSUM, DESCRIPTOR, FLOAT, HINTS, IDS, NAMESPACE, OID, PIN_TTL, SIZE
from kvstore.message_base import Message

# Descriptors and hints repeat across objects (one model, a few layouts): their parsed and
# encoded forms are cached, which took decoding a meta from ~58 us to a few. Cached wire
# dicts are shared: read them, never change them.
CODEC_CACHE_ENTRIES = 1024


def _cached_codec(codec: tuple, name: str) -> tuple:
    dec, enc = codec
    dec_items = functools.lru_cache(CODEC_CACHE_ENTRIES)(lambda items: dec(dict(items)))
    enc_cached = functools.lru_cache(CODEC_CACHE_ENTRIES)(enc)

    def decode(value):
        if not isinstance(value, dict):
            return dec(value)  # raises the codec's own error
        try:
            return dec_items(tuple(sorted(value.items())))
        except TypeError:  # unhashable values: not a valid descriptor anyway, let dec say why
            return dec(value)

    decode.__name__ = f"decode_{name}"
    return decode, enc_cached


CACHED_DESCRIPTOR = _cached_codec(DESCRIPTOR, "descriptor")
CACHED_HINTS = _cached_codec(HINTS, "hints")


@dataclass(frozen=True, slots=True)
class RemoteMeta:
    """What a home node knows about one object; the payload has `size` bytes. created_at:
    the wall-clock time of its put (None: not known), so that a copy made anywhere expires
    when the object does (hints.ttl_s counts from the put on every tier and node)."""

    size: int
    checksum: bytes
    descriptor: StateDescriptor
    hints: Hints = Hints()
    created_at: float | None = None
    _codecs: ClassVar = {"size": SIZE, "checksum": CHECKSUM, "descriptor": CACHED_DESCRIPTOR, "hints": CACHED_HINTS,
                         "created_at": FLOAT}

    def expired(self, now_wall: float) -> bool:
        """Past its TTL, counted from its put (never, without a TTL or a known put time)."""
        ttl_s = self.hints.ttl_s
        return ttl_s is not None and self.created_at is not None and self.created_at + ttl_s <= now_wall

    def to_wire(self) -> dict:
        return {k: enc(getattr(self, k)) for k, (_, enc) in self._codecs.items()}

    @classmethod
    def from_wire(cls, data) -> RemoteMeta:
        if not isinstance(data, dict) or set(data) - set(cls._codecs):
            raise ProtocolError("peer sent malformed object metadata")
        return cls(**{k: dec(data[k]) for k, (dec, _) in cls._codecs.items() if k in data})


# --- requests ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PeerGet(Message):
    """Reply {"meta": meta | None}; when found, `meta.size` payload bytes follow. With
    `ranges`, only those bytes follow, packed (kvstore.ranges), and the reply's
    "ranges_checksum" is their xxh3-128."""
    namespace: str
    object_id: ObjectId
    ranges: tuple | None = None
    op: ClassVar[str] = "peer_get"
    _codecs: ClassVar = {"namespace": NAMESPACE, "object_id": OID, "ranges": RANGES}
    _defaults: ClassVar = {"ranges": None}


@dataclass(frozen=True, slots=True)
class PeerPut(Message):
    """`size` payload bytes follow the request. Reply {"stored": bool} (False: already held)."""
    namespace: str
    object_id: ObjectId
    size: int
    checksum: bytes
    descriptor: StateDescriptor
    hints: Hints = Hints()
    created_at: float | None = None
    op: ClassVar[str] = "peer_put"
    _codecs: ClassVar = {"namespace": NAMESPACE, "object_id": OID, **RemoteMeta._codecs}
    _defaults: ClassVar = {"hints": Hints(), "created_at": None}

    @property
    def meta(self) -> RemoteMeta:
        return RemoteMeta(self.size, self.checksum, self.descriptor, self.hints, self.created_at)


@dataclass(frozen=True, slots=True)
class PeerLookup(Message):
    """Reply {"metas": [meta | None, ...]} in the order of `ids`."""
    namespace: str
    ids: tuple
    op: ClassVar[str] = "peer_lookup"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS}


@dataclass(frozen=True, slots=True)
class PeerDelete(Message):
    """Reply {"found": [bool, ...]}: per id, whether the peer held it (in any tier) and dropped it."""
    namespace: str
    ids: tuple
    op: ClassVar[str] = "peer_delete"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS}


def _bool_dec(v):
    if not isinstance(v, bool):
        raise InvalidArgument(f"must be true or false, got {v!r}"[:200])
    return v


@dataclass(frozen=True, slots=True)
class PeerPin(Message):
    """Pin (or with `unpin`, unpin) the ids' host copies held here. Reply {"pinned": [bool, ...]}:
    per id, whether this node held it and changed its pin."""
    namespace: str
    ids: tuple
    ttl_s: float | None = None
    unpin: bool = False
    op: ClassVar[str] = "peer_pin"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS, "ttl_s": PIN_TTL, "unpin": (_bool_dec, lambda v: v)}
    _defaults: ClassVar = {"ttl_s": None, "unpin": False}


PEER_OPS: dict[str, type[Message]] = {cls.op: cls for cls in (PeerGet, PeerPut, PeerLookup, PeerDelete, PeerPin)}
