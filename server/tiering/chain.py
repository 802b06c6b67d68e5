"""The chain of tiers, composed in one place: [GPU copies] -> host -> NVMe -> remote.

`compose()` is where the tiers meet. It builds the host tier, then NVMe with the host tier,
then this node's own delete and pin (`HereOps`), then the remote tier (the cluster's homes,
or a Mooncake pool) with what it serves peers from and lands fetched bytes in
(`LocalTiers`), then the node's index ops (lookup, delete, pin, prefetch over the chain)
with the remote tier below them. Last it tells the upper tiers what lies below them, the
cycle left: NVMe sends what it evicts or refuses to the remote tier, which serves peers from
NVMe's copies. Where the host tier's victims go (`victim_sink`: through NVMe's sink, else the
remote tier's, else nowhere) is not stored in the host tier: every caller that makes room
passes it (`HostTier.make_room(ns, size, sink)`), the chain's own callers `Chain.sink`, the
remote tier the sink it computes from what it was given (`victim_sink(local, itself)`).

No tier holds the tier manager or reaches a sibling through it: each is handed the tiers it
talks to, typed by the small Protocols below, which the null objects of switched-off tiers
(server/tiering/absent.py) implement too.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple, Protocol

from kvstore.config import HostTierConfig
from kvstore.identity import ObjectId
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


class Homes(Protocol):
    """What the NVMe tier and the index ops hand down to the remote tier
    (server/cluster/link.py: ClusterLink, server/pool/link.py: PoolLink, or NoCluster)."""

    async def demote(self, entries: list[ObjectEntry]) -> None: ...
    async def demote_from_nvme(self, namespace: str, oids: list[ObjectId]) -> None: ...
    def must_send(self, namespace: str, oid: ObjectId) -> bool: ...
    def forget(self, namespace: str, oid: ObjectId) -> None: ...
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


MakeNvme = Callable[[HostTier, object], object]  # (host tier, events) -> TierMover
MakeRemote = Callable[[LocalTiers], object]  # -> ClusterLink or PoolLink


class Chain:
    """The composed tiers, top to bottom. `local`: what the remote tier was given (the tiers
    of this node); `index`: lookup, delete, pin, prefetch over them all; `sink`: where the host
    tier's victims go (`victim_sink`), passed wherever room is made. `tiered`: objects may
    live below the host arena (some tier below takes the host tier's victims)."""

    def __init__(self, local: LocalTiers, remote, index: IndexOps, sink):
        self.local, self.remote, self.index, self.sink = local, remote, index, sink
        self.host, self.nvme = local.host, local.nvme
        self.gpu = NoGpu()  # server.tiering.gpu_reads.GpuReads once attach_gpu() (the daemon's start)
        self.nvme.below = remote
        self.host.on_leave = self._left_host
        self.tiered = sink is not None

    def attach_gpu(self, gpu) -> None:
        """The GPU tier joins the chain (made at start: it needs the probe, and device memory)."""
        self.gpu = gpu

    def _left_host(self, ns: Namespace, entry: ObjectEntry) -> None:
        self.gpu.forget(ns.name, entry.object_id.digest)
        if not self.nvme.holds(ns.name, entry.object_id):  # gone from this node altogether
            self.remote.forget(ns.name, entry.object_id)


def compose(host_config: HostTierConfig, *, clock=time.monotonic, events=NoEvents(), traffic: Traffic | None = None,
            make_nvme: MakeNvme | None = None, make_remote: MakeRemote | None = None) -> Chain:
    """The chain for one daemon. make_nvme / make_remote: factories of the tiers below the host
    arena (server.tiering.nvme_mover.TierMover; server.cluster.link.ClusterLink or
    server.pool.link.PoolLink); None: that tier is off and a null object stands in. traffic:
    the local service's (server/traffic.py); None: no client is heard, nothing waits."""
    host = HostTier(host_config, clock, events=events)
    nvme = make_nvme(host, events) if make_nvme else NoNvme()
    here = HereOps(host, nvme)
    local = LocalTiers(host, nvme, here, events, traffic if traffic is not None else Traffic())
    remote = make_remote(local) if make_remote else NoCluster()
    sink = victim_sink(local, remote)
    return Chain(local, remote, IndexOps(host, nvme, here, remote, sink), sink)
