"""Peer transports: how two daemons move control frames and payload bytes.

A transport opens `Channel`s (connect / listen). A channel carries the msgpack frames of
kvstore.protocol, each optionally followed by raw payload bytes, in order. Payloads go
straight from the sender's buffer and straight into the receiver's (`recv_into`): no copy
in between. Which transport runs is `ClusterConfig.transport`, made by
server.peer.transports.make_transport.

A request or reply whose payload follows it says how many bytes in its top-level
"payload_bytes" field. server.peer.client turns a channel into a PeerLink.

    tcp  an asyncio BufferedProtocol (server.peer.tcp)
    ucx  ucxx tagged messages (server.peer.ucx), loaded only when chosen
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol

from kvstore.errors import ProtocolError
from kvstore.fields import MAX_OBJECT_BYTES
from kvstore.protocol import NEED_DATA, BadFrame, Fatal, FrameCodec, Reply, Request

# Payloads nobody wants are read and dropped in pieces of this size.
DRAIN_CHUNK_BYTES = 1 << 20


class PeerClosed(ConnectionError):
    """The other end closed the channel."""


class Channel(Protocol):
    """One connection between two daemons. One task sends and one receives at a time.

    `send` returns once `payload` may be reused (its bytes are on the wire or copied by the
    kernel). `recv_into` fills the whole buffer. Errors: PeerClosed, OSError, ProtocolError,
    or the transport's own exception; after any of them the channel is unusable.
    """

    peer: str

    async def send(self, message: Request | Reply, payload=None) -> None: ...
    async def recv(self) -> Request | Reply: ...
    async def recv_into(self, buffer) -> None: ...
    async def discard(self, nbytes: int) -> None: ...
    def close(self) -> None: ...


class Listener(Protocol):
    address: str  # host:port it accepts on (the real port when 0 was asked)

    async def close(self) -> None: ...


class Transport(Protocol):
    name: str

    async def connect(self, address: str) -> Channel: ...
    async def listen(self, address: str, on_channel: Callable[[Channel], Awaitable[None]]) -> Listener: ...


def as_bytes_view(buffer) -> memoryview:
    view = memoryview(buffer)
    if not view.contiguous:
        raise ProtocolError("peer payload buffers must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def nbytes_of(buffer) -> int:
    """Size of any buffer: host (buffer protocol) or device (numpy-like `nbytes`, e.g. CuPy)."""
    nbytes = getattr(buffer, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else memoryview(buffer).nbytes


def payload_bytes(fields: dict) -> int:
    """The announced payload size of a request's args or a reply's result (0: none)."""
    nbytes = fields.get("payload_bytes", 0)
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_OBJECT_BYTES:
        raise ProtocolError(f"payload_bytes must be an integer in 0..{MAX_OBJECT_BYTES}")
    return nbytes


def decode_frame(codec: FrameCodec, data) -> Request | Reply:
    codec.receive_data(data)
    event = codec.next_event()
    if isinstance(event, (BadFrame, Fatal)):
        raise event.error
    if event is NEED_DATA:
        raise ProtocolError("incomplete peer frame")
    return event
