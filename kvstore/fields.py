"""Field codecs of the local protocol's requests: each is (decode wire -> python, encode
python -> wire). Decoders validate strictly and raise InvalidArgument naming the problem; the
request classes (kvstore/messages.py, kvstore/peer_messages.py) say which codec each field uses.
"""

from __future__ import annotations

import math
import struct

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.route import packed_route
from kvstore.identity import ObjectId, StateDescriptor, check_name
from kvstore.protocol import MAX_BATCH, MAX_STR_CHARS
from kvstore.ranges import CODEC as RANGES  # noqa: F401 (a field codec, as the others)
from kvstore.units import check_seconds

CHECKSUM_BYTES = 16  # xxh3-128
# One object may not exceed this; arenas are sized far below it in practice.
MAX_OBJECT_BYTES = 1 << 40
TIERS = ("gpu", "host", "nvme", "remote")
PUT_TIERS = ("host", "remote")  # where a put may ask its object to go
SCOPES = ("cluster", "node")  # of a delete, pin or unpin
PREFETCH_POLICIES = ("best_effort", "wait", "timeout")


# --- field codecs: (decode wire -> python, encode python -> wire) -----------------

def _int(lo: int, hi: int):
    def dec(v):
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise InvalidArgument(f"must be an integer in {lo}..{hi}, got {v!r}"[:200])
        return v
    return dec, lambda v: v


def _float(v):
    if v is None:
        return None
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise InvalidArgument(f"must be a finite number >= 0, got {v!r}"[:200])
    return float(v)


def _bool_dec(v):
    if not isinstance(v, bool):
        raise InvalidArgument(f"must be true or false, got {v!r}"[:200])
    return v


def _str_dec(v):
    if not isinstance(v, str) or len(v) > MAX_STR_CHARS:
        raise InvalidArgument(f"must be a string of at most {MAX_STR_CHARS} characters")
    return v


def _opt_str_dec(v):
    return None if v is None else _str_dec(v)


def _ns_dec(v):
    return check_name("namespace", v)


def _oid_dec(v):
    if not isinstance(v, bytes):
        raise InvalidArgument("object id must be 32 bytes (msgpack bin)")
    return ObjectId(v)


def _ids_dec(v):
    if not isinstance(v, list) or len(v) > MAX_BATCH:
        raise InvalidArgument(f"ids must be a list of at most {MAX_BATCH} object ids")
    return tuple(_oid_dec(x) for x in v)


def _raw_ids_dec(v):
    """Ids as validated raw 32-byte digests: the hot batch path builds no objects. On the
    wire one bin of 32 bytes per id (what raw_ids_wire sends), or a list of 32-byte bins
    (clients from before the packed form); either decodes to a tuple of bytes. (A
    message's own to_args() gives its ObjectIds, bytes too.)"""
    if type(v) is bytes:
        if len(v) % 32 or len(v) > 32 * MAX_BATCH:
            raise InvalidArgument(f"packed ids must be a multiple of 32 bytes, at most {MAX_BATCH} ids; "
                                  f"got {len(v)} bytes")
        # (a bytes object per id, for the index's hash: 4,096 in ~0.09 ms, where a
        # list's decode and checks took ~0.35)
        return struct.unpack("32s" * (len(v) // 32), v)
    if not isinstance(v, list) or len(v) > MAX_BATCH:
        raise InvalidArgument(f"ids must be a list of at most {MAX_BATCH} object ids")
    if not all(isinstance(x, bytes) and len(x) == 32 for x in v):
        raise InvalidArgument("every object id must be 32 bytes (msgpack bin)")
    return tuple(v)


def raw_ids_wire(ids) -> bytes:
    """RAW_IDS' wire form: the ids packed, 32 bytes each."""
    return b"".join(ids)


def _checksum_dec(v):
    if not isinstance(v, bytes) or len(v) != CHECKSUM_BYTES:
        raise InvalidArgument(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128)")
    return v


# The most bytes one put_inline carries (kvstore/messages.py: PutInline): well inside the
# smallest frame a daemon may be configured to read (kvstore/config.py: MIN_FRAME_BYTES).
INLINE_PUT_MAX_BYTES = 128 << 10


def _inline_data_dec(v):
    if not isinstance(v, bytes) or not 1 <= len(v) <= INLINE_PUT_MAX_BYTES:
        raise InvalidArgument(f"must be 1..{INLINE_PUT_MAX_BYTES} bytes (msgpack bin); "
                              "a larger object goes by reserve and commit")
    return v


def _choice(options):
    def dec(v):
        if v not in options:
            raise InvalidArgument(f"must be one of {options}, got {v!r}"[:200])
        return v
    return dec, lambda v: v


def _accept_dec(v):
    if v is None:
        return None
    if not isinstance(v, list) or not 0 < len(v) <= len(DType):
        raise InvalidArgument("accept must be a non-empty list of dtypes")
    return tuple(DType.parse(x) for x in v)


_ANY = (lambda v: v, lambda v: v)
NAMESPACE = (_ns_dec, lambda v: v)
OID = (_oid_dec, lambda v: v.digest)
# An ObjectId is a bytes subclass, which msgpack writes as bin as it is: a copy of each id
# (`.digest`) cost ~0.3 us, 1.2 ms of a 4,096-key lookup.
IDS = (_ids_dec, list)
RAW_IDS = (_raw_ids_dec, raw_ids_wire)
LEASE = _int(1, 2**63 - 1)
SIZE = _int(1, MAX_OBJECT_BYTES)
FLOAT = (_float, lambda v: v)


def pin_ttl(v, name: str = "ttl_s"):
    """A pin's TTL as a float: seconds in (0, MAX_DURATION_S], or None (pinned until unpinned).
    One rule for the wire, the client's pin and the admin API's."""
    if v is None:
        return None
    if check_seconds(v, name) == 0:
        raise InvalidArgument(f"{name} must be > 0 seconds, or null to pin until unpinned")
    return float(v)


PIN_TTL = (pin_ttl, lambda v: v)
STR = (_str_dec, lambda v: v)
BOOL = (_bool_dec, lambda v: v)
OPT_STR = (_opt_str_dec, lambda v: v)
CHECKSUM = (_checksum_dec, lambda v: v)
INLINE_DATA = (_inline_data_dec, lambda v: v)  # bytes, or a caller's flat uint8 buffer
DESCRIPTOR = (StateDescriptor.from_wire, lambda v: v.to_wire())
EXPECT = (lambda v: None if v is None else StateDescriptor.from_wire(v), lambda v: None if v is None else v.to_wire())
# Distinct descriptors one lookup may expect (a request mixes a few kinds of state, not more).
MAX_EXPECTED_DESCRIPTORS = 16
NO_EXPECTATION = 255  # in Lookup.expect_of: this id expects nothing


def _expect_list_dec(v):
    if v is None:
        return None
    if not isinstance(v, list) or not 0 < len(v) <= MAX_EXPECTED_DESCRIPTORS:
        raise InvalidArgument(f"must be a list of 1..{MAX_EXPECTED_DESCRIPTORS} descriptors")
    return tuple(StateDescriptor.from_wire(d) for d in v)


def _expect_of_dec(v):
    if v is not None and not isinstance(v, bytes):
        raise InvalidArgument("must be bytes: per id, an index into expect (255: none)")
    return v


EXPECT_LIST = (_expect_list_dec, lambda v: None if v is None else [d.to_wire() for d in v])
EXPECT_OF = (_expect_of_dec, lambda v: v)
HINTS = (Hints.from_wire, lambda v: v.to_wire())


def _routes_dec(v):
    """Per item of a batch a packed route (kvstore.route) or nil; () when the field is absent."""
    if not isinstance(v, list) or not 0 < len(v) <= MAX_BATCH:
        raise InvalidArgument(f"must be a list of 1..{MAX_BATCH} packed routes or nils")
    return tuple(packed_route(r) for r in v)


ROUTES = (_routes_dec, list)
ACCEPT = (_accept_dec, lambda v: None if v is None else [DType.parse(d).value for d in v])


# --- packed columns of the batched ops (one frame, many objects) ---------------------

_UINT = {2: "H", 8: "Q"}  # bytes per item -> struct's code


def pack_uints(values, width: int = 8) -> bytes:
    """A packed column: little-endian unsigned ints of `width` bytes (8: u64, 2: u16)."""
    values = list(values)
    return struct.pack(f"<{len(values)}{_UINT[width]}", *values)


def unpack_uints(packed: bytes, width: int = 8) -> list[int]:
    return list(struct.unpack(f"<{len(packed) // width}{_UINT[width]}", packed))


def _packed(width: int, what: str):
    """bytes holding 1..MAX_BATCH items of `width` bytes each, kept packed."""
    def dec(v):
        if type(v) is not bytes or not v or len(v) % width or len(v) // width > MAX_BATCH:
            raise InvalidArgument(f"must be 1..{MAX_BATCH} {what}, packed (msgpack bin of {width} bytes each)")
        return v
    return dec, lambda v: v


PACKED_IDS = _packed(32, "object ids")
PACKED_U64 = _packed(8, "little-endian u64s")
PACKED_CHECKSUMS = _packed(CHECKSUM_BYTES, "xxh3-128 checksums")
