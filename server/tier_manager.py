"""The tier manager: owns every namespace's arena, index, policy and leases.

Runs on the daemon's event loop thread only; nothing here blocks on I/O. Puts are
two-phase (reserve -> write in shared memory -> commit), gets hand out read leases,
and an extent is never freed or reused while a lease covers it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import xxhash

from kvstore.config import ServerConfig
from kvstore.errors import CapacityError, ChecksumError, InvalidArgument, LimitExceeded, NotFound
from kvstore.identity import ObjectId
from kvstore.messages import Reserve
from kvstore.policy import make_policy
from server.objects import ObjectEntry, PendingPut
from tiers.arena import HostArena
from tiers.leases import LeaseTable

log = logging.getLogger("kvstore.tiers")

# Fixed cost of loading one object on top of its bytes (one request and its lease).
PER_OBJECT_LOAD_S = 20e-6


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


@dataclass(slots=True)
class Namespace:
    name: str
    arena: HostArena
    policy: object
    objects: dict = field(default_factory=dict)  # ObjectId -> ObjectEntry
    counters: TierCounters = field(default_factory=TierCounters)


class TierManager:
    def __init__(self, config: ServerConfig, clock=time.monotonic):
        self.config = config
        self.clock = clock
        self.namespaces: dict[str, Namespace] = {}
        self.leases = LeaseTable()
        self._pending: dict[int, PendingPut] = {}  # write lease id -> reserved put
        self._reading: dict[int, ObjectEntry] = {}  # read lease id -> entry it covers
        self._zombies: dict[int, ObjectEntry] = {}  # id(entry) -> deleted entry still leased
        self._creating: dict[str, asyncio.Future] = {}  # namespaces whose arena is being made
        self.host_bandwidth_bytes_s = 8e9  # replaced by a measurement at start

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
            host = self.config.host
            if len(self.namespaces) + len(self._creating) >= host.max_namespaces:
                raise CapacityError(f"namespace limit reached ({host.max_namespaces}); raise host.max_namespaces")
            loop = asyncio.get_running_loop()
            creating = loop.run_in_executor(None, HostArena, name, host.arena_bytes, host.prefault)
            self._creating[name] = creating
            try:
                arena = await creating
            finally:
                del self._creating[name]
            ns = Namespace(name, arena, make_policy(host.policy, host.arena_bytes))
            self.namespaces[name] = ns
            log.info("event=namespace_open namespace=%s arena_bytes=%d", name, host.arena_bytes)
            return ns
        await creating
        return self.namespaces[name]

    # --- put --------------------------------------------------------------------

    def reserve(self, owner, msg: Reserve) -> dict:
        ns = self.namespace(msg.namespace)
        expected = msg.descriptor.object_bytes
        if expected and msg.size != expected:
            raise InvalidArgument(
                f"object of {msg.size} bytes does not match its layout {msg.descriptor.layout} "
                f"in {msg.descriptor.dtype.value} ({expected} bytes per {msg.descriptor.chunk_tokens}-token chunk)"
            )
        if msg.descriptor.namespace != msg.namespace:
            raise InvalidArgument("descriptor.namespace differs from the request's namespace")
        now = self.clock()
        existing = ns.objects.get(msg.object_id)
        if existing is not None and existing.expires_at > now:
            # Content-addressed and immutable: the same id is the same state. Skip the copy.
            ns.counters.num_dedup_puts += 1
            return {"exists": True}
        self._check_lease_quota(owner)
        extent = self._alloc(ns, msg.size, now)
        lease = self.leases.grant(owner, None, extent, "write", self.config.limits.lease_ttl_s, now)
        self._pending[lease.lease_id] = PendingPut(
            msg.namespace, msg.object_id, msg.size, msg.descriptor, msg.hints, extent
        )
        return {"lease": lease.lease_id, "offset": extent.offset}

    def _alloc(self, ns: Namespace, size: int, now: float):
        if size > ns.arena.capacity_bytes:
            raise CapacityError(
                f"object of {size} bytes is larger than namespace {ns.name}'s arena "
                f"({ns.arena.capacity_bytes} bytes); raise host.arena_bytes"
            )
        while not ns.arena.can_alloc(size):
            victims = ns.policy.victims(size, lambda oid: self._evictable(ns, oid, now))
            if not victims:
                raise CapacityError(
                    f"namespace {ns.name}: no room for {size} bytes; "
                    f"{ns.arena.allocator.used_bytes} of {ns.arena.capacity_bytes} bytes are pinned, leased or "
                    "being written (largest hole {} bytes). Release leases, unpin, or raise host.arena_bytes"
                    .format(ns.arena.allocator.largest_free_bytes)
                )
            for oid in victims:
                self._remove(ns, ns.objects[oid], reason="evict")
                ns.counters.num_evictions += 1
        return ns.arena.alloc(size)

    def _evictable(self, ns: Namespace, oid: ObjectId, now: float) -> bool:
        entry = ns.objects.get(oid)
        return entry is not None and entry.readers == 0 and not entry.is_pinned(now)

    def commit(self, owner, lease_id: int, checksum: bytes) -> dict:
        lease = self._own_lease(owner, lease_id, "write")
        put = self._pending.pop(lease_id)
        self.leases.release(lease_id)
        ns = self.namespaces[put.namespace]
        if self.config.verify_puts:
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
            if old.expires_at > now:  # a concurrent put of the same id won the race
                ns.arena.free(put.extent)
                ns.counters.num_dedup_puts += 1
                return {"exists": True}
            self._remove(ns, old, reason="expire")
        entry = ObjectEntry(
            put.object_id, put.namespace, put.extent, put.size, checksum, put.descriptor, put.hints,
            created_at=time.time(),
            expires_at=now + put.hints.ttl_s if put.hints.ttl_s is not None else math.inf,
            pinned_until=math.inf if put.hints.pin else 0.0,
        )
        ns.objects[put.object_id] = entry
        ns.policy.on_insert(put.object_id, put.size, put.hints.recompute_cost_ms, put.hints.priority)
        ns.counters.num_puts += 1
        ns.counters.bytes_in += put.size
        return {"exists": False, "tier": "host", "durability": "memory"}

    def abort(self, owner, lease_id: int) -> None:
        self._own_lease(owner, lease_id, "write")
        self._end_lease(self.leases.release(lease_id))

    # --- get --------------------------------------------------------------------

    def get(self, owner, namespace: str, oid: ObjectId, accept=None) -> dict:
        ns = self.namespaces.get(namespace)
        if ns is None:
            return {"hit": False}
        ns.counters.num_gets += 1
        now = self.clock()
        entry = ns.objects.get(oid)
        if entry is not None and entry.expires_at <= now:
            self._remove(ns, entry, reason="expire")
            entry = None
        if entry is None:
            ns.counters.num_misses += 1
            return {"hit": False}
        if accept is not None and entry.descriptor.dtype not in accept:
            ns.counters.num_misses += 1
            return {"hit": False, "reason": f"stored as {entry.descriptor.dtype.value}, not in accept list"}
        self._check_lease_quota(owner)
        lease = self.leases.grant(owner, oid, entry.extent, "read", self.config.limits.lease_ttl_s, now)
        self._reading[lease.lease_id] = entry
        entry.readers += 1
        entry.num_hits += 1
        ns.policy.on_access(oid)
        ns.counters.num_hits += 1
        ns.counters.bytes_out += entry.size
        return entry.get_reply(lease.lease_id)

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
            self.namespaces[put.namespace].arena.free(put.extent)
            return
        entry = self._reading.pop(lease.lease_id)
        entry.readers -= 1
        if entry.deleted and entry.readers == 0:
            self._zombies.pop(id(entry))
            self.namespaces[entry.namespace].arena.free(entry.extent)

    def _check_lease_quota(self, owner) -> None:
        limit = self.config.limits.max_leases_per_client
        if self.leases.count(owner) >= limit:
            raise LimitExceeded(
                f"this client holds {limit} leases (limits.max_leases_per_client); release some first"
            )

    # --- index operations ---------------------------------------------------------

    def lookup(self, namespace: str, ids) -> dict:
        ns = self.namespaces.get(namespace)
        if ns is None:
            return {"hits": 0, "tiers": [None] * len(ids), "hit_bytes": 0, "est_load_s": 0.0}
        now = self.clock()
        tiers, leading, hit_bytes = [], None, 0
        for i, oid in enumerate(ids):
            entry = ns.objects.get(oid)
            present = entry is not None and entry.expires_at > now
            tiers.append("host" if present else None)
            if present and leading is None:
                hit_bytes += entry.size
            elif not present and leading is None:
                leading = i
        hits = len(ids) if leading is None else leading
        est = hit_bytes / self.host_bandwidth_bytes_s + hits * PER_OBJECT_LOAD_S
        return {"hits": hits, "tiers": tiers, "hit_bytes": hit_bytes, "est_load_s": est}

    def delete(self, namespace: str, ids) -> int:
        ns = self.namespaces.get(namespace)
        if ns is None:
            return 0
        count = 0
        for oid in ids:
            entry = ns.objects.get(oid)
            if entry is not None:
                self._remove(ns, entry, reason="delete")
                ns.counters.num_deletes += 1
                count += 1
        return count

    def pin(self, namespace: str, ids, ttl_s: float | None) -> int:
        ns = self.namespaces.get(namespace)
        if ns is None:
            return 0
        until = math.inf if ttl_s is None else self.clock() + ttl_s
        count = 0
        for oid in ids:
            entry = ns.objects.get(oid)
            if entry is not None:
                entry.pinned_until = until
                count += 1
        return count

    def unpin(self, namespace: str, ids) -> int:
        ns = self.namespaces.get(namespace)
        if ns is None:
            return 0
        count = 0
        for oid in ids:
            entry = ns.objects.get(oid)
            if entry is not None and entry.pinned_until:
                entry.pinned_until = 0.0
                count += 1
        return count

    def evict(self, namespace: str, num_bytes: int | None, match=None) -> list[ObjectEntry]:
        """Operator eviction in one existing namespace, in the policy's victim order.

        Evicts until `num_bytes` are freed, or, with num_bytes None, every object `match`
        accepts (`match(entry) -> bool`; None accepts all). Leased and pinned objects are
        never chosen. Returns the evicted entries. Raises NotFound for an unknown namespace.
        """
        ns = self.namespaces.get(namespace)
        if ns is None:
            raise NotFound(f"no namespace {namespace!r}")
        now = self.clock()

        def chosen(oid: ObjectId) -> bool:
            return self._evictable(ns, oid, now) and (match is None or match(ns.objects[oid]))

        if num_bytes is None:
            num_bytes = sum(e.size for oid, e in ns.objects.items() if chosen(oid))
        evicted = []
        for oid in ns.policy.victims(num_bytes, chosen):
            entry = ns.objects[oid]
            self._remove(ns, entry, reason="evict")
            ns.counters.num_evictions += 1
            evicted.append(entry)
        return evicted

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
        for ns in self.namespaces.values():
            for entry in [e for e in ns.objects.values() if e.expires_at <= now]:
                self._remove(ns, entry, reason="expire")
                ns.counters.num_expired += 1

    def check_integrity(self) -> None:
        """Raise RuntimeError if the index, leases, policy and arenas disagree."""
        self.leases.check_integrity()
        for ns in self.namespaces.values():
            ns.arena.check_integrity()
            ns.policy.check_integrity()
            if len(ns.policy) != len(ns.objects) or any(oid not in ns.policy for oid in ns.objects):
                raise RuntimeError(f"namespace {ns.name}: policy tracks {len(ns.policy)} keys, index has {len(ns.objects)}")
            live = [e.extent for e in ns.objects.values()]
            live += [p.extent for p in self._pending.values() if p.namespace == ns.name]
            live += [z.extent for z in self._zombies.values() if z.namespace == ns.name]
            if ns.arena.allocator.num_allocated != len(live) or sum(x.length for x in live) != ns.arena.allocator.used_bytes:
                raise RuntimeError(
                    f"namespace {ns.name}: arena holds {ns.arena.allocator.num_allocated} extents / {ns.arena.allocator.used_bytes} B, "
                    f"index accounts for {len(live)} / {sum(x.length for x in live)} B"
                )
            for entry in ns.objects.values():
                if entry.readers < 0 or entry.deleted:
                    raise RuntimeError(f"namespace {ns.name}: bad entry state for {entry.object_id.hex}")
        readers = sum(e.readers for ns in self.namespaces.values() for e in ns.objects.values())
        readers += sum(z.readers for z in self._zombies.values())
        if readers != len(self._reading):
            raise RuntimeError(f"{readers} readers counted on entries, {len(self._reading)} read leases")

    def stats(self) -> dict:
        namespaces = {}
        for ns in self.namespaces.values():
            c = ns.counters
            namespaces[ns.name] = {
                "objects": len(ns.objects),
                "capacity_bytes": ns.arena.capacity_bytes,
                "used_bytes": ns.arena.allocator.used_bytes,
                "pinned": sum(1 for e in ns.objects.values() if e.is_pinned(self.clock())),
                **{k: getattr(c, k) for k in c.__slots__},
            }
        return {"leases": len(self.leases), "namespaces": namespaces}

    def close(self) -> None:
        for ns in self.namespaces.values():
            ns.arena.close()
        self.namespaces.clear()
