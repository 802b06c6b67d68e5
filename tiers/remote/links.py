"""Links to peers: what the remote tier asks of one (PeerLink), and the pools that reuse them.

A link is opened by `connect(address)` (server.peer.client.connect_peer with the
transport and secret bound, so this package imports no transport) and carries one call at a
time. LinkPools keeps up to MAX_LINKS_PER_PEER of them per address: a call takes an idle
link (no await on that path), opens a new one, or waits `timeout_s` for one to be released.
A pooled link found closed under a call (the peer restarted since it was opened) is dropped
with its idle siblings and the call tried once more on a fresh link.

Runs on one event loop.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

from kvstore.errors import ServiceError

# A transfer slower than this is treated as a cut-off peer (payload deadlines grow with size).
MIN_PEER_BANDWIDTH_BYTES_S = 100e6
# Links kept per peer: concurrent transfers to one peer beyond this wait for a free link.
MAX_LINKS_PER_PEER = 4


class PeerUnavailable(ServiceError):
    """A peer did not answer in time, closed the link, or broke the protocol: treat as a miss."""


class LinkBroken(PeerUnavailable):
    """The link was closed under a call (by the peer, or a reset) rather than timing out. On a
    link taken from the pool this is what a peer that restarted looks like: a fresh link to
    it may well work, so the call is tried once more on one."""


class PeerLink(Protocol):
    """One authenticated link to a peer; one call at a time (the tier pools links).

    `call` sends `payload` (any contiguous buffer) after the request and returns the reply's
    result as the peer sent it (a map from a well-behaved peer; the tier decodes it into a
    kvstore.peer_replies type); when the reply announces payload bytes, `into(result)` names
    the buffer they land in (None: drop them). It raises PeerUnavailable on timeout or a
    broken link (the link is then closed) and the peer's own error (from kvstore.errors) when
    it answers with one.
    """

    closed: bool

    async def call(self, op: str, args: dict, payload=None, into: Callable[[dict], Any] | None = None) -> Any: ...
    async def close(self) -> None: ...


@dataclass(slots=True)
class _Pool:
    idle: list = field(default_factory=list)
    num_open: int = 0
    waiters: collections.deque = field(default_factory=collections.deque)

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class LinkPools:
    """One pool of links per peer address."""

    def __init__(self, connect: Callable[[str], Awaitable[PeerLink]], timeout_s: float):
        self._connect, self._timeout_s = connect, timeout_s
        self._pools: dict[str, _Pool] = {}

    async def call(self, address: str, op: str, args: dict, payload, into) -> Any:
        """One call on a pooled link; a pooled link found broken (the peer restarted since it
        was opened) is dropped with its idle siblings and the call tried once on a fresh one.
        Calls are idempotent at the peer (puts are content-addressed), so a retry is safe."""
        fresh = False
        while True:
            link, reused = await self._acquire(address, fresh)
            try:
                return await link.call(op, args, payload=payload, into=into)
            except LinkBroken:
                if not reused or fresh:
                    raise
                await self._drop_idle(address)
                fresh = True
            finally:
                self._release(address, link)

    async def open_fresh(self, address: str) -> None:
        """Open a new link to `address` and keep it in the pool, in place of the idle links
        (they may date from before a restart). Raises what connect raises (PeerUnavailable,
        PermissionDenied for a wrong secret)."""
        await self._drop_idle(address)
        link, _ = await self._acquire(address, fresh=True)
        self._release(address, link)

    async def close(self) -> None:
        for pool in self._pools.values():
            for link in pool.idle:
                await link.close()
        self._pools.clear()

    def check_integrity(self) -> None:
        """Raise RuntimeError on the first broken pool invariant (idle links are open ones)."""
        for address, pool in self._pools.items():
            if not 0 <= len(pool.idle) <= pool.num_open <= MAX_LINKS_PER_PEER:
                raise RuntimeError(f"link pool of {address}: {len(pool.idle)} idle, {pool.num_open} open, "
                                   f"limit {MAX_LINKS_PER_PEER}")
            if any(link.closed for link in pool.idle):
                raise RuntimeError(f"link pool of {address} keeps a closed link as idle")

    async def _acquire(self, address: str, fresh: bool = False) -> tuple[PeerLink, bool]:
        """An idle link (no await on this path), a new one, or the next one released; and
        whether it was reused from the pool. fresh: only a new link will do."""
        pool = self._pools.setdefault(address, _Pool())
        while True:
            while pool.idle and not fresh:
                link = pool.idle.pop()
                if not link.closed:
                    return link, True
                pool.num_open -= 1
            while fresh and pool.idle and pool.num_open >= MAX_LINKS_PER_PEER:
                pool.num_open -= 1  # an idle link makes room for the new one
                await pool.idle.pop().close()
            if pool.num_open < MAX_LINKS_PER_PEER:
                pool.num_open += 1
                try:
                    return await self._connect(address), False  # bounded by connect's own timeout
                except BaseException:
                    pool.num_open -= 1
                    pool.wake_one()
                    raise
            waiter = asyncio.get_running_loop().create_future()
            pool.waiters.append(waiter)
            try:
                async with asyncio.timeout(self._timeout_s):
                    await waiter
            except TimeoutError:
                raise PeerUnavailable(f"no free link to peer {address} within {self._timeout_s} s") from None

    async def _drop_idle(self, address: str) -> None:
        """Close the idle links to `address` (they may all date from before a peer restart)."""
        pool = self._pools.get(address)
        if pool is None:
            return
        idle, pool.idle = pool.idle, []
        pool.num_open -= len(idle)
        for link in idle:
            await link.close()
        pool.wake_one()

    def _release(self, address: str, link: PeerLink) -> None:
        pool = self._pools[address]
        if link.closed:
            pool.num_open -= 1
        else:
            pool.idle.append(link)
        pool.wake_one()
