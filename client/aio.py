"""The asyncio client: the same operations as `Client`, awaited.

Reads use `loop.add_reader` and `recvmsg` (asyncio streams cannot receive fds); writes
go straight to the non-blocking socket and are queued only when it is full.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from kvstore import messages as m
from kvstore.config import default_socket_path
from kvstore.errors import DaemonUnavailable, from_wire
from kvstore.hints import Hints
from kvstore.identity import StateDescriptor
from kvstore.protocol import NEED_DATA, BadFrame, Fatal, Reply
from kvstore.replies import GpuHandleReply, HelloReply
from kvstore.client.core import ClientCore, Collect, Later
from kvstore.client.daemon_peer import check_daemon_peer
from kvstore.client import batched
from kvstore.client import groups as group_ops
from kvstore.client.results import LookupResult, PutResult
from kvstore.client.gpu import op_get_into_device
from kvstore.client.lease import ReadLease
from kvstore.client.sync import _ANCILLARY, RECV_BYTES, _recv_fds, parting_words


class AsyncClient:
    """Asyncio twin of `client.Client`; see its docstrings. One event loop per client."""

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
        await self._connect()

    async def close(self) -> None:
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

    async def _run(self, op):
        async with self._lock:  # one op at a time keeps fds paired with their replies
            if self._sock is None:
                raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
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

    # --- public API (see client.Client for the contract of each call) ---------------

    async def put(self, key, data, desc: StateDescriptor | None = None, hints: Hints | None = None,
                  tier: str = "host") -> PutResult:
        return await self._run(batched.put(self.core, key, data, desc, hints, tier))

    async def put_many(self, items, desc: StateDescriptor | None = None, hints: Hints | None = None,
                       tier: str = "host", routes=None) -> list[PutResult]:
        return await self._run(batched.put_many(self.core, list(items), desc, hints, tier, routes))

    async def get(self, key, namespace: str | None = None, accept=None, ranges=None,
                  expect: StateDescriptor | None = None) -> ReadLease | None:
        """A read lease, or None; use it as `async with await client.get(k) as lease:`."""
        return await self._run(self.core.op_get(key, namespace, accept, ranges, expect))

    async def get_into(self, key, out, namespace: str | None = None, verify: bool = False,
                       expect: StateDescriptor | None = None) -> int | None:
        return await self._run(self.core.op_get_into(key, out, namespace, verify, expect))

    async def get_many_into(self, items, namespace: str | None = None,
                            expect: StateDescriptor | None = None) -> list[int | None]:
        """As Client.get_many_into."""
        return await self._run(batched.get_many_into(self.core, list(items), namespace, expect))

    async def get_many(self, keys, namespace: str | None = None,
                       expect: StateDescriptor | None = None) -> list[ReadLease | None]:
        """As Client.get_many."""
        return await self._run(batched.get_many(self.core, list(keys), namespace, expect))

    async def release_many(self, leases) -> None:
        """As Client.release_many."""
        await self._run(batched.release_many(self.core, list(leases)))

    async def lookup(self, keys, namespace: str | None = None,
                     expect: StateDescriptor | None = None) -> LookupResult:
        return await self._run(self.core.op_lookup(list(keys), namespace, expect))

    async def delete(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        return await self._run(self.core.op_batch(m.Delete, list(keys), namespace, scope=scope))

    async def pin(self, keys, ttl_s: float | None = None, namespace: str | None = None,
                  scope: str = "cluster") -> int:
        return await self._run(self.core.op_batch(m.Pin, list(keys), namespace, ttl_s=ttl_s, scope=scope))

    async def unpin(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        return await self._run(self.core.op_batch(m.Unpin, list(keys), namespace, scope=scope))

    async def prefetch(self, keys, tier: str = "host", policy: str = "best_effort",
                       timeout_s: float | None = None, namespace: str | None = None) -> int:
        return await self._run(self.core.op_batch(m.Prefetch, list(keys), namespace,
                                                  tier=tier, policy=policy, timeout_s=timeout_s))

    async def put_group(self, items, hints: Hints | None = None, routes=None) -> group_ops.GroupPutResult:
        """Store objects that are only usable together as one group (see Client.put_group)."""
        return await self._run(group_ops.put_group(self.core, list(items), hints, routes))

    async def put_groups(self, groups, hints: Hints | None = None, routes=None) -> list:
        """put_group for many groups; per group its GroupPutResult or the exception that
        refused it (see Client.put_groups)."""
        return await self._run(group_ops.put_groups(self.core, [list(items) for items in groups], hints, routes))

    async def lookup_groups(self, groups, namespace: str | None = None) -> group_ops.GroupLookup:
        """Per group (a list of member keys: ChunkKeys, or kvstore.groups.Member) whether it
        is complete: its manifest and every member held, live and under the descriptor the
        key expects, on any tier. `leading` counts the complete groups before the first
        incomplete one."""
        return await self._run(group_ops.lookup_groups(self.core, list(groups), namespace))

    async def get_groups(self, groups, namespace: str | None = None) -> list:
        """get_group for many groups in one round trip (per window of leases): per group a
        GroupLease, or None with nothing of it leased."""
        return await self._run(group_ops.get_groups(self.core, [list(members) for members in groups], namespace))

    async def get_group(self, members, namespace: str | None = None) -> group_ops.GroupLease | None:
        """Read leases on every member of the group (a GroupLease, a context manager), or
        None and nothing leased: never part of a group."""
        return await self._run(group_ops.get_group(self.core, list(members), namespace))

    async def stats(self) -> dict:
        return (await self._run(self.core.op_simple(m.Stats()))).document

    async def check_integrity(self) -> None:
        await self._run(self.core.op_simple(m.Check()))

    async def get_into_device(self, key, out, namespace: str | None = None,
                              expect: StateDescriptor | None = None) -> int | None:
        """As Client.get_into_device."""
        return await self._run(op_get_into_device(self.core, key, out, namespace, expect))

    async def gpu_handle(self) -> GpuHandleReply:
        return await self._run(self.core.op_simple(m.GpuHandle()))
