"""The TCP peer transport: an asyncio BufferedProtocol per connection.

The event loop reads straight into the buffer `get_buffer` returns. Control bytes go to a
small receive buffer; once a frame announcing a payload is parsed, reading pauses until the
consumer names the payload's destination (`recv_into`), and the bytes then land there. At
most RX_BUFFER_BYTES of a payload (read together with its frame) are copied. Payloads are
written from the caller's buffer, and `send` returns once the kernel holds every byte. The
fd stays registered with the loop: no per-call epoll changes (the sock_* calls made two per
receive and cost ~100 us per round trip here).
"""

from __future__ import annotations

import asyncio
import collections
import socket

from kvstore.config import parse_address
from kvstore.errors import ProtocolError
from kvstore.protocol import HEADER, FrameCodec, Request
from kvstore.server.peer.transport import DRAIN_CHUNK_BYTES, PeerClosed, as_bytes_view, decode_frame, payload_bytes

# Control frames are small; a frame larger than this grows the buffer for itself.
RX_BUFFER_BYTES = 64 * 1024
LISTEN_BACKLOG = 128


class TcpChannel(asyncio.BufferedProtocol):
    def __init__(self):
        self.codec = FrameCodec()
        self.peer = "?"
        self.transport = None
        self._rx, self._start, self._end = bytearray(RX_BUFFER_BYTES), 0, 0
        self._events: collections.deque = collections.deque()
        self._payload_left = 0  # bytes of the current payload not yet handed to the consumer
        self._target: memoryview | None = None
        self._waiters: dict[str, asyncio.Future] = {}  # "rx" and "tx": one receiver, one sender
        self._error: BaseException | None = None
        self._paused = False

    # --- asyncio callbacks: the loop moves bytes --------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=0)  # resume_writing once the kernel has it all
        host, port = transport.get_extra_info("peername")[:2]
        self.peer = f"{host}:{port}"

    def get_buffer(self, sizehint: int):
        if self._target is not None:
            return self._target
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._rx) - self._end < HEADER.size + 1024:
            self._make_room(0)
        return memoryview(self._rx)[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._target = self._target[nbytes:]
            self._payload_left -= nbytes
            if not self._target.nbytes:
                self._target = None
                self._wake("rx")
            return
        self._end += nbytes
        try:
            self._parse()
        except ProtocolError as exc:
            self._fail(exc)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._fail(exc or PeerClosed(f"peer {self.peer} closed the channel"))

    def resume_writing(self) -> None:
        self._wake("tx")

    # --- parsing ------------------------------------------------------------------

    def _make_room(self, frame_bytes: int) -> None:
        """Unread bytes to the front of a new buffer (the loop may still hold a view of the old)."""
        unread = self._end - self._start
        rx = bytearray(max(RX_BUFFER_BYTES, frame_bytes, unread + RX_BUFFER_BYTES // 4))
        rx[:unread] = memoryview(self._rx)[self._start:self._end]
        self._rx, self._start, self._end = rx, 0, unread

    def _parse(self) -> None:
        while not self._payload_left:
            avail = self._end - self._start
            if avail < HEADER.size:
                return
            (length,) = HEADER.unpack_from(self._rx, self._start)
            if length > self.codec.max_frame_bytes:
                raise ProtocolError(f"peer frame of {length} bytes exceeds {self.codec.max_frame_bytes}")
            if avail < HEADER.size + length:
                if len(self._rx) - self._start < HEADER.size + length:
                    self._make_room(HEADER.size + length)
                return
            stop = self._start + HEADER.size + length
            event = decode_frame(self.codec, self._rx[self._start:stop])
            self._start = stop
            fields = event.args if isinstance(event, Request) else event.result
            self._payload_left = payload_bytes(fields) if isinstance(fields, dict) else 0
            self._events.append(event)
            self._wake("rx")
        if self._target is None and not self._paused:  # a payload follows: wait for its buffer
            self._paused = True
            self.transport.pause_reading()

    def _wake(self, side: str) -> None:
        waiter = self._waiters.get(side)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._error = self._error or exc
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(self._error)

    async def _wait(self, side: str) -> None:
        if self._error is not None:
            raise self._error
        self._waiters[side] = asyncio.get_running_loop().create_future()
        try:
            await self._waiters[side]
        finally:
            del self._waiters[side]

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            self.transport.resume_reading()

    # --- Channel --------------------------------------------------------------------

    async def send(self, message, payload=None) -> None:
        if self._error is not None or self.transport.is_closing():
            raise self._error or PeerClosed(f"channel to {self.peer} is closed")
        frame = self.codec.send_request(message) if isinstance(message, Request) else self.codec.send_reply(message)
        self.transport.write(frame)
        if payload is not None:
            self.transport.write(as_bytes_view(payload))
        while self.transport.get_write_buffer_size():  # the caller may reuse `payload` after this
            await self._wait("tx")

    async def recv(self):
        while not self._events:
            await self._wait("rx")
        return self._events.popleft()

    async def recv_into(self, buffer) -> None:
        view = as_bytes_view(buffer)
        if view.nbytes > self._payload_left:
            raise ProtocolError(f"asked for {view.nbytes} payload bytes; the peer announced {self._payload_left}")
        held = min(view.nbytes, self._end - self._start)  # read together with the frame
        view[:held] = memoryview(self._rx)[self._start:self._start + held]
        self._start += held
        self._payload_left -= held
        if held < view.nbytes:
            self._target = view[held:]
            self._resume()
            while self._target is not None:
                await self._wait("rx")
        if not self._payload_left:
            self._resume()
            self._parse()

    async def discard(self, nbytes: int) -> None:
        scratch = memoryview(bytearray(min(nbytes, DRAIN_CHUNK_BYTES)))
        while nbytes:
            n = min(nbytes, scratch.nbytes)
            await self.recv_into(scratch[:n])
            nbytes -= n

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class TcpListener:
    def __init__(self, on_channel):
        self.on_channel, self.server, self.address = on_channel, None, ""
        self._tasks: set[asyncio.Task] = set()

    def accept(self) -> TcpChannel:
        channel = TcpChannel()
        asyncio.get_running_loop().call_soon(self._start, channel)  # after connection_made
        return channel

    def _start(self, channel: TcpChannel) -> None:
        task = asyncio.create_task(self._serve(channel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, channel: TcpChannel) -> None:
        try:
            await self.on_channel(channel)
        finally:
            channel.close()

    async def close(self) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class TcpTransport:
    name = "tcp"

    async def connect(self, address: str) -> TcpChannel:
        host, port = parse_address(address)
        _, channel = await asyncio.get_running_loop().create_connection(TcpChannel, host, port)
        channel.peer = address
        return channel

    async def listen(self, address: str, on_channel) -> TcpListener:
        host, port = parse_address(address, any_port=True)
        listener = TcpListener(on_channel)
        listener.server = await asyncio.get_running_loop().create_server(
            listener.accept, host, port, backlog=LISTEN_BACKLOG, reuse_address=True)
        bound_host, bound_port = listener.server.sockets[0].getsockname()[:2]
        listener.address = f"[{bound_host}]:{bound_port}" if ":" in bound_host else f"{bound_host}:{bound_port}"
        return listener
