"""Store groups in the daemon: commit all or nothing, complete-or-not lookups, whole reads.

The group's manifest and members are ordinary objects (kvstore/groups.py), so they live,
move, expire and survive restarts on every tier as any object does. What this module adds:

- `commit_group` checks everything first (every write lease held by the caller and of the
  member it names, every checksum under verify_puts, every member said to be stored still
  held with the same bytes, the manifest's id, descriptor and bytes), then publishes the new
  members and the manifest in one pass of the event loop, without awaiting in between: no
  reader sees part of a group. Any refusal ends every write lease of the request.
- `lookup_groups` is one lookup over [manifest, members...] per group: a group is complete
  only where all of them are held, live and as expected, on whatever tier.
- `get_group` leases the manifest and every member, or none, and checks the members'
  checksums against the manifest's.

Built on the tier manager's object ops (`ObjectOps`: the same reserve, commit and get a
client's single ops take), the Ledger's write leases, the host tier's namespaces and the
node's index ops, each handed in by the daemon. Runs on the daemon's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import xxhash

from kvstore.errors import ChecksumError, Conflict, InvalidArgument, NotFound
from kvstore.groups import group_descriptor, group_id, manifest_bytes, parse_manifest
from kvstore.identity import ObjectId, descriptor_differences
from kvstore.fields import pack_uints
from kvstore.group_messages import CommitGroup
from kvstore.messages import Get
from kvstore.replies import CommitGroupReply, GetGroupReply, GetReply, LookupGroupsReply
from kvstore.server.later import MaybeAwaitable, is_ready, resolve, then
from kvstore.server.tiering.host import HostTier, Namespace
from kvstore.server.tiering.index_ops import IndexOps
from kvstore.server.tiering.ledger import Ledger
from kvstore.server.tiering.objects import PendingPut, check_same_object
from kvstore.tiers.allocator import Extent
from kvstore.tiers.leases import Owner

log = logging.getLogger("kvstore.tiers")
_SLOWER = {None: 0, "gpu": 1, "host": 1, "nvme": 2, "remote": 3}


class ObjectOps(Protocol):
    """What a group's commit and read use of the tier manager (server/tiering/manager.py)."""

    def held_copy(self, ns: Namespace, oid: ObjectId): ...
    def bytes_match(self, ns: Namespace, put: PendingPut, checksum: bytes) -> bool: ...
    def checksum_of(self, ns: Namespace, put: PendingPut) -> bytes: ...
    def publish_put(self, ns: Namespace, put: PendingPut, checksum: bytes) -> MaybeAwaitable: ...
    def abort(self, owner: Owner, lease_id: int) -> None: ...
    def get(self, owner: Owner, msg: Get) -> MaybeAwaitable[GetReply]: ...
    def release(self, owner: Owner, lease_id: int) -> None: ...


class GroupOps:
    def __init__(self, ops: ObjectOps, ledger: Ledger, host: HostTier, index: IndexOps):
        self.ops, self.ledger, self.host, self.index = ops, ledger, host, index

    # --- commit -------------------------------------------------------------------

    def commit_group(self, owner: int, msg: CommitGroup) -> MaybeAwaitable[CommitGroupReply]:
        ops, ledger = self.ops, self.ledger
        items = msg.items()
        leases = ([msg.manifest] if msg.manifest else []) + [lease for _, lease, _ in items if lease]
        if not leases:
            raise InvalidArgument("commit_group: no write lease: the manifest and every member are stored already")
        if len(set(leases)) != len(leases):
            raise InvalidArgument("commit_group: a write lease is named twice")
        try:
            for lease in leases:
                ledger.own_lease(owner, lease, "write")
            puts = {lease: ledger.pending_put(lease) for lease in leases}
            ns = self.host.namespace(puts[leases[0]].namespace)
            gid = group_id(msg.member_ids())
            self._check(ns, msg, puts, gid)
        except Exception:
            self._abandon(owner, leases)
            raise
        # Everything checked: from here to the end of this call nothing awaits.
        published = [ops.publish_put(ns, ledger.take_put(owner, lease), checksum) for _, lease, checksum in items if lease]
        if msg.manifest:
            manifest = ledger.take_put(owner, msg.manifest)
            published.append(ops.publish_put(ns, manifest, ops.checksum_of(ns, manifest)))
        ns.counters.num_group_puts += 1
        return then(_all(published), lambda replies: _committed(gid, replies))

    def _check(self, ns, msg: CommitGroup, puts: dict, gid: ObjectId) -> None:
        """Raise (naming the member) unless the whole group `gid` can be published now."""
        ops = self.ops
        ids = msg.member_ids()
        if any(put.tier != "host" or put.namespace != ns.name for put in puts.values()):
            raise InvalidArgument('commit_group: a group is put on tier "host" of one namespace')
        sums, first = [], None
        for i, (oid, lease, checksum) in enumerate(msg.items()):
            sums.append(checksum)
            old = ops.held_copy(ns, oid)
            if lease:
                put = puts[lease]
                if put.object_id != oid:
                    raise InvalidArgument(f"commit_group: member {i}'s lease is for another object")
                if not ops.bytes_match(ns, put, checksum):
                    raise ChecksumError(f"commit_group: member {i} ({oid.hex}): its bytes do not match its "
                                        "checksum; nothing of the group was stored")
                if old is not None:
                    check_same_object(oid, old.size, old.descriptor, put.size, put.descriptor, old.checksum, checksum)
                desc = put.descriptor
            else:
                if old is None:
                    raise NotFound(f"commit_group: member {i} ({oid.hex}) is not stored here any more (its put "
                                   "said it was, then it left); put the group again")
                if old.checksum != checksum:
                    raise Conflict(f"commit_group: member {i} ({oid.hex}) is already stored with other bytes; the "
                                   "stored bytes stand: delete it first to replace it")
                desc = old.descriptor
            first = first or group_descriptor(desc)
        listing = manifest_bytes(ids, sums)
        held = ops.held_copy(ns, gid)
        if msg.manifest:
            manifest = puts[msg.manifest]
            if manifest.object_id != gid:
                raise InvalidArgument("commit_group: the manifest's id is not the group id of these members "
                                      "(kvstore.groups.group_id)")
            descriptor = manifest.descriptor
            if bytes(ns.arena.view(manifest.extent)[:manifest.size]) != listing:
                raise InvalidArgument("commit_group: the manifest's bytes do not list these members and checksums "
                                      "(kvstore.groups.manifest_bytes)")
        elif held is None:
            raise NotFound("commit_group: the group's manifest is not stored any more; put the group again")
        else:
            descriptor = held.descriptor
        if held is not None and held.checksum != xxhash.xxh3_128_digest(listing):
            # A stored manifest lists other bytes, while every member is held, or being put,
            # with these (checked above): the group it lists is broken (members deleted,
            # expired or evicted, then put again with other bytes), and would block this one
            # for good, or take the place of its manifest. It goes, and the client, told
            # NotFound, puts the group again (client/groups.py: PUT_ATTEMPTS).
            self._drop(ns.name, gid)
            raise NotFound("commit_group: a stored manifest of this group listed other bytes of its members "
                           "(they were put again since); it was dropped: put the group again")
        if descriptor != first:
            raise InvalidArgument("commit_group: the manifest's descriptor is not kvstore.groups.group_descriptor "
                                  f"of the first member's ({descriptor_differences(descriptor, first)})")

    def _drop(self, namespace: str, gid: ObjectId) -> None:
        """Delete a stale manifest from this node's tiers (the host copy now, NVMe's in the
        background: its copy is forgotten before the next request is read)."""
        deleting = self.index.delete(namespace, [gid], scope="node")
        if not is_ready(deleting):
            task = asyncio.ensure_future(deleting)
            task.add_done_callback(lambda t: t.cancelled() or t.exception() is None
                                   or log.warning("event=stale_manifest_delete_failed error=%r", t.exception()))

    def _abandon(self, owner: int, leases: list[int]) -> None:
        """End the request's write leases that this owner holds (their extents freed)."""
        for lease in leases:
            try:
                self.ops.abort(owner, lease)
            except NotFound:
                pass

    # --- lookup -------------------------------------------------------------------

    def lookup_groups(self, namespace: str, groups: list[list[ObjectId]], expect: list | None
                      ) -> MaybeAwaitable[LookupGroupsReply]:
        ids, wanted, start = [], [], 0
        for members in groups:
            mine = expect[start:start + len(members)] if expect is not None else [None] * len(members)
            start += len(members)
            ids += [group_id(members), *members]
            wanted += [None if mine[0] is None else group_descriptor(mine[0]), *mine]
        found = self.index.lookup(namespace, tuple(ids), wanted if expect is not None else None)
        return then(found, lambda reply: _complete(groups, reply.names()))

    # --- get ----------------------------------------------------------------------

    async def get_group(self, owner: int, namespace: str, ids: list[ObjectId], expect: list | None) -> GetGroupReply:
        ops = self.ops
        gid = group_id(ids)
        wanted = expect if expect is not None else [None] * len(ids)
        first = None if wanted[0] is None else group_descriptor(wanted[0])
        leased: list[GetReply] = []
        try:
            manifest = await resolve(ops.get(owner, Get(namespace, gid, expect=first)))
            if not manifest.hit:
                return GetGroupReply(False, f"the group's manifest: {manifest.reason or 'not stored'}", -1)
            leased.append(manifest)
            for i, oid in enumerate(ids):
                got = await resolve(ops.get(owner, Get(namespace, oid, expect=wanted[i])))
                if not got.hit:
                    return GetGroupReply(False, f"member {i} ({oid.hex}): {got.reason or 'not stored'}", i)
                leased.append(got)
            arena = self.host.namespace(namespace).arena
            listed, sums = parse_manifest(arena.view(Extent(manifest.offset, manifest.size)))
            if listed != ids:
                return GetGroupReply(False, "the manifest lists other members", -1)
            for i, (got, checksum) in enumerate(zip(leased[1:], sums)):
                if got.checksum != checksum:
                    log.warning("event=group_member_changed namespace=%s member=%s", namespace, ids[i].hex)
                    return GetGroupReply(False, f"member {i} ({ids[i].hex}) holds other bytes than the group was "
                                                "committed with (deleted and stored again)", i)
            members, leased = leased[1:], leased[:1]  # the manifest's lease ends below; the members' are the reply's
            return _hit(members)
        finally:
            for got in leased:
                ops.release(owner, got.lease)


def _all(replies: list) -> MaybeAwaitable[list]:
    """The replies once every one is ready (most are: a commit held in memory)."""
    if all(is_ready(reply) for reply in replies):
        return replies

    async def gathered() -> list:
        # Every one is awaited, even after one failed: each is a member's copy to NVMe under
        # way, which must not be left unawaited (never written) because another failed.
        done = await asyncio.gather(*(resolve(reply) for reply in replies), return_exceptions=True)
        for reply in done:
            if isinstance(reply, BaseException):
                raise reply
        return done
    return gathered()


def _committed(gid: ObjectId, replies: list) -> CommitGroupReply:
    exists = all(reply.exists for reply in replies)
    durabilities = {reply.durability for reply in replies if not reply.exists}
    durability = durabilities.pop() if len(durabilities) == 1 else "memory" if durabilities else None
    return CommitGroupReply(gid.digest, exists, durability)


def _complete(groups: list[list[ObjectId]], tiers: tuple) -> LookupGroupsReply:
    complete, slowest, leading, at = bytearray(len(groups)), [], len(groups), 0
    for g, members in enumerate(groups):
        mine = tiers[at:at + 1 + len(members)]
        at += 1 + len(members)
        if all(tier is not None for tier in mine):
            complete[g] = 1
            slowest.append(max(mine, key=_SLOWER.__getitem__))
        else:
            slowest.append(None)
            leading = min(leading, g)
    return LookupGroupsReply(bytes(complete), leading, tuple(slowest))


def _hit(members: list[GetReply]) -> GetGroupReply:
    descriptors: list[dict] = []
    of = []
    for got in members:
        if got.descriptor not in descriptors:
            descriptors.append(got.descriptor)
        of.append(descriptors.index(got.descriptor))
    return GetGroupReply(True, leases=pack_uints(g.lease for g in members),
                         offsets=pack_uints(g.offset for g in members), sizes=pack_uints(g.size for g in members),
                         checksums=b"".join(g.checksum for g in members),
                         descriptors=tuple(descriptors), descriptor_of=pack_uints(of, 2))
