"""Which store groups name each object, for the groups whose manifest is in host memory.

A namespace's host tier indexes every manifest it holds (kvstore/groups.py) when the manifest
enters the index (a commit, a promotion from NVMe, a fetch from a peer) and forgets it when it
leaves. Two uses:

- Eviction prefers whole groups: when the policy picks a member of a group as a victim, the
  group's other members that belong to no other group, and its manifest, go with it (written
  down a tier, or dropped, as any victim). One member gone makes the rest useless for that
  group; taking them now spares a member of a group that is still whole.
- The admin API's `objects show` names the groups an object belongs to.

Groups whose manifest is only on NVMe or at a peer are not indexed here (their members are
found by lookups as usual; they are indexed once the manifest is read back into memory).
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.groups import parse_manifest
from kvstore.identity import Kind, ObjectId


class GroupIndex:
    """Per namespace: manifest id -> its members, member id -> the manifests naming it."""

    __slots__ = ("members", "groups_of")

    def __init__(self):
        self.members: dict[ObjectId, tuple[ObjectId, ...]] = {}
        self.groups_of: dict[ObjectId, set[ObjectId]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def add(self, entry, data) -> None:
        """Index manifest `entry`, whose bytes are `data` (another kind is ignored)."""
        if entry.descriptor.kind is not Kind.GROUP or entry.object_id in self.members:
            return
        try:
            ids, _ = parse_manifest(data)
        except InvalidArgument:
            return  # not a manifest this daemon wrote: it stays an opaque object
        self.members[entry.object_id] = tuple(ids)
        for oid in ids:
            self.groups_of.setdefault(oid, set()).add(entry.object_id)

    def remove(self, entry) -> None:
        ids = self.members.pop(entry.object_id, None)
        for oid in ids or ():
            groups = self.groups_of[oid]
            groups.discard(entry.object_id)
            if not groups:
                del self.groups_of[oid]

    def groups(self, oid: ObjectId) -> list[ObjectId]:
        return sorted(self.groups_of.get(oid, ()))

    def companions(self, victim: ObjectId) -> list[ObjectId]:
        """What should leave with `victim`: for each group it belongs to, the manifest and the
        members that belong to no other group."""
        out = []
        for gid in self.groups_of.get(victim, ()):
            out.append(gid)
            out += [oid for oid in self.members[gid] if oid != victim and self.groups_of.get(oid) == {gid}]
        return out

    def check_integrity(self, objects) -> None:
        for gid, ids in self.members.items():
            if gid not in objects or any(gid not in self.groups_of.get(oid, ()) for oid in ids):
                raise RuntimeError(f"group index: manifest {gid.hex} is not held, or its members do not name it")
        if sum(len(groups) for groups in self.groups_of.values()) != sum(len(ids) for ids in self.members.values()):
            raise RuntimeError("group index: member -> group links and group -> member lists disagree")
