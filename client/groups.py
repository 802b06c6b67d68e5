"""Store groups from the client: put_group, lookup_groups, get_group (kvstore/groups.py).

Generators over a ClientCore, driven like its op_* (client/core.py):

    put_group:     reserve each member and the manifest (one round trip)
                   -> copy + hash the new members, write the manifest -> commit_group
    lookup_groups: lookup_groups per frame of members -> per group complete or not
    get_group:     get_group -> a ReadLease per member, or None (nothing leased)
"""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import InvalidArgument, NotFound, from_wire
from kvstore.fields import pack_uints, unpack_uints
from kvstore.groups import Member, check_members, group_descriptor, group_id, manifest_bytes, manifest_size
from kvstore.hints import Hints
from kvstore.identity import ObjectId
from kvstore.protocol import MAX_BATCH
from client.core import ClientCore, _expect_fields, copy_and_hash
from client.lease import ReadLease

PUT_ATTEMPTS = 3  # a member said to be stored may leave before the commit: put again


@dataclass(frozen=True, slots=True)
class GroupPutResult:
    group: ObjectId  # the group's id (its manifest's)
    existed: bool  # the whole group was stored already; nothing new was published
    durability: str | None = None


@dataclass(frozen=True, slots=True)
class GroupLookup:
    complete: tuple  # per group: True where the manifest and every member are held as expected
    leading: int  # complete groups before the first incomplete one
    tiers: tuple  # per group: the slowest tier a member is on, None where incomplete


class GroupLease:
    """Read leases on every member of a group (in the order asked). A context manager:
    leaving it releases them all."""

    def __init__(self, core: ClientCore, group: ObjectId, leases: list[ReadLease]):
        self._core, self.group, self.leases = core, group, leases

    def __len__(self) -> int:
        return len(self.leases)

    def __getitem__(self, i: int) -> ReadLease:
        return self.leases[i]

    def __iter__(self):
        return iter(self.leases)

    def release(self) -> None:
        for lease in self.leases:
            lease.release()

    def __enter__(self) -> GroupLease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _members(items) -> list:
    """(Member, source bytes) per put item: (key, data) or (key, data, descriptor)."""
    out = []
    for item in items:
        if len(item) not in (2, 3):
            raise InvalidArgument("a group member to put is (key, data) or (key, data, descriptor)")
        member = Member.of(item[0], item[2] if len(item) == 3 else None)
        out.append((member, item[1]))
    return out


def put_group(core: ClientCore, items, hints: Hints | None = None):
    """Store `items` as one group: every member and the manifest become visible at once,
    or nothing is stored (the error is raised). Members already stored are not copied."""
    hints = hints or Hints()
    given = _members(items)
    check_members([member.object_id for member, _ in given])
    members = []
    for member, data in given:
        oid, desc, src = core.put_item(member.object_id, data, member.descriptor)
        members.append((oid, desc, src))
    namespaces = {desc.namespace for _, desc, _ in members}
    if len(namespaces) != 1:
        raise InvalidArgument(f"a group's members are in one namespace, got {sorted(namespaces)}")
    namespace = namespaces.pop()
    ids = [oid for oid, _, _ in members]
    gid, gdesc = group_id(ids), group_descriptor(members[0][1])
    yield from core.op_open(namespace)
    for attempt in range(PUT_ATTEMPTS):
        try:
            return (yield from _put_once(core, namespace, members, gid, gdesc, hints))
        except NotFound:
            if attempt == PUT_ATTEMPTS - 1:
                raise


def _put_once(core: ClientCore, namespace: str, members: list, gid: ObjectId, gdesc, hints: Hints):
    reserves = [m.Reserve(namespace, oid, src.size, desc, hints) for oid, desc, src in members]
    reserves.append(m.Reserve(namespace, gid, manifest_size(len(members)), gdesc, hints))
    replies = yield [core.request(msg) for msg in reserves]
    got, error = [], None
    for reply in replies:
        if reply.error is not None:
            error = error or from_wire(reply.error)
            got.append(None)
        else:
            got.append(r.ReserveReply.from_wire(reply.result))
    if error is not None:
        leased = [g.lease for g in got if g is not None and not g.exists]
        if leased:
            yield [core.request(m.Abort(lease), no_reply=True) for lease in leased]
        raise error
    *member_replies, manifest = got
    if manifest.exists and all(g.exists for g in member_replies):
        return GroupPutResult(gid, True)  # the whole group is stored already
    arena = core.arenas[namespace]
    checksums, leases = [], []
    for (oid, _, src), reserved in zip(members, member_replies):
        if reserved.exists:
            checksums.append(xxhash.xxh3_128_digest(src))
            leases.append(0)
        else:
            checksums.append(copy_and_hash(arena[reserved.offset:reserved.offset + src.size], src))
            leases.append(reserved.lease)
    if not manifest.exists:  # else only members are missing: they join the stored manifest
        listing = manifest_bytes([oid for oid, _, _ in members], checksums)
        arena[manifest.offset:manifest.offset + len(listing)] = memoryview(listing)
    commit = m.CommitGroup(0 if manifest.exists else manifest.lease, b"".join(oid.digest for oid, _, _ in members),
                           pack_uints(leases), b"".join(checksums))
    (reply,) = yield [core.request(commit)]
    done = core.result(reply, r.CommitGroupReply)
    return GroupPutResult(ObjectId(done.group), done.exists, done.durability)


def _frames(groups: list[list[Member]]) -> list[list[int]]:
    """Indexes of `groups` per lookup_groups frame: at most MAX_BATCH member ids each."""
    frames, size = [], 0
    for g, members in enumerate(groups):
        if not frames or size + len(members) > MAX_BATCH:
            frames.append([])
            size = 0
        frames[-1].append(g)
        size += len(members)
    return frames


def lookup_groups(core: ClientCore, groups, namespace: str | None = None):
    """Per group (a list of member keys: ChunkKeys, Members) whether it is complete."""
    groups = [[Member.of(key) for key in members] for members in groups]
    for members in groups:
        check_members([member.object_id for member in members])
    namespace = namespace or core.namespace
    yield from core.op_open(namespace, create=False)
    if not groups:
        return GroupLookup((), 0, ())
    requests = []
    for frame in _frames(groups):
        members = [member for g in frame for member in groups[g]]
        expect, expect_of = _expect_fields([member.descriptor for member in members])
        requests.append(core.request(m.LookupGroups(
            namespace, b"".join(member.object_id.digest for member in members),
            pack_uints(len(groups[g]) for g in frame), expect, expect_of)))
    complete, tiers = [], []
    for reply in (yield requests):
        found = core.result(reply, r.LookupGroupsReply)
        complete += [bool(c) for c in found.complete]
        tiers += found.tiers
    leading = next((g for g, ok in enumerate(complete) if not ok), len(complete))
    return GroupLookup(tuple(complete), leading, tuple(tiers))


def get_group(core: ClientCore, members, namespace: str | None = None):
    """Read leases on every member of the group (a GroupLease), or None: then nothing is
    leased. The daemon checks each member's bytes against those the group was committed
    with; a reader who wants to check the bytes it copies uses each lease's checksum."""
    members = [Member.of(key) for key in members]
    check_members([member.object_id for member in members])
    namespace = namespace or core.namespace
    yield from core.op_open(namespace, create=False)
    expect, expect_of = _expect_fields([member.descriptor for member in members])
    (reply,) = yield [core.request(m.GetGroup(namespace, b"".join(mb.object_id.digest for mb in members),
                                              expect, expect_of))]
    got = core.result(reply, r.GetGroupReply)
    if not got.hit:
        return None
    if namespace not in core.arenas:  # made since we opened (a promotion for this read)
        yield from core.op_open(namespace)
    arena = core.arenas[namespace]
    leases = []
    sizes, offsets = unpack_uints(got.sizes), unpack_uints(got.offsets)
    of = unpack_uints(got.descriptor_of, 2)
    for k, (member, lease) in enumerate(zip(members, unpack_uints(got.leases))):
        leases.append(ReadLease(core.release_cb, lease, member.object_id, sizes[k], got.checksums[16 * k:16 * k + 16],
                                got.descriptors[of[k]], "host", arena[offsets[k]:offsets[k] + sizes[k]], core=core))
    return GroupLease(core, group_id([mb.object_id for mb in members]), leases)
