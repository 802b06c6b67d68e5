"""Moving objects between the host tier and NVMe.

    demote:   host pressure -> victims by policy -> admitted ones are written to NVMe
              (verified against their checksum on the way) -> host extents freed
    promote:  get of an NVMe-only object -> room made in the host arena -> verified read
              into the arena -> a host entry again (also on NVMe)
    writes:   write_back (demote only), write_through (at commit, the reply waits for the
              durable write), selective (after write_after_hits hits, in the background)
    evict:    a full NVMe tier drops its own victims (S3-FIFO over NVMe objects)
    flush:    a clean stop writes the host objects NVMe lacks into its free room, most
              valuable first, never evicting (server/tiering/nvme_flush.py)

Every object that enters or leaves the NVMe table is reported to the KV event stream
(server/events/) as medium "STORAGE"; what recovery finds at start joins
the stream's holdings without an event per object (server/tiering/nvme_kept.py).

Runs on the event loop; NVMe I/O runs in the NVMe tier's thread pool. While an object is
copied out of the host arena it holds a reader, so its extent cannot be freed or reused
under the copy; a reader that arrives meanwhile keeps it resident.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.config import NvmeTierConfig
from kvstore.errors import CapacityError, ChecksumError, KVStoreError, ServiceError
from kvstore.identity import ObjectId
from kvstore.peer_messages import RemoteMeta
from kvstore.policy.admission import FrequencyAdmission
from kvstore.replies import IN_MEMORY, CommitReply
from kvstore.server.events import MEDIUM_STORAGE
from kvstore.server.later import MaybeAwaitable, resolve
from kvstore.server.tiering.nvme_kept import KeptHoldings
from kvstore.server.tiering.nvme_flush import flush_host
from kvstore.server.tiering.nvme_held import NvmeHeld
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.nvme import NvmeTier
from kvstore.tiers.nvme.index import key_parts
from kvstore.server.tiering.bandwidth import moving_bandwidth
from kvstore.server.windows import NoWindows

log = logging.getLogger("kvstore.movement")
# Until promotions have measured it, assume this NVMe read bandwidth for load estimates.
DEFAULT_NVME_BANDWIDTH = 1e9
# write(displace=ANY_VICTIM): the NVMe policy's victims, whatever they are, make room.
ANY_VICTIM = object()


@dataclass(slots=True)
class MoverCounters:
    num_demotions: int = 0  # host victims written down to NVMe
    num_promotions: int = 0  # NVMe objects read back into the host tier
    num_rejected: int = 0  # copies turned away (admission, or no room a flush may take)
    num_nvme_evictions: int = 0
    num_demotion_failures: int = 0  # writes that failed (EIO, full disk, host bytes changed)
    num_expired: int = 0  # NVMe objects deleted past their TTL


class TierMover:
    """The NVMe tier in the chain: below the host tier, above the remote tier (`sends`: its
    sending side, where objects NVMe refuses or evicts go when their homes may lack them;
    `departures`: told when one leaves NVMe and this node altogether)."""

    listed_as = ("nvme",)  # what the admin API's ?tier= may name

    def __init__(self, host, events, sends, departures, held: NvmeHeld, config: NvmeTierConfig,
                 windows=NoWindows()):
        """host: the host tier (server/tiering/host.py); events: the KV event stream; sends:
        the remote tier's sending side (server/tiering/chain.py: Sends, made before this tier;
        an NVMe copy it sends is read with the read handed to it, `read_copy`); departures:
        server/tiering/chain.py: Departures; held: what NVMe holds, which this tier fills (made
        before the host tier, whose departures read it); `config` is the `[nvme]` table with
        its path filled in (ServerConfig.nvme_path); windows: the race windows tests widen
        (server/windows.py)."""
        self.host = host
        self.events = events
        self.sends, self.departures = sends, departures
        self.windows = windows
        self.config = config
        self.nvme: NvmeTier | None = None
        self.held = held  # what NVMe holds (its lookups are the holdings')
        self.policy, self.deadlines = held.policy, held.deadlines
        self.admission = FrequencyAdmission(min_hits=self.config.admit_min_hits)
        self.bandwidth_bytes_s = DEFAULT_NVME_BANDWIDTH
        self._promoting: dict[bytes, asyncio.Future] = {}  # by table key
        self._voided: set[asyncio.Future] = set()  # promotions whose key left NVMe meanwhile: not published
        # Per key, the write or record removal under way: one at a time, so a write never
        # takes (deduplicates against) a record a removal is about to delete, and a removal
        # never deletes the copy a write has just recorded.
        self._turns: dict[bytes, asyncio.Future] = {}
        self._writes: set[asyncio.Task] = set()  # copies to NVMe and record removals under way (each runs to its end)
        self._removing: dict[bytes, int] = {}  # key -> removals of its record begun and not ended
        self._closing = False
        self._background: set[asyncio.Task] = set()
        self.counters = MoverCounters()
        self._kept: KeptHoldings | None = None  # with the event stream: what NVMe kept, told to it

    # --- start and stop -------------------------------------------------------------

    async def open(self) -> dict:
        """Open (and recover) the NVMe tier; index what it holds. Returns recovery facts."""
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        self.nvme = await loop.run_in_executor(None, NvmeTier.open, self.config)
        # What recovery found, learnt in bulk, oldest first (a meta decoded per record took
        # ~15 us and ~1 KB each: tiers/nvme/holdings.py); the age order is sorted meanwhile in
        # another thread. Nothing else uses the table yet.
        held = self.nvme.take_holdings()
        order = self.nvme.executor.submit(held.age_order)
        await loop.run_in_executor(None, self.policy.load, held.prefixes, held.namespaces, held.ids, held.sizes, order)
        for key, deadline in held.deadlines.items():
            self.deadlines.add(key, deadline)
        report = self.nvme.recovery
        facts = {"objects": len(self.policy), "ready_s": time.monotonic() - start,
                 "recovered": report.recovered, "dropped": report.dropped,
                 "dropped_by_reason": dict(report.dropped_by_reason), "sampled": report.sampled}
        log.info("event=nvme_ready path=%s objects=%d ready_s=%.2f", self.config.path, facts["objects"], facts["ready_s"])
        if self.events.enabled and len(self.policy):  # read in the background; start is not held up
            self._kept = KeptHoldings(self, self.events)
            self._kept.start()
        return facts

    async def close(self) -> None:
        if self._kept is not None:  # it reads the index: done before the tier closes
            await self._kept.stop()
        for task in list(self._background):
            task.cancel()
        while self._writes:  # each records or removes a copy: let them end first (new ones too)
            await asyncio.gather(*self._writes, return_exceptions=True)
        self._closing = True  # requests still being served get a ServiceError, not the pool's refusal
        if self.nvme is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.nvme.close)
            self.nvme = None

    def _run(self, fn, *args):
        """fn(*args) in the NVMe pool; fn a callable, or the name of an NVMe tier method
        (looked up once the tier is known to be open)."""
        if self._closing:
            raise ServiceError("the daemon is stopping: its NVMe tier is closed; try again once it is back")
        return asyncio.get_running_loop().run_in_executor(
            self.nvme.executor, getattr(self.nvme, fn) if isinstance(fn, str) else fn, *args)

    # --- what NVMe holds: its holdings' (server/tiering/nvme_held.py), and its copies ------------

    def holds(self, namespace: str, oid) -> bool:
        return self.held.holds(namespace, oid)

    def size_of(self, namespace: str, oid) -> int | None:
        return self.held.size_of(namespace, oid)

    def sizes_of(self, namespace: str, oids: list) -> list[int | None]:
        return self.held.sizes_of(namespace, oids)

    def remote_meta(self, namespace: str, oid):
        """What a peer lookup needs to know of an NVMe-only object (None if it went away)."""
        meta = self.nvme.meta(namespace, oid)
        return None if meta is None else RemoteMeta(meta.size, meta.checksum, meta.descriptor, meta.hints, meta.created_at)

    async def read_copy(self, namespace: str, oid):
        """(RemoteMeta, bytes verified against it) of an NVMe object, read into fresh memory
        without touching the host arena (what re-homing and demotion to peers send); None if
        NVMe no longer has it or it failed its check (the tier dropped and counted it)."""
        meta = await self._run("meta", namespace, oid)
        if meta is None:
            return None
        out = np.empty(meta.size, dtype=np.uint8)
        if await self._run("get_into", namespace, oid, out) is None:
            self._forget(self.held.key(namespace, oid))
            return None
        return RemoteMeta(meta.size, meta.checksum, meta.descriptor, meta.hints, meta.created_at), out

    def keys(self) -> list[tuple[str, bytes]]:
        return self.held.keys()

    async def metas(self, keys) -> list:
        """NvmeMeta (None where gone meanwhile) of (namespace, digest) keys, read in the NVMe pool."""
        if not keys or self.nvme is None:
            return [None] * len(keys)
        nvme = self.nvme
        return await self._run(lambda: [nvme.meta(name, ObjectId(digest)) for name, digest in keys])

    def on_hit(self, entry: ObjectEntry) -> None:
        """A host hit, counted on the entry already: counted for admission and the NVMe
        policy; under `selective`, the write_after_hits-th hit writes the object down in the
        background."""
        self._hits(entry, 1, entry.num_hits - 1)

    def on_hits(self, table, rows: np.ndarray, times: np.ndarray) -> None:
        """on_hit of times[k] hits on each of `table`'s rows[k] (distinct rows), not counted
        on their entries yet: as one hit after another on each entry (a batch's hits land at
        once: its entries' turns in the policy go in the order of `rows`)."""
        for row, count in zip(rows.tolist(), times.tolist()):
            entry = table.entry_at(row)
            self._hits(entry, count, entry.num_hits)

    def _hits(self, entry: ObjectEntry, count: int, before: int) -> None:
        """`count` hits on an entry that had `before`."""
        key = self.held.key(entry.namespace, entry.object_id)
        for _ in range(count):
            self.admission.record(key)
            self.policy.on_access(key)
        if (not entry.on_nvme and self.config.write_policy == "selective"
                and before < self.config.write_after_hits <= before + count):
            self.write_in_background(entry)

    @property
    def writes_through(self) -> bool:
        """Does a commit's reply wait for its NVMe write (on_commit)?"""
        return self.config.write_policy == "write_through"

    def on_commit(self, entry: ObjectEntry) -> MaybeAwaitable[CommitReply]:
        """A local commit: under `write_through` the reply waits for the durable write."""
        if self.writes_through:
            return self._write_through(entry)
        return IN_MEMORY

    async def _write_through(self, entry: ObjectEntry) -> CommitReply:
        durability = await self.write(entry)
        return IN_MEMORY if durability is None else CommitReply(False, "host", durability)

    # --- host -> NVMe -----------------------------------------------------------------------

    async def write(self, entry: ObjectEntry, displace=ANY_VICTIM) -> str | None:
        """Copy a host entry to NVMe. Returns the durability it got, or None if it failed or
        the entry left the host index (deleted, expired, dropped) before its copy was recorded.

        displace: which NVMe objects may be evicted to make room for it, a predicate on
        their policy keys (NvmeHeld.key); None: none (the copy goes only into free room).
        A copy that finds no room it may take is counted in num_rejected, not as a failure.

        The copy runs to its end even when the caller is cancelled: a record on NVMe that the
        table does not know of would outlive a delete and come back at the next start.
        """
        return await asyncio.shield(self._to_end(self._write(entry, displace)))

    def _to_end(self, coro) -> asyncio.Task:
        """A task for `coro` that runs to its end whoever waits for it (close() waits for it)."""
        task = asyncio.ensure_future(coro)
        self._writes.add(task)
        task.add_done_callback(self._write_done)
        return task

    def _write_done(self, task: asyncio.Task) -> None:
        self._writes.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that stopped waiting does not leave it unlogged

    async def _write(self, entry: ObjectEntry, displace) -> str | None:
        key = self.held.key(entry.namespace, entry.object_id)
        ns = self.host.namespaces[entry.namespace]
        async with self._turn(key):
            if not ns.objects.holds(entry):
                return None  # gone before its turn (its row may be another object's by now): none is made
            if key in self.policy:
                if await self._holds_copy_of(entry, key):
                    return "sync"
                # Past its TTL (housekeeping deletes it within a second) or, never expected,
                # other bytes: it must not pass for this entry's copy. Gone before this one lands.
                self._forget(key)
                await self._run("delete", entry.namespace, entry.object_id)
            await self.windows.at("nvme_write")
            if not ns.objects.holds(entry):
                return None  # gone before its copy began: none is made
            self.host.hold(entry)
            try:
                put = await self._put(ns, entry, displace)
                if put is None:
                    return None
                await self.windows.at("nvme_write")
            finally:  # every way out gives the hold back
                self.host.release_hold(entry)
            if not ns.objects.holds(entry):
                # Deleted (expired, dropped) while it was written: its copy must not outlive it.
                if key not in self.policy:
                    await self._run("delete", entry.namespace, entry.object_id)
                return None
            if key not in self.policy:
                self._remember(key, entry.size)
                self.events.stored(entry.namespace, entry.object_id, MEDIUM_STORAGE, entry.descriptor, entry.hints)
                if entry.hints.ttl_s is not None:  # counted from the put, not from this write
                    self.deadlines.add(key, entry.created_at + entry.hints.ttl_s)
            entry.on_nvme = True
            return put.durability

    async def _holds_copy_of(self, entry: ObjectEntry, key: bytes) -> bool:
        """NVMe's copy of the key is live and of `entry`'s bytes. (A host entry is published
        only while no live copy is held, so a live one is a copy of it; the checksum is
        compared all the same: a write must never claim another object's copy.)"""
        if self.held.expired(key):
            return False
        checksum = entry.checksum  # read before the await: the entry's row may be another's after it
        meta = await self._run("meta", entry.namespace, entry.object_id)
        if meta is not None and meta.checksum == checksum:
            return True
        if meta is not None:
            log.error("event=nvme_copy_of_other_bytes namespace=%s object=%s action=replaced",
                      entry.namespace, entry.object_id.hex)
        return False

    async def _put(self, ns, entry: ObjectEntry, displace):
        """The NVMe put of a held entry's bytes (evicting NVMe objects `displace` allows when
        full): its NvmePut, or None when it failed or found no room it may take."""
        view = ns.arena.view(entry.extent)[:entry.size]
        try:
            for attempt in range(3):
                try:
                    return await self._run("put", entry.namespace, entry.object_id, view, entry.checksum,
                                           entry.descriptor, entry.hints, entry.created_at)
                except CapacityError:
                    if attempt == 2 or displace is None or not await self._evict_nvme(entry.size, displace):
                        if displace is not ANY_VICTIM:  # refused by admission or the flush's rule
                            self.counters.num_rejected += 1
                            return None
                        raise
        except ChecksumError:
            # The host bytes no longer match what was put: never let them travel on.
            log.warning("event=host_checksum_mismatch namespace=%s object=%s", entry.namespace, entry.object_id.hex)
            ns.counters.num_checksum_failures += 1
            self.counters.num_demotion_failures += 1
            if ns.objects.holds(entry):
                self.host.drop(ns, entry)  # freed when the hold ends
            return None
        except (KVStoreError, OSError) as exc:
            log.warning("event=nvme_write_failed namespace=%s object=%s error=%r",
                        entry.namespace, entry.object_id.hex, getattr(exc, "message", exc))
            self.counters.num_demotion_failures += 1
            return None

    @contextlib.asynccontextmanager
    async def _turn(self, key: bytes):
        """Wait for the write or record removal of `key` under way, then be the one."""
        while (ahead := self._turns.get(key)) is not None:
            await asyncio.shield(ahead)
        mine = self._turns[key] = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            del self._turns[key]
            mine.set_result(None)

    async def _remove_record(self, key: bytes) -> bool:
        """Delete the NVMe record of a key the table no longer holds (in its turn: a write of
        the key waits). False if it was not there, or the key was written again meanwhile."""
        name, digest = key_parts(key)
        async with self._turn(key):
            await self.windows.at("nvme_delete")
            if key in self.policy:
                return False  # written again: that copy stays
            return await self._run("delete", name, ObjectId(digest))

    async def _evict_nvme(self, size: int, displace=ANY_VICTIM) -> bool:
        victims = self.policy.victims(
            size, lambda key: key not in self._promoting and (displace is ANY_VICTIM or displace(key)))
        # They leave NVMe now: nothing counts on these copies from here on (a host entry of
        # one may be written back meanwhile; its new copy is then kept).
        for key in victims:
            self._report_removed(key)
            self.deadlines.discard(key)
            entry = self._host_entry(key)
            if entry is not None:
                entry.on_nvme = False
        leaving: dict[str, list] = {}  # those leaving the node go to their homes first
        for key in victims:
            if self._host_entry(key) is None:  # the sending side sends those the homes may lack
                name, digest = key_parts(key)
                leaving.setdefault(name, []).append(ObjectId(digest))
        try:
            await asyncio.gather(*(self.sends.demote_from_nvme(ns, oids, self.read_copy)
                                   for ns, oids in leaving.items()))
        except Exception as exc:  # counted there; the eviction goes on
            log.warning("event=remote_demotion_failed error=%r", exc)
        for key in victims:
            if not await self._remove_record(key):
                continue  # written again while the copies above were sent
            self.counters.num_nvme_evictions += 1
            if self._host_entry(key) is None:
                name, digest = key_parts(key)
                self.departures.left_node(name, ObjectId(digest))
        return bool(victims)

    def _host_entry(self, key) -> ObjectEntry | None:
        name, digest = key_parts(key)
        ns = self.host.namespaces.get(name)
        return ns.objects.get(ObjectId(digest)) if ns else None

    def _report_removed(self, key) -> None:
        name, digest = key_parts(key)
        self.events.removed(name, digest, MEDIUM_STORAGE)

    def _left_nvme(self, key) -> None:
        """`key` left the table (forgotten, deleted, expired): reported, and the host entry
        no longer counts on the copy."""
        self._report_removed(key)
        entry = self._host_entry(key)
        if entry is not None:
            entry.on_nvme = False
        else:
            name, digest = key_parts(key)
            self.departures.left_node(name, ObjectId(digest))

    def victim_sink(self, below):
        """Where the host tier's victims go: written down here (what NVMe refuses or evicts goes
        on to the homes from here, through `sends`, not through `below`)."""
        return self.take_victims

    async def take_victims(self, ns, victims: list[ObjectEntry]) -> None:
        """Host victims (TierManager.allocate's sink): those NVMe holds already are evicted,
        the others written down as admission allows; those NVMe turns away go to their home
        nodes first (in a cluster). Each ends evicted, or resident if read or pinned meanwhile."""
        writes = []
        try:
            await self.windows.at("victims")
            for entry in victims:
                if not ns.objects.holds(entry):
                    continue  # deleted (expired, dropped) since it was chosen
                if entry.on_nvme or self.holds(ns.name, entry.object_id):  # (a live copy is this entry's)
                    self.host.evict(ns, entry)
                else:
                    writes.append(entry)
            if writes:
                await asyncio.gather(*(self.write(e, self._displaceable_by(e)) for e in writes))
            # NVMe refused some (full of hotter objects, full disk, EIO): those leave the
            # node, homes first.
            failed = [e for e in writes if ns.objects.holds(e) and not e.on_nvme
                      and self.sends.must_send(ns.name, e.object_id)]
            if failed:
                await self.sends.demote(failed)
        except BaseException:
            self.host.retrack_victims(ns, victims)  # cancelled: those not evicted stay (and are tracked)
            raise
        for entry in self.host.settle_victims(ns, writes):
            if entry.on_nvme:
                self.counters.num_demotions += 1

    def _displaceable_by(self, entry: ObjectEntry):
        """Which NVMe objects a host victim may push out (TinyLFU admission, docs/architecture.md).

        While NVMe has room nothing is pushed out. An object read at least admit_min_hits
        times (recently: the sketch ages) takes the NVMe policy's victims like any write.
        Any other takes only victims read no more often than itself: a new, unread object
        displaces old unread ones (they age out in the NVMe policy's FIFO order), never an
        object that is being read."""
        key = self.held.key(entry.namespace, entry.object_id)
        if self.config.capacity_bytes - self.used_bytes >= entry.size or self.admission.admit(key):
            return ANY_VICTIM
        reads = self.admission.estimate(key)
        return lambda victim: self.admission.estimate(victim) <= reads

    # --- NVMe -> host ------------------------------------------------------------------------

    async def promote(self, namespace: str, oid) -> ObjectEntry | None:
        """Bring an NVMe object into the host arena (verified). None if it is gone or corrupt."""
        key = self.held.key(namespace, oid)
        pending = self._promoting.get(key)
        if pending is not None and pending not in self._voided:
            return await asyncio.shield(pending)  # (a voided one brings nothing: the key's copy now is another)
        future = asyncio.get_running_loop().create_future()
        self._promoting[key] = future
        try:
            entry = await self._promote(namespace, oid, key, future)
            future.set_result(entry)
            return entry
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters get it, nobody else logs it
            raise
        finally:
            if self._promoting.get(key) is future:  # (a newer promotion of the key may have taken its place)
                del self._promoting[key]
            self._voided.discard(future)

    async def _promote(self, namespace: str, oid, key, future: asyncio.Future) -> ObjectEntry | None:
        if self.held.expired(key):
            return None  # housekeeping deletes it
        meta = await self._run("meta", namespace, oid)
        if meta is None:
            self._forget(key)
            return None
        ns = await self.host.open_namespace(namespace)
        extent = await resolve(self.host.make_room(ns, meta.size, self.take_victims))
        self.host.track_transient(ns, extent, add=True)
        try:
            start = time.perf_counter()
            view = ns.arena.view(extent)[:meta.size]
            got = await self._run("get_into", namespace, oid, view)
            del view
            elapsed = time.perf_counter() - start
        except Exception:  # the read failed (EIO) and is over: the extent is ours to give back
            ns.arena.free(extent)
            raise
        finally:
            self.host.track_transient(ns, extent, add=False)
        if got is None:  # gone meanwhile, or failed its checksum (the tier dropped and counted it)
            ns.arena.free(extent)
            self._forget(key)
            return None
        await self.windows.at("nvme_read")
        if future in self._voided or key not in self.policy:  # deleted (expired, evicted) while it was read
            ns.arena.free(extent)
            return None
        self.bandwidth_bytes_s = moving_bandwidth(self.bandwidth_bytes_s, meta.size, elapsed)
        entry = self.host.publish(ns, oid, extent, meta.size, meta.checksum, meta.descriptor, meta.hints,
                                  created_at=meta.created_at, on_nvme=True, counted=False)
        if entry.extent == extent:  # else a put of the same id landed while we read, and won
            self.counters.num_promotions += 1
        return entry

    @property
    def used_bytes(self) -> int:
        return self.held.used_bytes

    def compact(self) -> bool:
        """Give back the table's room once evictions and deletes left it sparse. True if it was."""
        return self.policy.compact()

    def _remember(self, key, size: int) -> None:
        self.policy.on_insert(key, size)

    def _forget(self, key) -> None:
        self.deadlines.discard(key)
        if key in self._promoting:  # its read may have begun: what it brings is not published
            self._voided.add(self._promoting[key])
        if key in self.policy:
            self.policy.on_remove(key)
            self._left_nvme(key)

    def expire_due(self) -> None:
        """Delete the NVMe objects past their TTL (housekeeping, every second): forgotten now,
        their records and extents deleted in the background."""
        now, due = time.time(), []
        for key in self.deadlines.due(now):
            if key in self._promoting:  # its reader holds the record: again at the next pass
                self.deadlines.add(key, now)
            elif key in self.policy:
                due.append(key)
        for key in due:
            self.policy.on_remove(key)
            self._left_nvme(key)
        if due:
            task = asyncio.get_running_loop().create_task(self._delete_keys(due))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            self.counters.num_expired += len(due)

    async def _delete_keys(self, keys: list[bytes]) -> None:
        for key in keys:
            await self._remove_record(key)

    # --- other paths ------------------------------------------------------------------------------

    async def flush_host(self) -> int:
        """On a clean stop, write the host objects NVMe lacks into its free room (server/tiering/
        nvme_flush.py). How many landed."""
        return await flush_host(self.host, self)

    def write_in_background(self, entry: ObjectEntry) -> None:
        task = asyncio.get_running_loop().create_task(self.write(entry))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def delete(self, namespace: str, oids) -> MaybeAwaitable[list[bool]]:
        """Delete NVMe copies: per id whether NVMe held it (live). Each is forgotten now, in
        the caller's step of the event loop (with the host tier's delete: a promotion under
        way then publishes nothing, a read misses), and its record removed after, in its
        key's turn. The awaitable, when any is held or being written or removed by another
        call, ends once none is: what a delete acknowledges stays deleted across a SIGKILL."""
        keys = [self.held.key(namespace, oid) for oid in oids]
        held = self.held.in_table(namespace, oids, keys)  # past their TTL too: they go now as well
        live = [h and not self.held.expired(key) for key, h in zip(keys, held)]
        for key, h in zip(keys, held):
            if h:
                self._forget(key)
        # A key another delete forgot whose removal has not ended gets a removal of its own:
        # acknowledged before that one ran, a SIGKILL brought the record back.
        pending = [key for key, h in zip(keys, held) if h or key in self._turns or key in self._removing]
        if not pending:
            return live
        for key in pending:
            self._removing[key] = self._removing.get(key, 0) + 1
        # Begun now, not when the caller awaits it (after a cluster's round trips perhaps).
        return self._acknowledged(self._to_end(self._removed(pending)), live)

    async def _removed(self, keys: list[bytes]) -> None:
        try:
            for key in keys:  # (a write of the key under way undoes itself: its entry was deleted)
                await self._remove_record(key)
        finally:
            for key in keys:
                left = self._removing.pop(key) - 1
                if left:
                    self._removing[key] = left

    @staticmethod
    async def _acknowledged(removal: asyncio.Task, live: list[bool]) -> list[bool]:
        await asyncio.shield(removal)
        return live

    def stats(self) -> dict:
        tier = dict(self.nvme.stats()) if self.nvme is not None else {}
        tier.update(asdict(self.counters), objects=len(self.policy), bandwidth_bytes_s=self.bandwidth_bytes_s,
                    write_policy=self.config.write_policy, num_admitted=self.admission.num_admitted)
        return tier

    def check_integrity(self) -> None:
        self.held.check_integrity()
        if self.nvme is not None:
            self.nvme.check_integrity()
