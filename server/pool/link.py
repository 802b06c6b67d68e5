"""PoolLink: a Mooncake Store pool as the daemon's remote tier (`[remote] backend = "mooncake"`),
behind the surface the tiers above use of the peer tier (server/tiering/chain.py: Homes).

    local put (commit) -> write_through: background put into the pool; write_back: nothing yet
    leaving this node  -> an object evicted from its last local tier that the pool is not
                          known to hold is put there first (host victims, NVMe evictions)
    local get miss     -> host, then NVMe, then the pool: the header and the payload (its size
                          guessed: the namespace's last) straight into the arena in one call (a
                          wrong guess: a second call for the payload), checked against the
                          header's xxh3-128, published (a ranged get fetches the whole object,
                          then serves the ranges)
    local get_many     -> its misses read ahead together (MAX_POOL_BATCH a call), then served
    lookup             -> local tiers, then one batch_is_exist and one header read per batch
    delete             -> this node's tiers, then the pool's keys

Every pool value carries kvstore's own header (kvstore/pool_header.py: id, descriptor,
checksum); a read whose header or bytes do not match is a miss, counted, never published.
Namespaces are kept apart by the key (<key_prefix><namespace>/<id>).

The pool down (master unreachable, at start or later) costs misses and failed demotions,
counted; the local tiers keep serving. An object put with hints.pin is soft-pinned in the
pool; later pins and unpins stay local (Mooncake has no call for them). Mooncake has no
expiry: the header carries the put's time, and a read past the TTL is a miss that removes the
key. A put with tier="remote" returns once the pool holds it, and keeps no local copy.

Two sides: the puts (server/pool/puts.py: PoolPuts, made before NVMe, which hands it what it
evicts or refuses; it owns the Mooncake client and what both sides share), and this link, made
after NVMe: reads, the write_through copies (one evicted to NVMe meanwhile is read back from
there), and the surface the tiers above use.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import asdict

import xxhash

from kvstore.errors import CapacityError
from kvstore.identity import ObjectId
from kvstore.peer_messages import RemoteMeta
from kvstore.pool_header import HEADER_BYTES, PoolHeaderError, decode_header
from kvstore.server.events import MEDIUM_PEER
from kvstore.server.pool.master_metrics import read_master_metrics
from kvstore.server.pool.puts import MAX_POOL_BATCH, PoolPuts
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.allocator import Extent
from kvstore.tiers.mooncake.pool import INVALID_PARAMS
from kvstore.server.tiering.bandwidth import moving_bandwidth
from kvstore.server.tiering.chain import victim_sink

log = logging.getLogger("kvstore.mooncake")
# A clean stop sends the write_through copies still waiting, for at most this long.
STOP_COPIES_S = 30.0
DEFAULT_POOL_BANDWIDTH = 1e9  # load estimates start from a loopback-TCP guess, then follow fetches
KNOWN_SIZES = 65_536  # payload sizes learned from lookups' headers, kept for the gets that follow


class PoolLink:
    """The remote tier as the tiers above see it, for `[remote] backend = "mooncake"`."""

    remote = None  # no peer tier (no homes): the pool takes tier="remote" puts itself
    takes_remote_puts = True
    fetches_many = True  # a get_many's misses are read ahead together (fetch_many)
    # A ranged miss reads the whole object: the pool cannot check a part of an object against
    # the whole object's checksum, so it is fetched and verified, then the ranges are served
    # from the host tier like any local hit's.
    reads_ranges = False

    def __init__(self, local, puts: PoolPuts, config):
        """local: this node's tiers (server/tiering/chain.py: LocalTiers), which fetches land
        in; puts: the sending side (made before NVMe), which owns the Mooncake client and what
        both sides share; config: the `[remote.mooncake]` table."""
        self.host, self.nvme, self.events, self.traffic = local.host, local.nvme, local.events, local.traffic
        self.config, self.puts = config, puts
        self.sink = victim_sink(local, self)  # where host victims go when fetched bytes need room (its puts')
        self.pool, self.read, self.write = puts.pool, puts.read, puts.write
        self.bandwidth_bytes_s = DEFAULT_POOL_BANDWIDTH
        # (namespace, digest) -> payload size a lookup read in its header: a get's exact guess
        # (a hybrid model's chunks and states differ in size), least recently learned first out
        self._known: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._committed: list[ObjectEntry] = []  # write_through: commits not yet sent to the pool
        self._senders = 0  # tasks sending them (at most io_threads)

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.puts.start()

    async def stop(self) -> None:
        """A clean stop: the write_through copies still waiting for the clients to pause go
        first (no client is left to wait for), for at most STOP_COPIES_S; then the rest stops."""
        backlog, self._committed = self._committed, []
        if backlog and self.pool.up:
            try:
                await asyncio.wait_for(self._copy_committed(backlog), STOP_COPIES_S)
            except Exception as exc:  # (a timeout included) the copies are a cache's: the stop goes on
                log.warning("event=pool_stop_copies_failed objects=%d error=%r", len(backlog), exc)
        await self.puts.stop()

    async def _metas(self, namespace: str, ids: list, ask_master: bool = True) -> list[RemoteMeta | None]:
        """The verified header of each id the pool holds (None: not held, or a bad header).
        ask_master: a batch_is_exist first, so only held keys' headers are read (a lookup of
        many ids, most of them misses); a get reads its one header at once (a key the pool
        lacks answers OBJECT_NOT_FOUND, one round trip instead of two)."""
        found: list[RemoteMeta | None] = [None] * len(ids)
        scratch = self.puts.slots
        for start in range(0, len(ids), MAX_POOL_BATCH):
            part = list(range(start, min(start + MAX_POOL_BATCH, len(ids))))
            if not self.pool.usable():
                break
            held = part
            if ask_master:
                keys = [self.puts.key(namespace, ids[i]) for i in part]
                held = [i for i, code in zip(part, await self.pool.exist(keys)) if code == 1]
            if not held or not self.pool.usable():
                continue
            slots = await scratch.take(len(held))
            try:
                got = await self.pool.read_ranges(scratch.address, [self.puts.key(namespace, ids[i]) for i in held],
                                                  [scratch.offset(s) for s in slots], [0] * len(held),
                                                  [HEADER_BYTES] * len(held))
                for i, slot, n in zip(held, slots, got):
                    if n == HEADER_BYTES:  # else gone meanwhile, or shorter than a header
                        found[i] = self._decoded(namespace, ids[i], scratch.view(slot))
                        if found[i] is not None:
                            self._remember(namespace, ids[i], found[i].size)
            finally:
                await scratch.give(slots)
        return found

    def _remember(self, namespace: str, object_id, size: int) -> None:
        key = (namespace, object_id.digest)
        self._known[key] = size
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_SIZES:
            self._known.popitem(last=False)

    def _guess(self, namespace: str, object_id) -> int | None:
        """The payload size to read a value with: what a lookup found, else the namespace's last."""
        return self._known.get((namespace, object_id.digest)) or self.puts.sizes.get(namespace)

    def _decoded(self, namespace: str, object_id, header) -> RemoteMeta | None:
        """A header read from the pool, checked against the key it was read under (None: bad,
        or the object is past its TTL: Mooncake has no expiry, so its key is removed here)."""
        try:
            meta = decode_header(header, namespace, object_id)
        except PoolHeaderError as exc:
            self.read.num_header_failures += 1
            log.warning("event=pool_bad_header namespace=%s id=%s error=%r", namespace, object_id, exc.message)
            return None
        if meta.expired(time.time()):
            self.read.num_expired += 1
            if not self.puts.putting(namespace, object_id):  # not while a new put of it goes
                self.puts.spawn(self.pool.remove([self.puts.key(namespace, object_id)]))
            return None
        return meta

    async def lookup_remote(self, namespace: str, ids) -> list[RemoteMeta | None]:
        """What the pool holds of `ids` (ObjectIds, or raw digests off the local protocol)."""
        self.read.num_lookups += 1
        ids = [i if isinstance(i, ObjectId) else ObjectId(bytes(i)) for i in ids]
        metas = await self._metas(namespace, ids)
        for oid, meta in zip(ids, metas):
            if meta is None:
                self.events.removed(namespace, oid, MEDIUM_PEER)
        return metas

    async def fetch(self, namespace: str, object_id) -> ObjectEntry | None:
        """A local miss: the object from the pool into the host tier, verified, published."""
        self.read.num_gets += 1
        entry = await self._fetch(namespace, object_id)
        if entry is None:
            self.read.num_misses += 1
        return entry

    async def _fetch(self, namespace: str, object_id) -> ObjectEntry | None:
        if not self.pool.up:
            self.pool.usable()  # counts the skip
            return None
        ns = self.host.namespaces.get(namespace)  # None: no arena here yet, made once the pool has the object
        if ns is not None:
            await self.puts.register_arena(ns)
        start = time.perf_counter()
        guess = self._guess(namespace, object_id) if ns is not None else None
        guessed = (await self._read_guessed(ns, namespace, [object_id], [guess]))[0] if guess else None
        if guessed is None:  # not tried: no arena, no size to guess, or no room for it
            meta, extent = (await self._metas(namespace, [object_id], ask_master=False))[0], None
        else:
            meta, extent = guessed
        if meta is None:
            # A miss: the next get reads the header alone first, so that a run of misses does
            # not make room (evict) for payloads that are not there. A hit guesses again.
            self.puts.sizes.pop(namespace, None)
            self._known.pop((namespace, object_id.digest), None)
            self.events.removed(namespace, object_id, MEDIUM_PEER)
            return None
        if ns is None:
            ns = await self.host.open_namespace(namespace)
            await self.puts.register_arena(ns)
        filled = extent is not None  # the payload came with the header
        if not filled:
            try:
                extent = await self.host.allocate(ns, meta.size, self.sink)
            except CapacityError:
                return None
            self.host.track_transient(ns, extent, add=True)
        ok = False
        try:
            if not filled and self.pool.usable():
                key = self.puts.key(namespace, object_id)
                got = await self.pool.read_ranges(self.puts.registered[ns.name] + extent.offset, [key], [0],
                                                  [HEADER_BYTES], [meta.size])
                filled = got[0] == meta.size
            ok = filled and self._verified(ns, namespace, object_id, extent, meta)
        finally:
            if not ok or object_id in ns.objects:  # a miss, or a local put landed meanwhile
                self.host.track_transient(ns, extent, add=False)
                ns.arena.free(extent)
        if not ok:
            return None
        if object_id in ns.objects:
            return ns.objects[object_id]
        return self._publish_read(ns, namespace, object_id, extent, meta, time.perf_counter() - start)

    def _verified(self, ns, namespace: str, object_id, extent, meta: RemoteMeta) -> bool:
        """Does the payload read into `extent` hash to its header's checksum? (counted if not)"""
        view = ns.arena.view(extent)[:meta.size]
        ok = xxhash.xxh3_128_digest(view) == meta.checksum
        view.release()
        if not ok:
            self.read.num_checksum_failures += 1
            log.warning("event=pool_checksum_mismatch namespace=%s id=%s", namespace, object_id)
        return ok

    def _publish_read(self, ns, namespace: str, object_id, extent, meta: RemoteMeta, seconds: float) -> ObjectEntry:
        """A verified read from the pool becomes the local object (the extent is its)."""
        self.read.num_hits += 1
        self.read.bytes_in += meta.size
        self.puts.sizes[namespace] = meta.size
        self._known.pop((namespace, object_id.digest), None)  # held here now
        self.bandwidth_bytes_s = moving_bandwidth(self.bandwidth_bytes_s, meta.size, seconds)
        self.host.track_transient(ns, extent, add=False)
        self.puts.held.add((namespace, object_id.digest))
        return self.host.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints,
                                    created_at=meta.created_at)

    async def _read_guessed(self, ns, namespace: str, ids: list, guesses: list[int]) -> list:
        """Each id's whole value, header and payload, into the arena in one Mooncake call
        (`batch_get_into`, the fastest read Mooncake has: ~2x its ranged reads), the payload's
        size guessed (`_guess`: what a lookup read in its header, else the namespace's last
        one put or read here: a model's chunks are alike).
        Each lands in an extent of a header page plus the guess; a kept one gives the header
        page back. Per id (meta, extent holding the unverified payload, tracked as transient),
        or (meta, None) when the guess was wrong (read the payload as usual), or (None, None)
        for a miss; None: not known (a value larger than the guess, or no room for it: read the
        header first)."""
        out: list = [None] * len(ids)
        extents = []
        try:
            for guess in guesses:
                extents.append(await self.host.allocate(ns, HEADER_BYTES + guess, self.sink))
                self.host.track_transient(ns, extents[-1], add=True)
        except CapacityError:
            pass
        n = len(extents)
        if not n:
            return out
        kept, done = [False] * n, False
        try:
            base = self.puts.registered[ns.name]
            got = await self.pool.get_into([self.puts.key(namespace, oid) for oid in ids[:n]],
                                           [base + e.offset for e in extents], [HEADER_BYTES + g for g in guesses[:n]])
            for i, (oid, extent, code, guess) in enumerate(zip(ids, extents, got, guesses)):
                if code == INVALID_PARAMS:  # larger than the guess: nothing was read
                    self.read.num_size_guesses_missed += 1
                    continue
                meta = None
                if code >= HEADER_BYTES:
                    header = ns.arena.view(Extent(extent.offset, HEADER_BYTES))
                    meta = self._decoded(namespace, oid, header)
                    header.release()
                kept[i] = meta is not None and meta.size == guess and code == HEADER_BYTES + guess
                if meta is not None and not kept[i]:
                    self.read.num_size_guesses_missed += 1
                out[i] = (meta, None)
            done = True
        finally:
            for i, extent in enumerate(extents):
                self.host.track_transient(ns, extent, add=False)
                if not (done and kept[i]):  # (a call cut short keeps nothing)
                    ns.arena.free(extent)
                    continue
                payload = ns.arena.trim_front(extent, HEADER_BYTES)
                self.host.track_transient(ns, payload, add=True)
                out[i] = (out[i][0], payload)
        return out

    async def fetch_many(self, namespace: str, ids: list) -> None:
        """A get_many's local misses read ahead together: per MAX_POOL_BATCH ids one
        batch_is_exist and one read of those the pool holds (headers and payloads, sizes
        guessed), verified and published, so that the batch's
        own gets find them here. Best effort: what is not published (a miss, a wrong guess,
        no room, a local put meanwhile) the batch's per-object get fetches as usual, and
        counts; only what this publishes is counted here (a get and a hit)."""
        if not self.pool.up:
            return
        ns = await self.host.open_namespace(namespace)
        await self.puts.register_arena(ns)
        for first in range(0, len(ids), MAX_POOL_BATCH):
            part = ids[first:first + MAX_POOL_BATCH]
            start = time.perf_counter()
            part = [oid for oid in part if self._guess(namespace, oid)]  # a size to read with
            if not part:
                continue
            # Only what the master says the pool holds: room is made (evicting) for each one read.
            held = await self.pool.exist([self.puts.key(namespace, oid) for oid in part])
            part = [oid for oid, code in zip(part, held) if code == 1]
            if not part or not self.pool.up:
                continue
            found = await self._read_guessed(ns, namespace, part, [self._guess(namespace, oid) for oid in part])
            seconds = (time.perf_counter() - start) / max(1, len(part))
            for oid, got in zip(part, found):
                meta, extent = got if got is not None else (None, None)
                if extent is None:
                    continue
                if oid in ns.objects or not self._verified(ns, namespace, oid, extent, meta):
                    self.host.track_transient(ns, extent, add=False)
                    ns.arena.free(extent)
                    continue
                self.read.num_gets += 1
                self.read.num_fetched_ahead += 1
                self._publish_read(ns, namespace, oid, extent, meta, seconds)

    # --- writes --------------------------------------------------------------------------

    def on_commit(self, entry: ObjectEntry) -> None:
        """A local put committed: under write_through, put it into the pool in the background.
        Commits queue, and each of up to io_threads senders puts what has queued as one batch
        (one Mooncake call for many commits), so a run of puts costs the pool few round trips."""
        if self.config.remote_write == "write_through" and self.pool.up:
            self._committed.append(entry)
            if self._senders < self.config.io_threads:
                self._senders += 1
                self.puts.spawn(self._replicate())

    async def _replicate(self) -> None:
        cfg = self.config
        try:
            while self._committed:
                if cfg.write_through_yield_ms > 0:  # the clients first (server/traffic.py)
                    await self.traffic.pause(cfg.write_through_quiet_ms / 1000, cfg.write_through_yield_ms / 1000)
                    if not self._committed:
                        break
                batch, self._committed = self._committed[:MAX_POOL_BATCH], self._committed[MAX_POOL_BATCH:]
                await self._copy_committed(batch)
        finally:
            self._senders -= 1

    async def _copy_committed(self, entries: list[ObjectEntry]) -> None:
        """Put committed entries into the pool (write_through), counted; one evicted to NVMe
        while its copy waited is read back from there (verified) and put."""
        done = await self.puts.put_entries(entries)
        self.write.num_replicated += sum(done)  # (not `+= await`: that reads the count before)
        for entry, ok in zip(entries, done):
            name, oid = entry.namespace, entry.object_id
            ns = self.host.namespaces.get(name)
            if not ok and not (ns is not None and ns.objects.holds(entry)) and self.puts.must_send(name, oid) \
                    and self.nvme.holds(name, oid):
                self.write.num_replicated += bool(await self.puts.put_from_nvme(name, oid, self.nvme.read_copy))

    def victim_sink(self, host):
        """The host tier's victims, with no NVMe tier: copied into the pool, then evicted."""
        return host.copy_then_evict(self.puts.demote)

    # --- what goes into the pool: the sending side's (server/pool/puts.py) -------------------

    def put_remote(self, entry: ObjectEntry):
        """A put with tier="remote": the commit's reply waits for the pool (PoolPuts.put_remote)."""
        return self.puts.put_remote(entry)

    def delete_everywhere(self, namespace: str, ids, found):
        """After this node's delete (`found`), the pool's keys (PoolPuts.delete)."""
        return self.puts.delete(namespace, ids, found)

    def pin_everywhere(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]) -> int:
        """Pins and unpins of held objects stay on this node: Mooncake 0.3.13 sets a soft pin only
        as a value is put (docs/architecture.md, "Pins and TTLs in the pool")."""
        return sum(here)

    async def pool_status(self) -> dict:
        """The pool as /v1/cluster and `kvstore status` show it: where it is, whether this
        daemon's client reaches it, what the master says it holds (master_metrics_url), and
        this daemon's counters."""
        cfg = self.config
        held, held_error = None, "master_metrics_url is not set"
        if cfg.master_metrics_url:
            held, held_error = await read_master_metrics(cfg.master_metrics_url)
        return {"backend": "mooncake", "master": cfg.master, "metadata_server": cfg.metadata_server,
                "protocol": cfg.protocol, "tenant_id": cfg.tenant_id, "key_prefix": cfg.key_prefix,
                "replicas": cfg.replicas, "remote_write": cfg.remote_write,
                "write_through_backlog": len(self._committed), "up": self.pool.up,
                "last_error": None if self.pool.up else self.pool.last_error, "held": held,
                "held_error": held_error if held is None else None,
                "counters": {**asdict(self.read), **asdict(self.write), **asdict(self.pool.counters)}}

    def stats(self) -> dict:
        return {"backend": "mooncake", "pool": self.pool.stats(), "remote": asdict(self.read),
                **asdict(self.write), "remote_write": self.config.remote_write}
