"""The tiers around the host arena when they are switched off: null objects.

The chain (server/tiering/chain.py) is [GPU copies] -> host -> NVMe -> the remote tier. A daemon without a GPU
tier gets `NoGpu`, one without NVMe `NoNvme`, one without a cluster `NoCluster`: each
answers like the real tier holding nothing and reaching no one, synchronously where the
real one would await I/O (server/later.py), so the tier manager and the other tiers never
ask whether a neighbour exists.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.replies import IN_MEMORY, CommitReply, GpuHandleReply
from kvstore.server.later import MaybeAwaitable, then
from kvstore.server.tiering.objects import ObjectEntry


class NoGpu:
    """The GPU tier of a daemon with `[gpu] enabled = false` (or before start): no copies,
    so a get with gpu=True is served from the host arena."""

    def lease_copy(self, ns, entry: ObjectEntry) -> None:
        return None

    def forget(self, namespace: str, digest: bytes) -> None:
        pass

    def handle(self) -> GpuHandleReply:
        raise InvalidArgument("this daemon runs no GPU tier: set [gpu] enabled = true on a node with CUDA "
                           "(`kvstore status` says what the GPU probe found), or read from the host tier")

    def stats(self) -> None:
        return None

    def check_integrity(self) -> None:
        pass


class NoNvme:
    """The NVMe tier of a daemon with `[nvme] enabled = false`: holds nothing."""

    listed_as = ()  # no ?tier=nvme in the admin API
    bandwidth_bytes_s = 1e9  # never used: nothing is loaded from here
    writes_through = False  # a commit never waits here

    def victim_sink(self, below):
        """Where the host tier's victims go: past this absent tier, to `below`'s sink."""
        return below

    def holds(self, namespace: str, oid) -> bool:
        return False

    def size_of(self, namespace: str, oid) -> int | None:
        return None

    def sizes_of(self, namespace: str, oids: list) -> list[int | None]:
        return [None] * len(oids)

    def remote_meta(self, namespace: str, oid):
        return None

    def keys(self) -> list[tuple[str, bytes]]:
        return []

    async def metas(self, keys) -> list:
        return [None] * len(keys)

    async def read_copy(self, namespace: str, oid):
        return None

    async def promote(self, namespace: str, oid) -> ObjectEntry | None:
        return None

    def on_hit(self, entry: ObjectEntry) -> None:
        pass

    def on_hits(self, table, rows, times) -> None:
        pass

    def on_commit(self, entry: ObjectEntry) -> MaybeAwaitable[CommitReply]:
        return IN_MEMORY

    def delete(self, namespace: str, oids) -> list[bool]:
        return [False] * len(oids)

    async def open(self) -> dict:
        return {}

    def expire_due(self) -> None:
        pass

    def compact(self) -> bool:
        return False

    async def flush_host(self) -> int:
        return 0

    async def close(self) -> None:
        pass

    def stats(self) -> None:
        return None

    def check_integrity(self) -> None:
        pass


class NoCluster:
    """The cluster of a daemon with `[cluster] enabled = false`: no peers, no homes. Both
    sides of the remote tier (server/tiering/chain.py: Sends and Homes)."""
    remote = None  # the peer tier (tiers.remote.RemoteTier) a clustered daemon has
    takes_remote_puts = False  # put(tier="remote") needs a tier to put into
    fetches_many = False  # a batch's misses are not read ahead together (fetch_many)
    reads_ranges = False  # a ranged miss is a fetch too (of nothing)
    bandwidth_bytes_s = 1e9  # never used: nothing is fetched

    def victim_sink(self, host):
        """No tier below: the host tier drops its victims (no sink, nothing to await)."""
        return None

    async def demote(self, entries: list[ObjectEntry]) -> None:
        pass

    def fetch(self, namespace: str, oid) -> MaybeAwaitable[ObjectEntry | None]:
        return None

    def lookup_remote(self, namespace: str, ids) -> MaybeAwaitable[list]:
        return [None] * len(ids)

    def on_commit(self, entry: ObjectEntry) -> None:
        pass

    def must_send(self, namespace: str, oid) -> bool:
        return False

    async def demote_from_nvme(self, namespace: str, oids, read) -> None:
        pass

    def delete_everywhere(self, namespace: str, ids, found: MaybeAwaitable[list[bool]]) -> MaybeAwaitable[int]:
        return then(found, sum)

    def pin_everywhere(self, namespace: str, ids, ttl_s, unpin: bool, here: list[bool]) -> int:
        return sum(here)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def pool_status(self) -> None:
        return None  # /v1/cluster: no shared pool

    def stats(self) -> None:
        return None
