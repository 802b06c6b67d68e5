"""One daemon's part of the cluster, wired from `ClusterConfig`: transport, peer service,
membership and the remote tier. The backend it serves peers from (server/cluster/serving.py)
comes at start: the node is made before the tiers that backend serves from (its remote tier is
what the cluster's sending side sends through, and NVMe is made with that side).

    node = PeerNode(config.cluster)
    await node.start(backend, on_members=link.on_members)  # listen, authenticate peers, register / read members
    await node.remote.get_into(namespace, object_id, alloc)     # a local miss asks the home
    await node.remote.put(namespace, object_id, meta, buffer)   # demotion to tier "remote"
    await node.remote.lookup(namespace, ids)                    # one round trip per home
    await node.stop()              # leave membership first, then stop serving
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from typing import Callable

from kvstore.config import ClusterConfig, parse_address
from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.server.cluster.membership import OnChange, make_membership
from kvstore.server.peer.service import PeerBackend, PeerService
from kvstore.server.peer.client import PeerClient, connect_peer
from kvstore.server.peer.transports import make_transport
from kvstore.server.cluster.peer_watch import PeerWatch
from kvstore.tiers.remote import RemoteTier

log = logging.getLogger("kvstore.peer")
# Peers marked down are first probed after max(peer_timeout_s, this) (server.cluster.peer_watch).
MIN_PROBE_S = 0.5


def read_secret(cluster: ClusterConfig) -> bytes:
    """The cluster's shared secret. A secret file others can read is used, with a warning:
    whoever reads it can join the cluster as a peer and read every tenant's objects."""
    if cluster.secret_file:
        try:
            with open(cluster.secret_file, "rb") as f:
                secret = f.read().strip()
                mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        except OSError as exc:
            raise InvalidArgument(f"cannot read cluster.secret_file {cluster.secret_file}: {exc.strerror}") from None
        if mode & 0o077:
            log.warning("event=secret_file_readable path=%s mode=%o note=\"others can read the cluster secret and "
                        "join as a peer; chmod 0600 it, owned by the daemon's user\"", cluster.secret_file, mode)
        if len(secret) < 16:
            raise InvalidArgument(f"cluster.secret_file {cluster.secret_file} holds fewer than 16 characters")
        return secret
    if not cluster.secret:
        raise InvalidArgument("the cluster needs cluster.secret or cluster.secret_file (the same on every node)")
    return cluster.secret.encode()


class PeerNode:
    def __init__(self, cluster: ClusterConfig):
        self.cluster = cluster
        self.node_id = cluster.node_id or socket.gethostname()
        self.secret = read_secret(cluster)
        self.transport = make_transport(cluster.transport)
        self.service: PeerService | None = None  # serving `backend` once started
        self.address = ""
        self.membership = None
        self.remote: RemoteTier | None = None
        self.watch: PeerWatch | None = None
        self.num_auth_failures = 0  # links we opened that failed authentication (wrong secret)

    async def connect(self, address: str) -> PeerClient:
        """An authenticated link to the peer at `address` (what RemoteTier calls)."""
        try:
            return await connect_peer(self.transport, address, self.secret, self.node_id,
                                      self.cluster.peer_timeout_s)
        except PermissionDenied:  # logged by peer_auth ("wrong secret from <address>")
            self.num_auth_failures += 1
            raise

    def _answered(self, node: str) -> None:
        """A peer authenticated a channel to us: it is up, whatever our last call to it said."""
        if self.remote is not None and node in self.membership.members():
            self.remote.mark_up(node)

    async def start(self, backend: PeerBackend, on_members: OnChange | None = None,
                    on_peer_state: Callable[[str, bool], None] | None = None) -> None:
        """Serve peers from `backend` and join. on_members(members): the member list changed;
        on_peer_state(node, up): a peer was marked down, or answers again (RemoteTier)."""
        self.service = PeerService(backend, self.transport, self.secret, self.node_id, self.cluster.peer_timeout_s,
                                   on_peer=self._answered)
        bound = await self.service.start(self.cluster.listen)
        self.address = self.cluster.advertise or bound
        if parse_address(self.address)[0] in ("0.0.0.0", "::"):
            await self.service.stop()
            raise InvalidArgument(f"peers cannot dial {self.address}: set cluster.advertise to this node's address")
        self.membership = make_membership(self.cluster, self.node_id, self.address, on_members)
        self.remote = RemoteTier(self.node_id, self.membership.members, self.connect,
                                 self.cluster.replicas, self.cluster.peer_timeout_s, on_state=on_peer_state)
        try:
            await self.membership.start()
        except BaseException:
            await self.service.stop()
            raise
        log.info("event=cluster_joined node=%s address=%s transport=%s membership=%s members=%s",
                 self.node_id, self.address, self.transport.name, self.cluster.membership,
                 ",".join(sorted(self.membership.members())))
        self.watch = PeerWatch(self.remote, max(self.cluster.peer_timeout_s, MIN_PROBE_S))
        self.watch.start()

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        if self.membership is not None:
            await self.membership.stop()
        if self.remote is not None:
            await self.remote.close()
        await self.service.stop()

    def stats(self) -> dict:
        return {"node_id": self.node_id, "address": self.address,
                "members": self.membership.members() if self.membership else {},
                "remote": self.remote.stats() if self.remote else {},
                "service": self.service.stats() if self.service else {},
                "auth_failures": {"client": self.num_auth_failures,
                                  "server": self.service.counters.num_auth_failures if self.service else 0}}
