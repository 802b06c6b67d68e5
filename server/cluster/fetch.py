"""A local miss fetched from the object's home nodes: the whole object (published here) or
only some byte ranges of it (leased to the reader, never published).

Both land the same way (`Landing`): in place in the arena when room is free, else in a
staging buffer that is copied in only once a home's bytes were verified, room being made
(evicting) then and only then. A home that fails or sends bad bytes gives its landing place
back before the next home is asked. A namespace with no arena here yet lands staged, and its
arena is made only once a home answered with the object: a miss makes none, and the chain is
walked once (the homes asked once), as for any other get.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from kvstore.errors import CapacityError
from kvstore.identity import read_refusal
from kvstore.peer_messages import RemoteMeta
from kvstore.ranges import check_within, total as ranges_total
from kvstore.server.events import MEDIUM_PEER
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.server.tiering.bandwidth import moving_bandwidth
from kvstore.tiers.allocator import Extent

DEFAULT_REMOTE_BANDWIDTH = 1e9


class RangesFetched(NamedTuple):
    """Some byte ranges of an object, fetched and verified, packed in `extent` (transient)."""
    extent: Extent
    meta: RemoteMeta
    checksum: bytes  # of the packed ranges, as the home computed and this node verified


class Landing:
    """Where one transfer's bytes land in a namespace's arena (see the module docstring).
    An extent it holds is tracked as transient until `keep` hands it over. `ns`: None while
    the namespace has no arena here (opened by `settle`)."""

    def __init__(self, host, namespace: str, sink):
        """sink: where the host tier's victims go when room is made (server/tiering/chain.py: victim_sink)."""
        self.host, self.name, self.ns, self.sink = host, namespace, host.namespaces.get(namespace), sink
        self.extent = None
        self.staged: np.ndarray | None = None

    def place(self, size: int):
        """A buffer for `size` bytes: free room in the arena, else a staging buffer."""
        self.give_back()
        extent = None if self.ns is None else self.ns.arena.alloc(size)  # room already free: receive in place
        if extent is None:
            self.staged = np.empty(size, dtype=np.uint8)  # no room yet: stage, copy after
            return self.staged
        self.host.track_transient(self.ns, extent, add=True)
        self.extent = extent
        return self.ns.arena.view(extent)[:size]

    async def settle(self, size: int):
        """After a verified hit: the extent holding the bytes (room made and staged bytes
        copied in if they were staged), or None when no room can be made. Makes the
        namespace's arena if it has none yet."""
        if self.extent is None:
            if self.ns is None:
                self.ns = await self.host.open_namespace(self.name)
            try:
                extent = await self.host.allocate(self.ns, size, self.sink)
            except CapacityError:
                return None
            self.host.track_transient(self.ns, extent, add=True)
            self.extent = extent
            np.copyto(np.frombuffer(self.ns.arena.view(extent), dtype=np.uint8)[:size], self.staged)
            self.staged = None
        return self.extent

    def keep(self, untrack: bool):
        """Hand the extent over (to the index, `untrack`; or to a lease that untracks it when
        it ends): this landing no longer frees it."""
        extent, self.extent = self.extent, None
        if untrack:
            self.host.track_transient(self.ns, extent, add=False)
        return extent

    def give_back(self) -> None:
        if self.extent is not None:
            self.host.track_transient(self.ns, self.extent, add=False)
            self.ns.arena.free(self.extent)
            self.extent = None
        self.staged = None


class Fetcher:
    """Fetches local misses from home nodes. `held` is shared with the other cluster roles."""

    def __init__(self, local, node, held: set, sink):
        """local: this node's tiers (server/tiering/chain.py: LocalTiers), which fetches land
        in, room made by `sink` (server/tiering/chain.py: victim_sink)."""
        self.host, self.events, self.node, self.held, self.sink = local.host, local.events, node, held, sink
        # Remote load estimates: start from a loopback-TCP guess, then follow fetches.
        self.bandwidth_bytes_s = DEFAULT_REMOTE_BANDWIDTH

    async def fetch(self, namespace: str, object_id) -> ObjectEntry | None:
        """A local miss: get the object from its home nodes into the host tier, verified."""
        remote = self.node.remote
        if remote is None:
            return None
        landing = Landing(self.host, namespace, self.sink)
        start = time.perf_counter()
        try:
            meta = await remote.get_into(namespace, object_id, lambda meta: landing.place(meta.size))
        except BaseException:
            landing.give_back()  # a failure that escaped: give the landing place back
            raise
        if meta is not None:
            self.bandwidth_bytes_s = moving_bandwidth(self.bandwidth_bytes_s, meta.size, time.perf_counter() - start)
        put_meanwhile = landing.ns is not None and object_id in landing.ns.objects  # a local put landed
        if meta is None or put_meanwhile:
            landing.give_back()
            if meta is None:  # the homes no longer hold it (or are down): not a PEER holding now
                self.events.removed(namespace, object_id, MEDIUM_PEER)
            return None if landing.ns is None else landing.ns.objects.get(object_id)
        if await landing.settle(meta.size) is None:  # (a put landing meanwhile wins in publish)
            return None
        ns = landing.ns
        self.held.add((namespace, object_id.digest))  # a home had it
        return self.host.publish(ns, object_id, landing.keep(untrack=True), meta.size, meta.checksum,
                                    meta.descriptor, meta.hints, created_at=meta.created_at)

    async def fetch_ranges(self, namespace: str, object_id, accept, ranges: tuple, expect=None):
        """A local miss of a reader that needs only `ranges` (kvstore.ranges): just those bytes
        fetched from a home, packed into an extent of their own (tracked as transient; the
        read lease the tier manager grants on it frees it when it ends). Nothing is published
        here. Returns a RangesFetched, the reason a home's copy was refused (its descriptor),
        or None (no home holds it, none answered, or no room)."""
        remote = self.node.remote
        size, landing, refused = ranges_total(ranges), Landing(self.host, namespace, self.sink), []

        def alloc(meta: RemoteMeta):
            check_within(ranges, meta.size)  # a home that did not check must not make us allocate
            why = read_refusal(meta.descriptor, accept, expect)
            if why is not None:
                refused.append(why)
                return None  # the bytes are drained, not kept
            return landing.place(size)

        got, extent = None, None
        try:
            if remote is not None and remote.remote_homes(object_id):
                got = await remote.get_ranges_into(namespace, object_id, ranges, alloc)
            if got is not None:
                extent = await landing.settle(size)
        finally:
            if extent is None:
                landing.give_back()
        if extent is None:
            return refused[-1] if refused else None
        landing.keep(untrack=False)
        meta, checksum = got
        return RangesFetched(extent, meta, checksum)
