"""Typed replies of the local protocol: what the daemon answers each request with.

The requests' counterpart (kvstore/messages.py holds the requests; this module is their
sibling only to keep each file to one concept and under 400 lines). The daemon builds
these and sends `reply.to_wire()`; the client reads `ReplyClass.from_wire(result)` and
then attributes, never string keys.

The wire format is the plain map older daemons and clients already speak, byte for byte:
a field without a default is always sent; a field with a default is left out while it
holds it (a hit's `reason`, a put's `homes`), in the order the fields are declared.
`from_wire` ignores keys it does not know (a newer daemon may add some) and fills in
defaults for keys an older one leaves out; a missing required key is a ProtocolError.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, ClassVar

from kvstore.errors import ProtocolError
from kvstore.ranges import CODEC as RANGES

_LIST = (tuple, list)  # a wire array decodes to a tuple (immutable) and encodes as a list


class ReplyMessage:
    """Base of typed replies. Subclasses are frozen, slotted dataclasses; `_codecs` maps a
    field whose wire form differs from its Python form to (decode, encode)."""

    __slots__ = ()
    _codecs: ClassVar[dict[str, tuple[Callable, Callable]]] = {}

    def to_wire(self) -> dict:
        return _codec_of(type(self))[0](self)

    @classmethod
    def from_wire(cls, data: Any):
        if not isinstance(data, dict):
            raise ProtocolError(f"{cls.__name__}: the daemon's reply is not a map: {type(data).__name__}")
        try:
            return _codec_of(cls)[1](cls, data)
        except KeyError as exc:
            raise ProtocolError(f"{cls.__name__}: the daemon's reply lacks {exc.args[0]!r}") from None


# Every get and put crosses to_wire in the daemon and from_wire in the client, so each reply
# class gets both written out as straight-line code on first use (as dataclasses writes
# __init__): a loop over the fields cost ~4 us a get against ~1 us for this.
_CODECS: dict[type, tuple[Callable, Callable]] = {}


def _optional(decode: Callable, value, default):
    return default if value is MISSING else None if value is None else decode(value)


def _codec_of(cls: type) -> tuple[Callable, Callable]:
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _compile(cls)
    return codec


def _compile(cls: type) -> tuple[Callable, Callable]:
    env: dict[str, Any] = {"MISSING": MISSING, "_optional": _optional}
    encode, decode = ["def to_wire(self):", "    out = {}"], []
    for i, f in enumerate(fields(cls)):
        dec, enc = cls._codecs.get(f.name, (None, None))
        env[f"_enc{i}"], env[f"_dec{i}"], env[f"_def{i}"] = enc, dec, f.default
        value = f"self.{f.name}"
        wire = f"_enc{i}({value})" if enc else value
        if f.default is MISSING:
            encode.append(f"    out[{f.name!r}] = {wire}")
            decode.append(f"_dec{i}(data[{f.name!r}])" if dec else f"data[{f.name!r}]")
        else:
            encode.append(f"    if {value} != _def{i}: out[{f.name!r}] = {wire}")
            decode.append(f"_optional(_dec{i}, data.get({f.name!r}, MISSING), _def{i})" if dec
                          else f"data.get({f.name!r}, _def{i})")
    encode.append("    return out")
    source = "\n".join(encode) + f"\ndef from_wire(cls, data):\n    return cls({', '.join(decode)})\n"
    exec(source, env)  # noqa: S102 (source built above from the class's own field names)
    return env["to_wire"], env["from_wire"]


def _tuple(v):
    return tuple(v) if isinstance(v, _LIST) else v


TUPLE = (_tuple, list)


@dataclass(frozen=True, slots=True)
class ClientLimits(ReplyMessage):
    """What the daemon allows one client (its [limits] table); None from a daemon that
    predates a field."""
    max_frame_bytes: int | None = None
    max_batch: int | None = None
    max_leases: int | None = None
    max_inflight_bytes: int | None = None
    lease_ttl_s: float | None = None


@dataclass(frozen=True, slots=True)
class HelloReply(ReplyMessage):
    server: str
    protocol: int
    conn: int
    limits: ClientLimits = ClientLimits()
    _codecs: ClassVar = {"limits": (ClientLimits.from_wire, ClientLimits.to_wire)}


@dataclass(frozen=True, slots=True)
class OpenReply(ReplyMessage):
    """arena_bytes 0: a reader's open of a namespace with no arena yet (no fd comes with it)."""
    namespace: str
    arena_bytes: int


@dataclass(frozen=True, slots=True)
class ReserveReply(ReplyMessage):
    """A write lease on `offset` in the namespace's arena, or `exists`: the id is stored
    already (same size and descriptor), so nothing is to be written."""
    exists: bool = False
    lease: int | None = None
    offset: int | None = None


@dataclass(frozen=True, slots=True)
class CommitReply(ReplyMessage):
    """Where a committed put lives: `tier` ("host" or "remote"), `durability` ("memory",
    or what NVMe write-through reached), and for tier="remote" puts its home nodes."""
    exists: bool
    tier: str | None = None
    durability: str | None = None
    homes: tuple | None = None
    _codecs: ClassVar = {"homes": TUPLE}


IN_MEMORY = CommitReply(False, "host", "memory")  # a put held in host memory only


@dataclass(frozen=True, slots=True)
class GetReply(ReplyMessage):
    """A hit (a read lease on `size` bytes at `offset` of the arena) or a miss (`reason`
    says why, when it is not simply absent). `descriptor` stays in its wire form: the
    daemon sends one it built once per object, and most readers never parse it.
    `ranges`: the lease holds only these (offset, length) ranges, packed, of an object of
    `object_size` bytes (a ranged get served by a home node)."""
    hit: bool
    reason: str | None = None
    lease: int | None = None
    offset: int | None = None
    size: int | None = None
    checksum: bytes | None = None
    tier: str | None = None
    descriptor: dict | None = None
    ranges: tuple | None = None
    object_size: int | None = None
    _codecs: ClassVar = {"ranges": RANGES}


MISS = GetReply(False)


@dataclass(frozen=True, slots=True)
class LookupReply(ReplyMessage):
    """Per id its tier ("host", "nvme", "remote") or None; the leading hits, their bytes
    and the estimated time to load them (DESIGN.md section 7)."""
    hits: int
    tiers: tuple
    hit_bytes: int
    est_load_s: float
    _codecs: ClassVar = {"tiers": TUPLE}

    @classmethod
    def nothing(cls, num_ids: int) -> LookupReply:
        return cls(0, (None,) * num_ids, 0, 0.0)


@dataclass(frozen=True, slots=True)
class DeleteReply(ReplyMessage):
    deleted: int  # ids found (and deleted) anywhere

    @property
    def count(self) -> int:
        return self.deleted


@dataclass(frozen=True, slots=True)
class PinReply(ReplyMessage):
    pinned: int  # ids pinned somewhere

    @property
    def count(self) -> int:
        return self.pinned


@dataclass(frozen=True, slots=True)
class UnpinReply(ReplyMessage):
    unpinned: int

    @property
    def count(self) -> int:
        return self.unpinned


@dataclass(frozen=True, slots=True)
class PrefetchReply(ReplyMessage):
    """`resident` of `requested` ids are in the host tier now; best_effort says how many
    promotions it `started`."""
    resident: int
    requested: int
    started: int | None = None

    @property
    def count(self) -> int:
        return self.resident


@dataclass(frozen=True, slots=True)
class StatsReply(ReplyMessage):
    """The daemon's statistics document, as `GET /v1/stats` serves it (a nested map whose
    tiers and counters grow with the daemon; it is read as a document, not as fields)."""
    document: dict

    def to_wire(self) -> dict:
        return self.document

    @classmethod
    def from_wire(cls, data: Any) -> StatsReply:
        if not isinstance(data, dict):
            raise ProtocolError(f"StatsReply: the daemon's reply is not a map: {type(data).__name__}")
        return cls(data)


@dataclass(frozen=True, slots=True)
class CheckReply(ReplyMessage):
    ok: bool  # every check_integrity() passed (a failure comes back as an error instead)


# What each op answers; release and abort answer nothing (None).
REPLIES: dict[str, type[ReplyMessage] | None] = {
    "hello": HelloReply, "open": OpenReply, "reserve": ReserveReply, "commit": CommitReply,
    "abort": None, "get": GetReply, "release": None, "lookup": LookupReply, "delete": DeleteReply,
    "pin": PinReply, "unpin": UnpinReply, "prefetch": PrefetchReply, "stats": StatsReply, "check": CheckReply,
}
