"""The asyncio client: the same operations as `Client`, awaited.

Reads use `loop.add_reader` and `recvmsg` (asyncio streams cannot receive fds); writes
go straight to the non-blocking socket and are queued only when it is full.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import socket
import warnings
import weakref

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
        self._abandoned = False  # a call stopped mid-way closed the connection: the next call opens one
        self.core = self._new_core()

    @classmethod
    async def connect(cls, socket_path: str | None = None, namespace: str = "default", token: str | None = None,
                      timeout_s: float = 30.0, client_name: str = "python-asyncio",
                      shared_index: bool = True) -> AsyncClient:
        self = cls(socket_path, namespace, token, timeout_s, client_name, shared_index)
        await self._connect()
        _UNCLOSED.add(self)
        return self

    async def _connect(self) -> None:
        """Connect self.core (new, not yet connected) to the daemon and say hello. The
        caller holds the lock, or nothing else can run a call yet."""
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
        self.core.shared.watch(sock)
        self._loop.add_reader(sock.fileno(), self._on_readable)
        self.server_info = await self._drive(self.core.op_hello(self.client_name), deferred_first=False)

    async def reconnect(self) -> None:
        async with self._lock:
            self._drop(DaemonUnavailable("reconnecting"))
            self._abandoned = False
            self.core = self._new_core(self.core)  # flush() on the new connection reports the old one's results
            await self._connect()

    async def close(self) -> None:
        _UNCLOSED.discard(self)
        if self.core.deferred and (self._sock is not None or self._abandoned):
            with contextlib.suppress(KVStoreError):  # settled: each unstored put's result says why
                await self._run(store_deferred(self.core), deferred_first=False)  # (reconnects if abandoned)
        self._abandoned = False
        if self._sock is None:
            self.core.close()  # no connection: deferred puts still held are lost, their results say so
        warn_unreported(self.core)
        if self._sock is not None and self.core.shared.num_pending:  # hits read from the shared index
            with contextlib.suppress(DaemonUnavailable):
                self._send(b"".join(map(self.core.codec.send_request, self.core.shared.reports())))
        self._drop(DaemonUnavailable("client closed"))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _drop(self, error: Exception, keep_deferred: bool = False) -> None:
        if self._sock is None:
            return
        self._loop.remove_reader(self._sock.fileno())
        self._loop.remove_writer(self._sock.fileno())
        self._sock.close()
        self._sock = None
        self._outbox.clear()
        self.core.close(keep_deferred)
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_exception(error)
        self._waiting.clear()

    def _abandon(self) -> None:
        """A call stopped mid-way (cancelled, or an error between a request and its reply):
        replies and fds it left unread would be taken for a later call's (another namespace's
        arena, another object's lease). Close the connection (the daemon ends its leases and
        reservations); the next call opens a new one."""
        if self._sock is not None:
            self._drop(DaemonUnavailable("a call on this connection was cancelled"), keep_deferred=True)
            self.core = self._new_core(self.core)  # what ops of later calls are made on
            self._abandoned = True

    def __del__(self) -> None:
        # No event loop can be counted on here to store them: say they are lost.
        core = getattr(self, "core", None)
        if core is not None and core.deferred:
            _warn_lost(self.socket_path, len(core.deferred))

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
        gathered = asyncio.gather(*futures)
        try:
            done = iter(await asyncio.wait_for(gathered, self.timeout_s))
        except asyncio.CancelledError:
            if gathered.done() and not gathered.cancelled():
                gathered.exception()  # retrieved: the caller was cancelled, not the replies
            raise
        except asyncio.TimeoutError:
            self._lost(f"no reply within {self.timeout_s} s")
            raise DaemonUnavailable(f"no reply from {self.socket_path} within {self.timeout_s} s") from None
        return [None if r.no_reply else next(done) for r in requests]

    async def _run(self, op, deferred_first: bool = True):
        async with self._lock:  # one op at a time keeps fds paired with their replies
            if self._sock is None:
                if not self._abandoned:
                    raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
                self._abandoned = False
                await self._connect()
            return await self._drive(op, deferred_first)

    async def _drive(self, op, deferred_first: bool):
        """Run `op` to its result on the connection (the lock held, or nothing else can run)."""
        if deferred_first and (self.core.deferred or self.core.storing):
            op = after_deferred(self.core, op)
        later: list[tuple[int, asyncio.Future]] = []  # (request id, reply) sent with Later
        exchanging = False
        core = self.core
        try:
            requests = next(op)
            while True:
                exchanging = True
                replies = await self._exchange(requests, later)
                exchanging = False
                if core.closed:
                    # The connection was lost after these replies came (the reader saw the
                    # close before this call ran on): the leases and reservations they name
                    # ended with it, and the mapped arenas are forgotten.
                    raise DaemonUnavailable(f"lost the daemon at {self.socket_path} during this call; "
                                            "call reconnect() once it is back")
                requests = op.send(replies)
        except StopIteration as done:
            return done.value
        except BaseException as exc:
            # Cancelled (or failed) between a request and its reply, or stopped anywhere by
            # something that is not an error of the call: the connection cannot be trusted.
            if exchanging or not isinstance(exc, Exception):
                self._abandon()
            raise
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


def _warn_lost(socket_path: str, count: int) -> None:
    warnings.warn(f"kvstore: an AsyncClient of {socket_path} was not closed: its {count} deferred put(s) "
                  "(put(wait=False)) were never stored; await client.flush() or client.close() before the "
                  "event loop ends", RuntimeWarning, stacklevel=2)


# AsyncClients never closed: at exit no event loop runs to store their deferred puts, so each
# that still holds some is named in a warning (a client collected earlier warns in __del__).
_UNCLOSED: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _warn_unclosed() -> None:
    for client in list(_UNCLOSED):
        if client.core.deferred:
            _warn_lost(client.socket_path, len(client.core.deferred))
            client.core.deferred = []  # warned once: not again by __del__
