"""Store groups from the client: put_groups, lookup_groups, get_groups (kvstore/groups.py).

Generators over a ClientCore, driven like its op_* (client/core.py):

    put_groups:    reserve each group's members and manifest (one round trip for a window of
                   groups) -> copy + hash the new members, write the manifests
                   -> one commit_group per group (one more round trip for the window)
    lookup_groups: lookup_groups per frame of members -> per group complete or not
    get_groups:    one get_group per group, in one round trip -> per group a GroupLease
                   (a ReadLease per member), or None (nothing of it leased)

put_group and get_group are the same for one group.
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
from kvstore.client import copies
from kvstore.client.core import PUT_WINDOW_BYTES, ClientCore, _expect_fields
from kvstore.client.lease import ReadLease

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


def put_group(core: ClientCore, items, hints: Hints | None = None, routes=None):
    """Store `items` as one group: every member and the manifest become visible at once,
    or nothing is stored (the error is raised). Members already stored are not copied.
    routes: per item a kvstore.route.Route or None (the member's hints.route)."""
    (result,) = yield from put_groups(core, [items], hints, None if routes is None else [routes])
    if isinstance(result, Exception):
        raise result
    return result


def _prepare(core: ClientCore, items, hints: Hints, routes) -> tuple:
    """(namespace, [(oid, descriptor, source bytes, hints)], group id, manifest descriptor)
    of one group to put; InvalidArgument names its problem."""
    given = _members(items)
    check_members([member.object_id for member, _ in given])
    if routes is not None and len(routes) != len(given):
        raise InvalidArgument(f"a group of {len(given)} members got {len(routes)} routes")
    members = [(*core.put_item(member.object_id, data, member.descriptor),
                hints if routes is None or routes[k] is None else hints.with_route(routes[k]))
               for k, (member, data) in enumerate(given)]
    namespaces = {desc.namespace for _, desc, _, _ in members}
    if len(namespaces) != 1:
        raise InvalidArgument(f"a group's members are in one namespace, got {sorted(namespaces)}")
    return (namespaces.pop(), members, group_id([oid for oid, _, _, _ in members]),
            group_descriptor(members[0][1]))


def _windows(core: ClientCore, groups: list) -> list[list[int]]:
    """Indexes of prepared groups per window: each window's reserved bytes and leases fit
    what one client may hold at once (a group larger than that alone)."""
    max_bytes = min(PUT_WINDOW_BYTES, core.max_inflight_bytes,
                    min((core.arenas[g[0]].size for g in groups), default=PUT_WINDOW_BYTES) // 4)
    max_leases = max(1, (core.max_leases or 2048) // 2)
    windows, size, leases = [], 0, 0
    for i, (_, members, _, _) in enumerate(groups):
        need, count = sum(src.size for _, _, src, _ in members), len(members) + 1
        if not windows or size + need > max_bytes or leases + count > max_leases:
            windows.append([])
            size = leases = 0
        windows[-1].append(i)
        size += need
        leases += count
    return windows


def put_groups(core: ClientCore, groups, hints: Hints | None = None, routes=None):
    """Store each of `groups` (lists of put items) as a group, all of a window's reserves in
    one round trip and all its commits in another. Per group its GroupPutResult, or the
    exception that refused it (that group stored nothing; the others are stored).
    routes: per group None or per item a kvstore.route.Route or None."""
    hints = Hints.of(hints)
    if routes is not None and len(routes) != len(groups):
        raise InvalidArgument(f"put_groups: {len(groups)} groups but {len(routes)} route lists")
    results: list = [None] * len(groups)
    prepared = {}
    for i, items in enumerate(groups):
        try:
            prepared[i] = _prepare(core, items, hints, None if routes is None else routes[i])
        except InvalidArgument as exc:
            results[i] = exc
    for namespace in {p[0] for p in prepared.values()}:
        yield from core.op_open(namespace)
    order = list(prepared)
    for window in _windows(core, [prepared[i] for i in order]):
        todo = [order[k] for k in window]
        for attempt in range(PUT_ATTEMPTS):  # a member said to be stored may leave before its commit
            done = yield from _put_window(core, [prepared[i] for i in todo], hints)
            for i, result in zip(todo, done):
                results[i] = result
            todo = [i for i in todo if isinstance(results[i], NotFound)]
            if not todo or attempt == PUT_ATTEMPTS - 1:
                break
    return results


def _put_window(core: ClientCore, groups: list, hints: Hints):
    requests = []
    for namespace, members, gid, gdesc in groups:
        requests += [core.request(m.Reserve(namespace, oid, src.size, desc, member_hints))
                     for oid, desc, src, member_hints in members]
        requests.append(core.request(m.Reserve(namespace, gid, manifest_size(len(members)), gdesc, hints)))
    replies = iter((yield requests))
    results, commits, aborts = [], [], []
    for namespace, members, gid, _ in groups:
        got, error = [], None
        for _ in range(len(members) + 1):
            reply = next(replies)
            if reply.error is not None:
                error = error or from_wire(reply.error)
                got.append(None)
            else:
                got.append(r.ReserveReply.from_wire(reply.result))
        if error is not None:
            aborts += [g.lease for g in got if g is not None and not g.exists]
            results.append(error)
            continue
        *member_replies, manifest = got
        if manifest.exists and all(g.exists for g in member_replies):
            results.append(GroupPutResult(gid, True))  # the whole group is stored already
            continue
        commits.append((len(results), _written(core.arenas[namespace], members, member_replies, manifest)))
        results.append(None)
    if aborts:
        yield [core.request(m.Abort(lease), no_reply=True) for lease in aborts]
    if commits:
        replies = yield [core.request(commit) for _, commit in commits]
        for (at, _), reply in zip(commits, replies):
            if reply.error is not None:
                results[at] = from_wire(reply.error)
            else:
                done = r.CommitGroupReply.from_wire(reply.result)
                results[at] = GroupPutResult(ObjectId(done.group), done.exists, done.durability)
    return results


def _written(arena, members: list, member_replies: list, manifest) -> m.CommitGroup:
    """Copy and hash the reserved members into the arena, write the manifest (unless it is
    stored already): the group's commit."""
    checksums, leases = [], []
    for (oid, _, src, _), reserved in zip(members, member_replies):
        if reserved.exists:
            checksums.append(xxhash.xxh3_128_digest(src))
            leases.append(0)
        else:
            checksums.append(copies.copy_and_hash(arena[reserved.offset:reserved.offset + src.size], src))
            leases.append(reserved.lease)
    if not manifest.exists:  # else only members are missing: they join the stored manifest
        listing = manifest_bytes([oid for oid, _, _, _ in members], checksums)
        arena[manifest.offset:manifest.offset + len(listing)] = memoryview(listing)
    return m.CommitGroup(0 if manifest.exists else manifest.lease, b"".join(oid.digest for oid, _, _, _ in members),
                         pack_uints(leases), b"".join(checksums))


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
    (got,) = yield from get_groups(core, [members], namespace)
    return got


def get_groups(core: ClientCore, groups, namespace: str | None = None):
    """Per group (a list of member keys) a GroupLease, or None (nothing of it leased); one
    get_group request each, sent together, in windows of at most half the client's lease
    quota. A refused request raises after every lease was released."""
    groups = [[Member.of(key) for key in members] for members in groups]
    for members in groups:
        check_members([member.object_id for member in members])
    namespace = namespace or core.namespace
    yield from core.op_open(namespace, create=False)
    out: list = [None] * len(groups)
    window, first_error = max(1, (core.max_leases or 2048) // 2), None
    if not groups:
        return out
    starts, count = [0], 0
    for g, members in enumerate(groups):
        if count and count + len(members) + 1 > window:
            starts.append(g)
            count = 0
        count += len(members) + 1
    for begin, end in zip(starts, starts[1:] + [len(groups)]):
        requests = []
        for members in groups[begin:end]:
            expect, expect_of = _expect_fields([member.descriptor for member in members])
            requests.append(core.request(m.GetGroup(namespace, b"".join(mb.object_id.digest for mb in members),
                                                    expect, expect_of)))
        replies = yield requests
        if namespace not in core.arenas and any(reply.error is None for reply in replies):
            yield from core.op_open(namespace)  # made since we opened (a promotion for this read)
        for g, reply in zip(range(begin, end), replies):
            if reply.error is not None:
                first_error = first_error or from_wire(reply.error)
                continue
            got = r.GetGroupReply.from_wire(reply.result)
            if got.hit:
                out[g] = _group_lease(core, core.arenas[namespace], groups[g], got)
    if first_error is not None:
        for lease in out:
            if lease is not None:
                lease.release()
        raise first_error
    return out


def _group_lease(core: ClientCore, arena, members: list[Member], got: r.GetGroupReply) -> GroupLease:
    leases = []
    sizes, offsets = unpack_uints(got.sizes), unpack_uints(got.offsets)
    of = unpack_uints(got.descriptor_of, 2)
    for k, (member, lease) in enumerate(zip(members, unpack_uints(got.leases))):
        leases.append(ReadLease(core.release_cb, lease, member.object_id, sizes[k], got.checksums[16 * k:16 * k + 16],
                                got.descriptors[of[k]], "host", arena[offsets[k]:offsets[k] + sizes[k]], core=core))
    return GroupLease(core, group_id([mb.object_id for mb in members]), leases)
