"""The tier manager: the daemon's one object for the local protocol's ops.

It composes the chain of tiers once, at construction: the host tier (server/tiering/host.py),
then NVMe (server/tiering/nvme_mover.py) and the cluster's homes (server/cluster/link.py), each replaced by
a null object (server/tiering/absent.py) when switched off. Above the host tier, device copies
for local engines (server/tiering/gpu_reads.py) join at start, once the GPU probe found CUDA. Puts are two-phase (reserve ->
write in shared memory -> commit), gets hand out read leases, and an extent is never freed
or reused while a lease covers it. Lookups, deletes, pins and prefetches are IndexOps
(server/tiering/index_ops.py), composed here too.

Runs on the daemon's event loop thread only; nothing here blocks on I/O. A call that needs
NVMe or peer I/O answers with an awaitable instead of its reply (server/later.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import xxhash

from kvstore.config import HostTierConfig, LimitsConfig
from kvstore.errors import ChecksumError, InvalidArgument, NotFound, RangeError
from kvstore.identity import ObjectId, read_refusal
from kvstore.messages import Reserve, ReserveMany
from kvstore.ranges import check_within
from kvstore.replies import IN_MEMORY, MISS, STORED, CommitReply, GetReply, ReserveReply
from kvstore.server.events import NoEvents
from kvstore.server.tiering.absent import NoCluster, NoGpu, NoNvme
from kvstore.server.tiering.host import HostTier, Namespace, give_back_heap
from kvstore.server.tiering.groups import GroupOps
from kvstore.server.tiering.index_ops import IndexOps
from kvstore.server.later import MaybeAwaitable, is_ready, resolve, then
from kvstore.server.tiering.objects import ObjectEntry, PendingPut, check_same_object
from kvstore.server.tiering.quotas import ClientQuotas
from kvstore.tiers.allocator import Extent
from kvstore.tiers.leases import Lease, LeaseTable, Owner

log = logging.getLogger("kvstore.tiers")


class TierManager:
    def __init__(self, host: HostTierConfig, limits: LimitsConfig = LimitsConfig(), *,
                 verify_puts: bool = False, clock=time.monotonic,
                 make_nvme: Callable[[TierManager], object] | None = None,
                 make_cluster: Callable[[TierManager], object] | None = None, events=NoEvents()):
        """The `[host]` and `[limits]` tables and ServerConfig.verify_puts. make_nvme / make_cluster:
        factories of the tiers below the host arena (server.tiering.nvme_mover.TierMover, server.cluster.link.
        ClusterLink), given this manager; None: that tier is off (a null object stands in).
        events: the KV event stream (server/events/) the host and NVMe tiers report to."""
        self.limits_config = limits
        self.verify_puts = verify_puts
        self.clock = clock
        self.events = events
        self.host = HostTier(host, clock, on_leave=self._left_host, events=events)
        self.leases = LeaseTable()
        self.quotas = ClientQuotas(limits, self.leases)
        self._pending: dict[int, PendingPut] = {}  # write lease id -> reserved put
        self._reading: dict[int, ObjectEntry] = {}  # read lease id -> entry it covers
        self._ranged: dict[int, tuple[Namespace, Extent]] = {}  # read lease id -> transient extent of fetched ranges
        self._on_gpu: dict[int, tuple[str, bytes]] = {}  # read lease id -> (namespace, digest) of a device copy
        self.host_bandwidth_bytes_s = 8e9  # replaced by a measurement at start
        # The host tier's surface, as the other tiers and the admin API use it.
        h = self.host
        self.namespaces, self.open_namespace = h.namespaces, h.open_namespace
        self.publish, self.hold, self.release_hold, self.held_view = h.publish, h.hold, h.release_hold, h.held_view
        self.drop, self.track_transient, self.stopping = h.drop, h.track_transient, h.stopping
        # The chain below the host arena, and where host victims go: written down to NVMe
        # (which sends what it refuses home), else sent home, else dropped (None: no await).
        self.gpu = NoGpu()  # server.tiering.gpu_reads.GpuReads once attach_gpu() (the daemon's start)
        self.mover = make_nvme(self) if make_nvme else NoNvme()
        self.cluster = make_cluster(self) if make_cluster else NoCluster(self.host)
        self.sink = self.mover.victim_sink(self.cluster.victim_sink(self.host))
        self.tiered = self.sink is not None  # objects may live below the host arena
        self.index = IndexOps(self)
        i = self.index
        self.lookup, self.delete, self.delete_here, self.prefetch = i.lookup, i.delete, i.delete_here, i.prefetch
        self.pin, self.unpin, self.pin_here, self.evict = i.pin, i.unpin, i.pin_here, i.evict
        self.groups = GroupOps(self)

    def attach_gpu(self, gpu) -> None:
        """The GPU tier joins the chain (made at start: it needs the probe, and device memory)."""
        self.gpu = gpu

    async def allocate(self, ns: Namespace, size: int) -> Extent:
        """An extent in the host arena, room made for it by the chain's sink."""
        return await resolve(self.host.make_room(ns, size, self.sink))

    async def arena_if_held(self, namespace: str, digests: tuple) -> bool:
        """A read in a namespace with no arena here: its objects may still be on NVMe or at a
        peer, and their bytes need an arena to land in. Make one (True) only if one of them
        is found there. `digests`: raw 32-byte ids, as a Lookup carries them."""
        found = await resolve(self.lookup(namespace, digests))
        if all(tier is None for tier in found.tiers):
            return False
        await self.open_namespace(namespace)
        return True

    def _left_host(self, ns: Namespace, entry: ObjectEntry) -> None:
        self.gpu.forget(ns.name, entry.object_id.digest)
        if not self.mover.holds(ns.name, entry.object_id):  # gone from this node altogether
            self.cluster.forget(ns.name, entry.object_id)

    # --- put --------------------------------------------------------------------

    def reserve(self, owner: Owner, msg: Reserve) -> MaybeAwaitable[ReserveReply]:
        ns = self.host.namespace(msg.namespace)
        expected = msg.descriptor.object_bytes
        if expected and msg.size != expected:
            raise InvalidArgument(
                f"object of {msg.size} bytes does not match its layout {msg.descriptor.layout} "
                f"in {msg.descriptor.dtype.value} ({expected} bytes per {msg.descriptor.chunk_tokens}-token chunk)"
            )
        if msg.descriptor.namespace != msg.namespace:
            raise InvalidArgument("descriptor.namespace differs from the request's namespace")
        if msg.tier == "remote" and not self.cluster.takes_remote_puts:
            raise InvalidArgument('put with tier="remote" needs a remote tier: a clustered daemon (cluster.enabled) '
                                  'or a Mooncake pool ([remote] backend = "mooncake")')
        existing = ns.objects.get(msg.object_id)
        if existing is not None and existing.is_live(self.clock()):
            # Content-addressed and immutable: the same id is the same state. Skip the copy.
            check_same_object(msg.object_id, existing.size, existing.descriptor, msg.size, msg.descriptor)
            ns.counters.num_dedup_puts += 1
            return ReserveReply(exists=True)
        if existing is None and self.mover.holds(msg.namespace, msg.object_id):
            held = self.mover.remote_meta(msg.namespace, msg.object_id)
            if held is not None:
                check_same_object(msg.object_id, held.size, held.descriptor, msg.size, msg.descriptor)
        self.quotas.check_lease(owner)
        self.quotas.check_reserve(owner, msg.size)
        room = self.host.make_room(ns, msg.size, self.sink)  # the extent now, unless victims must go first
        return then(room, lambda extent: self._grant_write(owner, ns, msg, extent))

    def _grant_write(self, owner: Owner, ns: Namespace, msg: Reserve, extent: Extent) -> ReserveReply:
        lease = self.leases.grant(owner, None, extent, "write", self.limits_config.lease_ttl_s, self.clock())
        self._pending[lease.lease_id] = PendingPut(
            msg.namespace, msg.object_id, msg.size, msg.descriptor, msg.hints, extent, msg.tier
        )
        self.quotas.reserved(owner, msg.size)
        return ReserveReply(lease=lease.lease_id, offset=extent.offset)

    def reserve_run(self, owner: Owner, msg: ReserveMany, ids: list, sizes: list, start: int,
                    leases: list, offsets: list, exists: bytearray) -> int:
        """Serve a reserve_many's items from `start` while each is the plain case, exactly as
        reserve() would: a new id with room in the arena now, or a live copy of the same state
        (exists). The checks that hold for the whole batch run once; columns are filled in
        place. Returns the first item it left for reserve() (a refusal, an id held on NVMe or
        expired, a quota reached, victims to make room), or len(ids)."""
        ns = self.namespaces.get(msg.namespace)
        desc = msg.descriptor
        if ns is None or desc.namespace != msg.namespace or (msg.tier == "remote" and not self.cluster.takes_remote_puts):
            return start
        expected, objects, now = desc.object_bytes, ns.objects, self.clock()
        leases_left, bytes_left = self.quotas.room(owner)
        capacity, ttl_s, holds = ns.arena.capacity_bytes, self.limits_config.lease_ttl_s, self.mover.holds
        i, n, reserved = start, len(ids), 0
        while i < n:
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
            lease = self.leases.grant(owner, None, extent, "write", ttl_s, now)
            self._pending[lease.lease_id] = PendingPut(ns.name, oid, size, desc, msg.hints_of(i), extent, msg.tier)
            leases[i], offsets[i] = lease.lease_id, extent.offset
            leases_left, bytes_left, reserved = leases_left - 1, bytes_left - size, reserved + size
            i += 1
        if reserved:
            self.quotas.reserved(owner, reserved)
        return i

    def commit_run(self, owner: Owner, items: list, start: int, codes: bytearray) -> tuple[int, MaybeAwaitable | None]:
        """Commit a commit_many's (lease, checksum) items from `start` while each is the plain
        case, exactly as commit() would: the caller's write lease, bytes that match, an id
        not held here meanwhile, stored in host memory (codes[i] = STORED). Returns (k, None):
        item k is left for commit() (or k is len(items)); or (k, reply): item k is committed
        and its reply is something else (an NVMe write-through to await, say), or the
        exception its commit raised."""
        i, n = start, len(items)
        get_lease, pending, holds = self.leases.get, self._pending, self.mover.holds
        while i < n:
            lease_id, checksum = items[i]
            lease = get_lease(lease_id)
            if lease is None or lease.owner != owner or lease.mode != "write":
                break
            put = pending.get(lease_id)
            if put is None:
                break
            ns = self.namespaces[put.namespace]
            if put.tier != "host" or put.object_id in ns.objects or holds(ns.name, put.object_id):
                break
            if self.verify_puts and self.checksum_of(ns, put) != checksum:
                break
            try:
                self.take_put(owner, lease_id)
                entry = self.host.publish(ns, put.object_id, put.extent, put.size, checksum, put.descriptor,
                                          put.hints, pin_hint=True)
                self.cluster.on_commit(entry)
                reply = self.mover.on_commit(entry)
            except Exception as exc:  # this item's failure, as commit() would raise it
                return i, exc
            if reply is not IN_MEMORY:
                return i, reply
            codes[i] = STORED
            i += 1
        return i, None

    def commit(self, owner: Owner, lease_id: int, checksum: bytes) -> MaybeAwaitable[CommitReply]:
        self.own_lease(owner, lease_id, "write")
        put = self.take_put(owner, lease_id)
        ns = self.namespaces[put.namespace]
        if not self.bytes_match(ns, put, checksum):
            ns.arena.free(put.extent)
            raise ChecksumError(
                f"object {put.object_id.hex}: bytes in the arena do not match the checksum sent "
                "with commit (written after commit, or a short write); nothing was stored"
            )
        return self.publish_put(ns, put, checksum)

    def pending_put(self, lease_id: int) -> PendingPut:
        """The put a write lease reserved (check the lease with own_lease first)."""
        return self._pending[lease_id]

    def checksum_of(self, ns: Namespace, put: PendingPut) -> bytes:
        """The xxh3-128 of a put's bytes as they are in the arena now."""
        return xxhash.xxh3_128_digest(ns.arena.view(put.extent)[:put.size])

    def take_put(self, owner: Owner, lease_id: int) -> PendingPut:
        """End a write lease whose bytes are written: its put, extent still allocated."""
        put = self._pending.pop(lease_id)
        self.quotas.settled(owner, put.size)
        self.leases.release(lease_id)
        return put

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
            old = self.mover.remote_meta(ns.name, oid) if self.mover.holds(ns.name, oid) else None
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
            return self.cluster.put_remote(entry)
        self.cluster.on_commit(entry)
        return self.mover.on_commit(entry)

    def abort(self, owner: Owner, lease_id: int) -> None:
        self.own_lease(owner, lease_id, "write")
        self._end_lease(self.leases.release(lease_id))

    # --- get --------------------------------------------------------------------

    def get(self, owner: Owner, namespace: str, oid: ObjectId, accept=None, ranges=None,
            expect=None, gpu: bool = False) -> MaybeAwaitable[GetReply]:
        """A read lease, or a miss. expect: the descriptor the reader can use (any other is a
        miss). A local miss goes down the chain: NVMe (promoted), then the homes (fetched;
        only the ranges asked for, when `ranges`). gpu: the reader mapped the GPU buffer; a
        hit is leased on its device copy where the GPU tier can hold one."""
        ns = self.namespaces.get(namespace)
        if ns is None:
            return MISS
        ns.counters.num_gets += 1
        entry = self.host.live_entry(ns, oid)
        if entry is None:
            if self.mover.holds(namespace, oid):
                self._check_ranges(ns, ranges, self.mover.size_of(namespace, oid))  # before promoting it
                return self._get_after(self.mover.promote(namespace, oid), owner, ns, oid, accept, ranges, expect, gpu)
            if ranges is not None:  # a sparse reader: only those bytes cross the network
                return self.cluster.get_ranges(owner, namespace, oid, accept, ranges, expect)
            return self._get_after(self.cluster.fetch(namespace, oid), owner, ns, oid, accept, None, expect, gpu)
        refused = read_refusal(entry.descriptor, accept, expect)
        if refused is not None:
            ns.counters.num_misses += 1
            return GetReply(False, refused)
        self._check_ranges(ns, ranges, entry.size)  # leased whole, but the same error wherever it is
        self.quotas.check_lease(owner)
        if gpu and ranges is None:
            copy = self.gpu.lease_copy(ns, entry)
            if not is_ready(copy):  # being copied to the device now
                return self._get_after(copy, owner, ns, oid, accept, None, expect, gpu=False, copied=True)
            if copy is not None:
                return self._lease(owner, ns, entry, copy)
        return self._lease(owner, ns, entry)

    def fetch_many(self, namespace: str, oids: list) -> MaybeAwaitable[None]:
        """Before a get_many is served: its local misses (in neither host nor NVMe) fetched
        together where the remote tier reads many in one call (a Mooncake pool); the batch's
        gets then find them in host memory. None when there is nothing to do."""
        ns = self.namespaces.get(namespace)
        if ns is None or not self.cluster.fetches_many:
            return None
        holds, live = self.mover.holds, self.host.live_entry
        missing = [oid for oid in oids if live(ns, oid) is None and not holds(namespace, oid)]
        return self.cluster.fetch_many(namespace, missing) if len(missing) > 1 else None

    def _lease(self, owner: Owner, ns: Namespace, entry: ObjectEntry, on_gpu: Extent | None = None) -> GetReply:
        """A read lease on the host entry, or on its device copy (`on_gpu`, acquired for it)."""
        oid = entry.object_id
        extent = entry.extent if on_gpu is None else on_gpu
        lease = self.leases.grant(owner, oid, extent, "read", self.limits_config.lease_ttl_s, self.clock())
        entry.num_hits += 1
        ns.policy.on_access(oid)
        ns.counters.num_hits += 1
        ns.counters.bytes_out += entry.size
        self.mover.on_hit(entry)
        if on_gpu is not None:
            self._on_gpu[lease.lease_id] = (ns.name, oid.digest)
            return entry.get_reply(lease.lease_id, tier="gpu", offset=on_gpu.offset)
        self._reading[lease.lease_id] = entry
        entry.readers += 1
        return entry.get_reply(lease.lease_id)

    def _get_after(self, bring: MaybeAwaitable, owner: Owner, ns: Namespace, oid: ObjectId, accept, ranges, expect,
                   gpu: bool, copied: bool = False) -> MaybeAwaitable[GetReply]:
        """Once `bring` put the object in the host tier (or found it nowhere), serve it from
        there. copied: `bring` made a device copy instead (its extent, acquired, or None)."""
        if is_ready(bring):
            return self._served(bring, owner, ns, oid, accept, ranges, expect, gpu, copied)
        return self._served_later(bring, owner, ns, oid, accept, ranges, expect, gpu, copied)

    async def _served_later(self, bring, owner: Owner, ns: Namespace, oid: ObjectId, accept, ranges, expect, gpu: bool,
                            copied: bool) -> GetReply:
        return await resolve(self._served(await bring, owner, ns, oid, accept, ranges, expect, gpu, copied))

    def _served(self, brought, owner: Owner, ns: Namespace, oid: ObjectId, accept, ranges, expect, gpu: bool,
                copied: bool) -> MaybeAwaitable[GetReply]:
        if copied and brought is not None:
            entry = ns.objects.get(oid)
            if entry is not None:
                return self._lease(owner, ns, entry, brought)
            self.gpu.release(ns.name, oid.digest)  # gone meanwhile: forgotten with its last reader
            brought = None
        if brought is None and not copied:
            ns.counters.num_misses += 1  # num_gets was counted when the request came in
            return MISS
        ns.counters.num_gets -= 1  # the get below counts this same request again
        return self.get(owner, ns.name, oid, accept, ranges, expect, gpu)  # resident now (or a miss)

    @staticmethod
    def _check_ranges(ns: Namespace, ranges, size: int) -> None:
        """A get's byte ranges against the object's size: RangeError (a counted miss)."""
        if ranges is not None:
            try:
                check_within(ranges, size)
            except RangeError:
                ns.counters.num_misses += 1
                raise

    def grant_ranged(self, owner: Owner, ns: Namespace, oid: ObjectId, extent: Extent) -> int:
        """A read lease on an extent holding some ranges of `oid` (transient, never indexed);
        it is freed when the lease ends."""
        self.quotas.check_lease(owner)
        lease = self.leases.grant(owner, oid, extent, "read", self.limits_config.lease_ttl_s, self.clock())
        self._ranged[lease.lease_id] = (ns, extent)
        return lease.lease_id

    def release(self, owner: Owner, lease_id: int) -> None:
        self.own_lease(owner, lease_id, "read")
        self._end_lease(self.leases.release(lease_id))

    def own_lease(self, owner: Owner, lease_id: int, mode: str) -> Lease:
        try:
            lease = self.leases.get(lease_id)
        except NotFound:
            lease = None
        if lease is None or lease.owner != owner or lease.mode != mode:
            raise NotFound(f"no {mode} lease {lease_id} held by this client (expired or already released)")
        return lease

    def _end_lease(self, lease: Lease) -> None:
        """Undo what a lease holds: a write lease frees its extent, a read lease drops a reader."""
        if lease.mode == "write":
            put = self._pending.pop(lease.lease_id)
            self.quotas.settled(lease.owner, put.size)
            self.namespaces[put.namespace].arena.free(put.extent)
            return
        on_gpu = self._on_gpu.pop(lease.lease_id, None)
        if on_gpu is not None:
            self.gpu.release(*on_gpu)
            return
        ranged = self._ranged.pop(lease.lease_id, None)
        if ranged is not None:
            self.host.track_transient(ranged[0], ranged[1], add=False)
            ranged[0].arena.free(ranged[1])
            return
        self.host.drop_reader(self._reading.pop(lease.lease_id))

    # --- housekeeping -----------------------------------------------------------

    def drop_owner(self, owner: Owner) -> int:
        """A client went away: end every lease it held. Returns how many."""
        leases = self.leases.release_owner(owner)
        for lease in leases:
            self._end_lease(lease)
        return len(leases)

    def expire(self) -> None:
        """Take back expired leases and drop objects past their ttl."""
        for lease in self.leases.expired(self.clock()):
            log.warning("event=lease_expired lease=%d owner=%s mode=%s", lease.lease_id, lease.owner, lease.mode)
            self._end_lease(lease)
        self.host.expire_objects()
        self.mover.expire_due()
        if self.mover.compact():
            give_back_heap()

    def num_indexed(self) -> int:
        """Objects indexed here: host entries plus NVMe objects (one on both counts twice)."""
        return sum(len(ns.objects) for ns in self.namespaces.values()) + ((self.mover.stats() or {}).get("objects") or 0)

    def check_integrity(self) -> None:
        """Raise RuntimeError if the index, leases, policy and arenas disagree."""
        self.leases.check_integrity()
        reserved: dict = {}
        for lease_id, put in self._pending.items():
            lease = self.leases.get(lease_id)
            owner = None if lease is None else lease.owner  # None: a reservation without its lease
            reserved[owner] = reserved.get(owner, 0) + put.size
        self.quotas.check_integrity(reserved)
        self.host.check_integrity([(p.namespace, p.extent) for p in self._pending.values()])
        if set(self._reading) & set(self._ranged):
            raise RuntimeError("a read lease is both a whole-object lease and a ranged one")
        for lease_id, (ns, extent) in self._ranged.items():
            lease = self.leases.get(lease_id)
            if lease is None or lease.mode != "read" or not self.host.holds_transient(ns, extent):
                raise RuntimeError(f"ranged lease {lease_id}: no read lease, or its extent is not accounted for")
        if sum(1 for lease in self.leases if lease.mode == "read") != len(self._reading) + len(self._ranged) + len(self._on_gpu):
            raise RuntimeError("read leases and the leases the tier manager tracks disagree")
        readers = self.host.readers()
        if readers != len(self._reading) + self.host.num_holds:
            raise RuntimeError(f"{readers} readers counted on entries, {len(self._reading)} read leases "
                               f"and {self.host.num_holds} daemon holds")
        self.mover.check_integrity()
        self.gpu.check_integrity()

    def stats(self) -> dict:
        """Per namespace and per tier (a tier that is off is left out)."""
        namespaces, host = self.host.stats()
        tiers = {"host": host}
        for name, tier in (("nvme", self.mover), ("remote", self.cluster)):
            doc = tier.stats()
            if doc is not None:
                tiers[name] = doc
        return {"leases": len(self.leases), "namespaces": namespaces, "tiers": tiers}

    def close(self) -> None:
        self.host.close()
