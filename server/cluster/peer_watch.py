"""Keeps this node's view of which peers are up honest, with or without traffic to them.

The remote tier marks a peer down when a call to it fails and up when an exchange with it
succeeds. With no calls to make, a peer that came back would stay "down" (in /v1/cluster
and kvstore_cluster_member_up) until the next call happened to try it. So:

    at start   one handshake with every other member: a wrong cluster secret is reported
               at once, on both sides (a member not listening yet is not marked down for it)
    then       every peer marked down is probed (a fresh authenticated link, kept in the
               pool) after interval_s, then at doubling intervals up to MAX_PROBE_S; the
               first probe that succeeds marks it up (and a static member's return starts a
               re-homing pass: server.cluster.link.ClusterLink.on_peer_state)

Runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvstore.peer")
# Probes of a peer that stays down slow down to one per this many seconds.
MAX_PROBE_S = 5.0


class PeerWatch:
    def __init__(self, remote, interval_s: float, clock=None):
        self.remote = remote  # tiers.remote.RemoteTier
        self.interval_s = interval_s
        self.clock = clock or asyncio.get_running_loop().time
        self._next: dict[str, tuple[float, float]] = {}  # node -> (next probe at, wait after it)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        others = [n for n in self.remote.members() if n != self.remote.node_id]
        await asyncio.gather(*(self.remote.probe(n) for n in others))
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.probe_down()
            except Exception:  # never let one bad round end the watch
                log.exception("event=peer_probe_failed")

    async def probe_down(self) -> None:
        """One round: probe each peer marked down whose turn has come."""
        now = self.clock()
        down = set(self.remote.down_nodes()) & set(self.remote.members())
        for node in set(self._next) - down:
            del self._next[node]  # up again (or gone): the next failure starts over
        due = [n for n in sorted(down) if self._next.get(n, (now, 0.0))[0] <= now]
        results = await asyncio.gather(*(self.remote.probe(n) for n in due))
        for node, up in zip(due, results):
            if up:
                self._next.pop(node, None)
            else:
                wait = min(2 * self._next.get(node, (0.0, self.interval_s / 2))[1], MAX_PROBE_S)
                self._next[node] = (self.clock() + wait, wait)
