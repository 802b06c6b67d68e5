"""The client end of a peer channel: the PeerLink the remote tier calls.

`connect_peer` opens a channel on a transport and runs the handshake; `PeerClient.call`
then does one exchange at a time: request (+ payload), reply (+ payload into the buffer
`into` names), all under one deadline of timeout_s plus transfer time. A timeout or a broken
channel closes the link and raises PeerUnavailable (LinkBroken when the channel was closed
under the call); an error the peer answers with is raised as itself and the link stays usable.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Callable

from kvstore.errors import InvalidArgument, KVStoreError, ProtocolError, from_wire
from kvstore.protocol import Reply, Request
from kvstore.server.peer.auth import authenticate_client
from kvstore.server.peer.transport import Channel, Transport, nbytes_of, payload_bytes
from kvstore.tiers.remote import MIN_PEER_BANDWIDTH_BYTES_S, LinkBroken, PeerUnavailable


class PeerClient:
    """An authenticated channel to one peer (tiers.remote.PeerLink). One call at a time."""

    def __init__(self, channel: Channel, peer_node: str, timeout_s: float):
        self.channel, self.peer_node, self.timeout_s = channel, peer_node, timeout_s
        self.closed = False
        self._ids = itertools.count(2)  # 0 and 1 were the handshake
        self._lock = asyncio.Lock()

    async def call(self, op: str, args: dict, payload=None, into: Callable[[dict], Any] | None = None) -> Any:
        if self.closed:
            raise PeerUnavailable(f"link to peer {self.peer_node} is closed")
        nbytes = 0 if payload is None else nbytes_of(payload)
        async with self._lock:
            try:
                async with asyncio.timeout(self._budget(nbytes)) as deadline:
                    result, error = await self._exchange(op, args, payload, nbytes, into, deadline)
            except BaseException as exc:
                await self.close()
                if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
                    raise
                what = "did not answer in time" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
                # Closed under us (a restarted peer, on a pooled link) is worth one retry on a
                # fresh link; a timeout (a cut-off peer) is not.
                broken = isinstance(exc, (ConnectionError, asyncio.IncompleteReadError))
                raise (LinkBroken if broken else PeerUnavailable)(
                    f"peer {self.peer_node} ({self.channel.peer}) {what} on {op}") from None
        if error is not None:  # the peer (or `into`) refused; the link stays usable
            raise error
        return result

    async def _exchange(self, op, args, payload, nbytes, into, deadline) -> tuple[Any, KVStoreError | None]:
        request = Request(next(self._ids), op, args if payload is None else {**args, "payload_bytes": nbytes})
        await self.channel.send(request, payload)
        reply = await self.channel.recv()
        if not isinstance(reply, Reply) or reply.id != request.id:
            raise ProtocolError(f"peer {self.peer_node} answered out of turn")
        if reply.error is not None:
            return {}, from_wire(reply.error)
        result = reply.result  # as the peer sent it: the caller's typed decode says what is wrong with it
        nbytes = payload_bytes(result) if isinstance(result, dict) else 0
        error = None
        if nbytes:
            deadline.reschedule(asyncio.get_running_loop().time() + self._budget(nbytes))
            try:
                buffer = into(result) if into is not None else None
                if buffer is not None and nbytes_of(buffer) != nbytes:
                    raise InvalidArgument(f"receive buffer has {nbytes_of(buffer)} bytes; the peer sends {nbytes}")
            except KVStoreError as exc:  # e.g. no room here: drop the bytes, keep the link
                buffer, error = None, exc
            if buffer is None:
                await self.channel.discard(nbytes)
            else:
                await self.channel.recv_into(buffer)
        return result, error

    def _budget(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / MIN_PEER_BANDWIDTH_BYTES_S

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.channel.close()


async def connect_peer(transport: Transport, address: str, secret: bytes, node_id: str,
                       timeout_s: float) -> PeerClient:
    """Open a channel and authenticate; PeerUnavailable, or PermissionDenied on a wrong secret."""
    channel = None
    try:
        async with asyncio.timeout(timeout_s):
            channel = await transport.connect(address)
            peer_node = await authenticate_client(channel, secret, node_id)
        return PeerClient(channel, peer_node, timeout_s)
    except BaseException as exc:
        if channel is not None:
            channel.close()
        if isinstance(exc, (KVStoreError, asyncio.CancelledError, KeyboardInterrupt)):
            raise
        what = "did not answer in time" if isinstance(exc, TimeoutError) else f"failed: {exc!r}"
        raise PeerUnavailable(f"connecting to peer {address} {what}") from None
