"""What the daemon knows about one committed object (its row: server/tiering/object_table.py),
and about a put not committed yet."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import Conflict
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor, descriptor_differences
from kvstore.server.tiering.object_entry import CHECKSUM_BYTES, ObjectEntry, StaleEntry
from kvstore.server.tiering.object_table import ObjectTable, lone_entry
from kvstore.tiers.allocator import Extent

__all__ = ["CHECKSUM_BYTES", "ObjectEntry", "ObjectTable", "PendingPut", "StaleEntry", "check_same_object", "live_in",
           "lone_entry"]


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


def check_same_object(oid: ObjectId, size: int, descriptor, new_size: int, new_descriptor,
                      checksum: bytes | None = None, new_checksum: bytes | None = None) -> None:
    """A put of an id already stored: the same state (dedup), or Conflict if it differs. With
    both checksums (a commit, whose bytes are known), other bytes conflict too: one id names
    one state, and a read must never see the stored bytes change."""
    if checksum is not None and new_checksum is not None and checksum != new_checksum \
            and size == new_size and descriptor == new_descriptor:
        raise Conflict(
            f"object {oid.hex} is already stored with other bytes of the same size and descriptor "
            "(checksums differ); the stored bytes stand: delete the object first to replace it")
    if size != new_size or descriptor != new_descriptor:
        diff = descriptor_differences(descriptor, new_descriptor)
        raise Conflict(
            f"object {oid.hex} is already stored with "
            + (f"{size} bytes, not {new_size}" if size != new_size else "another descriptor")
            + (f" ({diff}; stored != put)" if diff else "")
            + "; an id names one state: delete it first, or compute the key from the put's descriptor"
        )
