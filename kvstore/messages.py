"""Typed requests of the local protocol, with strict decoding of their arguments.

Each op is a frozen dataclass; `decode_request(Request)` validates a wire request into
one (raising InvalidArgument / ProtocolError that name the bad field), and
`message.to_args()` is what a client sends. Client and daemon share these classes, so
the two ends cannot drift apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from kvstore.ranges import CODEC as RANGES
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor, _check_name
from kvstore.protocol import MAX_BATCH, MAX_STR_CHARS, Request

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
    _check_name("namespace", v)
    return v


def _oid_dec(v):
    if not isinstance(v, bytes):
        raise InvalidArgument("object id must be 32 bytes (msgpack bin)")
    return ObjectId(v)


def _ids_dec(v):
    if not isinstance(v, list) or len(v) > MAX_BATCH:
        raise InvalidArgument(f"ids must be a list of at most {MAX_BATCH} object ids")
    return tuple(_oid_dec(x) for x in v)


def _raw_ids_dec(v):
    """Ids as validated raw 32-byte digests: the hot batch path builds no objects."""
    if not isinstance(v, list) or len(v) > MAX_BATCH:
        raise InvalidArgument(f"ids must be a list of at most {MAX_BATCH} object ids")
    if not all(type(x) is bytes and len(x) == 32 for x in v):
        raise InvalidArgument("every object id must be 32 bytes (msgpack bin)")
    return tuple(v)


def _checksum_dec(v):
    if not isinstance(v, bytes) or len(v) != CHECKSUM_BYTES:
        raise InvalidArgument(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128)")
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
IDS = (_ids_dec, lambda v: [x.digest for x in v])
RAW_IDS = (_raw_ids_dec, lambda v: [x.digest if isinstance(x, ObjectId) else x for x in v])
LEASE = _int(1, 2**63 - 1)
SIZE = _int(1, MAX_OBJECT_BYTES)
FLOAT = (_float, lambda v: v)


def _pin_ttl(v):
    v = _float(v)
    if v == 0:
        raise InvalidArgument("must be > 0 (seconds), or null to pin until unpinned")
    return v


PIN_TTL = (_pin_ttl, lambda v: v)
STR = (_str_dec, lambda v: v)
BOOL = (_bool_dec, lambda v: v)
OPT_STR = (_opt_str_dec, lambda v: v)
CHECKSUM = (_checksum_dec, lambda v: v)
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
ACCEPT = (_accept_dec, lambda v: None if v is None else [DType.parse(d).value for d in v])


class Message:
    """Base of typed requests. Subclasses set `op` and `_codecs` (field -> codec)."""

    op: ClassVar[str]
    _codecs: ClassVar[dict[str, tuple[Callable, Callable]]]
    _defaults: ClassVar[dict[str, Any]] = {}

    @classmethod
    def from_args(cls, args: dict) -> Message:
        unknown = set(args) - set(cls._codecs)
        if unknown:
            raise InvalidArgument(f"{cls.op}: unknown field(s) {sorted(map(str, unknown))[:8]}")
        values = {}
        for name, (dec, _) in cls._codecs.items():
            if name in args:
                try:
                    values[name] = dec(args[name])
                except InvalidArgument as exc:
                    raise InvalidArgument(f"{cls.op}.{name}: {exc.message}") from None
            elif name in cls._defaults:
                values[name] = cls._defaults[name]
            else:
                raise InvalidArgument(f"{cls.op}: missing field {name!r}")
        return cls(**values)

    def to_args(self) -> dict:
        """The wire fields; one at its default is left out (the decoder fills it in), so a
        field added later does not break a reader that predates it unless it is used."""
        defaults, args = self._defaults, {}
        for name, (_, encode) in self._codecs.items():
            value = getattr(self, name)
            if name not in defaults or value != defaults[name]:
                args[name] = encode(value)
        return args


@dataclass(frozen=True, slots=True)
class Hello(Message):
    client: str
    pid: int
    op: ClassVar[str] = "hello"
    _codecs: ClassVar = {"client": STR, "pid": _int(0, 2**31)}


@dataclass(frozen=True, slots=True)
class OpenNamespace(Message):
    """Ask for a namespace's host arena; the reply carries its fd (SCM_RIGHTS).

    create False (a reader): a namespace with no arena yet stays without one, and the reply
    says arena_bytes 0 with no fd; the connection may still look up and get there (misses).
    Only a writer's open (create True, the default) makes the arena."""
    namespace: str
    token: str | None = None
    create: bool = True
    op: ClassVar[str] = "open"
    _codecs: ClassVar = {"namespace": NAMESPACE, "token": OPT_STR, "create": BOOL}
    _defaults: ClassVar = {"token": None, "create": True}


@dataclass(frozen=True, slots=True)
class Reserve(Message):
    """Phase one of a put: a write lease on an extent of `size` bytes. tier "remote": the
    commit sends the object to its home nodes and waits for them (a clustered daemon only)."""
    namespace: str
    object_id: ObjectId
    size: int
    descriptor: StateDescriptor
    hints: Hints = Hints()
    tier: str = "host"
    op: ClassVar[str] = "reserve"
    _codecs: ClassVar = {"namespace": NAMESPACE, "object_id": OID, "size": SIZE,
                         "descriptor": DESCRIPTOR, "hints": HINTS, "tier": _choice(PUT_TIERS)}
    _defaults: ClassVar = {"hints": Hints(), "tier": "host"}


@dataclass(frozen=True, slots=True)
class Commit(Message):
    """Phase two of a put: the bytes are written; make the object visible."""
    lease: int
    checksum: bytes
    op: ClassVar[str] = "commit"
    _codecs: ClassVar = {"lease": LEASE, "checksum": CHECKSUM}


@dataclass(frozen=True, slots=True)
class Abort(Message):
    lease: int
    op: ClassVar[str] = "abort"
    _codecs: ClassVar = {"lease": LEASE}


@dataclass(frozen=True, slots=True)
class Get(Message):
    """A read lease on a committed object, or a miss. `accept` lists dtypes the reader can use.

    `ranges` ((offset, length) pairs, kvstore.ranges) says the reader needs only those bytes.
    An object held on this node is still leased whole; one only its home nodes hold is
    fetched as just those ranges, packed, into a lease of their own (reply field "ranges").

    `expect`: the descriptor the reader can use; an object stored under any other (model,
    revision, kind, dtype, layout, shard, chunk_tokens) is a miss.

    `gpu`: the reader has mapped the daemon's GPU buffer (op gpu_handle) and can read a
    device copy there; the daemon may then answer tier "gpu", with an offset into that
    buffer. Without it every hit is on the host arena, as before."""
    namespace: str
    object_id: ObjectId
    accept: tuple | None = None
    ranges: tuple | None = None
    expect: StateDescriptor | None = None
    gpu: bool = False
    op: ClassVar[str] = "get"
    _codecs: ClassVar = {"namespace": NAMESPACE, "object_id": OID, "accept": ACCEPT, "ranges": RANGES,
                         "expect": EXPECT, "gpu": BOOL}
    _defaults: ClassVar = {"accept": None, "ranges": None, "expect": None, "gpu": False}


@dataclass(frozen=True, slots=True)
class Release(Message):
    lease: int
    op: ClassVar[str] = "release"
    _codecs: ClassVar = {"lease": LEASE}


@dataclass(frozen=True, slots=True)
class Lookup(Message):
    """`ids` decode to raw 32-byte digests (each equal to its ObjectId).

    `expect`: descriptors the reader can use; an id stored under another one is a miss.
    `expect_of`: per id, the index of its descriptor in `expect` (NO_EXPECTATION: none);
    absent, every id expects expect[0]."""
    namespace: str
    ids: tuple
    expect: tuple | None = None
    expect_of: bytes | None = None
    op: ClassVar[str] = "lookup"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": RAW_IDS, "expect": EXPECT_LIST, "expect_of": EXPECT_OF}
    _defaults: ClassVar = {"expect": None, "expect_of": None}

    def __post_init__(self) -> None:
        if self.expect_of is None:
            return
        if self.expect is None or len(self.expect_of) != len(self.ids):
            raise InvalidArgument("lookup.expect_of needs expect and one byte per id")
        if any(i >= len(self.expect) and i != NO_EXPECTATION for i in self.expect_of):
            raise InvalidArgument(f"lookup.expect_of: an index past expect's {len(self.expect)} descriptors")

    def expectations(self) -> list | None:
        """Per id, the descriptor it expects (or None); None when no id expects one."""
        if self.expect is None:
            return None
        if self.expect_of is None:
            return [self.expect[0]] * len(self.ids)
        return [None if i == NO_EXPECTATION else self.expect[i] for i in self.expect_of]


@dataclass(frozen=True, slots=True)
class Delete(Message):
    """Drop ids from every tier: of every live member ("cluster", the default) or of this
    node only ("node": its own copies, homes keep theirs)."""
    namespace: str
    ids: tuple
    scope: str = "cluster"
    op: ClassVar[str] = "delete"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS, "scope": _choice(SCOPES)}
    _defaults: ClassVar = {"scope": "cluster"}


@dataclass(frozen=True, slots=True)
class Pin(Message):
    """Keep ids resident until unpinned or ttl_s passes: this node's host copies and, in a
    cluster with scope "cluster" (the default), their home nodes' too."""
    namespace: str
    ids: tuple
    ttl_s: float | None = None
    scope: str = "cluster"
    op: ClassVar[str] = "pin"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS, "ttl_s": PIN_TTL, "scope": _choice(SCOPES)}
    _defaults: ClassVar = {"ttl_s": None, "scope": "cluster"}


@dataclass(frozen=True, slots=True)
class Unpin(Message):
    namespace: str
    ids: tuple
    scope: str = "cluster"
    op: ClassVar[str] = "unpin"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS, "scope": _choice(SCOPES)}
    _defaults: ClassVar = {"scope": "cluster"}


@dataclass(frozen=True, slots=True)
class Prefetch(Message):
    namespace: str
    ids: tuple
    tier: str = "host"
    policy: str = "best_effort"
    timeout_s: float | None = None
    op: ClassVar[str] = "prefetch"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": IDS, "tier": _choice(TIERS),
                         "policy": _choice(PREFETCH_POLICIES), "timeout_s": FLOAT}
    _defaults: ClassVar = {"tier": "host", "policy": "best_effort", "timeout_s": None}


@dataclass(frozen=True, slots=True)
class Stats(Message):
    op: ClassVar[str] = "stats"
    _codecs: ClassVar = {}


@dataclass(frozen=True, slots=True)
class Check(Message):
    """Run every check_integrity() in the daemon now; errors come back as the reply."""
    op: ClassVar[str] = "check"
    _codecs: ClassVar = {}


@dataclass(frozen=True, slots=True)
class GpuHandle(Message):
    """The daemon's GPU tier buffer as a CUDA IPC handle (GpuHandleReply), for an engine on
    this node to map; an error when the daemon runs no GPU tier ([gpu] enabled = false)."""
    op: ClassVar[str] = "gpu_handle"
    _codecs: ClassVar = {}


OPS: dict[str, type[Message]] = {
    cls.op: cls
    for cls in (Hello, OpenNamespace, Reserve, Commit, Abort, Get, Release, Lookup,
                Delete, Pin, Unpin, Prefetch, Stats, Check, GpuHandle)
}


def decode_request(request: Request) -> Message:
    """Validate a wire request into its typed message; errors name the op and field."""
    cls = OPS.get(request.op)
    if cls is None:
        raise ProtocolError(f"unknown op {request.op[:64]!r}; known: {', '.join(OPS)}")
    return cls.from_args(request.args)
