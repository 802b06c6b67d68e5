"""How a kvstore object is laid out in a shared pool (Mooncake Store): one key per object, a
fixed-size header in front of the payload. Pure: bytes in, bytes out.

    key:    <key_prefix><namespace>/<object id, 64 hex>
    value:  header (HEADER_BYTES) | payload (meta.size bytes)
    header: magic "KVSPOOL1" (8) | body length u32 LE (4) | reserved u32 (4)
            | xxh3-128 of the body (16) | body: msgpack {"id": 32 bytes, "meta": RemoteMeta wire}
            | zeros up to HEADER_BYTES

The header travels in the same value as the bytes (never a companion key: Mooncake's keys are
not transactional, a companion could outlive or predate its payload). A reader takes it as
valid only if its own checksum holds, it names the id and namespace asked for and a size
that fits the value; the payload must then hash to the header's checksum. Anything else is
a miss (`PoolHeaderError`), never served.

The header has a fixed size so that a reader can fetch it alone with one ranged read (a
lookup), or with the payload straight into tier memory in the same call (a get that guesses
the payload's size), with no size lookup first. The meta's created_at (the put's wall-clock
time) lets a reader expire the object, which Mooncake itself never does.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import msgpack
import xxhash

from kvstore.errors import KVStoreError, ProtocolError
from kvstore.identity import ObjectId
from kvstore.peer_messages import RemoteMeta

MAGIC = b"KVSPOOL1"
# Room for the largest metadata an object can have (names of 256 characters, a long layout
# string, hints), and a multiple of the 4 KiB page the arenas and NVMe use.
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8sII16s")  # magic, body length, reserved, body checksum


class PoolHeaderError(KVStoreError):
    """A pool value that is not the object asked for: a miss, counted by the reader."""

    code = "pool_header"


def pool_key(prefix: str, namespace: str, object_id: ObjectId) -> str:
    """The pool key of an object. Namespaces are kept apart by the key: a lookup or read in
    one namespace can never name another's keys (the id alone is not trusted for that)."""
    return f"{prefix}{namespace}/{object_id.hex}"


def encode_header(object_id: ObjectId, meta: RemoteMeta) -> bytes:
    """The HEADER_BYTES header of `object_id` with `meta`. A route (the engine's block names,
    for router events) that does not fit is left out; ValueError if the rest does not fit
    either (the object is then not stored in the pool)."""
    body = msgpack.packb({"id": bytes(object_id), "meta": meta.to_wire()}, use_bin_type=True)
    if _FIXED.size + len(body) > HEADER_BYTES and getattr(meta.hints, "route", None) is not None:
        meta = replace(meta, hints=meta.hints.with_route(None))
        body = msgpack.packb({"id": bytes(object_id), "meta": meta.to_wire()}, use_bin_type=True)
    if _FIXED.size + len(body) > HEADER_BYTES:
        raise ValueError(f"object metadata of {len(body)} bytes does not fit a {HEADER_BYTES}-byte pool header")
    fixed = _FIXED.pack(MAGIC, len(body), 0, xxhash.xxh3_128_digest(body))
    return fixed + body + bytes(HEADER_BYTES - _FIXED.size - len(body))


def decode_header(header, namespace: str, object_id: ObjectId) -> RemoteMeta:
    """The meta of a header read back for `object_id` in `namespace`; PoolHeaderError if it is
    damaged or names another object, namespace or size."""
    view = memoryview(header).cast("B")
    if len(view) < HEADER_BYTES:
        raise PoolHeaderError(f"pool header of {len(view)} bytes, expected {HEADER_BYTES}")
    magic, length, _, digest = _FIXED.unpack_from(view)
    if magic != MAGIC or length > HEADER_BYTES - _FIXED.size:
        raise PoolHeaderError("not a kvstore pool header (magic or length)")
    body = view[_FIXED.size:_FIXED.size + length]
    if xxhash.xxh3_128_digest(body) != digest:
        raise PoolHeaderError("pool header fails its checksum")
    try:
        doc = msgpack.unpackb(body, raw=False)
        if not isinstance(doc, dict) or set(doc) != {"id", "meta"}:
            raise ProtocolError("pool header body is not {id, meta}")
        meta = RemoteMeta.from_wire(doc["meta"])
    except (ValueError, TypeError, KVStoreError) as exc:
        raise PoolHeaderError(f"pool header does not decode: {exc}") from None
    if doc["id"] != bytes(object_id):
        raise PoolHeaderError("pool header names another object id")
    if meta.descriptor.namespace != namespace:
        raise PoolHeaderError(f"pool header names namespace {meta.descriptor.namespace!r}, not {namespace!r}")
    return meta
