"""Store groups: objects that are committed, found and read together, or not at all.

A group is state that is only usable whole: a chunk's attention KV of every KV cache group
plus the recurrent-state snapshot at its boundary. Its members are ordinary content-addressed
objects (a member may belong to several groups); the group itself is one more object, its
*manifest*, whose id and bytes are fixed by the members:

    group id  = BLAKE2b-256(u32_le(n) || id_1 || ... || id_n, person="kvstore-grp-v1")
    manifest  = b"KVSG" || u32_le(n) || id_1 .. id_n || checksum_1 .. checksum_n   (xxh3-128 each)
    its descriptor = the first member's, with kind "group" and layout raw(bytes=0)

The daemon publishes a group's new members and its manifest in one pass of its event loop
(`commit_group`), after checking every lease, checksum and already-stored member: a reader
sees all of them or none. A group is *complete* while its manifest and every member are
held (any tier, live, under the descriptor the reader expects); a member that is evicted,
expires, fails its checksum or is deleted makes it incomplete at once. `get_group` leases
every member or none, and checks each member's checksum against the manifest's, so a member
deleted and stored again with other bytes is never read as part of the group.

Member ids are already keyed per namespace (kvstore.identity), so a group id needs no key.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.identity import ID_BYTES, Kind, ObjectId, StateDescriptor
from kvstore.layout import Layout

MAGIC = b"KVSG"
CHECKSUM_BYTES = 16
# Members of one group: a chunk's objects across KV cache groups, layers split or not, and
# its state snapshot; far below a frame's MAX_BATCH ids.
MAX_GROUP_MEMBERS = 256
_HEADER = struct.Struct("<4sI")
_RAW = Layout.make("raw", bytes=0)


@dataclass(frozen=True, slots=True)
class Member:
    """One member of a group: its id and the descriptor it is stored under."""

    object_id: ObjectId
    descriptor: StateDescriptor

    @classmethod
    def of(cls, key, descriptor: StateDescriptor | None = None) -> Member:
        """From a Member, a ChunkKey (its own descriptor) or an ObjectId with `descriptor`."""
        if isinstance(key, Member):
            return key
        carried = getattr(key, "descriptor", None)
        oid = getattr(key, "object_id", key)
        desc = carried if carried is not None else descriptor
        if desc is None:
            raise InvalidArgument(f"group member {ObjectId(oid).hex}: a descriptor is needed (a ChunkKey carries one)")
        if carried is not None and descriptor is not None and descriptor != carried:
            raise InvalidArgument(f"group member {ObjectId(oid).hex}: its key was computed for another descriptor")
        return cls(ObjectId(oid), desc)


def check_members(ids) -> None:
    """1..MAX_GROUP_MEMBERS distinct ids, else InvalidArgument."""
    if not 1 <= len(ids) <= MAX_GROUP_MEMBERS:
        raise InvalidArgument(f"a group has 1..{MAX_GROUP_MEMBERS} members, got {len(ids)}")
    if len(set(ids)) != len(ids):
        raise InvalidArgument("a group names one of its members twice")


def group_id(ids) -> ObjectId:
    """The id of the group of these members, in this order."""
    check_members(ids)
    h = hashlib.blake2b(digest_size=ID_BYTES, person=b"kvstore-grp-v1")
    h.update(struct.pack("<I", len(ids)))
    for oid in ids:
        h.update(oid)
    return ObjectId(h.digest())


def group_descriptor(first: StateDescriptor) -> StateDescriptor:
    """The manifest's descriptor: the first member's, kind "group", layout raw(bytes=0)."""
    return first.with_(kind=Kind.GROUP, layout=_RAW)


def manifest_bytes(ids, checksums) -> bytes:
    check_members(ids)
    if len(checksums) != len(ids) or any(len(c) != CHECKSUM_BYTES for c in checksums):
        raise InvalidArgument(f"a group manifest needs one {CHECKSUM_BYTES}-byte checksum per member")
    return _HEADER.pack(MAGIC, len(ids)) + b"".join(ids) + b"".join(checksums)


def manifest_size(num_members: int) -> int:
    return _HEADER.size + num_members * (ID_BYTES + CHECKSUM_BYTES)


def parse_manifest(data) -> tuple[list[ObjectId], list[bytes]]:
    """(member ids, their checksums) of a manifest's bytes; InvalidArgument if malformed."""
    data = bytes(data)
    if len(data) < _HEADER.size:
        raise InvalidArgument("a group manifest is shorter than its header")
    magic, n = _HEADER.unpack_from(data)
    if magic != MAGIC or not 1 <= n <= MAX_GROUP_MEMBERS or len(data) != manifest_size(n):
        raise InvalidArgument("not a group manifest (bad magic, member count or size)")
    ids_end = _HEADER.size + n * ID_BYTES
    ids = [ObjectId(data[i:i + ID_BYTES]) for i in range(_HEADER.size, ids_end, ID_BYTES)]
    sums = [data[i:i + CHECKSUM_BYTES] for i in range(ids_end, len(data), CHECKSUM_BYTES)]
    return ids, sums
