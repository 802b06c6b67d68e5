"""Who is in the cluster: a static peer list, or live members registered in etcd.

Both give `members() -> {node_id: address}` (this node always included) and call
`on_change(members)` on the event loop whenever that set changes.

EtcdMembership talks to etcd's v3 JSON gateway over HTTP (aiohttp; keys and values are
base64 in JSON). Each daemon grants a lease of `ttl_s`, puts `<prefix><node_id>` ->
{"node_id", "address"} under it and renews it every ttl_s / 3. A daemon that dies or is cut
off stops renewing; etcd drops its key when the lease runs out (at most ttl_s after its
last renewal), and the watch on the prefix tells every other node at once. A full re-read
every RESYNC_S covers a broken watch. If our own lease was lost (etcd restarted, a long
pause), the next renewal notices and registers again.

A daemon restarted faster than its old lease runs out puts its key again, so the set of
members never changes; yet it came back empty. Each registration carries the daemon
process's `incarnation` (random at start, kept when a lost lease is registered again): a
member seen under a new one is reported as having left and joined again (two on_change
calls), so the others re-home to it as to any node that joined.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
from typing import Callable, Mapping

import aiohttp

from kvstore.errors import ServiceError

log = logging.getLogger("kvstore.membership")
OnChange = Callable[[dict[str, str]], None]
# Safety net under the watch: how often the whole member list is read again.
RESYNC_S = 1.0
# A failing watch is opened again after this pause (etcd restarting, for example).
WATCH_RETRY_S = 0.5


class StaticMembership:
    """The peer list from config (`cluster.peers`); it never changes by itself."""

    def __init__(self, node_id: str, address: str, peers: Mapping[str, str], on_change: OnChange | None = None):
        self.node_id, self.on_change = node_id, on_change
        self._members = {**peers, node_id: peers.get(node_id, address)}

    def members(self) -> dict[str, str]:
        return dict(self._members)

    async def start(self) -> None:
        if self.on_change is not None:
            self.on_change(self.members())

    async def stop(self) -> None:
        pass


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _prefix_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])  # prefixes end in "/", never 0xff


class EtcdMembership:
    """Members registered in etcd under `prefix`, each under its own lease."""

    def __init__(self, endpoint: str, prefix: str, node_id: str, address: str, ttl_s: float = 5.0,
                 on_change: OnChange | None = None, timeout_s: float = 1.0):
        self.endpoint, self.node_id, self.address = endpoint.rstrip("/"), node_id, address
        self.prefix = prefix.encode()
        self.ttl_s, self.timeout_s, self.on_change = ttl_s, timeout_s, on_change
        self.lease_id: str | None = None
        self.incarnation = secrets.token_hex(8)  # this process; see the module docstring
        self._members: dict[str, str] = {node_id: address}
        self._incarnations: dict[str, str] = {}  # other members' last seen, by node id
        # The watch and the periodic re-read both re-read the list: one at a time, or an
        # older reply applied last would undo a change (or fake a restart).
        self._resyncing = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    def members(self) -> dict[str, str]:
        return dict(self._members)

    async def start(self) -> None:
        """Register and read the member list; raises ServiceError if etcd cannot be reached."""
        self._session = aiohttp.ClientSession()
        try:
            await self._register()
            await self.resync()
        except BaseException:
            await self._session.close()
            raise
        self._tasks = [asyncio.create_task(self._keepalive_loop()), asyncio.create_task(self._watch_loop()),
                       asyncio.create_task(self._resync_loop())]

    async def stop(self) -> None:
        """Leave at once (revoke the lease) instead of waiting for it to run out."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            if self.lease_id is not None:
                try:
                    await self._post("/v3/lease/revoke", {"ID": self.lease_id})
                except ServiceError as exc:
                    log.info("event=etcd_revoke_failed error=%r", exc.message)
            await self._session.close()

    # --- etcd calls ----------------------------------------------------------------

    async def _post(self, path: str, body: dict) -> dict:
        try:
            async with self._session.post(self.endpoint + path, json=body,
                                          timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ServiceError(f"etcd {path} answered {resp.status}: {text[:200]}")
                return json.loads(text)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise ServiceError(f"etcd at {self.endpoint} failed on {path}: {exc!r}") from None

    async def _register(self) -> None:
        grant = await self._post("/v3/lease/grant", {"TTL": max(1, round(self.ttl_s))})
        if "ID" not in grant:
            raise ServiceError(f"etcd refused a lease: {grant}")
        self.lease_id = grant["ID"]
        value = json.dumps({"node_id": self.node_id, "address": self.address, "incarnation": self.incarnation})
        await self._post("/v3/kv/put", {"key": _b64(self.prefix + self.node_id.encode()), "value": _b64(value),
                                        "lease": self.lease_id})
        log.info("event=member_registered node=%s address=%s lease=%s ttl_s=%g",
                 self.node_id, self.address, self.lease_id, self.ttl_s)

    async def resync(self) -> None:
        """Read the whole member list and report a change."""
        async with self._resyncing:
            reply = await self._post("/v3/kv/range", {"key": _b64(self.prefix),
                                                      "range_end": _b64(_prefix_end(self.prefix))})
            self._apply(reply)

    def _apply(self, reply: dict) -> None:
        members, incarnations = {}, {}
        for kv in reply.get("kvs", []):
            try:
                doc = json.loads(base64.b64decode(kv["value"]))
                members[str(doc["node_id"])] = str(doc["address"])
                if doc.get("incarnation") is not None:  # absent from older daemons' entries
                    incarnations[str(doc["node_id"])] = str(doc["incarnation"])
            except (KeyError, ValueError, TypeError):
                log.warning("event=member_entry_bad key=%r", kv.get("key"))
        members[self.node_id] = self.address
        incarnations.pop(self.node_id, None)
        restarted = {n for n, inc in incarnations.items()
                     if n in self._members and self._incarnations.get(n, inc) != inc}
        self._incarnations = incarnations
        if restarted:
            log.info("event=members_restarted nodes=%s", ",".join(sorted(restarted)))
            self._members = {n: a for n, a in self._members.items() if n not in restarted}
            if self.on_change is not None:  # gone (its old incarnation), then back below
                self.on_change(self.members())
        if members != self._members:
            left, joined = set(self._members) - set(members), set(members) - set(self._members)
            log.info("event=members_changed members=%s joined=%s left=%s",
                     ",".join(sorted(members)), ",".join(sorted(joined)) or "-", ",".join(sorted(left)) or "-")
            self._members = members
            if self.on_change is not None:
                self.on_change(self.members())

    # --- loops -----------------------------------------------------------------------

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                reply = await self._post("/v3/lease/keepalive", {"ID": self.lease_id})
                if int(reply.get("result", {}).get("TTL", 0)) <= 0:  # expired: etcd forgot us
                    log.warning("event=member_lease_lost node=%s lease=%s", self.node_id, self.lease_id)
                    await self._register()
                    await self.resync()
            except ServiceError as exc:
                log.warning("event=etcd_keepalive_failed error=%r", exc.message)

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(RESYNC_S)
            try:
                await self.resync()
            except ServiceError as exc:
                log.warning("event=etcd_resync_failed error=%r", exc.message)

    async def _watch_loop(self) -> None:
        body = {"create_request": {"key": _b64(self.prefix), "range_end": _b64(_prefix_end(self.prefix))}}
        while True:
            try:
                async with self._session.post(self.endpoint + "/v3/watch", json=body,
                                              timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s)) as resp:
                    async for line in resp.content:
                        if b'"events"' in line:  # a put or delete under the prefix
                            await self.resync()
            except (aiohttp.ClientError, asyncio.TimeoutError, ServiceError) as exc:
                log.info("event=etcd_watch_retry error=%r", exc)
            await asyncio.sleep(WATCH_RETRY_S)


def make_membership(cluster, node_id: str, address: str, on_change: OnChange | None = None):
    """The membership `ClusterConfig.membership` names."""
    if cluster.membership == "etcd":
        return EtcdMembership(cluster.etcd_endpoint, cluster.etcd_prefix, node_id, address, cluster.lease_ttl_s,
                              on_change, cluster.peer_timeout_s)
    return StaticMembership(node_id, address, cluster.peer_map(), on_change)
