"""Typed replies of the peer protocol: what a home node answers another daemon with.

The requests' counterpart (kvstore/peer_messages.py holds the requests and RemoteMeta), as
kvstore/replies.py is to kvstore/messages.py, and built by the same `@reply`: the peer
service sends `reply.to_wire()`, the remote tier reads `ReplyClass.from_wire(result)` and
then attributes. The wire is the plain map daemons sent before these types, byte for byte,
so daemons of both versions keep talking in one cluster.

A reply comes from another daemon, which may run another version or be broken: every field
checks its wire type as it decodes, and anything else is a ProtocolError naming the reply
and the field ("PeerPinReply.pinned: ..."), which the remote tier counts as a failed call to
that peer, never as an exception in the daemon.
"""

from __future__ import annotations

from typing import Callable, ClassVar

from kvstore.errors import KVStoreError, ProtocolError
from kvstore.peer_messages import RemoteMeta
from kvstore.replies import ReplyMessage, reply


def peer_reply(cls: type) -> type:
    """`@reply`, with each field's decoder (every field has one) wrapped so that whatever it
    raises becomes a ProtocolError naming the reply and the field."""
    name = cls.__name__
    unchecked = set(cls.__annotations__) - set(cls._codecs) - {"_codecs"}
    if unchecked:
        raise TypeError(f"{name}: fields {sorted(unchecked)} need a checking decoder in _codecs")
    cls._codecs = {field: (_named(name, field, dec), enc) for field, (dec, enc) in cls._codecs.items()}
    return reply(cls)


def _named(reply_name: str, field: str, decode: Callable) -> Callable:
    def checked(value):
        try:
            return decode(value)
        except Exception as exc:  # the peer's bytes, not ours: whatever fails to decode is its error
            why = exc.message if isinstance(exc, KVStoreError) else str(exc)
            raise ProtocolError(f"{reply_name}.{field}: {why}"[:300]) from None
    checked.__name__ = f"decode_{field}"
    return checked


def _bool(value) -> bool:
    if value is True or value is False:
        return value
    raise TypeError(f"expected true or false, got {type(value).__name__}")


def _flags(value) -> tuple:
    if isinstance(value, (list, tuple)) and all(v is True or v is False for v in value):
        return tuple(value)
    raise TypeError("expected a list of true or false")


def _meta(value) -> RemoteMeta | None:
    return None if value is None else RemoteMeta.from_wire(value)


def _meta_wire(meta: RemoteMeta | None) -> dict | None:
    return None if meta is None else meta.to_wire()


def _metas_wire(metas: tuple) -> list:
    return [None if m is None else m.to_wire() for m in metas]


def _metas(value) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list of metadata, got {type(value).__name__}")
    return tuple([None if wire is None else RemoteMeta.from_wire(wire) for wire in value])


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    raise TypeError(f"expected bytes, got {type(value).__name__}")


BOOL = (_bool, None)  # None: sent as it is (@reply writes no call)
FLAGS = (_flags, list)  # a wire array decodes to a tuple and encodes as a list


@peer_reply
class PeerGetReply(ReplyMessage):
    """`meta` None: a miss. Else meta.size payload bytes follow the reply (the transport's
    "payload_bytes" is added after these fields), or for a ranged get only the ranges,
    packed, and `ranges_checksum` is their xxh3-128."""
    meta: RemoteMeta | None
    ranges_checksum: bytes | None = None
    _codecs: ClassVar = {"meta": (_meta, _meta_wire), "ranges_checksum": (_bytes, None)}


PEER_MISS = PeerGetReply(None)


@peer_reply
class PeerPutReply(ReplyMessage):
    stored: bool  # False: the node held the id already (the payload was dropped)
    _codecs: ClassVar = {"stored": BOOL}


@peer_reply
class PeerLookupReply(ReplyMessage):
    metas: tuple  # (RemoteMeta | None, ...) in the order of the request's ids
    _codecs: ClassVar = {"metas": (_metas, _metas_wire)}


@peer_reply
class PeerDeleteReply(ReplyMessage):
    found: tuple  # (bool, ...): per id, whether the node held it (in any tier) and dropped it
    _codecs: ClassVar = {"found": FLAGS}


@peer_reply
class PeerPinReply(ReplyMessage):
    pinned: tuple  # (bool, ...): per id, whether the node held it and changed its pin
    _codecs: ClassVar = {"pinned": FLAGS}


# What each peer op answers (kvstore.peer_messages.PEER_OPS holds the requests).
PEER_REPLIES: dict[str, type[ReplyMessage]] = {
    "peer_get": PeerGetReply, "peer_put": PeerPutReply, "peer_lookup": PeerLookupReply,
    "peer_delete": PeerDeleteReply, "peer_pin": PeerPinReply,
}
