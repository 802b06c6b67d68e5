"""The sending side of the Mooncake pool as the remote tier (server/pool/link.py: PoolLink):
puts into the pool of objects leaving this node (host victims, NVMe evictions), of commits
(write_through) and of tier="remote" puts, and the deletes that must not be overtaken by a put
still in flight.

Made before NVMe, which hands it what it evicts or refuses (server/tiering/chain.py: Sends);
an NVMe copy it puts is read with the read NVMe hands it with the call. It owns the Mooncake
client and what both sides of the pool share: the header slots, the registered arenas, the
payload size a get guesses and the counters; and it keeps the set of objects the pool is known
to hold, made with the chain (server/tiering/chain.py: compose).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import numpy as np

from kvstore.peer_messages import RemoteMeta
from kvstore.pool_header import HEADER_BYTES, encode_header, pool_key
from kvstore.replies import CommitReply
from kvstore.server.events import MEDIUM_PEER
from kvstore.server.later import resolve
from kvstore.server.tiering.chain import ReadCopy
from kvstore.server.tiering.demotions import DemotionTally
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.allocator import Extent
from kvstore.tiers.mooncake.pool import MooncakePool
from kvstore.tiers.mooncake.scratch import HEADER_SLOTS, HeaderSlots

log = logging.getLogger("kvstore.mooncake")
# Keys per Mooncake call: a quarter of the header slots, so four batches run at once.
MAX_POOL_BATCH = HEADER_SLOTS // 4


@dataclass(slots=True)
class PoolReadCounters:  # the names of the peer tier's, so /metrics reports both alike
    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_lookups: int = 0
    num_deletes: int = 0
    num_checksum_failures: int = 0  # payloads that did not hash to their header's checksum
    num_header_failures: int = 0  # headers damaged or naming another object, namespace or size
    num_size_guesses_missed: int = 0  # gets whose payload was not the guessed size: a second call
    num_expired: int = 0  # objects found past their TTL (a miss; their key is removed)
    num_fetched_ahead: int = 0  # of the hits, those a get_many read ahead in batches
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass(slots=True)
class PoolWriteCounters:
    num_replicated: int = 0  # commits put into the pool (write_through)
    num_demoted_remote: int = 0  # objects put into the pool as they left this node
    num_demotion_failures: int = 0  # of those, the pool did not take (down, full, error)
    num_put_failures: int = 0  # every put the pool did not take (replication included)
    num_remote_puts: int = 0  # puts with tier="remote"
    num_remote_put_fallbacks: int = 0  # of those, the pool did not take: kept on this node


def address_of(buffer) -> tuple[int, np.ndarray]:
    """The address of a buffer's first byte, and the array that keeps it exported meanwhile."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    return array.ctypes.data, array


class PoolPuts:
    """What goes into the pool, and what both sides of the pool share (module docstring)."""

    def __init__(self, host, events, config, held: set, make_store=None):
        """host: the host tier, whose entries are put; events: the KV event stream; config:
        the `[remote.mooncake]` table; held: below. make_store: builds the Mooncake client (tests)."""
        self.host, self.events, self.config = host, events, config
        self.pool = MooncakePool(config, make_store)
        self.slots: HeaderSlots | None = None  # made at start (needs the loop)
        self.read = PoolReadCounters()
        self.write = PoolWriteCounters()
        # (namespace, digest) of objects held here that the pool is known to hold too: they
        # may leave this node without being put. Made with the chain, whose Departures forget
        # what leaves this node (server/tiering/chain.py).
        self.held = held
        self.registered: dict[str, int] = {}  # namespace -> arena address registered
        self.sizes: dict[str, int] = {}  # namespace -> the last payload size put or read: a get's guess
        self._in_flight: dict[tuple[str, bytes], asyncio.Future] = {}  # puts a delete waits for
        self._background: set[asyncio.Task] = set()
        self.demotions = DemotionTally(self.write)

    async def start(self) -> None:
        self.slots = HeaderSlots()
        await self.pool.register(self.slots.address, self.slots.nbytes)
        self.pool.start()  # set up in the background: a master down only delays the pool

    async def stop(self) -> None:
        """The background tasks cancelled, then the Mooncake client closed."""
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.pool.close()

    def key(self, namespace: str, oid) -> str:
        return pool_key(self.config.key_prefix, namespace, oid)

    async def register_arena(self, ns) -> None:
        """The namespace's whole arena, registered once: payloads move straight from and into it."""
        if ns.name not in self.registered:
            address, array = address_of(ns.arena.view(Extent(0, ns.arena.capacity_bytes)))
            del array  # the arena's mapping stays put until the daemon closes it, after stop()
            self.registered[ns.name] = address
            await self.pool.register(address, ns.arena.capacity_bytes)

    def spawn(self, coro) -> None:
        """A background task, cancelled at stop."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def putting(self, namespace: str, object_id) -> bool:
        """A put of this object is in flight from here."""
        return (namespace, object_id.digest) in self._in_flight

    async def _put(self, namespace: str, items: list[tuple]) -> list[bool]:
        """Put (object id, RemoteMeta, buffer) items of one namespace; per item whether the pool
        holds it now. The buffers must stay valid until this returns."""
        done = [False] * len(items)
        for start in range(0, len(items), MAX_POOL_BATCH):
            part = list(range(start, min(start + MAX_POOL_BATCH, len(items))))
            if not self.pool.usable():
                break
            slots = await self.slots.take(len(part))
            keep, keys, parts, sizes, indices = [], [], [], [], []
            try:
                for i, slot in zip(part, slots):
                    oid, meta, buffer = items[i]
                    try:
                        header = encode_header(oid, meta)
                    except ValueError as exc:
                        log.warning("event=pool_put_refused namespace=%s id=%s error=%r", namespace, oid, str(exc))
                        continue
                    self.slots.view(slot)[:] = header
                    address, array = address_of(buffer)
                    keep.append(array)
                    keys.append(self.key(namespace, oid))
                    parts.append([self.slots.address + self.slots.offset(slot)] + ([address] if meta.size else []))
                    sizes.append([HEADER_BYTES] + ([meta.size] if meta.size else []))
                    indices.append(i)
                for pin in (False, True):  # hints.pin: a soft pin in the pool (one Mooncake call each)
                    group = [k for k, i in enumerate(indices) if bool(items[i][1].hints.pin) == pin]
                    if not group:
                        continue
                    codes = await self.pool.put_from([keys[k] for k in group], [parts[k] for k in group],
                                                     [sizes[k] for k in group], soft_pin=pin)
                    for k, code in zip(group, codes):
                        done[indices[k]] = code == 0
                        if code == 0:
                            self.read.bytes_out += items[indices[k]][1].size
                            self.sizes[namespace] = items[indices[k]][1].size
            finally:
                del keep
                await self.slots.give(slots)
        self.write.num_put_failures += done.count(False)
        return done

    @contextlib.asynccontextmanager
    async def _sending(self, namespace: str, oid):
        """Around a put of one object: a delete waits for it, or the put would land after."""
        key = (namespace, oid.digest)
        future = asyncio.get_running_loop().create_future()
        previous = self._in_flight.get(key)
        self._in_flight[key] = future
        try:
            yield
        finally:
            future.set_result(None)
            if self._in_flight.get(key) is future:
                if previous is not None and not previous.done():
                    self._in_flight[key] = previous
                else:
                    del self._in_flight[key]

    async def put_entries(self, entries: list[ObjectEntry]) -> list[bool]:
        """Put host entries (held in place meanwhile); per entry whether the pool holds it."""
        results = [False] * len(entries)
        by_ns: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            ns = self.host.namespaces.get(entry.namespace)
            if ns is not None and ns.objects.holds(entry):  # not deleted or evicted
                by_ns.setdefault(entry.namespace, []).append(i)
        for name, indices in by_ns.items():
            ns = self.host.namespaces.get(name)  # still held after the awaits of the namespaces before?
            indices = [i for i in indices if ns is not None and ns.objects.holds(entries[i])]
            if not indices:
                continue
            with contextlib.ExitStack() as stack:
                items = []
                for i in indices:
                    e = entries[i]
                    view = stack.enter_context(self.host.held_view(e))
                    items.append((e.object_id, RemoteMeta(e.size, e.checksum, e.descriptor, e.hints, e.created_at), view))
                async with contextlib.AsyncExitStack() as sends:
                    for i in indices:
                        await sends.enter_async_context(self._sending(name, entries[i].object_id))
                    await self.register_arena(self.host.namespaces[name])
                    done = await self._put(name, items)
                del items
            for i, ok in zip(indices, done):
                results[i] = ok
                if ok:
                    self._stored(name, entries[i].object_id, entries[i].descriptor, entries[i].hints)
        return results

    def _stored(self, namespace: str, oid, descriptor, hints) -> None:
        self.held.add((namespace, oid.digest))
        self.events.stored(namespace, oid, MEDIUM_PEER, descriptor, hints)

    def must_send(self, namespace: str, object_id) -> bool:
        """Would this object be lost to the pool if it left this node now?"""
        return (namespace, object_id.digest) not in self.held

    def forget(self, namespace: str, object_id) -> None:
        """A delete of the object: it leaves `held` (what leaves by eviction, the chain's
        Departures drops from the same set)."""
        self.held.discard((namespace, object_id.digest))

    async def demote(self, entries: list[ObjectEntry]) -> None:
        """Host entries about to leave this node: put those the pool may lack. A failure is
        counted and logged, and the entry leaves anyway (as a cache eviction always could)."""
        sends = [e for e in entries if self.must_send(e.namespace, e.object_id)]
        if sends:
            self._count_demotions(sends, await self.put_entries(sends))

    async def demote_from_nvme(self, namespace: str, keys, read: ReadCopy) -> None:
        """NVMe objects (ObjectIds) about to be evicted: those the pool may lack are read
        (`read`, NVMe's: verified) and put."""
        oids = [oid for oid in keys if self.must_send(namespace, oid)]
        self._count_demotions(oids, [await self.put_from_nvme(namespace, oid, read) for oid in oids])

    async def put_from_nvme(self, namespace: str, oid, read: ReadCopy) -> bool | None:
        """Read an NVMe object (`read`, NVMe's: verified) and put it: whether the pool took it;
        None if the NVMe copy is gone or failed its check (counted by the NVMe tier)."""
        async with self._sending(namespace, oid):
            copy = await read(namespace, oid)
            if copy is None:
                return None
            meta, data = copy
            address = data.ctypes.data
            await self.pool.register(address, max(data.nbytes, 1))
            try:
                ok = (await self._put(namespace, [(oid, meta, data)]))[0]
            finally:
                await self.pool.unregister(address)
            if ok:
                self._stored(namespace, oid, meta.descriptor, meta.hints)
            return ok

    def _count_demotions(self, items, results) -> None:
        failed = self.demotions.count(items, results)
        if failed:
            log.warning("event=pool_demotion_failed objects=%d first=%s total=%d pool_up=%s full=%d", len(failed),
                        failed[0], self.write.num_demotion_failures, self.pool.up, self.pool.counters.num_pool_full)

    async def put_remote(self, entry: ObjectEntry) -> CommitReply:
        """A put with tier="remote": the reply waits until the pool holds the object, and the
        local copy goes (a later get reads it back from the pool, verified). If the pool does
        not take it (down, full) the copy stays and the reply says tier "host": nothing is
        lost, and nothing pretends."""
        self.write.num_remote_puts += 1
        ns = self.host.namespaces[entry.namespace]
        if not (await self.put_entries([entry]))[0]:
            self.write.num_remote_put_fallbacks += 1
            log.warning("event=remote_put_fallback namespace=%s id=%s pool_up=%s", entry.namespace, entry.object_id,
                        self.pool.up)
            return CommitReply(False, "host", "memory", ())
        if ns.objects.holds(entry):
            self.host.drop(ns, entry)  # forgets it here too
        return CommitReply(False, "remote", "memory", ())

    async def delete(self, namespace: str, ids, found) -> int:
        """After this node's delete (`found`: per id, or an awaitable of it), the pool's keys.
        Puts of these ids still in flight from here end first, so none lands after it."""
        found = list(await resolve(found))
        pending = [f for oid in ids if (f := self._in_flight.get((namespace, oid.digest))) is not None]
        if pending:
            await asyncio.wait(pending)
        for oid in ids:
            self.forget(namespace, oid)
        self.read.num_deletes += 1
        removed = [False] * len(ids)
        for start in range(0, len(ids), MAX_POOL_BATCH):
            if not self.pool.usable():
                break
            part = ids[start:start + MAX_POOL_BATCH]
            codes = await self.pool.remove([self.key(namespace, oid) for oid in part])
            for i, code in enumerate(codes):
                removed[start + i] = code == 0
        for oid in ids:
            self.events.removed(namespace, oid, MEDIUM_PEER)
        return sum(a or b for a, b in zip(found, removed))

