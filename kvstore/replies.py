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
from operator import itemgetter
from typing import Any, Callable, ClassVar

from kvstore.errors import ProtocolError
from kvstore.ranges import CODEC as RANGES

_LIST = (tuple, list)  # a wire array decodes to a tuple (immutable) and encodes as a list


class ReplyMessage:
    """Base of typed replies, each declared with `@reply`. `_codecs` maps a field whose
    wire form differs from its Python form to (decode, encode)."""

    __slots__ = ()
    _codecs: ClassVar[dict[str, tuple[Callable, Callable]]] = {}

    def to_wire(self) -> dict:  # written out per class by @reply
        raise NotImplementedError

    @classmethod
    def from_wire(cls, data: Any):  # written out per class by @reply
        raise NotImplementedError


def reply(cls: type) -> type:
    """`@dataclass(frozen=True, slots=True)`, with `__init__`, `to_wire` and `from_wire`
    written out as straight-line code, as dataclasses writes its methods. Every get and
    put crosses one reply's constructor and to_wire in the daemon and from_wire in the
    client: a frozen dataclass's own __init__ (object.__setattr__ per field) and a loop
    over the fields cost ~6 us a get; this costs ~2. A method the class defines wins."""
    own = {name for name in ("to_wire", "from_wire") if name in cls.__dict__}
    cls = dataclass(frozen=True, slots=True)(cls)
    env: dict[str, Any] = {"MISSING": MISSING, "_optional": _optional, "_not_a_map": _not_a_map, "_lacks": _lacks}
    params, init, encode, decode = [], [], ["def to_wire(self):", "    out = {}"], []
    for i, f in enumerate(fields(cls)):
        if f.default_factory is not MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: reply fields take plain (immutable) defaults")
        dec, enc = cls._codecs.get(f.name, (None, None))
        env.update({f"_set{i}": cls.__dict__[f.name].__set__, f"_def{i}": f.default, f"_enc{i}": enc, f"_dec{i}": dec})
        params.append(f.name if f.default is MISSING else f"{f.name}=_def{i}")
        init.append(f"    _set{i}(self, {f.name})")
        value = f"self.{f.name}"
        wire = f"_enc{i}({value})" if enc else value
        if f.default is MISSING:
            encode.append(f"    out[{f.name!r}] = {wire}")
            decode.append(f"_dec{i}(data[{f.name!r}])" if dec else f"data[{f.name!r}]")
        else:
            encode.append(f"    if {value} != _def{i}: out[{f.name!r}] = {wire}")
            decode.append(f"_optional(_dec{i}, data.get({f.name!r}, MISSING), _def{i})" if dec
                          else f"data.get({f.name!r}, _def{i})")
    source = "\n".join([
        f"def __init__(self, {', '.join(params)}):", *(init or ["    pass"]),
        *encode, "    return out",
        "def from_wire(cls, data):",
        "    if not isinstance(data, dict):",
        "        raise _not_a_map(cls, data)",
        "    try:",
        f"        return cls({', '.join(decode)})",
        "    except KeyError as exc:",
        "        raise _lacks(cls, exc) from None",
    ]) + "\n"
    exec(source, env)  # noqa: S102 (source built above from the class's own field names)
    cls.__init__ = env["__init__"]
    if "to_wire" not in own:
        cls.to_wire = env["to_wire"]
    if "from_wire" not in own:
        cls.from_wire = classmethod(env["from_wire"])
    return cls


def _optional(decode: Callable, value, default):
    return default if value is MISSING else None if value is None else decode(value)


def _not_a_map(cls: type, data) -> ProtocolError:
    return ProtocolError(f"{cls.__name__}: the daemon's reply is not a map: {type(data).__name__}")


def _lacks(cls: type, exc: KeyError) -> ProtocolError:
    return ProtocolError(f"{cls.__name__}: the daemon's reply lacks {exc.args[0]!r}")


def _tuple(v):
    return tuple(v) if isinstance(v, _LIST) else v


TUPLE = (_tuple, list)


@reply
class ClientLimits(ReplyMessage):
    """What the daemon allows one client (its [limits] table); None from a daemon that
    predates a field."""
    max_frame_bytes: int | None = None
    max_batch: int | None = None
    max_leases: int | None = None
    max_inflight_bytes: int | None = None
    lease_ttl_s: float | None = None
    max_inline_put_bytes: int | None = None  # the most bytes a put_inline may carry


@reply
class HelloReply(ReplyMessage):
    server: str
    protocol: int
    conn: int
    limits: ClientLimits = ClientLimits()
    shared_index: bool = False  # the daemon publishes shared indexes (open may ask for one)
    _codecs: ClassVar = {"limits": (ClientLimits.from_wire, ClientLimits.to_wire)}


@reply
class OpenReply(ReplyMessage):
    """arena_bytes 0: a reader's open of a namespace with no arena yet (no fd comes with it).
    index_bytes > 0: the shared index's fd came too, after the arena's. prefaulted: the
    daemon allocated the whole arena up front ([host] prefault), so a client may map its
    page tables at once; otherwise that would allocate the arena."""
    namespace: str
    arena_bytes: int
    index_bytes: int = 0
    prefaulted: bool = False


@reply
class ReserveReply(ReplyMessage):
    """A write lease on `offset` in the namespace's arena, or `exists`: the id is stored
    already (same size and descriptor), so nothing is to be written."""
    exists: bool = False
    lease: int | None = None
    offset: int | None = None


@reply
class CommitReply(ReplyMessage):
    """Where a committed put lives: `tier` ("host" or "remote"), `durability` ("memory",
    or what NVMe write-through reached), and for tier="remote" puts its home nodes."""
    exists: bool
    tier: str | None = None
    durability: str | None = None
    homes: tuple | None = None
    _codecs: ClassVar = {"homes": TUPLE}


IN_MEMORY = CommitReply(False, "host", "memory")  # a put held in host memory only


@reply
class GetReply(ReplyMessage):
    """A hit (a read lease on `size` bytes at `offset` of the arena) or a miss (`reason`
    says why, when it is not simply absent). `descriptor` stays in its wire form: the
    daemon sends one it built once per object, and most readers never parse it.
    `ranges`: the lease holds only these (offset, length) ranges, packed, of an object of
    `object_size` bytes (a ranged get served by a home node).
    `tier` "gpu" (only to a Get that set `gpu`): the lease is on a device copy, and `offset`
    is into the daemon's GPU buffer (GpuHandleReply), not into the host arena."""
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


# A lookup's tiers by code: `LookupReply.codes` holds one of these indexes per id.
TIER_NAMES = (None, "host", "nvme", "remote")


def tier_names(codes) -> tuple:
    """Each code's name in TIER_NAMES (codes: bytes, or any sequence of small ints)."""
    return itemgetter(*codes)(TIER_NAMES) if len(codes) > 1 else tuple(TIER_NAMES[code] for code in codes)


def _tier_codes(v):
    if type(v) is not bytes or (v and max(v) >= len(TIER_NAMES)):
        raise ProtocolError(f"LookupReply.codes: a byte per id below {len(TIER_NAMES)}, got {v!r}"[:200])
    return v


@reply
class LookupReply(ReplyMessage):
    """Per id its tier ("host", "nvme", "remote") or None; the leading hits, their bytes
    and the estimated time to load them. The tiers come as names in `tiers` or, to a
    lookup that asks for them (`Lookup.codes`), packed in `codes`: a byte per id, its
    index in TIER_NAMES (4,096 names cost ~0.3 ms to encode and decode; read either form
    with `names()`)."""
    hits: int
    tiers: tuple
    hit_bytes: int
    est_load_s: float
    codes: bytes = b""
    _codecs: ClassVar = {"tiers": TUPLE, "codes": (_tier_codes, bytes)}

    @classmethod
    def nothing(cls, num_ids: int) -> LookupReply:
        return cls(0, (None,) * num_ids, 0, 0.0)

    def names(self) -> tuple:
        """Per id its tier's name, or None on a miss, from whichever form the reply has."""
        return tier_names(self.codes) if self.codes else self.tiers

    def named(self) -> LookupReply:
        """This reply with its tiers as names, for a lookup that did not ask for codes."""
        return self if not self.codes else LookupReply(self.hits, self.names(), self.hit_bytes, self.est_load_s)


@reply
class DeleteReply(ReplyMessage):
    deleted: int  # ids found (and deleted) anywhere

    @property
    def count(self) -> int:
        return self.deleted


@reply
class PinReply(ReplyMessage):
    pinned: int  # ids pinned somewhere

    @property
    def count(self) -> int:
        return self.pinned


@reply
class UnpinReply(ReplyMessage):
    unpinned: int

    @property
    def count(self) -> int:
        return self.unpinned


@reply
class PrefetchReply(ReplyMessage):
    """`resident` of `requested` ids are in the host tier now; best_effort says how many
    promotions it `started`."""
    resident: int
    requested: int
    started: int | None = None

    @property
    def count(self) -> int:
        return self.resident


@reply
class StatsReply(ReplyMessage):
    """The daemon's statistics document, as `GET /v1/stats` serves it (a nested map whose
    tiers and counters grow with the daemon; it is read as a document, not as fields)."""
    document: dict

    def to_wire(self) -> dict:
        return self.document

    @classmethod
    def from_wire(cls, data: Any) -> StatsReply:
        if not isinstance(data, dict):
            raise _not_a_map(cls, data)
        return cls(data)


@reply
class CheckReply(ReplyMessage):
    ok: bool  # every check_integrity() passed (a failure comes back as an error instead)


@reply
class GpuHandleReply(ReplyMessage):
    """The daemon's GPU tier buffer, exported for local engines (op gpu_handle): the fields
    of torch's CUDA IPC export (`_share_cuda_()`, tiers.gpu.GpuTier.ipc_handle) and the
    buffer's size. An engine maps it once per process (client.gpu.GpuMapping) and reads the
    extents gpu-tier gets hand out. Each export carries one consumer reference (a torch ref
    counter slot), given back when the consumer unmaps: export once per request.
    `device` is the daemon's CUDA device index, which names the same GPU in the engine only
    under the same CUDA_VISIBLE_DEVICES; `device_uuid` (when the daemon knows it) always does."""
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    capacity_bytes: int
    device_uuid: str | None = None


# --- replies of the batched ops (kvstore/messages.py): per item, packed columns ----------
# `errors` lists [index, error map] for the items that failed; their column entries are 0.


@reply
class ReserveManyReply(ReplyMessage):
    """Per item: its write lease and arena offset (u64 columns), or `exists` (a byte each:
    1, stored already, nothing to write)."""
    leases: bytes
    offsets: bytes
    exists: bytes
    errors: tuple = ()
    _codecs: ClassVar = {"errors": TUPLE}


STORED = 0  # CommitManyReply.codes: held in host memory (IN_MEMORY)
EXISTED = 1  # stored already (a concurrent put of the same id)
FAILED = 2  # see errors
OTHER = 3  # see others: anything else (NVMe write-through reached, a tier="remote" put)


@reply
class CommitManyReply(ReplyMessage):
    """Per item a code byte (STORED, EXISTED, FAILED, OTHER); `others` lists [index,
    CommitReply map] for the OTHER items."""
    codes: bytes
    others: tuple = ()
    errors: tuple = ()
    _codecs: ClassVar = {"others": TUPLE, "errors": TUPLE}

    def results(self) -> list[CommitReply | None]:
        """Per item its CommitReply (None: failed, see errors)."""
        table = (IN_MEMORY, CommitReply(True), None, None)
        out = [table[code] for code in self.codes]
        for index, wire in self.others:
            out[index] = CommitReply.from_wire(wire)
        return out


@reply
class GetManyReply(ReplyMessage):
    """Per item: `hits` (a byte each), and for a hit its read lease, arena offset, size
    (u64 columns), checksum (16 bytes each) and descriptor: `descriptor_of` (u16 each)
    indexes `descriptors`, the distinct descriptors of the batch in their wire form."""
    hits: bytes
    leases: bytes
    offsets: bytes
    sizes: bytes
    checksums: bytes
    descriptors: tuple
    descriptor_of: bytes
    errors: tuple = ()
    _codecs: ClassVar = {"descriptors": TUPLE, "errors": TUPLE}


# --- store groups (kvstore/groups.py) -------------------------------------------------


@reply
class CommitGroupReply(ReplyMessage):
    """A committed group: its id (the manifest's), whether it was stored already (every
    member and the manifest held: nothing new was published), and the durability its
    objects reached ("memory", or what NVMe write-through reached for all of them)."""
    group: bytes
    exists: bool
    durability: str | None = None


@reply
class LookupGroupsReply(ReplyMessage):
    """Per group one byte, 1 where it is complete (manifest and every member held, live,
    as expected); `leading`: the complete groups before the first incomplete one; `tiers`:
    per complete group the slowest tier a member is on ("host", "nvme", "remote"), None
    for an incomplete one."""
    complete: bytes
    leading: int
    tiers: tuple
    _codecs: ClassVar = {"tiers": TUPLE}


@reply
class GetGroupReply(ReplyMessage):
    """Every member leased (`hit`; per member, in request order, the columns of a
    GetManyReply), or none: `missing` is the first member that could not be read (-1: the
    manifest) and `reason` says why."""
    hit: bool
    reason: str | None = None
    missing: int | None = None
    leases: bytes = b""
    offsets: bytes = b""
    sizes: bytes = b""
    checksums: bytes = b""
    descriptors: tuple = ()
    descriptor_of: bytes = b""
    _codecs: ClassVar = {"descriptors": TUPLE}


# What each op answers; release and abort answer nothing (None). A CommitReply is no op's
# reply of its own: it is a commit_many item's (CommitManyReply.results).
REPLIES: dict[str, type[ReplyMessage] | None] = {
    "hello": HelloReply, "open": OpenReply, "reserve": ReserveReply, "put_inline": CommitReply,
    "abort": None, "get": GetReply, "release": None, "lookup": LookupReply, "delete": DeleteReply,
    "pin": PinReply, "unpin": UnpinReply, "prefetch": PrefetchReply, "stats": StatsReply, "check": CheckReply,
    "gpu_handle": GpuHandleReply, "reserve_many": ReserveManyReply, "commit_many": CommitManyReply,
    "get_many": GetManyReply, "release_many": None, "touch": None,
    "commit_group": CommitGroupReply, "lookup_groups": LookupGroupsReply, "get_group": GetGroupReply,
}
