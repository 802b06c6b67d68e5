"""The chain of tiers, composed in one place: [GPU copies] -> host -> NVMe -> remote.

`compose()` is where the tiers meet, each handed what it talks to in its constructor. The
tiers below the host arena use each other both ways, so each is made in two steps, and what
a later tier needs of an earlier one is made before it:

    held, NVMe's holdings   what the remote tier is known to hold of this node's objects (a
                            set), and what NVMe holds (server/tiering/nvme_held.py: NvmeHeld)
    Departures              told when an object leaves the host tier or NVMe, in the same
                            step: the GPU copy is forgotten, and an object gone from this
                            node altogether leaves `held`; it reads NVMe's holdings
    host tier               with Departures as its on_leave
    sending side (`Sends`)  the remote tier's: the cluster's replicator, or the pool's puts
    NVMe (TierMover)        with the host tier, the sending side (what NVMe evicts or refuses
                            goes on to it, with NVMe's read for a copy to send), Departures
                            and its holdings
    `HereOps`, then the rest of the remote tier (the cluster's homes, or a Mooncake pool)
    with its sending side and what it serves peers from and lands fetched bytes in
    (`LocalTiers`), then the node's index ops (lookup, delete, pin, prefetch over the chain)
    with the remote tier below them.

The GPU tier joins at the daemon's start (`attach_gpu`: it needs the probe and device
memory). Where the host tier's victims go (`victim_sink`: through NVMe's sink, else the remote
tier's, else nowhere) is not stored in the host tier: every caller that makes room passes it
(`HostTier.make_room(ns, size, sink)`), the chain's own callers `Chain.sink`, the remote tier
the sink it computes from what it was given (`victim_sink(local, itself)`).

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


class Holdings(Protocol):
    """What Departures reads of NVMe, made before the host tier (server/tiering/nvme_held.py:
    NvmeHeld, or NoNvme)."""

    def holds(self, namespace: str, oid: ObjectId) -> bool: ...


class Departures:
    """Told in the same step when an object leaves a tier of this node: the host tier (its
    on_leave: evicted, expired, deleted, dropped) or NVMe (evicted, expired, deleted, failed a
    read). The GPU tier forgets its copy of a host entry; an object gone from this node
    altogether (NVMe lacks it too, or the host tier, for NVMe's) leaves `held`, the objects
    held here that the remote tier is known to hold (they may leave without being sent), before
    any NVMe eviction that follows asks the sending side what it must send. Made before the
    tiers that tell it; the GPU tier joins at the daemon's start (`attach_gpu`)."""

    def __init__(self, nvme: Holdings, held: set[tuple[str, bytes]]):
        self.nvme, self.held = nvme, held
        self.gpu = NoGpu()  # server.tiering.gpu_reads.GpuReads once attached

    def attach_gpu(self, gpu) -> None:
        self.gpu = gpu

    def left_host(self, ns: Namespace, entry: ObjectEntry) -> None:
        self.gpu.forget(ns.name, entry.object_id.digest)
        if not self.nvme.holds(ns.name, entry.object_id):
            self.left_node(ns.name, entry.object_id)

    def left_node(self, namespace: str, oid: ObjectId) -> None:
        """`oid` is gone from this node altogether."""
        self.held.discard((namespace, oid.digest))


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


MakeHoldings = Callable[[], Holdings]  # -> NvmeHeld
MakeSends = Callable[[HostTier, object, set], Sends]  # (host tier, events, held) -> Replicator or PoolPuts
# (host tier, events, sends, departures, NVMe's holdings) -> TierMover
MakeNvme = Callable[[HostTier, object, Sends, Departures, Holdings], object]
MakeRemote = Callable[[LocalTiers, Sends], object]  # (local tiers, its sending side) -> ClusterLink or PoolLink


class Chain:
    """The composed tiers, top to bottom. `local`: what the remote tier was given (the tiers
    of this node); `index`: lookup, delete, pin, prefetch over them all; `sink`: where the
    host tier's victims go (`victim_sink`), passed wherever room is made; `departures`: what
    the tiers tell when an object leaves them, which holds the GPU tier. `tiered`: objects
    may live below the host arena (some tier below takes the host tier's victims)."""

    def __init__(self, local: LocalTiers, remote, index: IndexOps, sink, departures: Departures):
        self.local, self.remote, self.index, self.sink, self.departures = local, remote, index, sink, departures
        self.host, self.nvme = local.host, local.nvme
        self.tiered = sink is not None

    @property
    def gpu(self):  # NoGpu until attach_gpu
        return self.departures.gpu

    def attach_gpu(self, gpu) -> None:
        """The GPU tier joins the chain (made at start: it needs the probe, and device memory)."""
        self.departures.attach_gpu(gpu)


def compose(host_config: HostTierConfig, *, clock=time.monotonic, events=NoEvents(), traffic: Traffic | None = None,
            make_holdings: MakeHoldings | None = None, make_nvme: MakeNvme | None = None,
            make_sends: MakeSends | None = None, make_remote: MakeRemote | None = None) -> Chain:
    """The chain for one daemon. make_holdings / make_nvme: NVMe's two steps (its holdings,
    server.tiering.nvme_held.NvmeHeld; the mover, server.tiering.nvme_mover.TierMover);
    make_sends / make_remote: the remote tier's (its sending side, server.cluster.replicate.
    Replicator or server.pool.puts.PoolPuts; the rest, server.cluster.link.ClusterLink or
    server.pool.link.PoolLink). Each pair comes together; None: that tier is off and a null
    object stands in. traffic: the local service's (server/traffic.py); None: no client is
    heard, nothing waits."""
    held: set[tuple[str, bytes]] = set()  # of this node's objects, those the remote tier is known to hold
    holdings = make_holdings() if make_holdings else NoNvme()
    departures = Departures(holdings, held)
    host = HostTier(host_config, clock, on_leave=departures.left_host, events=events)
    sends = make_sends(host, events, held) if make_sends else NoCluster()
    nvme = make_nvme(host, events, sends, departures, holdings) if make_nvme else NoNvme()
    here = HereOps(host, nvme)
    local = LocalTiers(host, nvme, here, events, traffic if traffic is not None else Traffic())
    remote = make_remote(local, sends) if make_remote else NoCluster()
    sink = victim_sink(local, remote)
    return Chain(local, remote, IndexOps(host, nvme, here, remote, sink), sink, departures)
