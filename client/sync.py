"""The blocking client. One per thread (calls are serialised by a lock)."""

from __future__ import annotations

import array
import atexit
import contextlib
import socket
import threading
import warnings
import weakref

from kvstore.config import default_socket_path
from kvstore.errors import DaemonUnavailable, KVStoreError, from_wire
from kvstore.protocol import NEED_DATA, BadFrame, Fatal, Reply
from kvstore.replies import HelloReply
from kvstore.client.api import ClientCalls
from kvstore.client.batched import after_deferred, store_deferred, warn_unreported
from kvstore.client.core import ClientCore, Collect, Later
from kvstore.client.daemon_peer import check_daemon_peer

RECV_BYTES = 256 * 1024
# A round trip's requests go out in groups of at most this many bytes, each group's replies
# read before the next is sent. A group this small always fits in the socket's kernel buffer,
# so this client never blocks in send while the daemon, its reply buffer full, has stopped
# reading until the client reads (server/local/service.py REPLY_BUFFER_HIGH_BYTES).
SEND_GROUP_BYTES = 64 * 1024
# At exit, how long to wait for a call in another thread before leaving its client's
# deferred puts unstored (with a warning) rather than hang the exit.
AT_EXIT_LOCK_S = 1.0
# Room for a few fds per recvmsg; the daemon sends one per opened namespace.
_ANCILLARY = socket.CMSG_SPACE(8 * array.array("i").itemsize)


def parting_words(sock: socket.socket, codec) -> str | None:
    """Why the daemon hung up, if it said so before closing (limits.max_clients, a fatal
    frame): a send then fails with EPIPE while the reason waits unread in the socket."""
    try:
        sock.setblocking(False)
        codec.receive_data(sock.recv(RECV_BYTES))
    except OSError:
        return None
    while (event := codec.next_event()) is not NEED_DATA and not isinstance(event, Fatal):
        if isinstance(event, Reply) and event.id == 0 and event.error is not None:
            return from_wire(event.error).message
    return None


def _recv_fds(ancdata) -> list[int]:
    fds = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds.extend(array.array("i", data[:usable]))
    return fds


class Client(ClientCalls):
    """Talks to the local daemon over its Unix socket; payloads move through shared memory.

    Every call raises `DaemonUnavailable` once the daemon is unreachable (never hangs
    longer than `timeout_s`); call `reconnect()` when it is back. Leases held across a
    reconnect are gone on the daemon side (their views still read the old mapping).
    `shared_index` (default on): resolve hits from the daemon's shared index, without a
    round trip, where the daemon publishes one (client/shared_reads.py).
    """

    def __init__(self, socket_path: str | None = None, namespace: str = "default",
                 token: str | None = None, timeout_s: float = 30.0, client_name: str = "python",
                 shared_index: bool = True):
        self.shared_index = shared_index
        self.socket_path = socket_path or default_socket_path()
        self.namespace = namespace
        self.token = token
        self.timeout_s = timeout_s
        self.client_name = client_name
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._later: dict[int, Reply | None] = {}  # ids sent with Later -> reply, once read
        self.server_info: HelloReply | None = None  # the daemon's hello: version, limits
        self._abandoned = False  # a call stopped mid-way closed the connection: the next call opens one
        self.core = self._new_core()
        self._connect()
        _AT_EXIT.add(self)

    @classmethod
    def connect(cls, socket_path: str | None = None, **kwargs) -> Client:
        """Connect to `socket_path`, else $KVSTORE_SOCKET, else the default path."""
        return cls(socket_path, **kwargs)

    # --- connection -------------------------------------------------------------

    def _connect(self) -> None:
        """Connect self.core (new, not yet connected) to the daemon and say hello."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(
                f"no kvstore daemon at {self.socket_path} ({exc.strerror or exc}); start one with `kvstore serve`"
            ) from None
        check_daemon_peer(sock, self.socket_path)  # closes sock when it refuses
        self._sock = sock
        self.core.shared.watch(sock)
        self.server_info = self._run(self.core.op_hello(self.client_name), deferred_first=False)

    def reconnect(self) -> None:
        with self._lock:
            self._drop()
            self._abandoned = False
            self.core = self._new_core(self.core)  # flush() on the new connection reports the old one's results
            self._connect()

    def close(self, wait_s: float | None = None) -> None:
        """Store the deferred puts still held, report hits read from the shared index, and
        close the connection (its leases end). wait_s: how long to wait for a call another
        thread is running on this client (None: until it returns); past it nothing is done,
        with a warning naming the deferred puts left unstored."""
        if not self._lock.acquire(timeout=-1 if wait_s is None else wait_s):
            warnings.warn(f"kvstore: a client of {self.socket_path} was busy in another thread: not closed, its "
                          f"{len(self.core.deferred)} deferred put(s) not stored", RuntimeWarning, stacklevel=2)
            return
        try:
            _AT_EXIT.discard(self)
            if self.core.deferred and (self._sock is not None or self._abandoned):
                with contextlib.suppress(KVStoreError):  # settled: each unstored put's result says why
                    self._run(store_deferred(self.core), deferred_first=False)  # (reconnects if abandoned)
            self._abandoned = False
            if self._sock is None:
                self.core.close()  # no connection: deferred puts still held are lost, their results say so
            warn_unreported(self.core)
            if self._sock is not None and self.core.shared.num_pending:  # hits read from the shared index
                with contextlib.suppress(DaemonUnavailable):
                    self._send(b"".join(map(self.core.codec.send_request, self.core.shared.reports())))
            self._drop()
        finally:
            self._lock.release()

    def _drop(self, keep_deferred: bool = False) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.core.close(keep_deferred)

    def _abandon(self) -> None:
        """A call stopped mid-way (KeyboardInterrupt, an error between a request and its
        reply): replies and fds it left unread would be taken for a later call's (another
        namespace's arena, another object's lease). Close the connection (the daemon ends its
        leases and reservations); the next call opens a new one."""
        if self._sock is not None:
            self._drop(keep_deferred=True)
            self.core = self._new_core(self.core)  # what ops of later calls are made on
            self._abandoned = True

    def __del__(self) -> None:
        # Deferred puts still held when the client is collected are stored, not lost silently.
        if getattr(self, "_sock", None) is not None or getattr(self, "_abandoned", False):
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lost(self, why: str) -> DaemonUnavailable:
        self._drop()
        return DaemonUnavailable(f"lost the daemon at {self.socket_path}: {why}; call reconnect() once it is back")

    # --- driving ops ---------------------------------------------------------------

    def _run(self, op, deferred_first: bool = True):
        with self._lock:
            if self._sock is None:
                if not self._abandoned:
                    raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
                self._abandoned = False
                self._connect()
            if deferred_first and (self.core.deferred or self.core.storing):
                op = after_deferred(self.core, op)
            exchanging = False
            try:
                requests = next(op)
                while True:
                    exchanging = True
                    replies = self._exchange(requests)
                    exchanging = False
                    requests = op.send(replies)
            except StopIteration as done:
                return done.value
            except BaseException as exc:
                # Stopped between a request and its reply, or interrupted anywhere (an fd
                # taken off the queue but not yet used): the connection cannot be trusted.
                if exchanging or not isinstance(exc, Exception):
                    self._abandon()
                raise
            finally:
                self._later.clear()  # what the op did not collect: later replies are dropped

    def _exchange(self, requests):
        if isinstance(requests, Later):
            self._send(b"".join(self.core.codec.send_request(r) for r in requests))
            self._later.update((r.id, None) for r in requests if not r.no_reply)
            return requests
        if isinstance(requests, Collect):
            missing = {r.id: None for r in requests if not r.no_reply and self._later.get(r.id) is None}
            self._read_replies_into(missing)
            self._later.update(missing)
            return [None if r.no_reply else self._later.pop(r.id) for r in requests]
        return self._roundtrip(requests)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise self._lost(parting_words(self._sock, self.core.codec) or str(exc)) from None

    def _roundtrip(self, requests) -> list:
        codec = self.core.codec
        frames = [codec.send_request(r) for r in requests]
        replies: list[Reply | None] = [None] * len(requests)
        start = 0
        while start < len(frames):
            end, size = start + 1, len(frames[start])
            while end < len(frames) and size + len(frames[end]) <= SEND_GROUP_BYTES:
                size += len(frames[end])
                end += 1
            self._send(b"".join(frames[start:end]))
            self._read_replies(requests, start, end, replies)
            start = end
        return replies

    def _read_replies(self, requests, start: int, end: int, replies: list) -> None:
        index = {requests[i].id: i for i in range(start, end) if not requests[i].no_reply}
        got: dict[int, Reply | None] = dict.fromkeys(index)
        self._read_replies_into(got)
        for request_id, i in index.items():
            replies[i] = got[request_id]

    def _read_replies_into(self, wanted: dict) -> None:
        """Read until every id in `wanted` has its reply there (filled in place); a reply to a
        request sent with Later meanwhile is kept for its Collect."""
        codec = self.core.codec
        left = sum(reply is None for reply in wanted.values())
        while left:
            event = codec.next_event()
            if event is NEED_DATA:
                try:
                    data, ancdata, _, _ = self._sock.recvmsg(RECV_BYTES, _ANCILLARY)
                except TimeoutError:
                    raise self._lost(f"no reply within {self.timeout_s} s") from None
                except OSError as exc:
                    raise self._lost(str(exc)) from None
                if not data:
                    raise self._lost("connection closed")
                self.core.fds.extend(_recv_fds(ancdata))
                codec.receive_data(data)
            elif isinstance(event, Reply) and wanted.get(event.id, False) is None:
                wanted[event.id] = event
                left -= 1
            elif isinstance(event, Reply) and event.id in self._later:
                self._later[event.id] = event
            elif isinstance(event, Reply) and event.id == 0 and event.error is not None:
                raise self._lost(from_wire(event.error).message)
            elif isinstance(event, (Fatal, BadFrame)):
                raise self._lost(f"bad frame from daemon: {event.error.message}")

    def _release(self, lease_id: int) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._send(self.core.codec.send_request(self.core.release_request(lease_id)))
                except DaemonUnavailable:
                    pass  # the daemon is gone, and with it the lease


class _ClientsAtExit:
    """Clients still open when the interpreter exits: their deferred puts are stored then
    (close()), not lost silently. Weak: a client collected earlier closed itself (__del__)."""

    def __init__(self):
        self._clients = weakref.WeakSet()
        atexit.register(self.close_all)

    def add(self, client: Client) -> None:
        self._clients.add(client)

    def discard(self, client: Client) -> None:
        self._clients.discard(client)

    def close_all(self) -> None:
        for client in list(self._clients):
            with contextlib.suppress(Exception):
                client.close(wait_s=AT_EXIT_LOCK_S)  # a call still running in another thread: not waited for


_AT_EXIT = _ClientsAtExit()
