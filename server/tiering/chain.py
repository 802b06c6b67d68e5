"""The chain of tiers, composed in one place: [GPU copies] -> host -> NVMe -> remote.

`compose()` is where the tiers meet. It builds the host tier, then the remote tier's sending
side (`Sends`: the cluster's replicator, or the pool's puts), then NVMe with both (what NVMe
evicts or refuses goes on to the sending side), then this node's own delete and pin
(`HereOps`), then the rest of the remote tier (the cluster's homes, or a Mooncake pool) with
its sending side and what it serves peers from and lands fetched bytes in (`LocalTiers`),
then the node's index ops (lookup, delete, pin, prefetch over the chain) with the remote
tier below them. The remote tier is made in two steps because it and NVMe use each other:
NVMe hands its departures down to the sending side, and the serving side serves peers from
NVMe's copies; where the sending side reads an NVMe copy (an NVMe eviction sent home), NVMe
hands it the read with the call (`Sends.demote_from_nvme`). Left set after construction: the
host tier's `on_leave`. Where the host tier's victims go (`victim_sink`: through NVMe's sink,
else the remote tier's, else nowhere) is not stored in the host tier: every caller that makes room
passes it (`HostTier.make_room(ns, size, sink)`), the chain's own callers `Chain.sink`, the
remote tier the sink it computes from what it was given (`victim_sink(local, itself)`).

No tier holds the tier manager or reaches a sibling through it: each is handed the tiers it
talks to, typed by the small Protocols below, which the null objects of switched-off tiers
(server/tiering/absent.py) implement too.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable, NamedTuple, Protocol

import numpy as np

from kvstore.config import HostTierConfig
from kvstore.identity import ObjectId
from kvstore.peer_messages import RemoteMeta
from kvstore.server.events import NoEvents
from kvstore.server.tiering.absent import NoCluster, NoGpu, NoNvme
from kvstore.server.tiering.host import HostTier, Namespace
from kvstore.server.tiering.index_ops import HereOps, IndexOps
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.server.traffic import Traffic


class LocalCopies(Protocol):
    """What the remote tier reads of this node's NVMe tier (server/tiering/nvme_mover.py:
    TierMover, or NoNvme)."""

    def holds(self, namespace: str, oid: ObjectId) -> bool: ...
    def remote_meta(self, namespace: str, oid: ObjectId): ...
    async def read_copy(self, namespace: str, oid: ObjectId): ...
    async def promote(self, namespace: str, oid: ObjectId) -> ObjectEntry | None: ...
    def keys(self) -> list[tuple[str, bytes]]: ...


# An NVMe copy read for sending (LocalCopies.read_copy): (RemoteMeta, verified bytes), or None.
ReadCopy = Callable[[str, ObjectId], Awaitable[tuple[RemoteMeta, np.ndarray] | None]]


class Sends(Protocol):
    """What NVMe hands down to the remote tier's sending side, made before NVMe
    (server/cluster/replicate.py: Replicator, server/pool/puts.py: PoolPuts, or NoCluster):
    objects leaving this node, sent to their homes first where those may lack them."""

    async def demote(self, entries: list[ObjectEntry]) -> None: ...
    async def demote_from_nvme(self, namespace: str, oids: list[ObjectId], read: ReadCopy) -> None: ...
    def must_send(self, namespace: str, oid: ObjectId) -> bool: ...
    def forget(self, namespace: str, oid: ObjectId) -> None: ...


class Homes(Protocol):
    """What the index ops hand down to the remote tier (server/cluster/link.py: ClusterLink,
    server/pool/link.py: PoolLink, or NoCluster)."""

    def lookup_remote(self, namespace: str, ids): ...
    def delete_everywhere(self, namespace: str, ids, found): ...
    def pin_everywhere(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]): ...


class LocalTiers(NamedTuple):
    """What the remote tier is given: the tiers it serves peers from and lands fetched bytes
    in, this node's own delete and pin (a peer's), the KV event stream, and when clients last
    asked something (server/traffic.py: what background copies yield to)."""
    host: HostTier
    nvme: LocalCopies
    here: HereOps
    events: object
    traffic: Traffic


def victim_sink(local: LocalTiers, homes):
    """Where the host tier's victims go (server/tiering/host.py: Sink): NVMe's sink (what NVMe
    refuses or evicts goes on to the homes from there), else the homes' (`homes`: the remote
    tier, or NoCluster), else None (they are dropped). One rule for every caller that makes
    room in the host arena: the chain, and the remote tier, which lands fetched bytes there."""
    return local.nvme.victim_sink(homes.victim_sink(local.host))


MakeSends = Callable[[HostTier, object], Sends]  # (host tier, events) -> Replicator or PoolPuts
MakeNvme = Callable[[HostTier, object, Sends], object]  # (host tier, events, sends) -> TierMover
MakeRemote = Callable[[LocalTiers, Sends], object]  # (local tiers, its sending side) -> ClusterLink or PoolLink


class Chain:
    """The composed tiers, top to bottom. `local`: what the remote tier was given (the tiers
    of this node); `sends`: the remote tier's sending side; `index`: lookup, delete, pin,
    prefetch over them all; `sink`: where the host tier's victims go (`victim_sink`), passed
    wherever room is made. `tiered`: objects may live below the host arena (some tier below
    takes the host tier's victims)."""

    def __init__(self, local: LocalTiers, remote, sends: Sends, index: IndexOps, sink):
        self.local, self.remote, self.sends, self.index, self.sink = local, remote, sends, index, sink
        self.host, self.nvme = local.host, local.nvme
        self.gpu = NoGpu()  # server.tiering.gpu_reads.GpuReads once attach_gpu() (the daemon's start)
        self.host.on_leave = self._left_host
        self.tiered = sink is not None

    def attach_gpu(self, gpu) -> None:
        """The GPU tier joins the chain (made at start: it needs the probe, and device memory)."""
        self.gpu = gpu

    def _left_host(self, ns: Namespace, entry: ObjectEntry) -> None:
        self.gpu.forget(ns.name, entry.object_id.digest)
        if not self.nvme.holds(ns.name, entry.object_id):  # gone from this node altogether
            self.sends.forget(ns.name, entry.object_id)


def compose(host_config: HostTierConfig, *, clock=time.monotonic, events=NoEvents(), traffic: Traffic | None = None,
            make_sends: MakeSends | None = None, make_nvme: MakeNvme | None = None,
            make_remote: MakeRemote | None = None) -> Chain:
    """The chain for one daemon. make_sends / make_nvme / make_remote: factories of the tiers
    below the host arena (the remote tier's sending side: server.cluster.replicate.Replicator
    or server.pool.puts.PoolPuts; server.tiering.nvme_mover.TierMover; the rest of the remote
    tier: server.cluster.link.ClusterLink or server.pool.link.PoolLink; make_sends and
    make_remote come together); None: that tier is off and a null object stands in. traffic:
    the local service's (server/traffic.py); None: no client is heard, nothing waits."""
    host = HostTier(host_config, clock, events=events)
    sends = make_sends(host, events) if make_sends else NoCluster()
    nvme = make_nvme(host, events, sends) if make_nvme else NoNvme()
    here = HereOps(host, nvme)
    local = LocalTiers(host, nvme, here, events, traffic if traffic is not None else Traffic())
    remote = make_remote(local, sends) if make_remote else NoCluster()
    sink = victim_sink(local, remote)
    return Chain(local, remote, sends, IndexOps(host, nvme, here, remote, sink), sink)
