"""The UCX peer transport (ucxx): tagged sends for control frames and payloads.

A control frame travels as two tagged messages, its 4-byte length and then its body, so the
receiver checks the length against the frame limit before it allocates anything (ucxx's
`recv_obj` would allocate whatever the sender announces). A payload is one tagged message
sent straight from the caller's buffer and received straight into the caller's buffer: host
memory or a CUDA array, which UCX moves without staging where GPUDirect is available. All
messages of a channel use the endpoint's tag, and UCX matches same-tag messages from one
sender in order, so frames and payloads stay in step.

Environment defaults (set before ucxx loads, only where the user has not set them):
UCX_MM_ERROR_HANDLING=y keeps shared memory on with endpoint error handling (which the asyncio
listener always enables); UCX_WARN_UNUSED_ENV_VARS=n; UCX_RNDV_SCHEME as RNDV_SCHEME says;
UCXPY_PROGRESS_MODE=blocking.

ucxx's listener takes a port only and accepts on every interface; the handshake guards it.

A listener is never destroyed while the process runs (see `UcxListener.close`).
"""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np

from kvstore.config import parse_address
from kvstore.errors import ProtocolError
from kvstore.protocol import HEADER, FrameCodec, Request
from kvstore.server.peer.transport import PeerClosed, decode_frame

# put_zcopy roughly doubled large transfers over UCX's tcp transport (FIELD-NOTES); set
# UCX_RNDV_SCHEME yourself to compare (bench/remote.py prints what ran).
RNDV_SCHEME = "put_zcopy"
# "blocking": the loop sleeps on the worker's event fd (no spinning core on a shared machine).
PROGRESS_MODE = "blocking"
UCX_ENV_DEFAULTS = {"UCX_MM_ERROR_HANDLING": "y", "UCX_RNDV_SCHEME": RNDV_SCHEME, "UCX_WARN_UNUSED_ENV_VARS": "n",
                    "UCXPY_PROGRESS_MODE": PROGRESS_MODE}


_UCX_ERRORS: tuple = ()

# Closed listeners, kept for the life of the process (see UcxListener.close).
_CLOSED_LISTENERS: list = []


def load_ucxx():
    """Import and initialise ucxx once per process; raises ImportError with the reason."""
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    global _UCX_ERRORS
    import ucxx
    import ucxx.core
    if ucxx.core._ctx is None:
        ucxx.init()  # reads UCXPY_PROGRESS_MODE
    _UCX_ERRORS = (ucxx.exceptions.UCXError,)
    return ucxx


class UcxChannel:
    def __init__(self, endpoint, peer: str):
        self.ep, self.peer = endpoint, peer
        self.codec = FrameCodec()
        self._header = np.empty(HEADER.size, dtype=np.uint8)

    async def send(self, message, payload=None) -> None:
        frame = self.codec.send_request(message) if isinstance(message, Request) else self.codec.send_reply(message)
        view = memoryview(frame)
        await self.ep.send(np.frombuffer(view[:HEADER.size], dtype=np.uint8))
        await self.ep.send(np.frombuffer(view[HEADER.size:], dtype=np.uint8))
        if payload is not None:
            await self.ep.send(_array(payload))

    async def recv(self):
        await self._recv(self._header)
        (length,) = HEADER.unpack(self._header.tobytes())
        if length > self.codec.max_frame_bytes:
            raise ProtocolError(f"peer frame of {length} bytes exceeds {self.codec.max_frame_bytes}")
        body = np.empty(length, dtype=np.uint8)
        await self._recv(body)
        return decode_frame(self.codec, self._header.tobytes() + body.tobytes())

    async def recv_into(self, buffer) -> None:
        await self._recv(_array(buffer))

    async def discard(self, nbytes: int) -> None:
        await self._recv(np.empty(nbytes, dtype=np.uint8))  # one UCX message: one receive of its size

    async def _recv(self, array) -> None:
        try:
            await self.ep.recv(array)
        except _UCX_ERRORS as exc:  # closed, reset, canceled, truncated: the channel is gone
            raise PeerClosed(f"peer {self.peer}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        if not self.ep.closed:
            self.ep.abort()


def _array(buffer):
    """Host buffers as uint8 arrays; device arrays (__cuda_array_interface__) pass unchanged."""
    if hasattr(buffer, "__cuda_array_interface__"):
        return buffer
    return np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)


class UcxListener:
    def __init__(self, listener, host: str):
        self.listener = listener
        self.address = f"{host}:{listener.port}"
        self.tasks: set[asyncio.Task] = set()
        self.closed = False

    async def close(self) -> None:
        """Stop serving: end every channel, and abort each connection that arrives later.

        The ucxx listener itself is kept, not closed. Closing it frees ucxx's callback state
        while UCX may still hold a connection request for it in the worker's progress queue
        ("destroying listener ... with 1 unprocessed connection requests"); the next progress
        then runs that request's callback on freed memory: SIGSEGV in
        ucp_cm_server_conn_request_progress, which killed 5 of 12 runs of the UCX peer tests
        under CPU load. A kept listener costs its port until the process exits (a daemon
        closes its one listener on shutdown).
        """
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        _CLOSED_LISTENERS.append(self.listener)


class UcxTransport:
    name = "ucx"

    def __init__(self):
        self.ucxx = load_ucxx()

    async def connect(self, address: str) -> UcxChannel:
        host, port = parse_address(address)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        endpoint = await self.ucxx.create_endpoint(infos[0][4][0], port)  # ucxx wants an IP address
        return UcxChannel(endpoint, address)

    async def listen(self, address: str, on_channel) -> UcxListener:
        host, port = parse_address(address, any_port=True)
        holder: list[UcxListener] = []

        async def accept(endpoint) -> None:
            channel = UcxChannel(endpoint, f"ucx:{host}:{port}#{endpoint.uid:x}")
            if holder[0].closed:
                channel.close()
                return
            task = asyncio.current_task()
            holder[0].tasks.add(task)
            try:
                await on_channel(channel)
            finally:
                holder[0].tasks.discard(task)
                channel.close()

        holder.append(UcxListener(self.ucxx.create_listener(accept, port), host))
        return holder[0]
