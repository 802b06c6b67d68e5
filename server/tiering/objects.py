"""What the daemon knows about one committed object."""

from __future__ import annotations

import functools
import itertools
import math
import time
from dataclasses import dataclass, field

from kvstore.errors import Conflict
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor, descriptor_differences
from kvstore.replies import GetReply
from tiers.allocator import Extent


_SERIALS = itertools.count(1)


@dataclass(slots=True)
class ObjectEntry:
    """A committed, immutable object in the host tier. Mutable fields are bookkeeping only."""

    object_id: ObjectId
    namespace: str
    extent: Extent
    size: int
    checksum: bytes
    descriptor: StateDescriptor
    hints: Hints
    created_at: float  # wall clock, for listings
    expires_at: float = math.inf  # monotonic; from hints.ttl_s
    pinned_until: float = 0.0  # monotonic; math.inf = pinned until unpinned
    num_hits: int = 0
    readers: int = 0  # read leases on this entry
    deleted: bool = False  # removed from the index, extent freed when the last reader leaves
    on_nvme: bool = False  # a verified copy is on the NVMe tier too
    descriptor_wire: dict | None = None  # descriptor.to_wire(), shared by equal descriptors: every get sends it
    serial: int = field(default_factory=lambda: next(_SERIALS))  # this copy, never reused

    @classmethod
    def create(cls, object_id: ObjectId, namespace: str, extent, size: int, checksum: bytes,
               descriptor: StateDescriptor, hints: Hints, now: float, created_at: float | None = None,
               pin: bool = False, on_nvme: bool = False) -> ObjectEntry:
        """The one way to make an entry: it expires hints.ttl_s after `now` (monotonic), and is
        pinned until unpinned when `pin`."""
        return cls(object_id, namespace, extent, size, checksum, descriptor, hints,
                   created_at=time.time() if created_at is None else created_at,
                   expires_at=math.inf if hints.ttl_s is None else now + hints.ttl_s,
                   pinned_until=math.inf if pin else 0.0, on_nvme=on_nvme)

    def is_live(self, now: float) -> bool:
        """Not past its TTL at `now` (monotonic): the one liveness rule every reader applies."""
        return self.expires_at > now

    def get_reply(self, lease_id: int, tier: str = "host", offset: int | None = None) -> GetReply:
        """What a get hit sends: where to read (the host arena; tier "gpu": `offset` into the
        GPU buffer), how to check it, and what it is."""
        if self.descriptor_wire is None:
            self.descriptor_wire = _wire_of(self.descriptor)
        return GetReply(True, lease=lease_id, offset=self.extent.offset if offset is None else offset, size=self.size,
                        checksum=self.checksum, tier=tier, descriptor=self.descriptor_wire)

    def is_pinned(self, now: float) -> bool:
        return self.pinned_until > now

    def to_wire(self, tier: str = "host") -> dict:
        return {
            "object_id": self.object_id.digest,
            "size": self.size,
            "checksum": self.checksum,
            "descriptor": self.descriptor.to_wire(),
            "hints": self.hints.to_wire(),
            "tier": tier,
            "created_at": self.created_at,
            "num_hits": self.num_hits,
        }


@dataclass(slots=True)
class PendingPut:
    """An extent reserved for a put that is not committed yet (a write lease)."""

    namespace: str
    object_id: ObjectId
    size: int
    descriptor: StateDescriptor
    hints: Hints
    extent: Extent
    tier: str = "host"  # "remote": the commit sends it to its home nodes


def live_in(ns, oid: ObjectId, now: float) -> ObjectEntry | None:
    """The entry of `oid` in namespace `ns` (None: not open here), unless absent or past its
    TTL at `now`. Reads only: a get drops an expired entry (HostTier.live_entry); peers, the
    admin API and re-homing merely do not see it."""
    entry = ns.objects.get(oid) if ns is not None else None
    return entry if entry is not None and entry.is_live(now) else None


def check_same_object(oid: ObjectId, size: int, descriptor, new_size: int, new_descriptor) -> None:
    """A put of an id already stored: the same state (dedup), or Conflict if it differs."""
    if size != new_size or descriptor != new_descriptor:
        diff = descriptor_differences(descriptor, new_descriptor)
        raise Conflict(
            f"object {oid.hex} is already stored with "
            + (f"{size} bytes, not {new_size}" if size != new_size else "another descriptor")
            + (f" ({diff}; stored != put)" if diff else "")
            + "; an id names one state: delete it first, or compute the key from the put's descriptor"
        )


@functools.lru_cache(maxsize=4096)
def _wire_of(descriptor: StateDescriptor) -> dict:
    """One wire map per distinct descriptor (never mutated): a get_many reply sends each once."""
    return descriptor.to_wire()
