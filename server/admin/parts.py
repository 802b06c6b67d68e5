"""What the admin API serves from: each part of the daemon its handlers use, handed in by the
daemon (`AdminParts`), and the typed keys under which a handler finds the one it needs
(`request.app[INDEX]`). No handler holds the daemon or reaches a part through another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from kvstore.config import AdminConfig
from kvstore.server.tiering.chain import LocalCopies
from kvstore.server.tiering.groups import GroupOps
from kvstore.server.tiering.host import HostTier
from kvstore.server.tiering.index_ops import IndexOps


class NvmeCopies(LocalCopies, Protocol):
    """What the admin API reads of the NVMe tier (server/tiering/nvme_mover.py: TierMover,
    or NoNvme): LocalCopies, the name ?tier= gives it, and its objects' metadata."""

    listed_as: tuple[str, ...]

    async def metas(self, keys) -> list: ...


class Node(Protocol):
    """What the admin API asks of the daemon itself (server/daemon.py: Daemon)."""

    ready: bool  # recovery done, the socket serves (GET /readyz)

    def stats(self) -> dict: ...


@dataclass(frozen=True)
class AdminParts:
    config: AdminConfig
    data_dir: str  # where admin.addr and admin.token are written
    node: Node
    host: HostTier  # namespaces and their entries (listings, show, evict)
    nvme: NvmeCopies  # NVMe copies (listings, show, pin promotes), or NoNvme
    index: IndexOps  # lookup, delete, pin, evict over the chain
    groups: GroupOps  # whether a shown object's groups are complete
    remote: object  # the remote tier (GET /v1/cluster): ClusterLink, PoolLink or NoCluster
    events: object  # the KV event stream (lookups by block hashes): EventStream or NoEvents


HOST = web.AppKey("host", HostTier)
NVME = web.AppKey("nvme", object)
INDEX = web.AppKey("index", IndexOps)
GROUPS = web.AppKey("groups", GroupOps)
REMOTE = web.AppKey("remote", object)
EVENTS = web.AppKey("events", object)


def hand_parts(app: web.Application, parts: AdminParts) -> None:
    """Put each part the handlers use under its key."""
    for key, part in ((HOST, parts.host), (NVME, parts.nvme), (INDEX, parts.index), (GROUPS, parts.groups),
                      (REMOTE, parts.remote), (EVENTS, parts.events)):
        app[key] = part
