"""The asyncio client: the same operations as `Client`, awaited.

Reads use `loop.add_reader` and `recvmsg` (asyncio streams cannot receive fds); writes
go straight to the non-blocking socket and are queued only when it is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from kvstore.config import default_socket_path
from kvstore.errors import DaemonUnavailable, KVStoreError, from_wire
from kvstore.protocol import NEED_DATA, BadFrame, Fatal, Reply
from kvstore.replies import HelloReply
from kvstore.client.api import ClientCalls, awaited
from kvstore.client.batched import after_deferred, store_deferred, warn_unreported
from kvstore.client.core import ClientCore, Collect, Later
from kvstore.client.daemon_peer import check_daemon_peer
from kvstore.client.sync import _ANCILLARY, RECV_BYTES, _recv_fds, parting_words


@awaited
class AsyncClient(ClientCalls):
    """Asyncio twin of `Client`: the same calls (client/api.py), awaited; a lease works as
    `async with await client.get(k) as lease:`. One event loop per client."""

    def __init__(self, socket_path: str | None, namespace: str, token: str | None,
                 timeout_s: float, client_name: str, shared_index: bool = True):
        self.shared_index = shared_index
        self.socket_path = socket_path or default_socket_path()
        self.namespace = namespace
        self.token = token
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._sock: socket.socket | None = None
        self._waiting: dict[int, asyncio.Future] = {}
        self._outbox = bytearray()
        self._lock = asyncio.Lock()
        self.server_info: HelloReply | None = None  # the daemon's hello: version, limits

    @classmethod
    async def connect(cls, socket_path: str | None = None, namespace: str = "default", token: str | None = None,
                      timeout_s: float = 30.0, client_name: str = "python-asyncio",
                      shared_index: bool = True) -> AsyncClient:
        self = cls(socket_path, namespace, token, timeout_s, client_name, shared_index)
        await self._connect()
        return self

    async def _connect(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(self._loop.sock_connect(sock, self.socket_path), self.timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            sock.close()
            raise DaemonUnavailable(
                f"no kvstore daemon at {self.socket_path} ({exc}); start one with `kvstore serve`"
            ) from None
        check_daemon_peer(sock, self.socket_path)  # closes sock when it refuses
        self._sock = sock
        self.core = ClientCore(self.namespace, self.token, self._release, self.shared_index)
        self.core.shared.watch(sock)
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self.server_info = await self._run(self.core.op_hello(self.client_name))

    async def reconnect(self) -> None:
        self._drop(DaemonUnavailable("reconnecting"))
        unreported = self.core.deferred_results  # flush() on the new connection reports them
        await self._connect()
        self.core.deferred_results[:0] = unreported

    async def close(self) -> None:
        if self._sock is not None and self.core.deferred:
            with contextlib.suppress(KVStoreError):  # settled: each unstored put's result says why
                await self._run(store_deferred(self.core), deferred_first=False)
        warn_unreported(self.core)
        if self._sock is not None and self.core.shared.num_pending:  # hits read from the shared index
            with contextlib.suppress(DaemonUnavailable):
                self._send(b"".join(map(self.core.codec.send_request, self.core.shared.reports())))
        self._drop(DaemonUnavailable("client closed"))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _drop(self, error: Exception) -> None:
        if self._sock is None:
            return
        self._loop.remove_reader(self._sock.fileno())
        self._loop.remove_writer(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._outbox.clear()
        self.core.close()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)
        self._waiting.clear()

    def _lost(self, why: str) -> None:
        self._drop(DaemonUnavailable(f"lost the daemon at {self.socket_path}: {why}; call reconnect() once it is back"))

    # --- transport ---------------------------------------------------------------

    def _on_readable(self) -> None:
        try:
            data, ancdata, _, _ = self._sock.recvmsg(RECV_BYTES, _ANCILLARY)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(str(exc))
        if not data:
            return self._lost("connection closed")
        self.core.fds.extend(_recv_fds(ancdata))
        self.core.codec.receive_data(data)
        while (event := self.core.codec.next_event()) is not NEED_DATA:
            if isinstance(event, Reply) and event.id in self._waiting:
                fut = self._waiting.pop(event.id)
                if not fut.done():
                    fut.set_result(event)
            elif isinstance(event, Reply) and event.id == 0 and event.error is not None:
                return self._lost(from_wire(event.error).message)
            elif isinstance(event, (Fatal, BadFrame)):
                return self._lost(f"bad frame from daemon: {event.error.message}")

    def _send(self, data: bytes) -> None:
        if self._sock is None:
            raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
        if not self._outbox:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                why = parting_words(self._sock, self.core.codec) or str(exc)
                self._lost(why)
                raise DaemonUnavailable(f"lost the daemon at {self.socket_path}: {why}") from None
            data = data[sent:]
            if not data:
                return
            self._loop.add_writer(self._sock.fileno(), self._on_writable)
        self._outbox += data

    def _on_writable(self) -> None:
        try:
            sent = self._sock.send(self._outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            return self._lost(str(exc))
        del self._outbox[:sent]
        if not self._outbox:
            self._loop.remove_writer(self._sock.fileno())

    async def _roundtrip(self, requests) -> list:
        futures = []
        for r in requests:
            if not r.no_reply:
                futures.append(self._loop.create_future())
                self._waiting[r.id] = futures[-1]
        try:
            self._send(b"".join(self.core.codec.send_request(r) for r in requests))
        except DaemonUnavailable:
            for fut in futures:  # failed with the connection; the caller gets the raise below
                if fut.done():
                    fut.exception()  # retrieved: no "exception was never retrieved" warning
                else:
                    fut.cancel()
            raise
        try:
            done = iter(await asyncio.wait_for(asyncio.gather(*futures), self.timeout_s))
        except asyncio.TimeoutError:
            self._lost(f"no reply within {self.timeout_s} s")
            raise DaemonUnavailable(f"no reply from {self.socket_path} within {self.timeout_s} s") from None
        return [None if r.no_reply else next(done) for r in requests]

    async def _run(self, op, deferred_first: bool = True):
        async with self._lock:  # one op at a time keeps fds paired with their replies
            if self._sock is None:
                raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
            if deferred_first and (self.core.deferred or self.core.storing):
                op = after_deferred(self.core, op)
            later: list[tuple[int, asyncio.Future]] = []  # (request id, reply) sent with Later
            try:
                requests = next(op)
                while True:
                    requests = op.send(await self._exchange(requests, later))
            except StopIteration as done:
                return done.value
            finally:
                for request_id, fut in later:  # what the op did not collect: later replies are dropped
                    self._waiting.pop(request_id, None)
                    if fut.done() and not fut.cancelled():
                        fut.exception()  # retrieved: no "exception was never retrieved" warning

    async def _exchange(self, requests, later: list):
        if isinstance(requests, Later):
            return self._send_later(requests, later)
        if isinstance(requests, Collect):
            return [None if fut is None else await self._reply_of(fut) for fut in requests]
        return await self._roundtrip(requests)

    def _send_later(self, requests, later: list) -> list:
        """Send now; the handle is a future per request (None: no reply)."""
        handle = []
        for r in requests:
            handle.append(None if r.no_reply else self._loop.create_future())
            if handle[-1] is not None:
                self._waiting[r.id] = handle[-1]
                later.append((r.id, handle[-1]))
        self._send(b"".join(self.core.codec.send_request(r) for r in requests))
        return handle

    async def _reply_of(self, fut: asyncio.Future):
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            self._lost(f"no reply within {self.timeout_s} s")
            raise DaemonUnavailable(f"no reply from {self.socket_path} within {self.timeout_s} s") from None

    def _release(self, lease_id: int) -> None:
        if self._sock is not None:
            try:
                self._send(self.core.codec.send_request(self.core.release_request(lease_id)))
            except DaemonUnavailable:
                pass
