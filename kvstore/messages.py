"""Typed requests of the local protocol, with strict decoding of their arguments.

Each op is a frozen dataclass; `decode_request(Request)` validates a wire request into
one (raising InvalidArgument / ProtocolError that name the bad field), and
`message.to_args()` is what a client sends. Client and daemon share these classes, so
the two ends cannot drift apart. The field codecs are in kvstore/fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.errors import InvalidArgument, ProtocolError
from kvstore.fields import (  # noqa: F401 (its constants are part of this module's interface)
    ACCEPT, BOOL, DESCRIPTOR, EXPECT, EXPECT_LIST, EXPECT_OF, FLOAT, HINTS, IDS, INLINE_DATA, INLINE_PUT_MAX_BYTES, LEASE,
    MAX_EXPECTED_DESCRIPTORS, MAX_OBJECT_BYTES, NAMESPACE, NO_EXPECTATION, OID, OPT_STR, PIN_TTL,
    PACKED_CHECKSUMS, PACKED_IDS, PACKED_U64, PREFETCH_POLICIES, PUT_TIERS, RANGES, RAW_IDS, ROUTES, SCOPES, SIZE,
    STR, TIERS,
    _choice, _int, pack_uints, unpack_uints)
from kvstore.group_messages import GROUP_OPS, CommitGroup, GetGroup, LookupGroups  # noqa: F401 (ops of this protocol)
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.message_base import Message, check_expectations, expectations  # noqa: F401 (the base of every op)
from kvstore.protocol import Request
from kvstore.route import packed_route


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
    Only a writer's open (create True, the default) makes the arena. index: send the shared
    index's fd too (kvstore/shared_index.py; a client asks only a daemon whose hello offered it)."""
    namespace: str
    token: str | None = None
    create: bool = True
    index: bool = False
    op: ClassVar[str] = "open"
    _codecs: ClassVar = {"namespace": NAMESPACE, "token": OPT_STR, "create": BOOL, "index": BOOL}
    _defaults: ClassVar = {"token": None, "create": True, "index": False}


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
class PutInline(Message):
    """A whole put of a small object in one request, its bytes in the frame (at most
    INLINE_PUT_MAX_BYTES): the daemon reserves as for a Reserve, copies and hashes the bytes
    into the arena, and commits, answering what the commit answers. One round trip instead
    of two, where the round trip costs more than the frame's extra copies."""
    namespace: str
    object_id: ObjectId
    descriptor: StateDescriptor
    data: bytes
    hints: Hints = Hints()
    tier: str = "host"
    op: ClassVar[str] = "put_inline"
    _codecs: ClassVar = {"namespace": NAMESPACE, "object_id": OID, "descriptor": DESCRIPTOR, "data": INLINE_DATA,
                         "hints": HINTS, "tier": _choice(PUT_TIERS)}
    _defaults: ClassVar = {"hints": Hints(), "tier": "host"}

    def reserve(self) -> Reserve:
        """The Reserve this put makes."""
        return Reserve(self.namespace, self.object_id, len(self.data), self.descriptor, self.hints, self.tier)


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
    absent, every id expects expect[0]. `codes`: the reply gives the tiers packed
    (LookupReply.codes), not as names."""
    namespace: str
    ids: tuple
    expect: tuple | None = None
    expect_of: bytes | None = None
    codes: bool = False
    op: ClassVar[str] = "lookup"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": RAW_IDS, "expect": EXPECT_LIST, "expect_of": EXPECT_OF,
                         "codes": BOOL}
    _defaults: ClassVar = {"expect": None, "expect_of": None, "codes": False}

    def __post_init__(self) -> None:
        check_expectations(self.op, self.expect, self.expect_of, len(self.ids))

    def expectations(self) -> list | None:
        """Per id, the descriptor it expects (or None); None when no id expects one."""
        return expectations(self.expect, self.expect_of, len(self.ids))


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


# --- batched ops: many objects in one frame, served in one pass ------------------------
#
# Each carries its per-object fields as packed columns (kvstore.fields): n 32-byte ids,
# n little-endian u64 sizes or leases, n 16-byte checksums. Every item is handled as its
# single op would be, in order; one item's error is reported in its place (the reply's
# `errors`) and does not stop the others.


def _ids_of(packed: bytes) -> list[ObjectId]:
    return [ObjectId(packed[i:i + 32]) for i in range(0, len(packed), 32)]


@dataclass(frozen=True, slots=True)
class ReserveMany(Message):
    """Phase one of many puts of one descriptor: per id a write lease on `size` bytes (a
    Reserve each). Build it with `ReserveMany.of(...)`."""
    namespace: str
    ids: bytes
    sizes: bytes
    descriptor: StateDescriptor
    hints: Hints = Hints()
    tier: str = "host"
    routes: tuple = ()  # per id a packed kvstore.route.Route or None (its hints' route); (): none
    op: ClassVar[str] = "reserve_many"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": PACKED_IDS, "sizes": PACKED_U64,
                         "descriptor": DESCRIPTOR, "hints": HINTS, "tier": _choice(PUT_TIERS), "routes": ROUTES}
    _defaults: ClassVar = {"hints": Hints(), "tier": "host", "routes": ()}

    def __post_init__(self) -> None:
        if len(self.sizes) // 8 != len(self.ids) // 32:
            raise InvalidArgument(f"{self.op}: {len(self.ids) // 32} ids but {len(self.sizes) // 8} sizes")
        if self.routes and len(self.routes) != len(self.ids) // 32:
            raise InvalidArgument(f"{self.op}: {len(self.ids) // 32} ids but {len(self.routes)} routes")
        sizes = unpack_uints(self.sizes)
        if not 1 <= min(sizes) <= max(sizes) <= MAX_OBJECT_BYTES:
            raise InvalidArgument(f"{self.op}.sizes: every size must be in 1..{MAX_OBJECT_BYTES}")

    @classmethod
    def of(cls, namespace: str, ids, sizes, descriptor: StateDescriptor, hints: Hints = Hints(),
           tier: str = "host", routes=None) -> ReserveMany:
        """routes: per id a kvstore.route.Route or None, or None for no routes at all."""
        packed = () if routes is None or all(r is None for r in routes) else tuple(map(packed_route, routes))
        return cls(namespace, b"".join(oid.digest for oid in ids), pack_uints(sizes),
                   descriptor, hints, tier, packed)

    def items(self) -> list[Reserve]:
        """The single reserves this batch stands for (each with its route in its hints)."""
        ids, sizes = _ids_of(self.ids), unpack_uints(self.sizes)
        return [self.item(i, oid, size) for i, (oid, size) in enumerate(zip(ids, sizes))]

    def columns(self) -> tuple[list[ObjectId], list[int]]:
        """(ids, sizes): the per-item fields, read once for the whole batch."""
        return _ids_of(self.ids), unpack_uints(self.sizes)

    def hints_of(self, i: int) -> Hints:
        """Item i's hints: the batch's, with its route where it has one."""
        route = self.routes[i] if self.routes else None
        return self.hints if route is None else self.hints.with_route(route)

    def item(self, i: int, oid: ObjectId, size: int) -> Reserve:
        """Item i as the single reserve it stands for (oid, size: its columns' entries)."""
        return Reserve(self.namespace, oid, size, self.descriptor, self.hints_of(i), self.tier)


@dataclass(frozen=True, slots=True)
class CommitMany(Message):
    """Phase two of many puts: per write lease, the checksum of the bytes written."""
    leases: bytes
    checksums: bytes
    op: ClassVar[str] = "commit_many"
    _codecs: ClassVar = {"leases": PACKED_U64, "checksums": PACKED_CHECKSUMS}

    def __post_init__(self) -> None:
        if len(self.leases) // 8 != len(self.checksums) // 16:
            raise InvalidArgument(
                f"{self.op}: {len(self.leases) // 8} leases but {len(self.checksums) // 16} checksums")

    @classmethod
    def of(cls, leases, checksums) -> CommitMany:
        return cls(pack_uints(leases), b"".join(checksums))

    def items(self) -> list[tuple[int, bytes]]:
        sums = self.checksums
        return [(lease, sums[16 * i:16 * i + 16]) for i, lease in enumerate(unpack_uints(self.leases))]


@dataclass(frozen=True, slots=True)
class GetMany(Message):
    """A read lease per id, or a miss (a Get each, whole objects, host leases). `expect`:
    the descriptor every id must be stored under (any other is a miss)."""
    namespace: str
    ids: bytes
    expect: StateDescriptor | None = None
    op: ClassVar[str] = "get_many"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": PACKED_IDS, "expect": EXPECT}
    _defaults: ClassVar = {"expect": None}

    @classmethod
    def of(cls, namespace: str, ids, expect: StateDescriptor | None = None) -> GetMany:
        return cls(namespace, b"".join(oid.digest for oid in ids), expect)

    def object_ids(self) -> list[ObjectId]:
        return _ids_of(self.ids)


@dataclass(frozen=True, slots=True)
class ReleaseMany(Message):
    """End many read leases (sent without waiting for a reply; an error names the leases
    that were not held)."""
    leases: bytes
    op: ClassVar[str] = "release_many"
    _codecs: ClassVar = {"leases": PACKED_U64}

    @classmethod
    def of(cls, leases) -> ReleaseMany:
        return cls(pack_uints(leases))

    def items(self) -> list[int]:
        return unpack_uints(self.leases)


# A client reports its shared-index hits at most this long after reading them (at its next
# hit or request; client/shared_reads.py): a touch says the client read objects over about
# this span, which the daemon counts as client traffic (server/traffic.py).
TOUCH_WITHIN_S = 0.05


@dataclass(frozen=True, slots=True)
class Touch(Message):
    """Hits a client read from the shared index (client/shared_reads.py), which the daemon
    never saw as gets: it counts them as hits and touches each object still there, as a get
    would (server/tiering/shared_index.py: count_shared_hits). Sent without waiting for a
    reply. `ids` decode to raw 32-byte digests (each equal to its ObjectId)."""
    namespace: str
    ids: tuple
    op: ClassVar[str] = "touch"
    _codecs: ClassVar = {"namespace": NAMESPACE, "ids": RAW_IDS}


# Ops are named on the wire, not numbered: removing one renumbers nothing. Names once used
# and since removed stay out of OPS and are never reused (tests/kvstore/test_protocol.py
# checks), so a frame naming one gets the "unknown op" ProtocolError any unknown name gets:
#   "commit": the single-object commit; every put commits with commit_many or commit_group.
RETIRED_OPS = frozenset({"commit"})

OPS: dict[str, type[Message]] = {
    cls.op: cls
    for cls in (Hello, OpenNamespace, Reserve, PutInline, Abort, Get, Release, Lookup, Delete, Pin, Unpin, Prefetch,
                Stats, Check, GpuHandle, ReserveMany, CommitMany, GetMany, ReleaseMany, Touch, *GROUP_OPS)
}


def decode_request(request: Request) -> Message:
    """Validate a wire request into its typed message; errors name the op and field."""
    cls = OPS.get(request.op)
    if cls is None:
        raise ProtocolError(f"unknown op {request.op[:64]!r}; known: {', '.join(OPS)}")
    return cls.from_args(request.args)
