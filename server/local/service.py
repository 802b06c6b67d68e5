"""The local service: one asyncio Protocol per client connection on the Unix socket.

It only moves bytes between the socket and the sans-I/O codec, dispatches typed
requests to the parts the daemon hands it (`LocalServices`: the tier manager, the index
ops, group ops, the host tier's namespaces), and passes arena fds with SCM_RIGHTS. A bad frame gets
an error reply (or, if the stream cannot be resynchronised, the connection is closed);
no request can crash the daemon or change stored state by failing.
"""

from __future__ import annotations

import array
import asyncio
import collections
import itertools
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Protocol

from kvstore import messages as m
from kvstore import replies as r
from kvstore.config import LimitsConfig
from kvstore.errors import LimitExceeded, PermissionDenied, ProtocolError
from kvstore.protocol import NEED_DATA, BadFrame, Fatal, FrameCodec, Reply, Request
from kvstore.server.later import is_ready, then
from kvstore.server.local import batches, inline
from kvstore.server.local.errors import error_wire
from kvstore.server.tiering.groups import GroupOps
from kvstore.server.tiering.host import HostTier
from kvstore.server.tiering.index_ops import IndexOps
from kvstore.server.tiering.manager import TierManager
from kvstore.server.traffic import Traffic

log = logging.getLogger("kvstore.local")
_conn_ids = itertools.count(1)
SERVER_VERSION = "0.1.0"
# Replies one connection may have queued in the daemon before the daemon stops reading its
# requests (asyncio flow control): a client that sends without ever reading cannot make the
# daemon buffer replies without bound. Far above what the clients keep in flight (the sync
# client sends in groups of 64 KiB of requests and reads their replies before the next).
REPLY_BUFFER_HIGH_BYTES = 4 * 1024 * 1024


class Door(Protocol):
    """What a connection asks of the daemon itself (server/daemon.py: Daemon)."""

    def authorize(self, namespace: str, token: str | None, peer) -> None: ...
    def limits_for_clients(self) -> r.ClientLimits: ...
    def client_stats(self, owner, opened) -> dict: ...
    def gpu_handle(self) -> r.GpuHandleReply: ...


@dataclass(frozen=True, slots=True)
class LocalServices:
    """What the local socket's connections use, each part handed in by the daemon: gets,
    puts and leases (the tier manager), lookups, deletes, pins and prefetches (the index
    ops), store groups, the host tier's namespaces (opened, and their arenas' fds), the
    `[limits]` table, the daemon itself for what only it knows (`Door`), and the note of
    when a client last sent something (`Traffic`: background copies yield to clients)."""
    manager: TierManager
    index: IndexOps
    groups: GroupOps
    host: HostTier
    limits: LimitsConfig
    door: Door
    traffic: Traffic = field(default_factory=Traffic)
    connections: dict[int, "LocalConnection"] = field(default_factory=dict)  # conn id -> connection


class _Retry:
    """A namespace's arena was made off the loop: dispatch its open `msg` again, which now
    answers at once (with the arena's fd)."""

    __slots__ = ("msg",)

    def __init__(self, msg):
        self.msg = msg


class LocalConnection(asyncio.Protocol):
    def __init__(self, services: LocalServices):
        self.manager, self.index, self.groups, self.host = services.manager, services.index, services.groups, services.host
        self.door, self.limits, self.connections = services.door, services.limits, services.connections
        self.traffic = services.traffic
        self.conn_id = next(_conn_ids)
        self.codec = FrameCodec(self.limits.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.opened: set[str] = set()  # namespaces this connection may use
        self.client_name = "?"
        self.peer = (0, -1, -1)  # pid, uid, gid from SO_PEERCRED
        self._fd_sock: socket.socket | None = None
        self._held: list[tuple[bytes, int | None]] | None = None  # frames queued behind an fd send
        # Replies made while one read's requests are served go out in one write (a lookup and
        # its pin answered in one send, not two: each send to a waiting client costs a wakeup).
        self._corked: list[bytes] | None = None
        # Requests run in arrival order. One that must wait for I/O (a demotion, an NVMe
        # read) runs as a task, and the requests behind it wait in the inbox.
        self._inbox: collections.deque[Request] = collections.deque()
        self._busy = False
        self._write_paused = False  # the reply buffer is past its high-water mark

    # --- asyncio callbacks --------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        self.peer = struct.unpack("3i", creds)
        if len(self.connections) >= self.limits.max_clients:
            err = LimitExceeded(f"daemon serves at most {self.limits.max_clients} clients (limits.max_clients)")
            transport.write(self.codec.send_reply(Reply(0, error=err.to_wire())))
            transport.close()
            return
        transport.set_write_buffer_limits(high=REPLY_BUFFER_HIGH_BYTES)
        # asyncio's transport socket has no sendmsg; a dup of the fd does.
        self._fd_sock = socket.socket(fileno=os.dup(sock.fileno()))
        self.connections[self.conn_id] = self

    def data_received(self, data: bytes) -> None:
        self.traffic.heard()
        self.codec.receive_data(data)
        corked = self._cork()
        try:
            self._serve_events()
        finally:
            if corked:
                self._uncork()

    def _serve_events(self) -> None:
        while True:
            event = self.codec.next_event()
            if event is NEED_DATA:
                break
            if isinstance(event, Fatal):
                log.warning("event=protocol_fatal conn=%d error=%r", self.conn_id, event.error.message)
                err = ProtocolError(f"{event.error.message} (limits.max_frame_bytes); closing the connection")
                self._write(self.codec.send_reply(Reply(0, error=err.to_wire())))
                self._uncork()
                self.transport.close()
                return
            if isinstance(event, BadFrame):
                log.info("event=bad_frame conn=%d id=%d error=%r", self.conn_id, event.id, event.error.message)
                self._write(self.codec.send_reply(Reply(event.id, error=event.error.to_wire())))
            elif isinstance(event, Reply):
                err = ProtocolError("clients send requests, not replies")
                self._write(self.codec.send_reply(Reply(event.id, error=err.to_wire())))
            else:
                self._inbox.append(event)
        if not self._busy:
            self._drain()

    def pause_writing(self) -> None:
        """The client is not reading its replies: stop reading its requests until it does."""
        self._write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if not self.transport.is_closing():
            self.transport.resume_reading()
            if not self._busy:
                self._drain()

    def connection_lost(self, exc) -> None:
        self.connections.pop(self.conn_id, None)
        dropped = self.manager.drop_owner(self.conn_id)
        if dropped:
            log.info("event=client_gone conn=%d client=%s pid=%d leases_released=%d",
                     self.conn_id, self.client_name, self.peer[0], dropped)
        if self._fd_sock is not None:
            self._fd_sock.close()
            self._fd_sock = None

    # --- requests -------------------------------------------------------------------

    def _drain(self) -> None:
        while self._inbox and not self.transport.is_closing() and not self._write_paused:
            request = self._inbox.popleft()
            try:
                msg = m.decode_request(request)
                result, fd = self._dispatch(msg)
            except Exception as exc:
                self._reply(request, None, None, exc)
                continue
            if not is_ready(result):
                self._busy = True
                asyncio.get_running_loop().create_task(self._finish(request, result))
                return
            self._reply(request, result, fd, None)

    async def _finish(self, request: Request, pending) -> None:
        fd, corked = None, False
        try:
            try:
                result = await pending
                corked = self._cork()  # after the await: never held while other callbacks write
                if isinstance(result, _Retry):  # the arena is made: the open answers now
                    result, fd = self._dispatch(result.msg)
            except Exception as exc:
                corked = corked or self._cork()
                self._reply(request, None, None, exc)
            else:
                self._reply(request, result, fd, None)
        finally:  # whatever the reply did, the connection goes on (or lets go of what it was granted)
            self._busy = False
            if self.transport.is_closing():
                # The client left while this request waited on I/O: whatever it was granted
                # (a lease from a promotion or a reservation) has no owner any more.
                self.manager.drop_owner(self.conn_id)
            else:
                self._drain()
            if corked:
                self._uncork()

    def _reply(self, request: Request, result, fd, error: Exception | None) -> None:
        try:
            if error is not None:
                raise error
            reply = Reply(request.id, None if result is None else result.to_wire())
        except Exception as exc:  # a refusal, or a bug: answer it, log it, keep serving
            reply = Reply(request.id, error=error_wire(exc, self.conn_id, request.op))
        if request.no_reply and reply.ok:
            return
        frame = self.codec.send_reply(reply)
        if fd is None:
            self._write(frame)
        else:
            self._write_with_fd(frame, fd)

    def _ns(self, name: str) -> str:
        if name not in self.opened:
            raise PermissionDenied(f"namespace {name!r} is not open on this connection; call open first")
        return name

    def _dispatch(self, msg: m.Message):
        """(reply, fd): the request's typed reply (kvstore.replies), None for release, abort
        and touch, or an awaitable of either (server/later.py: answered after I/O); fd is an
        arena's (or a tuple: the arena's and its shared index's), sent with the reply
        (SCM_RIGHTS), or None."""
        mgr, owner = self.manager, self.conn_id
        match msg:
            case m.Get():
                self._ns(msg.namespace)
                return mgr.get(owner, msg), None
            case m.Release():
                mgr.release(owner, msg.lease)
                return None, None
            case m.Reserve():
                self._ns(msg.namespace)
                return mgr.reserve(owner, msg), None
            case m.PutInline():
                self._ns(msg.namespace)
                return inline.put_inline(mgr, owner, msg), None
            case m.Abort():
                mgr.abort(owner, msg.lease)
                return None, None
            case m.Lookup():
                found = self.index.lookup(self._ns(msg.namespace), msg.ids, msg.expectations())
                return (found if msg.codes else then(found, r.LookupReply.named)), None
            case m.Delete():
                return then(self.index.delete(self._ns(msg.namespace), msg.ids, msg.scope), r.DeleteReply), None
            case m.Pin():
                return then(self.index.pin(self._ns(msg.namespace), msg.ids, msg.ttl_s, msg.scope), r.PinReply), None
            case m.Unpin():
                return then(self.index.unpin(self._ns(msg.namespace), msg.ids, msg.scope), r.UnpinReply), None
            case m.Prefetch():
                return self.index.prefetch(self._ns(msg.namespace), msg.ids, msg.tier, msg.policy, msg.timeout_s), None
            case m.OpenNamespace():
                self.door.authorize(msg.namespace, msg.token, self.peer)
                ns = self.host.namespaces.get(msg.namespace)
                if ns is None and not msg.create:  # a reader: nothing to map, and nothing is made
                    self.opened.add(msg.namespace)
                    return r.OpenReply(msg.namespace, 0), None
                if ns is None:  # first open: the arena is made off the loop, then we retry
                    return self._open_later(msg), None
                self.opened.add(msg.namespace)
                if msg.index and ns.shared.enabled:  # only to a connection authorised just above
                    opened = r.OpenReply(msg.namespace, ns.arena.capacity_bytes, ns.shared.size_bytes, ns.arena.prefaulted)
                    return opened, (ns.arena.fd, ns.shared.fd)
                return r.OpenReply(msg.namespace, ns.arena.capacity_bytes, 0, ns.arena.prefaulted), ns.arena.fd
            case m.Hello():
                self.client_name = msg.client
                return r.HelloReply(SERVER_VERSION, 1, self.conn_id, self.door.limits_for_clients(),
                                    self.host.config.shared_index), None
            case m.Touch():
                mgr.touch(self._ns(msg.namespace), msg.ids)
                self.traffic.reading()
                return None, None
            case m.Stats():
                return r.StatsReply(self.door.client_stats(owner, self.opened)), None
            case m.Check():
                self.manager.check_integrity()
                return r.CheckReply(True), None
            case m.GpuHandle():
                return self.door.gpu_handle(), None
            case m.ReserveMany():
                self._ns(msg.namespace)
                return batches.reserve_many(mgr, owner, msg), None
            case m.CommitMany():
                return batches.commit_many(mgr, owner, msg), None
            case m.GetMany():
                self._ns(msg.namespace)
                return batches.get_many(mgr, owner, msg), None
            case m.ReleaseMany():
                batches.release_many(mgr, owner, msg)
                return None, None
            case m.CommitGroup():
                return self.groups.commit_group(owner, msg), None
            case m.LookupGroups():
                return self.groups.lookup_groups(self._ns(msg.namespace), msg.groups(), msg.expectations()), None
            case m.GetGroup():
                return self.groups.get_group(owner, self._ns(msg.namespace), msg.member_ids(), msg.expectations()), None
        raise ProtocolError(f"op {msg.op} not served on the local socket")

    async def _open_later(self, msg: m.OpenNamespace):
        await self.host.open_namespace(msg.namespace)
        return _Retry(msg)

    # --- output -----------------------------------------------------------------------

    def _cork(self) -> bool:
        """Hold this turn's reply frames for one write; False where a caller holds them already."""
        if self._corked is not None:
            return False
        self._corked = []
        return True

    def _uncork(self, keep: bool = False) -> None:
        """Write the held frames; with `keep`, go on holding the ones that follow."""
        frames, self._corked = self._corked, ([] if keep else None)
        if frames and not self.transport.is_closing():
            self.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def _write(self, frame: bytes) -> None:
        if self._held is not None:
            self._held.append((frame, None))
        elif self._corked is not None:
            self._corked.append(frame)
        elif not self.transport.is_closing():
            self.transport.write(frame)

    def _write_with_fd(self, frame: bytes, fd: int | tuple) -> None:
        """Send `frame` with `fd` attached, never interleaved with other buffered bytes.
        Nothing is sent once the client has gone (an open that waited for its arena)."""
        if self._fd_sock is None or self.transport.is_closing():
            return
        if self._corked:  # the frames before this one go first
            self._uncork(keep=True)
        if self._held is None and self.transport.get_write_buffer_size() == 0:
            if self._try_sendmsg(frame, fd):
                return
        if self._held is None:
            self._held = []
            asyncio.get_running_loop().create_task(self._flush_held())
        self._held.append((frame, fd))

    def _try_sendmsg(self, frame: bytes, fd: int | tuple) -> bool:
        fds = array.array("i", fd if isinstance(fd, tuple) else (fd,))
        try:
            sent = self._fd_sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.transport.close()
            return True
        if sent < len(frame):
            self.transport.write(frame[sent:])
        return True

    async def _flush_held(self) -> None:
        while self._held:
            frame, fd = self._held[0]
            if self.transport.is_closing():
                self._held = None
                return
            if fd is None:
                self.transport.write(frame)
            else:
                if self.transport.get_write_buffer_size() or not self._try_sendmsg(frame, fd):
                    await asyncio.sleep(0.001)
                    continue
            self._held.pop(0)
        self._held = None
