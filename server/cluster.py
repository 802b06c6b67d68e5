"""The daemon's part of a cluster: serves peers from the local tiers and asks peers on a miss.

    local put (commit) -> background copy to the object's home nodes (rendezvous hashing)
    local get miss     -> host, then NVMe, then the home nodes (one verified transfer)
    lookup             -> local tiers, then one batched round trip per home for the misses
    peer asks us       -> read / reserve / lookup against the tier manager (PeerBackend)

Bytes cross nodes only as a transfer between two owners, and every received object is
checked against its xxh3-128 before it is published (tiers/remote.py and the peer service
do the checking). A dead or cut-off peer costs at most cluster.peer_timeout_s, then a miss.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from kvstore.errors import CapacityError, ChecksumError
from kvstore.peer_messages import RemoteMeta
from server.objects import ObjectEntry
from server.peer_node import PeerNode
from server.peer_service import PeerRead, PeerWrite

log = logging.getLogger("kvstore.cluster")
DEFAULT_REMOTE_BANDWIDTH = 1e9


class ClusterLink:
    def __init__(self, manager, config):
        self.manager = manager
        self.config = config.cluster
        self.node = PeerNode(config.cluster, self)
        self._background: set[asyncio.Task] = set()
        self.num_replicated = 0
        # Remote load estimates: start from a loopback-TCP guess, then follow fetches.
        self.bandwidth_bytes_s = DEFAULT_REMOTE_BANDWIDTH

    async def start(self) -> None:
        await self.node.start()

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.node.stop()

    @property
    def remote(self):
        return self.node.remote

    # --- PeerBackend: what peers ask of this node --------------------------------------

    def _meta(self, entry: ObjectEntry) -> RemoteMeta:
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

    def _lend(self, ns, entry: ObjectEntry) -> PeerRead:
        self.manager.hold(entry)  # the extent stays put until the transfer ends
        view = ns.arena.view(entry.extent)[:entry.size]
        return PeerRead(self._meta(entry), view, lambda: self.manager.release_hold(entry))

    def reserve(self, namespace: str, object_id, meta: RemoteMeta):
        if meta.descriptor.namespace != namespace:
            raise ChecksumError("peer put names another namespace in its descriptor")
        ns = self.manager.namespaces.get(namespace)
        if ns is not None and object_id in ns.objects:
            return None
        if self.manager.mover is not None and self.manager.mover.holds(namespace, object_id):
            return None
        return self._reserve(namespace, object_id, meta)

    async def _reserve(self, namespace: str, object_id, meta: RemoteMeta) -> PeerWrite:
        ns = await self.manager.open_namespace(namespace)
        extent = await self.manager.allocate(ns, meta.size)
        self.manager.track_transient(ns, extent, add=True)
        view = ns.arena.view(extent)[:meta.size]

        def commit() -> None:  # the peer service verified the bytes against meta.checksum
            self.manager.track_transient(ns, extent, add=False)
            self.manager.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints)

        def abort() -> None:
            self.manager.track_transient(ns, extent, add=False)
            ns.arena.free(extent)

        return PeerWrite(view, commit, abort)

    def lookup(self, namespace: str, ids) -> list[RemoteMeta | None]:
        ns = self.manager.namespaces.get(namespace)
        mover = self.manager.mover
        found = []
        for oid in ids:
            entry = self._live(ns, oid)
            if entry is not None:
                found.append(self._meta(entry))
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
        return self.manager.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints)

    def replicate_in_background(self, entry: ObjectEntry) -> None:
        """Copy a fresh local put to its home nodes unless this node is the only home."""
        if self.remote is None or not self.remote.remote_homes(entry.object_id):
            return
        task = asyncio.get_running_loop().create_task(self._replicate(entry))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _replicate(self, entry: ObjectEntry) -> None:
        ns = self.manager.namespaces[entry.namespace]
        self.manager.hold(entry)
        try:
            view = ns.arena.view(entry.extent)[:entry.size]
            held = await self.remote.put(entry.namespace, entry.object_id, self._meta(entry), view)
            del view
            if held:
                self.num_replicated += 1
        finally:
            self.manager.release_hold(entry)

    async def lookup_remote(self, namespace: str, ids) -> list[RemoteMeta | None]:
        if self.remote is None:
            return [None] * len(ids)
        return await self.remote.lookup(namespace, list(ids))

    def stats(self) -> dict:
        stats = dict(self.node.stats())
        stats["num_replicated"] = self.num_replicated
        return stats
