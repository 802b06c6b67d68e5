"""What peers ask of this node (the peer service's `PeerBackend`): reads, puts into this
node's host tier, lookups, deletes and pins, all against the local tiers.

A peer's put lands in an extent of its own, tracked as transient until the peer service has
verified the bytes against their xxh3-128; only then is it published. Room for it is made
without queueing behind this node's own sends (`FOR_PEER`): two nodes making room for each
other's puts must never wait for each other.
"""

from __future__ import annotations

import contextvars

from kvstore.errors import ChecksumError
from kvstore.peer_messages import RemoteMeta
from kvstore.server.tiering.objects import ObjectEntry, check_same_object, live_in
from kvstore.server.peer.service import PeerRead, PeerWrite

# Set in the task that makes room for a peer's put (and inherited by the sends it starts).
FOR_PEER: contextvars.ContextVar[bool] = contextvars.ContextVar("kvstore_for_peer", default=False)


class PeerServing:
    """Serves peers from this node's tiers (`local`: server/tiering/chain.py: LocalTiers).
    `held`: (namespace, digest) of objects held here that every remote home is known to hold
    too (shared with the other cluster roles); `sink`: where the host tier's victims go when
    a peer's put needs room (server/tiering/chain.py: victim_sink)."""

    def __init__(self, local, held: set, sink):
        self.host, self.nvme, self.here = local.host, local.nvme, local.here
        self.held, self.sink = held, sink

    @staticmethod
    def meta(entry: ObjectEntry) -> RemoteMeta:
        return RemoteMeta(entry.size, entry.checksum, entry.descriptor, entry.hints, entry.created_at)

    def _live(self, ns, object_id) -> ObjectEntry | None:
        return live_in(ns, object_id, self.host.clock())

    def read(self, namespace: str, object_id) -> PeerRead | None | object:
        ns = self.host.namespaces.get(namespace)
        entry = self._live(ns, object_id)
        if entry is None:
            if self.nvme.holds(namespace, object_id):
                return self._read_after_promotion(namespace, object_id)
            return None
        return self._lend(ns, entry)

    async def _read_after_promotion(self, namespace: str, object_id):
        entry = await self.nvme.promote(namespace, object_id)
        return None if entry is None else self._lend(self.host.namespaces[namespace], entry)

    def _lend(self, ns, entry: ObjectEntry) -> PeerRead:
        self.host.hold(entry)  # the extent stays put until the transfer ends
        view = ns.arena.view(entry.extent)[:entry.size]
        return PeerRead(self.meta(entry), view, lambda: self.host.release_hold(entry), entry.serial)

    def reserve(self, namespace: str, object_id, meta: RemoteMeta):
        if meta.descriptor.namespace != namespace:
            raise ChecksumError("peer put names another namespace in its descriptor")
        ns = self.host.namespaces.get(namespace)
        held = self._live(ns, object_id)
        if held is None and self.nvme.holds(namespace, object_id):
            held = self.nvme.remote_meta(namespace, object_id)
        if held is not None:  # the same state, or a Conflict (raised to a tier="remote" put)
            check_same_object(object_id, held.size, held.descriptor, meta.size, meta.descriptor)
            return None
        return self._reserve(namespace, object_id, meta)  # (a copy past its TTL is replaced at publish)

    async def _reserve(self, namespace: str, object_id, meta: RemoteMeta) -> PeerWrite:
        ns = await self.host.open_namespace(namespace)
        token = FOR_PEER.set(True)  # demotions this makes room with skip the send gate
        try:
            extent = await self.host.allocate(ns, meta.size, self.sink)
        finally:
            FOR_PEER.reset(token)
        self.host.track_transient(ns, extent, add=True)
        view = ns.arena.view(extent)[:meta.size]

        def commit() -> None:  # the peer service verified the bytes against meta.checksum
            self.host.track_transient(ns, extent, add=False)
            self.host.publish(ns, object_id, extent, meta.size, meta.checksum, meta.descriptor, meta.hints,
                                 pin_hint=True, created_at=meta.created_at)
            self.held.add((namespace, object_id.digest))  # the sender sends to every home

        def abort() -> None:
            self.host.track_transient(ns, extent, add=False)
            ns.arena.free(extent)

        return PeerWrite(view, commit, abort)

    def delete(self, namespace: str, ids):
        for oid in ids:
            self.held.discard((namespace, oid.digest))
        return self.here.delete_here(namespace, ids)

    def pin(self, namespace: str, ids, ttl_s, unpin: bool) -> list[bool]:
        return self.here.pin_here(namespace, ids, ttl_s, unpin)

    def lookup(self, namespace: str, ids) -> list[RemoteMeta | None]:
        ns = self.host.namespaces.get(namespace)
        mover = self.nvme
        found = []
        for oid in ids:
            entry = self._live(ns, oid)
            if entry is not None:
                found.append(self.meta(entry))
            elif mover.holds(namespace, oid):
                found.append(mover.remote_meta(namespace, oid))
            else:
                found.append(None)
        return found
