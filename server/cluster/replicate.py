"""Copies of this node's objects to their home nodes: after a commit (write_through), before
an object leaves this node (demotion to tier "remote"), for a put with tier="remote", and
the deletes that must not be overtaken by a copy still in flight.

Every send passes one gate (`sending`): a burst queues here instead of timing out on the
remote tier's link pool, which would mark a healthy peer down. Sends made while making room
for a peer's put skip it (`FOR_PEER`), so two nodes never wait for each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from kvstore.errors import Conflict
from kvstore.replies import CommitReply
from kvstore.server.cluster.serving import FOR_PEER, PeerServing
from kvstore.server.events import MEDIUM_PEER
from kvstore.server.tiering.chain import ReadCopy
from kvstore.server.tiering.demotions import DemotionTally
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.remote import MAX_LINKS_PER_PEER

log = logging.getLogger("kvstore.cluster")


@dataclass(slots=True)
class ReplicaCounters:
    num_replicated: int = 0  # commits copied to every remote home (write_through)
    num_demoted_remote: int = 0  # objects sent home before they left this node
    num_demotion_failures: int = 0
    num_remote_puts: int = 0  # puts with tier="remote"
    num_remote_put_fallbacks: int = 0  # of those, kept here because no home could take them


class Replicator:
    """The cluster's sending side (server/tiering/chain.py: Sends), made before NVMe, which
    hands it what it evicts or refuses. `held`: (namespace, digest) of objects held here that
    every remote home is known to hold too (made with the chain, shared with the other cluster
    roles; server/tiering/chain.py: Departures forgets what leaves this node)."""

    def __init__(self, host, events, config, node, held: set):
        """host: the host tier, whose entries are sent; events: the KV event stream; node: this
        node's PeerNode (server/cluster/node.py), started by ClusterLink once it serves peers."""
        self.host, self.events, self.config, self.node, self.held = host, events, config, node, held
        self._background: set[asyncio.Task] = set()
        # Sends in flight per object: a delete waits for them, or the copy would land after it.
        self._sending: dict[tuple[str, bytes], list[asyncio.Future]] = {}
        self.gate = asyncio.Semaphore(MAX_LINKS_PER_PEER)
        self.counters = ReplicaCounters()
        self.demotions = DemotionTally(self.counters)

    @property
    def remote(self):
        return self.node.remote

    def stop(self) -> None:
        for task in list(self._background):
            task.cancel()

    @contextlib.asynccontextmanager
    async def sending(self, namespace: str, object_id):
        """Around one send of an object to peers: gated, and visible to a delete."""
        key = (namespace, object_id.digest)
        done = asyncio.get_running_loop().create_future()
        self._sending.setdefault(key, []).append(done)
        try:
            if FOR_PEER.get():  # room for a peer's put: never queue behind our own sends
                yield           # to that peer (two nodes could each wait for the other)
            else:
                async with self.gate:
                    yield
        finally:
            done.set_result(None)
            waiting = self._sending[key]
            waiting.remove(done)
            if not waiting:
                del self._sending[key]

    def on_commit(self, entry: ObjectEntry) -> None:
        """A local put committed: under write_through, copy it to its homes in the background."""
        if self.config.remote_write == "write_through" and self.remote is not None \
                and self.remote.remote_homes(entry.object_id):
            task = asyncio.get_running_loop().create_task(self._replicate(entry))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _replicate(self, entry: ObjectEntry) -> None:
        if await self._send(entry):
            self.counters.num_replicated += 1

    async def _send(self, entry: ObjectEntry) -> bool:
        """Send a host entry to every remote home. True once all of them hold it."""
        return (await self._send_to_homes(entry))[1]

    async def _send_to_homes(self, entry: ObjectEntry, raising: bool = False) -> tuple[list[str], bool]:
        """Send a host entry to every remote home: (the remote homes that hold it now, whether
        all of them do). raising: a home's Conflict is raised (tiers.remote.RemoteTier.put)."""
        ns = self.host.namespaces[entry.namespace]
        if not ns.objects.holds(entry):
            return [], False  # deleted or evicted before its turn: its extent may be reused
        homes = self.remote.remote_homes(entry.object_id)
        async with self.sending(entry.namespace, entry.object_id):
            if not ns.objects.holds(entry):
                return [], False
            with self.host.held_view(entry) as view:
                held = await self.remote.put(entry.namespace, entry.object_id, PeerServing.meta(entry), view,
                                             raising)
        if held and set(held) >= set(homes):
            if ns.objects.holds(entry):
                self.held.add((entry.namespace, entry.object_id.digest))
            self.events.stored(entry.namespace, entry.object_id, MEDIUM_PEER, entry.descriptor, entry.hints)
            return held, True
        return held, False

    # --- demotion to tier "remote" -----------------------------------------------------------

    def must_send(self, namespace: str, object_id) -> bool:
        """Would this object be lost to the cluster if it left this node now?"""
        return ((namespace, object_id.digest) not in self.held and self.remote is not None
                and bool(self.remote.remote_homes(object_id)))

    def forget(self, namespace: str, object_id) -> None:
        """A delete of the object: it leaves `held` (what leaves by eviction, the chain's
        Departures drops from the same set)."""
        self.held.discard((namespace, object_id.digest))

    async def demote(self, entries: list[ObjectEntry]) -> None:
        """Host entries about to leave this node: send the ones their homes may lack, in
        parallel. Each send is bounded by the peer timeout; a failure is counted and logged
        and the entry leaves anyway (as a cache eviction always could)."""
        sends = [e for e in entries if self.must_send(e.namespace, e.object_id)]
        results = await asyncio.gather(*(self._send(e) for e in sends)) if sends else []
        self._count_demotions(sends, results)

    async def demote_from_nvme(self, namespace: str, keys, read: ReadCopy) -> None:
        """NVMe objects (ObjectIds) about to be evicted: those the homes may lack are read
        (`read`, NVMe's: verified) and sent."""
        oids = [oid for oid in keys if self.must_send(namespace, oid)]
        results = await asyncio.gather(*(self._send_from_nvme(namespace, oid, read) for oid in oids)) if oids else []
        self._count_demotions(oids, results)

    async def _send_from_nvme(self, namespace: str, oid, read: ReadCopy) -> bool | None:
        async with self.sending(namespace, oid):
            copy = await read(namespace, oid)
            if copy is None:
                return None  # gone, or failed its check (counted by the NVMe tier)
            meta, data = copy
            homes = self.remote.remote_homes(oid)
            sent = set(await self.remote.put(namespace, oid, meta, data)) >= set(homes)
            if sent:
                self.events.stored(namespace, oid, MEDIUM_PEER, meta.descriptor, meta.hints)
            return sent

    def _count_demotions(self, items, results) -> None:
        failed = self.demotions.count(items, results)
        if failed:
            log.warning("event=remote_demotion_failed objects=%d first=%s homes=%s total=%d", len(failed), failed[0],
                        ",".join(self.remote.remote_homes(failed[0])), self.counters.num_demotion_failures)

    async def put_remote(self, entry: ObjectEntry) -> CommitReply:
        """An explicit put with tier="remote": the reply waits until the homes hold it. The
        local copy stays only where this node is a home itself, or where no home could take
        it (the reply then says tier "host": nothing is lost, and nothing pretends)."""
        self.counters.num_remote_puts += 1
        homes = self.remote.homes(entry.object_id)
        held, sent = [], True
        ns = self.host.namespaces[entry.namespace]
        if self.remote.remote_homes(entry.object_id):
            try:
                held, sent = await self._send_to_homes(entry, raising=True)
            except Conflict:  # a home holds this id as another state: the put is refused here too
                if ns.objects.holds(entry):
                    self.host.drop(ns, entry)
                raise
        if not sent:
            self.counters.num_remote_put_fallbacks += 1
            log.warning("event=remote_put_fallback namespace=%s id=%s homes=%s", entry.namespace, entry.object_id,
                        ",".join(homes))
            # Every home that holds it: this node (it keeps its copy) and those the send reached.
            return CommitReply(False, "host", "memory", tuple(n for n in homes if n == self.node.node_id or n in held))
        if self.node.node_id not in homes and ns.objects.holds(entry):
            self.host.drop(ns, entry)  # forgets it here too
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
        for oid in ids:
            self.events.removed(namespace, oid, MEDIUM_PEER)
        return sum(a or b for a, b in zip(found, remote))
