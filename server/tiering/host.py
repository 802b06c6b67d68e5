"""The host tier: every namespace's arena, index and policy, and the one way to make room.

What the tiers below (server/tiering/nvme_mover.py, server/cluster/, server/pool/) and the tier
manager use of the host tier is this class's public surface: open a namespace, make room
(`allocate` or `make_room`, each with the caller's sink: the sink decides where victims go;
the chain's is server/tiering/chain.py: victim_sink), publish verified bytes as an object,
hold an entry while the daemon reads it, drop or evict one. Leases and clients are the tier
manager's business.

Runs on the daemon's event loop thread only; nothing here blocks on I/O. An extent is never
freed or reused while a reader (a client's read lease, or a daemon hold) covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from typing import Awaitable, Callable

from kvstore.config import HostTierConfig
from kvstore.errors import CapacityError, NotFound, ServiceError
from kvstore.identity import Kind, ObjectId
from kvstore.server.events import MEDIUM_CPU, NoEvents
from kvstore.server.host_memory import check_new_arena, host_memory
from kvstore.server.later import MaybeAwaitable, resolve
from kvstore.server.tiering.expiry import ExpiryQueue
from kvstore.server.tiering.namespace import Namespace, give_back_heap
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.server.tiering.shared_index import shared_index
from kvstore.tiers.allocator import Extent
from kvstore.tiers.arena import HostArena
from kvstore.tiers.huge_pages import choose as choose_pages

log = logging.getLogger("kvstore.tiers")

# Where host victims go (TierMover.take_victims, or the cluster's send-home): each victim must
# end evicted (`evict`), or tracked by the policy again (`retrack_victims`).
Sink = Callable[["Namespace", list[ObjectEntry]], Awaitable[None]]


class HostTier:
    def __init__(self, config: HostTierConfig, clock=time.monotonic,
                 on_leave: Callable[[Namespace, ObjectEntry], None] = lambda ns, entry: None,
                 events=NoEvents()):
        """on_leave(ns, entry): told when an entry leaves the index (evicted, expired,
        deleted, dropped); the chain's Departures (server/tiering/chain.py), made before this
        tier, forgets its GPU copy, and in the remote tier if no lower tier keeps it.
        events: the KV event stream (server/events/), told of every entry that enters or
        leaves the index, as medium "CPU"."""
        self.config = config
        self.events = events
        self.clock = clock
        self.on_leave = on_leave
        self.bandwidth_bytes_s = 8e9  # a memcpy here: lookups' load estimate (measured at start)
        self.namespaces: dict[str, Namespace] = {}
        self.num_holds = 0  # readers the daemon itself holds (copies to NVMe or peers in flight)
        self.stopping = threading.Event()  # set by the daemon's stop: an arena's prefault gives up
        self._creating: dict[str, asyncio.Future] = {}  # namespaces whose arena is being made
        self._transient: dict[int, tuple[str, Extent]] = {}  # id(extent) -> (namespace, extent) being filled
        self.expiry = ExpiryQueue()  # objects with a TTL, by expiry time
        self._pages_logged = ""  # the kind of arena pages last logged (tiers/huge_pages.py)

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
            if self.stopping.is_set():  # a request still served while the daemon stops: its pool is going
                raise ServiceError("the daemon is stopping: no new namespace opens; try again once it is back")
            config = self.config
            if len(self.namespaces) + len(self._creating) >= config.max_namespaces:
                raise CapacityError(f"namespace limit reached ({config.max_namespaces}); raise host.max_namespaces")
            pages = choose_pages(config.arena_bytes, config.huge_pages)
            if pages.kind != self._pages_logged:  # once, and again only when the kind changes
                self._pages_logged = pages.kind
                log.info("event=arena_pages pages=%s reason=%r", pages.kind, pages.reason)
            if pages.kind != "hugetlb":  # reserved huge pages are not in the memory available
                check_new_arena(config, host_memory(), name)  # a CapacityError here, not an OOM kill elsewhere
            creating = asyncio.ensure_future(self._create_namespace(name, pages.kind))
            self._creating[name] = creating
        # Every opener gets the namespace from the creating task itself: a dict lookup after the
        # await could run before the creator resumed (KeyError). Shielded: one opener cancelled
        # (a peer's deadline) does not cancel the creation the others wait for.
        return await asyncio.shield(creating)

    async def _create_namespace(self, name: str, pages: str) -> Namespace:
        config = self.config
        try:
            arena = await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(HostArena, name, config.arena_bytes, config.prefault, cancel=self.stopping,
                                        pages=pages))
        finally:
            del self._creating[name]
        ns = Namespace(name, arena, config.policy,
                       shared=shared_index(config.shared_index, name, config.arena_bytes, config.prefault))
        self.namespaces[name] = ns
        log.info("event=namespace_open namespace=%s arena_bytes=%d pages=%s", name, config.arena_bytes, arena.pages)
        return ns

    # --- making room ------------------------------------------------------------

    def check_size(self, ns: Namespace, size: int) -> None:
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
        now, objects = self.clock(), ns.objects
        victims = [objects.entry_at(row) for row in ns.policy.victims(ns.arena.footprint(size),
                                                                      lambda row: objects.idle(row, now))]
        if not victims:
            raise self.no_room(ns, size)
        if ns.groups:  # a member of a group goes with the rest of its group (server/tiering/group_index.py)
            chosen = {entry.object_id for entry in victims}
            for entry in list(victims):
                for oid in ns.groups.companions(entry.object_id):
                    other = objects.get(oid)
                    if oid not in chosen and other is not None and objects.idle(other.row, now):
                        ns.policy.on_remove(other.row)
                        chosen.add(oid)
                        victims.append(other)
        return victims

    def alloc_now(self, ns: Namespace, size: int) -> Extent:
        """An extent now, victims dropped (no tier below the host arena keeps them)."""
        self.check_size(ns, size)
        while (extent := ns.arena.alloc(size)) is None:  # alloc answers None without room: one search
            for entry in self._victims(ns, size):
                self.evict(ns, entry)
        return extent

    async def allocate(self, ns: Namespace, size: int, sink: Sink | None) -> Extent:
        """An extent in the arena, room made for it by `sink` (make_room, awaited)."""
        return await resolve(self.make_room(ns, size, sink))

    def make_room(self, ns: Namespace, size: int, sink: Sink | None) -> MaybeAwaitable[Extent]:
        """An extent of `size` bytes, room made for it: the one victim loop. The sink settles
        each batch of victims (writes them down a tier, sends them home); None drops them.
        The extent itself when there is room already (or no sink), else an awaitable of it."""
        if sink is None:
            return self.alloc_now(ns, size)
        self.check_size(ns, size)
        extent = ns.arena.alloc(size)
        return extent if extent is not None else self._room_made(ns, size, sink)

    async def _room_made(self, ns: Namespace, size: int, sink: Sink) -> Extent:
        while (extent := ns.arena.alloc(size)) is None:
            await sink(ns, self._victims(ns, size))
        return extent

    def settle_victims(self, ns: Namespace, entries: list[ObjectEntry]) -> list[ObjectEntry]:
        """Victims whose copy elsewhere was awaited: evict those still idle; a victim read or
        pinned meanwhile stays resident (tracked by the policy again). Returns the evicted."""
        evicted = []
        now = self.clock()
        for entry in entries:
            if not ns.objects.holds(entry):
                continue  # deleted or dropped meanwhile
            if entry.readers or entry.is_pinned(now):
                self.retrack_victims(ns, [entry])
            else:
                self.evict(ns, entry)
                evicted.append(entry)
        return evicted

    def copy_then_evict(self, send: Callable[[list[ObjectEntry]], Awaitable[None]]) -> Sink:
        """A sink that awaits send(victims) (copies them elsewhere), then evicts those still
        idle. A send that fails or is cancelled (a peer's deadline) leaves every victim
        resident and tracked."""
        async def sink(ns: Namespace, entries: list[ObjectEntry]) -> None:
            try:
                await send(entries)
            except BaseException:
                self.retrack_victims(ns, entries)
                raise
            self.settle_victims(ns, entries)
        return sink

    def retrack_victims(self, ns: Namespace, entries: list[ObjectEntry]) -> None:
        """Victims that stay after all: the policy (which dropped them) tracks them again."""
        for entry in entries:
            if ns.objects.holds(entry):
                ns.policy.on_insert(entry.locate())

    # --- the index ----------------------------------------------------------------

    def live_entry(self, ns: Namespace, oid: ObjectId) -> ObjectEntry | None:
        """The committed entry of `oid`, None if absent; one past its TTL goes now (counted)."""
        entry = ns.objects.get(oid)
        if entry is not None and not entry.is_live(self.clock()):
            self.expire(ns, entry)
            return None
        return entry

    def _indexed(self, ns: Namespace, entry: ObjectEntry) -> None:
        """An entry just added to the index: the policy, the expiry queue, the shared index,
        the group index and the event stream learn of it."""
        ns.policy.on_insert(entry.row)
        self.expiry.add(entry)
        ns.shared.publish(entry)
        if entry.descriptor.kind is Kind.GROUP:  # a store group's manifest: index its members
            ns.groups.add(entry, ns.arena.view(entry.extent)[:entry.size])
        self.events.stored(ns.name, entry.object_id, MEDIUM_CPU, entry.descriptor, entry.hints)

    def publish(self, ns: Namespace, oid: ObjectId, extent: Extent, size: int, checksum: bytes, descriptor,
                hints, pin_hint: bool = False, created_at: float | None = None,
                on_nvme: bool = False, counted: bool = True) -> ObjectEntry:
        """Make verified bytes already in `extent` a committed object: the one way an object
        enters the index (a commit, a peer's put, a fetch, a promotion). If a live copy landed
        meanwhile it wins and `extent` is freed; one past its TTL is replaced.
        pin_hint: honour hints.pin (a put here or at a home; not a fetched or promoted copy).
        counted: a put (num_puts, bytes_in); a promotion from NVMe is not one."""
        now = self.clock()
        existing = ns.objects.get(oid)
        if existing is not None:
            if existing.is_live(now):
                ns.arena.free(extent)
                return existing
            self.expire(ns, existing)
        entry = ns.objects.add(oid, extent, size, checksum, descriptor, hints, now,
                               created_at=created_at, pin=pin_hint and hints.pin, on_nvme=on_nvme)
        self._indexed(ns, entry)
        if counted:
            ns.counters.num_puts += 1
            ns.counters.bytes_in += size
        return entry

    def publish_many(self, ns: Namespace, oids: list, extents: list, sizes: list, checksums: bytes, descriptor,
                     hints) -> list[ObjectEntry]:
        """publish() for a batch's plain case, as arrays: new ids, none indexed here, all under
        one (descriptor, hints) pair naming no route, TTL or pin, not a store group's manifest
        (ObjectTable.add_many). The policy, the shared index and the event stream learn of
        them together. Their entries, in order."""
        table = ns.objects
        rows, serial = table.add_many(oids, extents, sizes, checksums, descriptor, hints, self.clock())
        ns.policy.on_insert_many(rows)
        ns.shared.publish_many(oids, *table.placements(rows), checksums, descriptor)
        if self.events.enabled:
            for oid in oids:
                self.events.stored(ns.name, oid, MEDIUM_CPU, descriptor, hints)
        ns.counters.num_puts += len(oids)
        ns.counters.bytes_in += sum(sizes)
        return [ObjectEntry(table, row, serial + i, oid) for i, (row, oid) in enumerate(zip(rows.tolist(), oids))]

    def hold(self, entry: ObjectEntry) -> None:
        """Keep an entry's extent allocated while the daemon itself reads it."""
        entry.readers += 1
        self.num_holds += 1

    @contextlib.contextmanager
    def held_view(self, entry: ObjectEntry):
        """The entry's bytes in the arena, its extent kept in place (held) meanwhile."""
        self.hold(entry)
        try:
            yield self.namespaces[entry.namespace].arena.view(entry.extent)[:entry.size]
        finally:
            self.release_hold(entry)

    def release_hold(self, entry: ObjectEntry) -> None:
        self.num_holds -= 1
        self.drop_reader(entry)

    def drop_reader(self, entry: ObjectEntry) -> None:
        """A reader (lease or hold) is done; a deleted entry's extent goes with its last one."""
        entry.readers -= 1
        if entry.deleted and entry.readers == 0:
            ns = self.namespaces[entry.namespace]
            ns.arena.free(entry.extent)
            ns.objects.release(entry)

    def track_transient(self, ns: Namespace, extent: Extent, add: bool) -> None:
        """An extent being filled (a promotion, a fetch) or leased as ranges: not indexed, but
        accounted for by check_integrity."""
        if add:
            self._transient[id(extent)] = (ns.name, extent)
        else:
            del self._transient[id(extent)]

    def holds_transient(self, ns: Namespace, extent: Extent) -> bool:
        return self._transient.get(id(extent)) == (ns.name, extent)

    def evict(self, ns: Namespace, entry: ObjectEntry) -> None:
        """Drop a victim that victims() already stopped tracking."""
        self._remove(ns, entry, tracked=False)
        ns.counters.num_evictions += 1

    def drop(self, ns: Namespace, entry: ObjectEntry) -> None:
        """Drop a tracked entry (corrupt, or otherwise unusable)."""
        self._remove(ns, entry)

    def delete(self, ns: Namespace, entry: ObjectEntry) -> None:
        self._remove(ns, entry)
        ns.counters.num_deletes += 1

    def expire(self, ns: Namespace, entry: ObjectEntry) -> None:
        """An entry found past its TTL (by a read, a put of its id, or housekeeping) goes, counted."""
        self._remove(ns, entry)
        ns.counters.num_expired += 1

    def _remove(self, ns: Namespace, entry: ObjectEntry, tracked: bool = True) -> None:
        """Drop an entry from the index; its extent is freed now or when its last reader leaves."""
        ns.shared.remove(entry)  # first: clients must stop reading the extent before it can be reused
        ns.objects.remove(entry)
        ns.groups.remove(entry)
        if tracked:  # victims() already stopped tracking evicted keys
            ns.policy.on_remove(entry.row)
        read = entry.readers
        if read:
            entry.deleted = True  # its row keeps the extent (ObjectTable.extents_still_read)
        else:
            ns.arena.free(entry.extent)
        self.events.removed(ns.name, entry.object_id, MEDIUM_CPU)
        self.on_leave(ns, entry)
        if not read:
            ns.objects.release(entry)  # last: its fields stay readable until the row is reused

    # --- housekeeping -----------------------------------------------------------

    def expire_objects(self) -> None:
        """Drop objects past their TTL (only those due: server/tiering/expiry.py); rebuild
        tables that removals left sparse; tell clients the shared indexes are still kept."""
        for name, oid, serial in self.expiry.due(self.clock()):
            ns = self.namespaces.get(name)
            entry = ns.objects.get(oid) if ns is not None else None
            if entry is not None and entry.serial == serial:  # still the copy that was due
                self.expire(ns, entry)
        self.expiry.rebuild_if_stale((e for ns in self.namespaces.values() for e in ns.objects.values()),
                                     sum(len(ns.objects) for ns in self.namespaces.values()))
        compacted = False
        for ns in self.namespaces.values():
            compacted = ns.compact() or compacted
            ns.shared.keep_alive()
        if compacted:
            give_back_heap()

    def readers(self) -> int:
        """Readers counted on entries, deleted ones still read included."""
        return sum(ns.objects.total_readers() for ns in self.namespaces.values())

    def check_integrity(self, pending: list[tuple[str, Extent]]) -> None:
        """Raise RuntimeError if an index, its policy and its arena disagree. pending:
        (namespace, extent) reserved for puts not committed yet (the tier manager's)."""
        for ns in self.namespaces.values():
            ns.arena.check_integrity()
            ns.objects.check_integrity()
            ns.policy.check_integrity()
            ns.shared.check_integrity(ns.objects)
            ns.groups.check_integrity(ns.objects)
            indexed = ns.objects.indexed_rows()
            if not ns.policy.tracks_exactly(indexed):
                raise RuntimeError(f"namespace {ns.name}: the policy tracks {len(ns.policy)} rows, the index "
                                   f"has {len(indexed)}, or other rows")
            live = [e.extent for e in ns.objects.values()]
            live += [x for name, x in pending if name == ns.name]
            live += ns.objects.extents_still_read()
            live += [x for name, x in self._transient.values() if name == ns.name]
            allocator = ns.arena.allocator
            if allocator.num_allocated != len(live) or sum(x.length for x in live) != allocator.used_bytes:
                raise RuntimeError(
                    f"namespace {ns.name}: arena holds {allocator.num_allocated} extents / {allocator.used_bytes} B, "
                    f"index accounts for {len(live)} / {sum(x.length for x in live)} B"
                )
            for entry in ns.objects.values():
                if entry.readers < 0 or entry.deleted:
                    raise RuntimeError(f"namespace {ns.name}: bad entry state for {entry.object_id.hex}")

    def stats(self) -> tuple[dict, dict]:
        """(per namespace, the host tier's totals). used_bytes: what objects take (a slot of their
        size class up to 3.5 KiB, whole pages above: tiers/slabs.py); slab_free_bytes: free slots."""
        namespaces = {}
        now = self.clock()
        for ns in self.namespaces.values():
            c = ns.counters
            namespaces[ns.name] = {
                "objects": len(ns.objects),
                "capacity_bytes": ns.arena.capacity_bytes,
                "used_bytes": ns.arena.allocator.used_bytes,
                "slab_free_bytes": ns.arena.allocator.slab_free_bytes,
                "pages": ns.arena.pages,  # what backs the arena (tiers/huge_pages.py)
                "pinned": ns.objects.num_pinned(now),
                **{k: getattr(c, k) for k in c.__slots__},
            }
        totals = {key: sum(n[key] for n in namespaces.values()) for key in ("capacity_bytes", "used_bytes", "objects")}
        return namespaces, totals

    def close(self) -> None:
        for ns in self.namespaces.values():
            ns.arena.close()
            ns.shared.close()
        self.namespaces.clear()
