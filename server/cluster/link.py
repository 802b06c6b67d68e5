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
    membership change  -> objects held here are copied to their new homes (server.cluster.rehome)
    pin / unpin        -> this node's host copies, then the homes' (scope "cluster")
    peer asks us       -> read / reserve / lookup / delete / pin against this node's tiers

Three roles, one module each: serving peers (server/cluster/serving.py), fetching misses from
homes (server/cluster/fetch.py: one landing for whole and ranged reads), and replicating to
homes (server/cluster/replicate.py: commit copies, demotion, remote puts, deletes, the send
gate). The replicator is the sending side, made before NVMe (which hands it what it evicts or
refuses) with this node's PeerNode; the link is made after NVMe with it, composes the other two
roles over the local tiers, and starts the node serving peers from them. They share one set,
made with the chain and handed to the replicator (server/tiering/chain.py: compose, whose
Departures forgets what leaves this node): the objects held here that every remote home is
known to hold too, which may leave this node without being sent.

Bytes cross nodes only as a transfer between two owners, and every received object is
checked against its xxh3-128 before it is published (tiers/remote/ and the peer service
do the checking). A dead or cut-off peer costs at most cluster.peer_timeout_s, then a miss.
"""

from __future__ import annotations

from dataclasses import asdict

from kvstore.config import ClusterConfig
from kvstore.identity import ObjectId
from kvstore.server.events import MEDIUM_PEER
from kvstore.server.cluster.fetch import Fetcher
from kvstore.server.cluster.replicate import Replicator
from kvstore.server.cluster.serving import PeerServing
from kvstore.server.later import MaybeAwaitable, then
from kvstore.server.cluster.rehome import Rehomer
from kvstore.server.tiering.chain import LocalTiers, victim_sink
from kvstore.server.tiering.objects import ObjectEntry


class ClusterLink:
    """The cluster as the tiers above see it: the roles, membership and re-homing. The
    last tier of the chain (server/tiering/absent.py: NoCluster stands in when it is off)."""

    reads_ranges = True  # a ranged miss fetches only those ranges from a home (fetch_ranges)

    def __init__(self, local: LocalTiers, replicator: Replicator, config: ClusterConfig):
        """local: this node's tiers, which peers are served from and fetches land in;
        replicator: the sending side (made before NVMe, with this node's PeerNode);
        config: the `[cluster]` table."""
        self.config = config
        self.events = local.events
        self.replicator, self.node = replicator, replicator.node
        # (namespace, digest) of objects held here that every remote home is known to hold
        # too: they may leave this node without being sent. Only objects held here are kept,
        # and only for the member list of the day (homes move when it changes).
        self._held = replicator.held
        # Where the host tier's victims go when fetched bytes or a peer's put need room: the
        # chain's rule, computed from this node's tiers and this link (its demote).
        sink = victim_sink(local, self)
        self.serving = PeerServing(local, self._held, sink)
        self.fetcher = Fetcher(local, self.node, self._held, sink)
        self.rehomer = Rehomer(self, local, config) if config.rehome else None

    # --- what the tiers above ask (server/tiering/chain.py: Homes), each answered by its role

    def fetch(self, namespace: str, oid: ObjectId) -> MaybeAwaitable[ObjectEntry | None]:
        """A local miss fetched from the homes into the host tier (server/cluster/fetch.py)."""
        return self.fetcher.fetch(namespace, oid)

    def fetch_ranges(self, namespace: str, oid: ObjectId, accept, ranges: tuple, expect=None):
        """Only `ranges` of a local miss, fetched from a home (Fetcher.fetch_ranges)."""
        return self.fetcher.fetch_ranges(namespace, oid, accept, ranges, expect)

    def on_commit(self, entry: ObjectEntry) -> None:
        """A local commit: copied to the homes now (write_through) or later (server/cluster/replicate.py)."""
        self.replicator.on_commit(entry)

    def put_remote(self, entry: ObjectEntry):
        """A put with tier="remote": the commit's reply waits for the homes."""
        return self.replicator.put_remote(entry)

    def sending(self, namespace: str, oid: ObjectId):
        """The send gate (an async context), shared by commit copies, demotions and re-homing."""
        return self.replicator.sending(namespace, oid)

    def victim_sink(self, host):
        """The host tier's victims, with no NVMe tier: copied to their homes (those that may
        lack them), then evicted."""
        return host.copy_then_evict(self.replicator.demote)

    async def start(self) -> None:
        await self.node.start(self.serving, on_members=self.on_members, on_peer_state=self.on_peer_state)
        if self.rehomer is not None:
            self.rehomer.begin(self.node.membership.members())

    async def stop(self) -> None:
        if self.rehomer is not None:
            if self.config.membership != "static" and self.config.handover_s > 0 and self.remote is not None:
                await self.rehomer.hand_over(self.config.handover_s)  # while still a member
            self.rehomer.stop()
        self.replicator.stop()
        await self.node.stop()

    @property
    def remote(self):
        return self.node.remote

    fetches_many = False  # a batch's misses are fetched from their homes one by one, as their turn comes

    @property
    def takes_remote_puts(self) -> bool:
        return self.node.remote is not None

    @property
    def bandwidth_bytes_s(self) -> float:
        """Remote load estimate (bytes/s), following the fetches."""
        return self.fetcher.bandwidth_bytes_s

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

    def delete_everywhere(self, namespace: str, ids, found: MaybeAwaitable[list[bool]]) -> MaybeAwaitable[int]:
        """After this node's delete (`found`, per id), every member's: how many ids were
        found anywhere."""
        if self.remote is None:
            return then(found, sum)
        return self.replicator.delete_everywhere(namespace, ids, found)

    def pin_everywhere(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]) -> MaybeAwaitable[int]:
        """After this node's pins (`here`, per id), the homes': how many ids were pinned somewhere."""
        if self.remote is None:
            return sum(here)
        return self._pin_homes(namespace, ids, ttl_s, unpin, here)

    async def _pin_homes(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]) -> int:
        remote = await self.remote.pin(namespace, list(ids), ttl_s, unpin)
        return sum(a or b for a, b in zip(here, remote))

    async def lookup_remote(self, namespace: str, ids):
        """What the homes hold of `ids` (ObjectIds, or raw digests off the local protocol)."""
        if self.remote is None:
            return [None] * len(ids)
        metas = await self.remote.lookup(namespace, [i if isinstance(i, ObjectId) else ObjectId(bytes(i)) for i in ids])
        for oid, meta in zip(ids, metas):
            if meta is None:  # the homes no longer hold it (or are down): not a PEER holding now
                self.events.removed(namespace, oid, MEDIUM_PEER)
        return metas

    async def pool_status(self) -> None:
        return None  # /v1/cluster: the peer tier has members, not a shared pool

    def stats(self) -> dict:
        stats = dict(self.node.stats())
        stats.update(asdict(self.replicator.counters), remote_write=self.config.remote_write)
        if self.rehomer is not None:
            stats["rehome"] = self.rehomer.stats()
        return stats
