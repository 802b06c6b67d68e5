"""The tier manager: the daemon's one object for the local protocol's ops.

It serves clients from a composed chain of tiers (server/tiering/chain.py: the host tier,
NVMe, the remote tier, and device copies for local engines once the GPU probe found CUDA).
Puts are two-phase (reserve -> write in shared memory -> commit), gets hand out read leases
and walk the chain once (host, then NVMe, then the remote tier), and an extent is never freed
or reused while a lease covers it. Leases, pending puts and client quotas are the Ledger's
(server/tiering/ledger.py): the manager decides what to lease, the Ledger keeps the books.
Lookups, deletes, pins and prefetches are the chain's IndexOps (server/tiering/index_ops.py),
groups GroupOps (server/tiering/groups.py): the daemon hands each to whom uses it.

Runs on the daemon's event loop thread only; nothing here blocks on I/O. A call that needs
NVMe or peer I/O answers with an awaitable instead of its reply (server/later.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import xxhash

from kvstore.config import LimitsConfig
from kvstore.errors import ChecksumError, InvalidArgument, RangeError
from kvstore.identity import Kind, ObjectId, check_object_size, read_refusal
from kvstore.messages import Get, GetMany, Reserve, ReserveMany
from kvstore.ranges import check_within, total as ranges_total
from kvstore.replies import IN_MEMORY, MISS, STORED, CommitReply, GetReply, ReserveReply
from kvstore.server.tiering.chain import Chain
from kvstore.server.tiering.host import Namespace, give_back_heap
from kvstore.server.tiering.ledger import Ledger
from kvstore.server.tiering.shared_index import count_shared_hits
from kvstore.server.later import MaybeAwaitable, is_ready, resolve, then
from kvstore.server.tiering.objects import ObjectEntry, PendingPut, check_same_object
from kvstore.tiers.allocator import Extent
from kvstore.tiers.leases import Owner

# The fewest alike items commit_many commits as one batch: below it, its arrays cost more
# than committing them one at a time.
MIN_BATCH = 16

log = logging.getLogger("kvstore.tiers")


class TierManager:
    def __init__(self, chain: Chain, limits: LimitsConfig = LimitsConfig(), *, verify_puts: bool = False):
        """chain: the tiers, composed (server/tiering/chain.py: compose); the `[limits]` table
        and ServerConfig.verify_puts."""
        self.chain = chain
        self.host, self.nvme, self.remote, self.index = chain.host, chain.nvme, chain.remote, chain.index
        self.verify_puts = verify_puts
        self.clock = self.host.clock
        self.ledger = Ledger(chain.host, limits)

    @property
    def tiered(self) -> bool:
        """Objects may live below the host arena (a namespace with no arena may hold some)."""
        return self.chain.tiered

    def has_arena(self, namespace: str) -> bool:
        """The namespace is open here (its host arena made)."""
        return namespace in self.host.namespaces

    async def arena_if_held(self, namespace: str, digests: tuple) -> bool:
        """A batch's reads in a namespace with no arena here: its objects may still be on NVMe
        or below, and their bytes need an arena to land in. Make one (True) only if one of them
        is found there: one lookup for the batch, not one per object (a single get walks the
        chain once instead: `_get_unopened`). `digests`: raw 32-byte ids, as a Lookup carries them."""
        found = await resolve(self.index.lookup(namespace, digests))
        if not any(found.names()):
            return False
        await self.host.open_namespace(namespace)
        return True

    def touch(self, namespace: str, ids: tuple) -> None:
        """Hits a client resolved from the shared index (op `touch`), counted as gets."""
        count_shared_hits(self.host, self.nvme, namespace, ids)

    # --- put --------------------------------------------------------------------

    def reserve(self, owner: Owner, msg: Reserve) -> MaybeAwaitable[ReserveReply]:
        ns = self.host.namespace(msg.namespace)
        check_object_size(msg.descriptor, msg.size)
        if msg.descriptor.namespace != msg.namespace:
            raise InvalidArgument("descriptor.namespace differs from the request's namespace")
        if msg.tier == "remote" and not self.remote.takes_remote_puts:
            raise InvalidArgument('put with tier="remote" needs a remote tier: a clustered daemon (cluster.enabled) '
                                  'or a Mooncake pool ([remote] backend = "mooncake")')
        existing = ns.objects.get(msg.object_id)
        if existing is not None and existing.is_live(self.clock()):
            # Content-addressed and immutable: the same id is the same state. Skip the copy.
            check_same_object(msg.object_id, existing.size, existing.descriptor, msg.size, msg.descriptor)
            ns.counters.num_dedup_puts += 1
            return ReserveReply(exists=True)
        if existing is None and self.nvme.holds(msg.namespace, msg.object_id):
            held = self.nvme.remote_meta(msg.namespace, msg.object_id)
            if held is not None:
                check_same_object(msg.object_id, held.size, held.descriptor, msg.size, msg.descriptor)
        self.ledger.check_lease(owner)
        self.ledger.check_reserve(owner, msg.size)
        room = self.host.make_room(ns, msg.size, self.chain.sink)  # the extent now, unless victims must go first
        return then(room, lambda extent: self._grant_write(owner, ns, msg, extent))

    def _grant_write(self, owner: Owner, ns: Namespace, msg: Reserve, extent: Extent) -> ReserveReply:
        put = PendingPut(msg.namespace, msg.object_id, msg.size, msg.descriptor, msg.hints, extent, msg.tier)
        return ReserveReply(lease=self.ledger.grant_write(owner, put), offset=extent.offset)

    def reserve_run(self, owner: Owner, msg: ReserveMany, ids: list, sizes: list, start: int,
                    leases: list, offsets: list, exists: bytearray) -> int:
        """Serve a reserve_many's items from `start` while each is the plain case, exactly as
        reserve() would: a new id with room in the arena now, or a live copy of the same state
        (exists). The checks that hold for the whole batch run once; columns are filled in
        place. Returns the first item it left for reserve() (a refusal, an id held on NVMe or
        expired, a quota reached, victims to make room), or len(ids)."""
        ns = self.host.namespaces.get(msg.namespace)
        desc = msg.descriptor
        if ns is None or desc.namespace != msg.namespace or (msg.tier == "remote" and not self.remote.takes_remote_puts):
            return start
        expected, objects, now = desc.object_bytes, ns.objects, self.clock()
        leases_left, bytes_left = self.ledger.room(owner)
        capacity, holds, grant = ns.arena.capacity_bytes, self.nvme.holds, self.ledger.grant_write
        i, n, next_batch = start, len(ids), start
        while i < n:
            if i >= next_batch and not msg.routes:
                batched, looked_at = self._reserve_batch(owner, ns, msg, ids, sizes, i, leases, offsets, now)
                if batched:
                    leases_left, bytes_left = self.ledger.room(owner)
                    i += batched
                    continue
                next_batch = i + max(1, looked_at)  # too few alike: these go one at a time
            oid, size = ids[i], sizes[i]
            if expected and size != expected:
                break
            existing = objects.get(oid)
            if existing is not None:
                if not existing.is_live(now) or existing.size != size or existing.descriptor != desc:
                    break
                ns.counters.num_dedup_puts += 1
                exists[i] = 1
                i += 1
                continue
            if holds(ns.name, oid) or leases_left <= 0 or size > bytes_left or size > capacity:
                break
            extent = ns.arena.alloc(size)
            if extent is None:
                break
            leases[i] = grant(owner, PendingPut(ns.name, oid, size, desc, msg.hints_of(i), extent, msg.tier), now)
            offsets[i] = extent.offset
            leases_left, bytes_left = leases_left - 1, bytes_left - size
            i += 1
        return i

    def _reserve_batch(self, owner: Owner, ns: Namespace, msg: ReserveMany, ids: list, sizes: list, start: int,
                       leases: list, offsets: list, now: float) -> tuple[int, int]:
        """Reserve the items from `start` that reserve_run's plain case would grant, as one
        batch (HostArena.alloc_many, Ledger.grant_writes), while they are alike: one size,
        distinct ids none indexed here or held on NVMe, within the caller's quotas and the
        room the arena has now. Returns (how many it reserved, how many it looked at): none
        where fewer than MIN_BATCH are alike, which go one at a time."""
        size, expected, holds, seen = sizes[start], msg.descriptor.object_bytes, self.nvme.holds, set()
        leases_left, bytes_left = self.ledger.room(owner)
        most = min(len(ids) - start, leases_left, bytes_left // size if size > 0 else 0)
        if (expected and size != expected) or size > ns.arena.capacity_bytes:
            return 0, 1
        end = start
        while end < start + most and sizes[end] == size and ids[end] not in seen and not holds(ns.name, ids[end]):
            seen.add(ids[end])
            end += 1
        count = ns.objects.first_indexed(ids[start:end])  # (an indexed one: reserve() says what happens)
        if count < MIN_BATCH:
            return 0, max(1, count)
        extents = ns.arena.alloc_many(size, count)  # (short of room: the rest make room one at a time)
        desc, hints, tier = msg.descriptor, msg.hints, msg.tier
        puts = [PendingPut(ns.name, oid, size, desc, hints, extent, tier) for oid, extent in zip(ids[start:], extents)]
        leases[start:start + len(puts)] = self.ledger.grant_writes(owner, puts, now)
        offsets[start:start + len(puts)] = [extent.offset for extent in extents]
        return len(puts), max(1, count)

    def commit_run(self, owner: Owner, items: list, start: int, codes: bytearray) -> tuple[int, MaybeAwaitable | None]:
        """Commit a commit_many's (lease, checksum) items from `start` while each is the plain
        case, exactly as commit() would: the caller's write lease, bytes that match, an id
        not held here meanwhile, stored in host memory (codes[i] = STORED). Returns (k, None):
        item k is left for commit() (or k is len(items)); or (k, reply): item k is committed
        and its reply is something else (an NVMe write-through to await, say), or the
        exception its commit raised."""
        i, n, next_batch = start, len(items), start
        own_put, holds = self.ledger.own_put, self.nvme.holds
        while i < n:
            if i >= next_batch:
                batched, looked_at = self._commit_batch(owner, items, i)
                if batched:
                    codes[i:i + batched] = bytes([STORED]) * batched
                    i += batched
                    continue
                next_batch = i + max(1, looked_at)  # too few alike: these go one at a time
            lease_id, checksum = items[i]
            put = own_put(owner, lease_id)
            if put is None:
                break
            ns = self.host.namespaces[put.namespace]
            if put.tier != "host" or put.object_id in ns.objects or holds(ns.name, put.object_id):
                break
            if self.verify_puts and self.checksum_of(ns, put) != checksum:
                break
            try:
                self.ledger.take_put(owner, lease_id)
                entry = self.host.publish(ns, put.object_id, put.extent, put.size, checksum, put.descriptor,
                                          put.hints, pin_hint=True)
                self.remote.on_commit(entry)
                reply = self.nvme.on_commit(entry)
            except Exception as exc:  # this item's failure, as commit() would raise it
                return i, exc
            if reply is not IN_MEMORY:
                return i, reply
            codes[i] = STORED
            i += 1
        return i, None

    def _commit_batch(self, owner: Owner, items: list, start: int) -> tuple[int, int]:
        """Commit the items from `start` that commit_run's plain case would, as one batch
        (HostTier.publish_many), while they are alike: one namespace, descriptor and hints
        (no route, TTL or pin; no store group), distinct ids none held here or on NVMe, no
        NVMe write-through to wait for. Returns (how many it committed, how many it looked
        at): none where fewer than MIN_BATCH are alike, which go one at a time."""
        first = self.ledger.own_put(owner, items[start][0])
        if first is None or first.tier != "host" or self.nvme.writes_through:
            return 0, 1
        ns, desc, hints = self.host.namespaces[first.namespace], first.descriptor, first.hints
        if hints.route is not None or hints.ttl_s is not None or hints.pin or desc.kind is Kind.GROUP:
            return 0, 1
        own_put, holds, verify, puts, seen = self.ledger.own_put, self.nvme.holds, self.verify_puts, [], set()
        for k in range(start, len(items)):
            lease_id, checksum = items[k]
            put = own_put(owner, lease_id)
            if (put is None or put.descriptor is not desc or put.hints is not hints or put.tier != "host"
                    or put.namespace != ns.name or put.object_id in seen or holds(ns.name, put.object_id)
                    or verify and self.checksum_of(ns, put) != checksum):
                break
            seen.add(put.object_id)
            puts.append(put)
        oids = [put.object_id for put in puts]
        count = ns.objects.first_indexed(oids)  # (one indexed meanwhile: commit() says what happens)
        if count < MIN_BATCH:
            return 0, count
        puts, oids = puts[:count], oids[:count]
        entries = self.host.publish_many(ns, oids, [put.extent for put in puts], [put.size for put in puts],
                                         b"".join(checksum for _, checksum in items[start:start + count]), desc, hints)
        self.ledger.take_puts(owner, [lease_id for lease_id, _ in items[start:start + count]])
        for entry in entries:
            self.remote.on_commit(entry)
        return count, count

    def commit(self, owner: Owner, lease_id: int, checksum: bytes) -> MaybeAwaitable[CommitReply]:
        self.ledger.own_lease(owner, lease_id, "write")
        put = self.ledger.take_put(owner, lease_id)
        ns = self.host.namespaces[put.namespace]
        if not self.bytes_match(ns, put, checksum):
            ns.arena.free(put.extent)
            raise ChecksumError(
                f"object {put.object_id.hex}: bytes in the arena do not match the checksum sent "
                "with commit (written after commit, or a short write); nothing was stored"
            )
        return self.publish_put(ns, put, checksum)

    def reserved_view(self, lease_id: int) -> memoryview:
        """The arena bytes a write lease reserved, for the daemon to fill (a put_inline)."""
        put = self.ledger.pending_put(lease_id)
        return self.host.namespace(put.namespace).arena.view(put.extent)[:put.size]

    def checksum_of(self, ns: Namespace, put: PendingPut) -> bytes:
        """The xxh3-128 of a put's bytes as they are in the arena now."""
        return xxhash.xxh3_128_digest(ns.arena.view(put.extent)[:put.size])

    def bytes_match(self, ns: Namespace, put: PendingPut, checksum: bytes) -> bool:
        """The put's bytes against the checksum sent (only under verify_puts; else True).
        A mismatch is counted and logged."""
        if not self.verify_puts:
            return True
        if self.checksum_of(ns, put) == checksum:
            return True
        ns.counters.num_checksum_failures += 1
        log.warning("event=put_checksum_mismatch namespace=%s object=%s", put.namespace, put.object_id.hex)
        return False

    def held_copy(self, ns: Namespace, oid: ObjectId):
        """What this node holds of `oid` (a live host entry, else NVMe's metadata), or None."""
        old = ns.objects.get(oid)
        if old is None or not old.is_live(self.clock()):  # held only on NVMe: its bytes stand
            old = self.nvme.remote_meta(ns.name, oid) if self.nvme.holds(ns.name, oid) else None
        return old

    def publish_put(self, ns: Namespace, put: PendingPut, checksum: bytes) -> MaybeAwaitable[CommitReply]:
        """Verified bytes of a taken put become the object, or are dropped for a copy held
        already (the same state: exists; other bytes: Conflict)."""
        old = self.held_copy(ns, put.object_id)
        if old is not None:  # a concurrent put of the same id won the race, or NVMe holds it
            ns.arena.free(put.extent)
            check_same_object(put.object_id, old.size, old.descriptor, put.size, put.descriptor,
                              old.checksum, checksum)
            ns.counters.num_dedup_puts += 1
            return CommitReply(exists=True)
        entry = self.host.publish(ns, put.object_id, put.extent, put.size, checksum, put.descriptor, put.hints,
                                  pin_hint=True)
        if put.tier == "remote":
            return self.remote.put_remote(entry)
        self.remote.on_commit(entry)
        return self.nvme.on_commit(entry)

    def abort(self, owner: Owner, lease_id: int) -> None:
        self.ledger.end(owner, lease_id, "write")

    # --- get --------------------------------------------------------------------

    def get(self, owner: Owner, msg: Get, oid: ObjectId | None = None) -> MaybeAwaitable[GetReply]:
        """A read lease, or a miss, walking the chain once: the host tier; on a miss NVMe
        (promoted), then the remote tier (fetched whole, or only the ranges asked for where
        the remote tier reads ranges); what is brought up is leased as a host hit is.
        msg.expect: the descriptor the reader can use (any other is a miss). msg.gpu: the
        reader mapped the GPU buffer; a hit is leased on its device copy where the GPU tier can
        hold one. A namespace with no arena here gets one only if the object is held below.
        oid: the object, when `msg` holds the terms of a batch's reads (get_many, one id
        after another); else msg.object_id."""
        oid = msg.object_id if oid is None else oid
        ns = self.host.namespaces.get(msg.namespace)
        if ns is None:
            return self._get_unopened(owner, msg, oid) if self.chain.tiered else MISS
        ns.counters.num_gets += 1
        entry = self.host.live_entry(ns, oid)
        if entry is None:
            return self._get_below(owner, ns, msg, oid)
        return self._serve(owner, ns, entry, msg)

    async def _get_unopened(self, owner: Owner, msg: Get, oid: ObjectId) -> GetReply:
        """A namespace with no arena here: its objects may still be on NVMe or below, and the
        chain is walked once, as for any miss. NVMe's index is this node's own: where it holds
        the object the arena is made and the get goes on as in an open namespace. Else the
        remote tier is asked, and makes the arena only once a home or the pool answered with
        the object: a miss makes none."""
        name = msg.namespace
        if self.nvme.holds(name, oid):
            await self.host.open_namespace(name)
            return await resolve(self.get(owner, msg, oid))
        if msg.ranges is not None and self.remote.reads_ranges:
            reply = await self._get_ranges_below(owner, name, msg, oid)
            brought = None
        else:
            reply, brought = None, await resolve(self.remote.fetch(name, oid))
        ns = self.host.namespaces.get(name)  # None: held nowhere below, and no arena made
        if ns is not None:
            ns.counters.num_gets += 1
        if reply is not None:
            return reply
        return MISS if ns is None else await resolve(self._serve_resident(brought, owner, ns, msg, oid))

    def _get_below(self, owner: Owner, ns: Namespace, msg: Get, oid: ObjectId) -> MaybeAwaitable[GetReply]:
        """A miss in the host tier: NVMe, then the remote tier."""
        if self.nvme.holds(ns.name, oid):
            self._check_ranges(ns, msg.ranges, self.nvme.size_of(ns.name, oid))  # before promoting it
            return self._serve_brought(self.nvme.promote(ns.name, oid), owner, ns, msg, oid)
        if msg.ranges is not None and self.remote.reads_ranges:  # a sparse reader: only those bytes cross the network
            return self._get_ranges_below(owner, ns.name, msg, oid)
        return self._serve_brought(self.remote.fetch(ns.name, oid), owner, ns, msg, oid)

    def _serve_brought(self, bring: MaybeAwaitable, owner: Owner, ns: Namespace, msg: Get,
                       oid: ObjectId) -> MaybeAwaitable[GetReply]:
        """Serve what `bring` (a promotion or a fetch) put in the host tier, or a miss."""
        if is_ready(bring):
            return self._serve_resident(bring, owner, ns, msg, oid)

        async def later() -> GetReply:
            return await resolve(self._serve_resident(await bring, owner, ns, msg, oid))
        return later()

    def _serve_resident(self, brought: ObjectEntry | None, owner: Owner, ns: Namespace, msg: Get,
                        oid: ObjectId) -> MaybeAwaitable[GetReply]:
        entry = None if brought is None else self.host.live_entry(ns, oid)  # (brought, or a put's meanwhile)
        if entry is None:  # held nowhere below, or gone again since
            ns.counters.num_misses += 1
            return MISS
        return self._serve(owner, ns, entry, msg)

    def _serve(self, owner: Owner, ns: Namespace, entry: ObjectEntry, msg: Get) -> MaybeAwaitable[GetReply]:
        """A host entry: refused (its descriptor), or leased: on its device copy (msg.gpu, where
        one is held or can be made), else on the host arena."""
        refused = read_refusal(entry.descriptor, msg.accept, msg.expect)
        if refused is not None:
            ns.counters.num_misses += 1
            return GetReply(False, refused)
        self._check_ranges(ns, msg.ranges, entry.size)  # leased whole, but the same error wherever it is
        self.ledger.check_lease(owner)
        if msg.gpu and msg.ranges is None:
            copy = self.chain.gpu.lease_copy(ns, entry)
            if not is_ready(copy):  # being copied to the device now
                return self._lease_when_copied(copy, owner, ns, entry)
            if copy is not None:
                return self._lease(owner, ns, entry, copy)
        return self._lease(owner, ns, entry)

    async def _lease_when_copied(self, copy, owner: Owner, ns: Namespace, entry: ObjectEntry) -> GetReply:
        """Leased on the device copy once made (its extent, acquired), or on the host entry
        when none could be made; a miss if the object left meanwhile."""
        on_gpu = await copy
        if self.host.live_entry(ns, entry.object_id) != entry:
            if on_gpu is not None:
                self.chain.gpu.release(ns.name, entry.object_id.digest)  # forgotten with its last reader
            ns.counters.num_misses += 1
            return MISS
        return self._lease(owner, ns, entry, on_gpu)

    async def _get_ranges_below(self, owner: Owner, name: str, msg: Get, oid: ObjectId) -> GetReply:
        """A sparse reader's local miss: only its ranges fetched from a home, into an extent
        leased to this reader alone (never published; freed when the lease ends). The
        namespace's arena is made by the fetch if it had none (and only on a hit)."""
        self.ledger.check_lease(owner)  # before any byte crosses the network

        def missed() -> None:
            if name in self.host.namespaces:
                self.host.namespaces[name].counters.num_misses += 1
        try:
            got = await resolve(self.remote.fetch_ranges(name, oid, msg.accept, msg.ranges, msg.expect))
        except BaseException:
            missed()
            raise
        if got is None or isinstance(got, str):  # held by no home (or none answered), or refused: why
            missed()
            return MISS if got is None else GetReply(False, got)
        ns = self.host.namespaces[name]
        try:
            lease_id = self.ledger.grant_ranged(owner, ns, oid, got.extent)
        except BaseException:
            ns.counters.num_misses += 1
            self.host.track_transient(ns, got.extent, add=False)
            ns.arena.free(got.extent)
            raise
        size = ranges_total(msg.ranges)
        ns.counters.num_hits += 1
        ns.counters.bytes_out += size
        return GetReply(True, lease=lease_id, offset=got.extent.offset, size=size, checksum=got.checksum,
                        tier="remote", descriptor=got.meta.descriptor.to_wire(), ranges=msg.ranges,
                        object_size=got.meta.size)

    def fetch_many(self, namespace: str, oids: list) -> MaybeAwaitable[None]:
        """Before a get_many is served: its local misses (in neither host nor NVMe) fetched
        together where the remote tier reads many in one call (a Mooncake pool); the batch's
        gets then find them in host memory. None when there is nothing to do."""
        ns = self.host.namespaces.get(namespace)
        if ns is None or not self.remote.fetches_many:
            return None
        holds, live = self.nvme.holds, self.host.live_entry
        missing = [oid for oid in oids if live(ns, oid) is None and not holds(namespace, oid)]
        return self.remote.fetch_many(namespace, missing) if len(missing) > 1 else None

    def _lease(self, owner: Owner, ns: Namespace, entry: ObjectEntry, on_gpu: Extent | None = None) -> GetReply:
        """A read lease on the host entry, or on its device copy (`on_gpu`, acquired for it)."""
        lease_id = self._grant_read(owner, ns, entry, on_gpu)
        if on_gpu is not None:
            return entry.get_reply(lease_id, tier="gpu", offset=on_gpu.offset)
        return entry.get_reply(lease_id)

    def _grant_read(self, owner: Owner, ns: Namespace, entry: ObjectEntry, on_gpu: Extent | None = None) -> int:
        """A read's lease and what a hit counts (the entry's hits, the policy, NVMe admission,
        the reader that keeps the extent); its id."""
        oid = entry.object_id
        release_gpu = None if on_gpu is None else functools.partial(self.chain.gpu.release, ns.name, oid.digest)
        lease_id = self.ledger.grant_read(owner, entry, on_gpu, release_gpu)
        entry.num_hits += 1
        ns.policy.on_access(entry.locate())
        ns.counters.num_hits += 1
        ns.counters.bytes_out += entry.size
        self.nvme.on_hit(entry)
        return lease_id

    def get_run(self, owner: Owner, msg: GetMany, ids: list, start: int, hit: Callable) -> int:
        """Serve a get_many's items from `start` while each is the plain case, exactly as get()
        would: a live host entry stored under msg.expect (any, when None), leased on the host
        arena; hit(i, lease id, offset, size, checksum, descriptor wire) takes item i's answer.
        The checks that hold for the whole batch run once. Returns the first item it left for
        get() (not resident, expired, stored under another descriptor, the lease quota
        reached), or len(ids)."""
        ns = self.host.namespaces.get(msg.namespace)
        if ns is None:
            return start
        expect, objects = msg.expect, ns.objects
        end = min(len(ids), start + max(0, self.ledger.room(owner)[0]))  # the leases this owner may still take
        if end <= start:
            return start
        i = start
        for row in objects.live_rows(ids[start:end], self.clock()).tolist():  # probed at once
            if row < 0 or (expect is not None and objects.descriptor_at(row) != expect):
                break
            entry = objects.entry_on(row, ids[i])
            ns.counters.num_gets += 1
            hit(i, self._grant_read(owner, ns, entry), *entry.read_fields())
            i += 1
        return i

    @staticmethod
    def _check_ranges(ns: Namespace, ranges, size: int) -> None:
        """A get's byte ranges against the object's size: RangeError (a counted miss)."""
        if ranges is not None:
            try:
                check_within(ranges, size)
            except RangeError:
                ns.counters.num_misses += 1
                raise

    def release(self, owner: Owner, lease_id: int) -> None:
        self.ledger.end(owner, lease_id, "read")

    # --- housekeeping -----------------------------------------------------------

    def drop_owner(self, owner: Owner) -> int:
        """A client went away: end every lease it held. Returns how many."""
        return self.ledger.drop_owner(owner)

    def expire(self) -> None:
        """Take back expired leases and drop objects past their ttl."""
        self.ledger.expire()
        self.host.expire_objects()
        self.nvme.expire_due()
        if self.nvme.compact():
            give_back_heap()

    def num_indexed(self) -> int:
        """Objects indexed here: host entries plus NVMe objects (one on both counts twice)."""
        return sum(len(ns.objects) for ns in self.host.namespaces.values()) + ((self.nvme.stats() or {}).get("objects") or 0)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the index, leases, policy and arenas disagree."""
        self.ledger.check_integrity()
        self.nvme.check_integrity()
        self.chain.gpu.check_integrity()

    def stats(self) -> dict:
        """Per namespace and per tier (a tier that is off is left out)."""
        namespaces, host = self.host.stats()
        tiers = {"host": host}
        for name, tier in (("nvme", self.nvme), ("remote", self.remote)):
            doc = tier.stats()
            if doc is not None:
                tiers[name] = doc
        return {"leases": len(self.ledger), "namespaces": namespaces, "tiers": tiers}

    def close(self) -> None:
        self.host.close()
