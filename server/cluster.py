"""The daemon's part of a cluster: serves peers from the local tiers and asks peers on a miss.

    local put (commit) -> write_through: background copy to the object's home nodes
                          (rendezvous hashing); write_back: nothing yet
    put tier="remote"  -> the commit waits for the homes; the local copy goes unless this
                          node is a home itself
    leaving this node  -> an object evicted from its last local tier that its homes are not
                          known to hold is sent there first (demotion to tier "remote")
    local get miss     -> host, then NVMe, then the home nodes (one verified transfer);
                          a get with byte ranges fetches only those, leased, not published
    lookup             -> local tiers, then one batched round trip per home for the misses
    delete             -> this node's tiers, then every live member
    membership change  -> objects held here are copied to their new homes (server.rehome)
    pin / unpin        -> this node's host copies, then the homes' (scope "cluster")
    peer asks us       -> read / reserve / lookup / delete / pin against the tier manager

Bytes cross nodes only as a transfer between two owners, and every received object is
checked against its xxh3-128 before it is published (tiers/remote/ and the peer service
do the checking). A dead or cut-off peer costs at most cluster.peer_timeout_s, then a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import time

import numpy as np

from kvstore.errors import CapacityError, ChecksumError, Conflict
from kvstore.identity import descriptor_differences
from kvstore.peer_messages import RemoteMeta
from kvstore.ranges import check_within, total as ranges_total
from kvstore.replies import MISS, CommitReply, GetReply
from server.objects import ObjectEntry, check_same_object
from server.peer_node import PeerNode
from server.peer_service import PeerRead, PeerWrite
from server.rehome import Rehomer
from tiers.remote import MAX_LINKS_PER_PEER

log = logging.getLogger("kvstore.cluster")
DEFAULT_REMOTE_BANDWIDTH = 1e9
# Set in the task that makes room for a peer's put (and inherited by the sends it starts).
_FOR_PEER: contextvars.ContextVar[bool] = contextvars.ContextVar("kvstore_for_peer", default=False)


class ClusterLink:
    def __init__(self, manager, config):
        self.manager = manager
        self.config = config.cluster
        self.rehomer = Rehomer(self, config.cluster) if config.cluster.rehome else None
        self.node = PeerNode(config.cluster, self, on_members=self.on_members, on_peer_state=self.on_peer_state)
        self._background: set[asyncio.Task] = set()
        # (namespace, digest) of objects held here that every remote home is known to hold
        # too: they may leave this node without being sent. Only objects held here are kept,
        # and only for the member list of the day (homes move when it changes).
        self._held: set[tuple[str, bytes]] = set()
        # Sends in flight per object: a delete waits for them, or the copy would land after it.
        self._sending: dict[tuple[str, bytes], list[asyncio.Future]] = {}
        # Every send to peers (commit copies, demotions, re-homing) passes this gate: a burst
        # queues here instead of timing out on the remote tier's link pool (which would mark
        # a healthy peer down).
        self.gate = asyncio.Semaphore(MAX_LINKS_PER_PEER)
        self._demotion_log_at = -math.inf
        self.counters = {"num_replicated": 0, "num_demoted_remote": 0, "num_demotion_failures": 0,
                         "num_remote_puts": 0, "num_remote_put_fallbacks": 0}
        # Remote load estimates: start from a loopback-TCP guess, then follow fetches.
        self.bandwidth_bytes_s = DEFAULT_REMOTE_BANDWIDTH

    async def start(self) -> None:
        await self.node.start()
        if self.rehomer is not None:
            self.rehomer.begin(self.node.membership.members())

    async def stop(self) -> None:
        if self.rehomer is not None:
            if self.config.membership != "static" and self.config.handover_s > 0 and self.remote is not None:
                await self.rehomer.hand_over(self.config.handover_s)  # while still a member
            self.rehomer.stop()
        for task in list(self._background):
            task.cancel()
        await self.node.stop()

    @property
    def remote(self):
        return self.node.remote

    def on_members(self, members) -> None:
        """Membership changed: homes moved, so "the homes hold it" must be learned again."""
        self._held.clear()
        if self.rehomer is not None:
            self.rehomer.on_members(members)

    def on_peer_state(self, node: str, up: bool) -> None:
        """A peer was marked down, or answers again. A member back up may lack what it is
        home to (copies that failed while it was down, its memory if it restarted), and the
        member list need not have changed (a static list; etcd when it was back within its
        lease): "the homes hold it" must be learned again, and the re-homer sends it what
        it lacks."""
        if not up:
            return
        self._held.clear()
        if self.rehomer is not None:
            self.rehomer.on_peer_back(node)

    @contextlib.asynccontextmanager
    async def sending(self, namespace: str, object_id):
        """Around one send of an object to peers: gated, and visible to a delete."""
        key = (namespace, object_id.digest)
        done = asyncio.get_running_loop().create_future()
        self._sending.setdefault(key, []).append(done)
        try:
            if _FOR_PEER.get():  # room for a peer's put: never queue behind our own sends
                yield            # to that peer (two nodes could each wait for the other)
            else:
                async with self.gate:
                    yield
        finally:
            done.set_result(None)
            waiting = self._sending[key]
            waiting.remove(done)
            if not waiting:
                del self._sending[key]

    # --- PeerBackend: what peers ask of this node --------------------------------------

    def meta(self, entry: ObjectEntry) -> RemoteMeta:
        return RemoteMeta(entry.size, entry.checksum, entry.descriptor, entry.hints)

    def _live(self, ns, object_id) -> ObjectEntry | None:
        """The entry, unless absent or past its TTL (a local get would drop it as expired)."""
        entry = ns.objects.get(object_id) if ns is not None else None
        return entry if entry is not None and entry.expires_at > self.manager.clock() else None

    def read(self, namespace: str, object_id) -> PeerRead | None | object:
        ns = self.manager.namespaces.get(namespace)
        entry = self._live(ns, object_id)
        if entry is None:
            mover = self.manager.mover
            if mover is not None and mover.holds(namespace, object_id):
                return self._read_after_promotion(namespace, object_id)
            return None
        return self._lend(ns, entry)

    async def _read_after_promotion(self, namespace: str, object_id):
        entry = await self.manager.mover.promote(namespace, object_id)
        return None if entry is None else self._lend(self.manager.namespaces[namespace], entry)

    @contextlib.contextmanager
    def held_view(self, entry: ObjectEntry):
        """The entry's bytes in the arena, its extent kept in place (a held reader) meanwhile."""
        self.manager.hold(entry)
        try:
            yield self.manager.namespaces[entry.namespace].arena.view(entry.extent)[:entry.size]
        finally:
            self.manager.release_hold(entry)

    def _lend(self, ns, entry: ObjectEntry) -> PeerRead:
        self.manager.hold(entry)  # the extent stays put until the transfer ends
        view = ns.arena.view(entry.extent)[:entry.size]
        return PeerRead(self.meta(entry), view, lambda: self.manager.release_hold(entry), entry.serial)

    def reserve(self, namespace: str, object_id, meta: RemoteMeta):
        if meta.descriptor.namespace != namespace:
            raise ChecksumError("peer put names another namespace in its descriptor")
        ns = self.manager.namespaces.get(namespace)
        held = self._live(ns, object_id)
        if held is None and self.manager.mover is not None and self.manager.mover.holds(namespace, object_id):
            held = self.manager.mover.remote_meta(namespace, object_id)
        if held is not None:  # the same state, or a Conflict (raised to a tier="remote" put)
            check_same_object(object_id, held.size, held.descriptor, meta.size, meta.descriptor)
            return None
        if ns is not None and object_id in ns.objects:
            return None
        return self._reserve(namespace, object_id, meta)

    async def _reserve(self, namespace: str, object_id, meta: RemoteMeta) -> PeerWrite:
        ns = await self.manager.open_namespace(namespace)
        token = _FOR_PEER.set(True)  # demotions this makes room with skip the gate (see `sending`)
        try:
            extent = await self.manager.allocate(ns, meta.size)
        finally:
            _FOR_PEER.reset(token)
        self.manager.track_transient(ns, extent, add=True)
        view = ns.arena.view(extent)[:meta.size]

        def commit() -> None:  # the peer service verified the bytes against meta.checksum
            self.manager.track_transient(ns, extent, add=False)
            self.manager.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints,
                                 pin_hint=True)
            self._held.add((namespace, object_id.digest))  # the sender sends to every home

        def abort() -> None:
            self.manager.track_transient(ns, extent, add=False)
            ns.arena.free(extent)

        return PeerWrite(view, commit, abort)

    def delete(self, namespace: str, ids):
        for oid in ids:
            self._held.discard((namespace, oid.digest))
        return self.manager.delete_here(namespace, ids)

    def pin(self, namespace: str, ids, ttl_s, unpin: bool) -> list[bool]:
        return self.manager.pin_here(namespace, ids, ttl_s, unpin)

    def lookup(self, namespace: str, ids) -> list[RemoteMeta | None]:
        ns = self.manager.namespaces.get(namespace)
        mover = self.manager.mover
        found = []
        for oid in ids:
            entry = self._live(ns, oid)
            if entry is not None:
                found.append(self.meta(entry))
            elif mover is not None and mover.holds(namespace, oid):
                found.append(mover.remote_meta(namespace, oid))
            else:
                found.append(None)
        return found

    # --- this node asking peers ------------------------------------------------------------

    async def fetch(self, namespace: str, object_id) -> ObjectEntry | None:
        """A local miss: get the object from its home nodes into the host tier, verified."""
        if self.remote is None:
            return None
        ns = await self.manager.open_namespace(namespace)
        landed: dict = {}

        def alloc(meta: RemoteMeta):
            # Called again for the next home when one failed or sent bad bytes: free the
            # previous landing place first, or its extent leaks (transient forever).
            old = landed.pop("extent", None)
            if old is not None:
                self.manager.track_transient(ns, old, add=False)
                ns.arena.free(old)
            landed.pop("staged", None)
            extent = ns.arena.alloc(meta.size)  # room already free: receive in place
            if extent is not None:
                self.manager.track_transient(ns, extent, add=True)
                landed["extent"] = extent
                return ns.arena.view(extent)[:meta.size]
            landed["staged"] = np.empty(meta.size, dtype=np.uint8)  # no room yet: stage, copy after
            return landed["staged"]

        start = time.perf_counter()
        try:
            meta = await self.remote.get_into(namespace, object_id, alloc)
        except BaseException:
            extent = landed.get("extent")
            if extent is not None:  # a failure that escaped: give the landing place back
                self.manager.track_transient(ns, extent, add=False)
                ns.arena.free(extent)
            raise
        extent = landed.get("extent")
        if extent is not None:
            self.manager.track_transient(ns, extent, add=False)
        if meta is not None:
            seconds = max(time.perf_counter() - start, 1e-6)
            self.bandwidth_bytes_s = 0.8 * self.bandwidth_bytes_s + 0.2 * meta.size / seconds
        if meta is None or object_id in ns.objects:  # a miss, or a local put landed meanwhile
            if extent is not None:
                ns.arena.free(extent)
            return ns.objects.get(object_id)
        if extent is None:  # staged: make room now and copy the verified bytes in
            try:
                extent = await self.manager.allocate(ns, meta.size)
            except CapacityError:
                return None
            np.copyto(np.frombuffer(ns.arena.view(extent), dtype=np.uint8)[:meta.size], landed["staged"])
        self._held.add((namespace, object_id.digest))  # a home had it
        return self.manager.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints)

    async def get_ranges(self, owner, namespace: str, object_id, accept, ranges: tuple, expect=None) -> GetReply:
        """A local miss of a reader that needs only `ranges` (kvstore.ranges): fetch just those
        bytes from a home and lease them; nothing is published here. As in `fetch`, room is
        taken only once a home has answered: free room at once, else the bytes are staged and
        room is made (evicting) only for a verified hit."""
        mgr = self.manager
        ns = mgr.namespaces[namespace]
        size, landed = ranges_total(ranges), {}

        def alloc(meta: RemoteMeta):
            check_within(ranges, meta.size)  # a home that did not check must not make us allocate
            if accept is not None and meta.descriptor.dtype not in accept:
                landed["refused"] = f"stored as {meta.descriptor.dtype.value}, not in accept list"
                return None  # the bytes are drained, not kept
            if expect is not None and meta.descriptor != expect:
                landed["refused"] = f"stored as {descriptor_differences(meta.descriptor, expect)}"
                return None
            if "extent" not in landed:  # a second home reuses the first one's landing place
                extent = ns.arena.alloc(size)
                if extent is None:
                    return landed.setdefault("staged", np.empty(size, dtype=np.uint8))
                mgr.track_transient(ns, extent, add=True)
                landed["extent"] = extent
            return ns.arena.view(landed["extent"])[:size]

        lease_id, got = None, None
        try:
            if self.remote is not None and self.remote.remote_homes(object_id):
                got = await self.remote.get_ranges_into(namespace, object_id, ranges, alloc)
            if got is not None and "extent" not in landed:  # staged: make room for a verified hit
                try:
                    extent = await mgr.allocate(ns, size)
                except CapacityError:
                    got = None
                else:
                    mgr.track_transient(ns, extent, add=True)
                    landed["extent"] = extent
                    np.copyto(np.frombuffer(ns.arena.view(extent), dtype=np.uint8)[:size], landed["staged"])
            if got is not None:
                lease_id = mgr.grant_ranged(owner, ns, object_id, landed["extent"])
        finally:
            if lease_id is None:
                ns.counters.num_misses += 1  # a miss, a refusal or an error
                extent = landed.get("extent")
                if extent is not None:  # the landing place goes back
                    mgr.track_transient(ns, extent, add=False)
                    ns.arena.free(extent)
        if lease_id is None:
            if "refused" in landed:
                return GetReply(False, landed["refused"])
            return MISS
        meta, checksum = got
        ns.counters.num_hits += 1
        ns.counters.bytes_out += size
        return GetReply(True, lease=lease_id, offset=landed["extent"].offset, size=size, checksum=checksum,
                        tier="remote", descriptor=meta.descriptor.to_wire(), ranges=ranges, object_size=meta.size)

    def on_commit(self, entry: ObjectEntry) -> None:
        """A local put committed: under write_through, copy it to its homes in the background."""
        if self.config.remote_write == "write_through" and self.remote is not None \
                and self.remote.remote_homes(entry.object_id):
            task = asyncio.get_running_loop().create_task(self._replicate(entry))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _replicate(self, entry: ObjectEntry) -> None:
        if await self._send(entry):
            self.counters["num_replicated"] += 1

    async def _send(self, entry: ObjectEntry) -> bool:
        """Send a host entry to every remote home. True once all of them hold it."""
        return (await self._send_to_homes(entry))[1]

    async def _send_to_homes(self, entry: ObjectEntry, raising: bool = False) -> tuple[list[str], bool]:
        """Send a host entry to every remote home: (the remote homes that hold it now, whether
        all of them do). raising: a home's Conflict is raised (tiers.remote.RemoteTier.put)."""
        ns = self.manager.namespaces[entry.namespace]
        if ns.objects.get(entry.object_id) is not entry:
            return [], False  # deleted or evicted before its turn: its extent may be reused
        homes = self.remote.remote_homes(entry.object_id)
        async with self.sending(entry.namespace, entry.object_id):
            if ns.objects.get(entry.object_id) is not entry:
                return [], False
            with self.held_view(entry) as view:
                held = await self.remote.put(entry.namespace, entry.object_id, self.meta(entry), view, raising)
        if held and set(held) >= set(homes):
            if ns.objects.get(entry.object_id) is entry:
                self._held.add((entry.namespace, entry.object_id.digest))
            return held, True
        return held, False

    # --- demotion to tier "remote" -----------------------------------------------------------

    def must_send(self, namespace: str, object_id) -> bool:
        """Would this object be lost to the cluster if it left this node now?"""
        return ((namespace, object_id.digest) not in self._held and self.remote is not None
                and bool(self.remote.remote_homes(object_id)))

    def forget(self, namespace: str, object_id) -> None:
        """The object left this node (evicted from its last tier, or deleted)."""
        self._held.discard((namespace, object_id.digest))

    async def demote(self, entries: list[ObjectEntry]) -> None:
        """Host entries about to leave this node: send the ones their homes may lack, in
        parallel. Each send is bounded by the peer timeout; a failure is counted and logged
        and the entry leaves anyway (as a cache eviction always could)."""
        sends = [e for e in entries if self.must_send(e.namespace, e.object_id)]
        results = await asyncio.gather(*(self._send(e) for e in sends)) if sends else []
        self._count_demotions(sends, results)

    async def demote_from_nvme(self, namespace: str, keys) -> None:
        """NVMe objects (ObjectIds) about to be evicted: read, verify and send those the
        homes may lack."""
        oids = [oid for oid in keys if self.must_send(namespace, oid)]
        results = await asyncio.gather(*(self._send_from_nvme(namespace, oid) for oid in oids)) if oids else []
        self._count_demotions(oids, results)

    async def _send_from_nvme(self, namespace: str, oid) -> bool | None:
        async with self.sending(namespace, oid):
            copy = await self.manager.mover.read_copy(namespace, oid)
            if copy is None:
                return None  # gone, or failed its check (counted by the NVMe tier)
            meta, data = copy
            homes = self.remote.remote_homes(oid)
            return set(await self.remote.put(namespace, oid, meta, data)) >= set(homes)

    def _count_demotions(self, items, results) -> None:
        failed = []
        for item, ok in zip(items, results):
            if ok is None:
                continue
            self.counters["num_demoted_remote" if ok else "num_demotion_failures"] += 1
            if not ok:
                failed.append(getattr(item, "object_id", item))
        # With a home down every eviction fails alike: one line per second, not one per object.
        now = time.monotonic()
        if failed and now - self._demotion_log_at >= 1.0:
            self._demotion_log_at = now
            log.warning("event=remote_demotion_failed objects=%d first=%s homes=%s total=%d", len(failed), failed[0],
                        ",".join(self.remote.remote_homes(failed[0])), self.counters["num_demotion_failures"])

    async def put_remote(self, entry: ObjectEntry) -> CommitReply:
        """An explicit put with tier="remote": the reply waits until the homes hold it. The
        local copy stays only where this node is a home itself, or where no home could take
        it (the reply then says tier "host": nothing is lost, and nothing pretends)."""
        self.counters["num_remote_puts"] += 1
        homes = self.remote.homes(entry.object_id)
        held, sent = [], True
        ns = self.manager.namespaces[entry.namespace]
        if self.remote.remote_homes(entry.object_id):
            try:
                held, sent = await self._send_to_homes(entry, raising=True)
            except Conflict:  # a home holds this id as another state: the put is refused here too
                if ns.objects.get(entry.object_id) is entry:
                    self.manager.drop(ns, entry)
                raise
        if not sent:
            self.counters["num_remote_put_fallbacks"] += 1
            log.warning("event=remote_put_fallback namespace=%s id=%s homes=%s", entry.namespace, entry.object_id,
                        ",".join(homes))
            # Every home that holds it: this node (it keeps its copy) and those the send reached.
            return CommitReply(False, "host", "memory", tuple(n for n in homes if n == self.node.node_id or n in held))
        if self.node.node_id not in homes and ns.objects.get(entry.object_id) is entry:
            self.manager.drop(ns, entry)  # forgets it here too
            return CommitReply(False, "remote", "memory", tuple(homes))
        return CommitReply(False, "host" if self.node.node_id in homes else "remote", "memory", tuple(homes))

    async def delete_everywhere(self, namespace: str, ids, found) -> int:
        """After this node's delete (`found`: per id, or an awaitable of it), every member's.
        Sends of these ids still in flight from here finish first (each is bounded by the
        peer timeout), so none lands after the delete."""
        if not isinstance(found, list):
            found = await found
        for oid in ids:
            self.forget(namespace, oid)
        pending = [f for oid in ids for f in self._sending.get((namespace, oid.digest), ())]
        if pending:  # queued ones give up at once (their entry is gone); bounded regardless
            await asyncio.wait(pending, timeout=4 * self.config.peer_timeout_s)
        remote = await self.remote.delete(namespace, list(ids))
        return sum(a or b for a, b in zip(found, remote))

    async def pin_everywhere(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]) -> int:
        """After this node's pins (`here`, per id), the homes': how many ids were pinned somewhere."""
        remote = await self.remote.pin(namespace, list(ids), ttl_s, unpin)
        return sum(a or b for a, b in zip(here, remote))

    async def lookup_remote(self, namespace: str, ids) -> list[RemoteMeta | None]:
        if self.remote is None:
            return [None] * len(ids)
        return await self.remote.lookup(namespace, list(ids))

    def stats(self) -> dict:
        stats = dict(self.node.stats())
        stats.update(self.counters, remote_write=self.config.remote_write)
        if self.rehomer is not None:
            stats["rehome"] = self.rehomer.stats()
        return stats
