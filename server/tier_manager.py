"""The tier manager: owns every namespace's arena, index, policy and leases.

Runs on the daemon's event loop thread only; nothing here blocks on I/O. Puts are
two-phase (reserve -> write in shared memory -> commit), gets hand out read leases,
and an extent is never freed or reused while a lease covers it.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

import xxhash

from kvstore.config import HostTierConfig, LimitsConfig
from kvstore.errors import CapacityError, ChecksumError, InvalidArgument, LimitExceeded, NotFound
from kvstore.identity import ObjectId, descriptor_differences
from kvstore.messages import Reserve
from kvstore.replies import IN_MEMORY, MISS, CommitReply, GetReply, ReserveReply
from kvstore.policy import make_policy
from kvstore.policy.base import sparse
from server.host_memory import check_new_arena, host_memory
from server.index_ops import IndexOps
from server.later import MaybeAwaitable, resolve
from server.objects import ObjectEntry, PendingPut, check_same_object
from server.tier_report import TierReport
from tiers.arena import HostArena
from tiers.leases import LeaseTable

log = logging.getLogger("kvstore.tiers")



@dataclass(slots=True)
class TierCounters:
    num_puts: int = 0
    num_dedup_puts: int = 0
    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0
    num_expired: int = 0
    num_deletes: int = 0
    num_checksum_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


def give_back_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim); a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


@dataclass(slots=True)
class Namespace:
    name: str
    arena: HostArena
    policy: object
    objects: dict = field(default_factory=dict)  # ObjectId -> ObjectEntry
    counters: TierCounters = field(default_factory=TierCounters)
    peak_objects: int = 0  # the most objects indexed since the index was last compacted

    def compact(self) -> bool:
        """Rebuild the index's and the policy's tables once removals left them sparse (Python
        dicts never shrink). True if anything was rebuilt."""
        rebuilt = sparse(len(self.objects), self.peak_objects)
        if rebuilt:
            self.objects = dict(self.objects)  # nobody keeps a reference across an await
            self.peak_objects = len(self.objects)
        return self.policy.compact() or rebuilt


class TierManager(IndexOps, TierReport):
    def __init__(self, host: HostTierConfig, limits: LimitsConfig = LimitsConfig(), *,
                 verify_puts: bool = False, clock=time.monotonic):
        """The `[host]` and `[limits]` tables and ServerConfig.verify_puts; the NVMe write
        policy is the mover's own config (`mover.config`)."""
        self.host_config = host
        self.limits_config = limits
        self.verify_puts = verify_puts
        self.clock = clock
        self.namespaces: dict[str, Namespace] = {}
        self.leases = LeaseTable()
        self._pending: dict[int, PendingPut] = {}  # write lease id -> reserved put
        self._inflight_bytes: dict = {}  # owner -> bytes of its reserved, uncommitted puts
        self._reading: dict[int, ObjectEntry] = {}  # read lease id -> entry it covers
        self._zombies: dict[int, ObjectEntry] = {}  # id(entry) -> deleted entry still leased
        self._creating: dict[str, asyncio.Future] = {}  # namespaces whose arena is being made
        self._transient: dict[int, object] = {}  # id(extent) -> extent being filled by a promotion
        self._ranged: dict[int, tuple] = {}  # read lease id -> (namespace, transient extent of fetched ranges)
        self.mover = None  # server.movement.TierMover when the NVMe tier is enabled
        self.cluster = None  # server.cluster.ClusterLink when cluster.enabled
        self._num_holds = 0  # readers the daemon itself holds (copies to NVMe in flight)
        self.host_bandwidth_bytes_s = 8e9  # replaced by a measurement at start
        self.stopping = threading.Event()  # set by the daemon's stop: an arena's prefault gives up

    # --- namespaces -------------------------------------------------------------

    def namespace(self, name: str) -> Namespace:
        """An open namespace; NotFound if nobody opened it yet (ops never create one)."""
        ns = self.namespaces.get(name)
        if ns is None:
            raise NotFound(f"namespace {name!r} is not open on this daemon")
        return ns

    async def open_namespace(self, name: str) -> Namespace:
        """The namespace, creating its arena on first use.

        Creating an arena faults in its memory (seconds for a few GiB), so it runs in a
        worker thread; concurrent opens of the same new namespace share one creation.
        """
        ns = self.namespaces.get(name)
        if ns is not None:
            return ns
        creating = self._creating.get(name)
        if creating is None:
            host = self.host_config
            if len(self.namespaces) + len(self._creating) >= host.max_namespaces:
                raise CapacityError(f"namespace limit reached ({host.max_namespaces}); raise host.max_namespaces")
            check_new_arena(host, host_memory(), name)  # a CapacityError here, not an OOM kill elsewhere
            creating = asyncio.ensure_future(self._create_namespace(name))
            self._creating[name] = creating
        # Every opener gets the namespace from the creating task itself: a dict lookup after the
        # await could run before the creator resumed (KeyError). Shielded: one opener cancelled
        # (a peer's deadline) does not cancel the creation the others wait for.
        return await asyncio.shield(creating)

    async def _create_namespace(self, name: str) -> Namespace:
        host = self.host_config
        try:
            arena = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(HostArena, name, host.arena_bytes, host.prefault, cancel=self.stopping))
        finally:
            del self._creating[name]
        ns = Namespace(name, arena, make_policy(host.policy, host.arena_bytes))
        self.namespaces[name] = ns
        log.info("event=namespace_open namespace=%s arena_bytes=%d", name, host.arena_bytes)
        return ns

    # --- put --------------------------------------------------------------------

    def reserve(self, owner, msg: Reserve) -> MaybeAwaitable[ReserveReply]:
        ns = self.namespace(msg.namespace)
        expected = msg.descriptor.object_bytes
        if expected and msg.size != expected:
            raise InvalidArgument(
                f"object of {msg.size} bytes does not match its layout {msg.descriptor.layout} "
                f"in {msg.descriptor.dtype.value} ({expected} bytes per {msg.descriptor.chunk_tokens}-token chunk)"
            )
        if msg.descriptor.namespace != msg.namespace:
            raise InvalidArgument("descriptor.namespace differs from the request's namespace")
        if msg.tier == "remote" and (self.cluster is None or self.cluster.remote is None):
            raise InvalidArgument('put with tier="remote" needs a clustered daemon (cluster.enabled)')
        now = self.clock()
        existing = ns.objects.get(msg.object_id)
        if existing is not None and existing.is_live(now):
            # Content-addressed and immutable: the same id is the same state. Skip the copy.
            check_same_object(msg.object_id, existing.size, existing.descriptor, msg.size, msg.descriptor)
            ns.counters.num_dedup_puts += 1
            return ReserveReply(exists=True)
        if existing is None and self.mover is not None and self.mover.holds(msg.namespace, msg.object_id):
            held = self.mover.remote_meta(msg.namespace, msg.object_id)
            if held is not None:
                check_same_object(msg.object_id, held.size, held.descriptor, msg.size, msg.descriptor)
        self._check_lease_quota(owner)
        self._check_inflight(owner, msg.size)
        if (self.mover is not None or self.cluster is not None) and not ns.arena.can_alloc(msg.size):
            return self._reserve_after_demotion(owner, ns, msg)
        return self._grant_write(owner, ns, msg, self._alloc(ns, msg.size))

    async def _reserve_after_demotion(self, owner, ns: Namespace, msg: Reserve) -> ReserveReply:
        return self._grant_write(owner, ns, msg, await self.allocate(ns, msg.size))

    def _grant_write(self, owner, ns: Namespace, msg: Reserve, extent) -> ReserveReply:
        lease = self.leases.grant(owner, None, extent, "write", self.limits_config.lease_ttl_s, self.clock())
        self._pending[lease.lease_id] = PendingPut(
            msg.namespace, msg.object_id, msg.size, msg.descriptor, msg.hints, extent, msg.tier
        )
        self._inflight_bytes[owner] = self._inflight_bytes.get(owner, 0) + msg.size
        return ReserveReply(lease=lease.lease_id, offset=extent.offset)

    def _check_size(self, ns: Namespace, size: int) -> None:
        if size > ns.arena.capacity_bytes:
            raise CapacityError(
                f"object of {size} bytes is larger than namespace {ns.name}'s arena "
                f"({ns.arena.capacity_bytes} bytes); raise host.arena_bytes"
            )

    def no_room(self, ns: Namespace, size: int) -> CapacityError:
        return CapacityError(
            f"namespace {ns.name}: no room for {size} bytes; "
            f"{ns.arena.allocator.used_bytes} of {ns.arena.capacity_bytes} bytes are pinned, leased or "
            f"being written (largest hole {ns.arena.allocator.largest_free_bytes} bytes). "
            "Release leases, unpin, or raise host.arena_bytes"
        )

    def _victims(self, ns: Namespace, size: int) -> list[ObjectEntry]:
        """The policy's next victims towards `size` free bytes (it stops tracking them: each
        must end evicted, or tracked again by `retrack_victims`); CapacityError when none."""
        now = self.clock()
        victims = ns.policy.victims(size, lambda oid: self.evictable(ns, oid, now))
        if not victims:
            raise self.no_room(ns, size)
        return [ns.objects[oid] for oid in victims]

    def _alloc(self, ns: Namespace, size: int):
        """An extent now, victims dropped: no tier below the host arena keeps them."""
        self._check_size(ns, size)
        while not ns.arena.can_alloc(size):
            for entry in self._victims(ns, size):
                self.evict_entry(ns, entry)
        return ns.arena.alloc(size)

    def evictable(self, ns: Namespace, oid: ObjectId, now: float) -> bool:
        entry = ns.objects.get(oid)
        return entry is not None and entry.readers == 0 and not entry.is_pinned(now)

    _evictable = evictable

    # --- used by the mover ------------------------------------------------------------

    def evict_entry(self, ns: Namespace, entry: ObjectEntry) -> None:
        """Drop a victim that victims() already stopped tracking."""
        self._remove(ns, entry, reason="evict")
        ns.counters.num_evictions += 1

    def drop(self, ns: Namespace, entry: ObjectEntry) -> None:
        """Drop a tracked entry (corrupt, or otherwise unusable)."""
        self._remove(ns, entry, reason="drop")

    def insert(self, ns: Namespace, entry: ObjectEntry) -> None:
        ns.objects[entry.object_id] = entry
        if len(ns.objects) > ns.peak_objects:
            ns.peak_objects = len(ns.objects)
        ns.policy.on_insert(entry.object_id, entry.size, entry.hints.recompute_cost_ms, entry.hints.priority)

    def hold(self, entry: ObjectEntry) -> None:
        """Keep an entry's extent allocated while the daemon itself reads it."""
        entry.readers += 1
        self._num_holds += 1

    def release_hold(self, entry: ObjectEntry) -> None:
        self._num_holds -= 1
        self._drop_reader(entry)

    def _drop_reader(self, entry: ObjectEntry) -> None:
        entry.readers -= 1
        if entry.deleted and entry.readers == 0:
            self._zombies.pop(id(entry))
            self.namespaces[entry.namespace].arena.free(entry.extent)

    async def allocate(self, ns: Namespace, size: int):
        """An extent of `size` bytes in the host arena, room made for it: victims are written
        down to NVMe, sent to their homes, or dropped, as the tiers below decide (`_sink`)."""
        sink = self._sink()
        if sink is None:
            return self._alloc(ns, size)
        self._check_size(ns, size)
        while True:
            while not ns.arena.can_alloc(size):  # the one victim loop; the sink settles each batch
                await sink(ns, self._victims(ns, size))
            extent = ns.arena.alloc(size)
            if extent is not None:
                return extent

    def _sink(self):
        """Where host victims go: the NVMe tier (which sends what it refuses home), else the
        homes (a cluster without NVMe), else nowhere (None: they are dropped, no await)."""
        if self.mover is not None:
            return self.mover.take_victims
        if self.cluster is not None:
            return self._send_home_then_evict
        return None

    async def _send_home_then_evict(self, ns: Namespace, entries: list[ObjectEntry]) -> None:
        """Host victims in a cluster without NVMe: those their homes may lack go there first."""
        try:
            await self.cluster.demote(entries)
        except BaseException:  # cancelled (a peer's deadline): the victims stay, tracked
            self.retrack_victims(ns, entries)
            raise
        self.settle_victims(ns, entries)

    def settle_victims(self, ns: Namespace, entries) -> list[ObjectEntry]:
        """Victims whose copy elsewhere was awaited: evict those still idle; a victim read or
        pinned meanwhile stays resident (tracked by the policy again). Returns the evicted."""
        evicted = []
        now = self.clock()
        for entry in entries:
            if ns.objects.get(entry.object_id) is not entry:
                continue  # deleted or dropped meanwhile
            if entry.readers or entry.is_pinned(now):
                self.retrack_victims(ns, [entry])
            else:
                self.evict_entry(ns, entry)
                evicted.append(entry)
        return evicted

    def retrack_victims(self, ns: Namespace, entries) -> None:
        """Victims that stay after all: the policy (which dropped them) tracks them again."""
        for entry in entries:
            if ns.objects.get(entry.object_id) is entry:
                ns.policy.on_insert(entry.object_id, entry.size, entry.hints.recompute_cost_ms, entry.hints.priority)

    def publish(self, ns: Namespace, oid: ObjectId, extent, size: int, checksum: bytes, descriptor, hints,
                pin_hint: bool = False) -> ObjectEntry:
        """Make verified bytes already in `extent` a committed object (a peer's put or fetch).
        pin_hint: honour hints.pin (a home's copy, as at a local commit; not a fetched copy)."""
        now = self.clock()
        existing = ns.objects.get(oid)
        if existing is not None:
            if existing.is_live(now):  # the same state landed meanwhile (a put, another fetch)
                ns.arena.free(extent)
                return existing
            self._expire(ns, existing)  # past its TTL: the new copy replaces it
        entry = ObjectEntry.create(oid, ns.name, extent, size, checksum, descriptor, hints, now,
                                   pin=pin_hint and hints.pin)
        self.insert(ns, entry)
        ns.counters.num_puts += 1
        ns.counters.bytes_in += size
        return entry

    def track_transient(self, ns: Namespace, extent, add: bool) -> None:
        if add:
            self._transient[id(extent)] = (ns.name, extent)
        else:
            del self._transient[id(extent)]

    def commit(self, owner, lease_id: int, checksum: bytes) -> MaybeAwaitable[CommitReply]:
        self._own_lease(owner, lease_id, "write")
        put = self._pending.pop(lease_id)
        self._settle_inflight(owner, put.size)
        self.leases.release(lease_id)
        ns = self.namespaces[put.namespace]
        if self.verify_puts:
            actual = xxhash.xxh3_128_digest(ns.arena.view(put.extent)[:put.size])
            if actual != checksum:
                ns.arena.free(put.extent)
                ns.counters.num_checksum_failures += 1
                log.warning("event=put_checksum_mismatch namespace=%s object=%s", put.namespace, put.object_id.hex)
                raise ChecksumError(
                    f"object {put.object_id.hex}: bytes in the arena do not match the checksum sent "
                    "with commit (written after commit, or a short write); nothing was stored"
                )
        now = self.clock()
        old = ns.objects.get(put.object_id)
        if old is not None:
            if old.is_live(now):  # a concurrent put of the same id won the race
                ns.arena.free(put.extent)
                check_same_object(put.object_id, old.size, old.descriptor, put.size, put.descriptor)
                ns.counters.num_dedup_puts += 1
                return CommitReply(exists=True)
            self._expire(ns, old)
        entry = ObjectEntry.create(put.object_id, put.namespace, put.extent, put.size, checksum, put.descriptor,
                                   put.hints, now, pin=put.hints.pin)
        self.insert(ns, entry)
        ns.counters.num_puts += 1
        ns.counters.bytes_in += put.size
        if put.tier == "remote":
            return self.cluster.put_remote(entry)
        if self.cluster is not None:
            self.cluster.on_commit(entry)
        if self.mover is not None and self.mover.config.write_policy == "write_through":
            return self._write_through(entry)
        return IN_MEMORY

    async def _write_through(self, entry: ObjectEntry) -> CommitReply:
        durability = await self.mover.write(entry)
        return IN_MEMORY if durability is None else CommitReply(False, "host", durability)

    def abort(self, owner, lease_id: int) -> None:
        self._own_lease(owner, lease_id, "write")
        self._end_lease(self.leases.release(lease_id))

    # --- get --------------------------------------------------------------------

    def get(self, owner, namespace: str, oid: ObjectId, accept=None, ranges=None,
            expect=None) -> MaybeAwaitable[GetReply]:
        """A read lease, or a miss. expect: the descriptor the reader can use (any other is a miss)."""
        ns = self.namespaces.get(namespace)
        if ns is None:
            return MISS
        ns.counters.num_gets += 1
        now = self.clock()
        entry = ns.objects.get(oid)
        if entry is not None and not entry.is_live(now):
            self._expire(ns, entry)
            entry = None
        if entry is None:
            if self.mover is not None and self.mover.holds(namespace, oid):
                self._check_ranges(ns, ranges, self.mover.size_of(namespace, oid))  # before promoting it
                return self._get_after_promotion(owner, namespace, oid, accept, ranges, expect)
            if self.cluster is not None:
                if ranges is not None:  # a sparse reader: only those bytes cross the network
                    self._check_lease_quota(owner)
                    return self.cluster.get_ranges(owner, namespace, oid, accept, ranges, expect)
                return self._get_from_peers(owner, namespace, oid, accept, expect)
            ns.counters.num_misses += 1
            return MISS
        if accept is not None and entry.descriptor.dtype not in accept:
            ns.counters.num_misses += 1
            return GetReply(False, f"stored as {entry.descriptor.dtype.value}, not in accept list")
        if expect is not None and entry.descriptor != expect:
            ns.counters.num_misses += 1
            return GetReply(False, f"stored as {descriptor_differences(entry.descriptor, expect)}")
        self._check_ranges(ns, ranges, entry.size)  # leased whole, but the same error wherever it is
        self._check_lease_quota(owner)
        lease = self.leases.grant(owner, oid, entry.extent, "read", self.limits_config.lease_ttl_s, now)
        self._reading[lease.lease_id] = entry
        entry.readers += 1
        entry.num_hits += 1
        ns.policy.on_access(oid)
        ns.counters.num_hits += 1
        ns.counters.bytes_out += entry.size
        if self.mover is not None:
            self.mover.record_access(namespace, oid)
            if (not entry.on_nvme and self.mover.config.write_policy == "selective"
                    and entry.num_hits == self.mover.config.write_after_hits):
                self.mover.write_in_background(entry)
        return entry.get_reply(lease.lease_id)

    async def _get_from_peers(self, owner, namespace: str, oid: ObjectId, accept, expect=None) -> GetReply:
        return await self._get_after(self.cluster.fetch(namespace, oid), owner, namespace, oid, accept, None, expect)

    async def _get_after_promotion(self, owner, namespace: str, oid: ObjectId, accept, ranges=None,
                                   expect=None) -> GetReply:
        return await self._get_after(self.mover.promote(namespace, oid), owner, namespace, oid, accept, ranges,
                                     expect)

    async def _get_after(self, bring, owner, namespace: str, oid: ObjectId, accept, ranges=None,
                         expect=None) -> GetReply:
        """Await what brings the object into the host tier, then serve it from there."""
        entry = await bring
        ns = self.namespaces[namespace]
        if entry is None:
            ns.counters.num_misses += 1  # num_gets was counted when the request came in
            return MISS
        ns.counters.num_gets -= 1  # the get below counts this same request again
        return await resolve(self.get(owner, namespace, oid, accept, ranges, expect))  # resident now

    def grant_ranged(self, owner, ns: Namespace, oid: ObjectId, extent) -> int:
        """A read lease on an extent holding some ranges of `oid` (transient, never indexed);
        it is freed when the lease ends."""
        self._check_lease_quota(owner)
        lease = self.leases.grant(owner, oid, extent, "read", self.limits_config.lease_ttl_s, self.clock())
        self._ranged[lease.lease_id] = (ns, extent)
        return lease.lease_id

    def release(self, owner, lease_id: int) -> None:
        self._own_lease(owner, lease_id, "read")
        self._end_lease(self.leases.release(lease_id))

    def _own_lease(self, owner, lease_id: int, mode: str):
        try:
            lease = self.leases.get(lease_id)
        except NotFound:
            lease = None
        if lease is None or lease.owner != owner or lease.mode != mode:
            raise NotFound(f"no {mode} lease {lease_id} held by this client (expired or already released)")
        return lease

    def _end_lease(self, lease) -> None:
        """Undo what a lease holds: a write lease frees its extent, a read lease drops a reader."""
        if lease.mode == "write":
            put = self._pending.pop(lease.lease_id)
            self._settle_inflight(lease.owner, put.size)
            self.namespaces[put.namespace].arena.free(put.extent)
            return
        ranged = self._ranged.pop(lease.lease_id, None)
        if ranged is not None:
            self.track_transient(ranged[0], ranged[1], add=False)
            ranged[0].arena.free(ranged[1])
            return
        self._drop_reader(self._reading.pop(lease.lease_id))

    def _check_inflight(self, owner, size: int) -> None:
        limit = self.limits_config.max_inflight_bytes_per_client
        held = self._inflight_bytes.get(owner, 0)
        if held + size > limit:
            raise LimitExceeded(
                f"reserving {size} bytes would bring this client's uncommitted puts to {held + size} bytes, over "
                f"limits.max_inflight_bytes_per_client ({limit}); commit or abort some first"
            )

    def _settle_inflight(self, owner, size: int) -> None:
        left = self._inflight_bytes.pop(owner) - size
        if left:
            self._inflight_bytes[owner] = left

    def _check_lease_quota(self, owner) -> None:
        limit = self.limits_config.max_leases_per_client
        if self.leases.count(owner) >= limit:
            raise LimitExceeded(
                f"this client holds {limit} leases (limits.max_leases_per_client); release some first"
            )

    def _remove(self, ns: Namespace, entry: ObjectEntry, reason: str) -> None:
        """Drop an entry from the index; its extent is freed now or when its last reader leaves."""
        del ns.objects[entry.object_id]
        if reason != "evict":  # victims() already stopped tracking evicted keys
            ns.policy.on_remove(entry.object_id)
        if entry.readers:
            entry.deleted = True
            self._zombies[id(entry)] = entry
        else:
            ns.arena.free(entry.extent)
        if self.cluster is not None and not (self.mover is not None and self.mover.holds(ns.name, entry.object_id)):
            self.cluster.forget(ns.name, entry.object_id)

    def _expire(self, ns: Namespace, entry: ObjectEntry) -> None:
        """An entry found past its TTL (by a read, a put of its id, or housekeeping) goes, counted."""
        self._remove(ns, entry, reason="expire")
        ns.counters.num_expired += 1

    # --- housekeeping -----------------------------------------------------------

    def drop_owner(self, owner) -> int:
        """A client went away: end every lease it held. Returns how many."""
        leases = self.leases.release_owner(owner)
        for lease in leases:
            self._end_lease(lease)
        return len(leases)

    def expire(self) -> None:
        """Take back expired leases and drop objects past their ttl."""
        now = self.clock()
        for lease in self.leases.expired(now):
            log.warning("event=lease_expired lease=%d owner=%s mode=%s", lease.lease_id, lease.owner, lease.mode)
            self._end_lease(lease)
        compacted = False
        for ns in self.namespaces.values():
            for entry in [e for e in ns.objects.values() if not e.is_live(now)]:
                self._expire(ns, entry)
            compacted = ns.compact() or compacted
        if compacted:
            give_back_heap()

    def close(self) -> None:
        for ns in self.namespaces.values():
            ns.arena.close()
        self.namespaces.clear()
