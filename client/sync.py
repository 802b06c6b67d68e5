"""The blocking client. One per thread (calls are serialised by a lock)."""

from __future__ import annotations

import array
import contextlib
import socket
import threading

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

RECV_BYTES = 256 * 1024
# A round trip's requests go out in groups of at most this many bytes, each group's replies
# read before the next is sent. A group this small always fits in the socket's kernel buffer,
# so this client never blocks in send while the daemon, its reply buffer full, has stopped
# reading until the client reads (server/local/service.py REPLY_BUFFER_HIGH_BYTES).
SEND_GROUP_BYTES = 64 * 1024
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


class Client:
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
        self._connect()

    @classmethod
    def connect(cls, socket_path: str | None = None, **kwargs) -> Client:
        """Connect to `socket_path`, else $KVSTORE_SOCKET, else the default path."""
        return cls(socket_path, **kwargs)

    # --- connection -------------------------------------------------------------

    def _connect(self) -> None:
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
        self.core = ClientCore(self.namespace, self.token, self._release, self.shared_index)
        self.core.shared.watch(sock)
        self.server_info = self._run(self.core.op_hello(self.client_name))

    def reconnect(self) -> None:
        with self._lock:
            self._drop()
            self._connect()

    def close(self) -> None:
        with self._lock:
            if self._sock is not None and self.core.shared.num_pending:  # hits read from the shared index
                with contextlib.suppress(DaemonUnavailable):
                    self._send(b"".join(map(self.core.codec.send_request, self.core.shared.reports())))
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.core.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lost(self, why: str) -> DaemonUnavailable:
        self._drop()
        return DaemonUnavailable(f"lost the daemon at {self.socket_path}: {why}; call reconnect() once it is back")

    # --- driving ops ---------------------------------------------------------------

    def _run(self, op):
        with self._lock:
            if self._sock is None:
                raise DaemonUnavailable(f"not connected to {self.socket_path}; call reconnect()")
            try:
                requests = next(op)
                while True:
                    requests = op.send(self._exchange(requests))
            except StopIteration as done:
                return done.value
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

    # --- public API --------------------------------------------------------------

    def put(self, key, data, desc: StateDescriptor | None = None, hints: Hints | None = None,
            tier: str = "host") -> PutResult:
        """Store `data` (bytes-like, numpy array or CPU tensor) under `key`.

        Two phases: reserve an extent, copy straight into the shared arena, commit with
        the xxh3-128 checksum. An id the daemon already holds with the same size and
        descriptor is not copied again (`existed=True`); held with another size or
        descriptor, the put raises Conflict and the stored object stays. A ChunkKey carries
        the descriptor its id was computed for: `desc` may be left out, and another `desc`
        raises InvalidArgument. Raises CapacityError when nothing can be evicted to make room.
        tier="remote" (a clustered daemon): the commit returns once the object's home nodes
        hold it, and this node keeps no copy unless it is a home; `result.tier` says where
        it ended up ("host" if no home could take it) and `result.homes` names the homes.
        On a daemon whose remote tier is a Mooncake pool: once the pool holds it (no homes).
        """
        return self._run(batched.put(self.core, key, data, desc, hints, tier))

    def put_many(self, items, desc: StateDescriptor | None = None, hints: Hints | None = None,
                 tier: str = "host", routes=None) -> list[PutResult]:
        """Store many `(key, data)` pairs: per window of up to 1,024 objects one reserve_many
        and one commit_many round trip (packed columns, one frame each). Never raises for one
        item's failure (an empty item, a key whose descriptor differs, a Conflict, no room):
        each result carries its own `error` (None on success; `object_id` None when the key
        itself was not one) and the other items are stored. routes: per item a
        kvstore.route.Route or None, the engine's names for its blocks (a put's route is
        `hints.route`); the daemon's KV events publish them."""
        return self._run(batched.put_many(self.core, list(items), desc, hints, tier, routes))

    def get(self, key, namespace: str | None = None, accept=None, ranges=None,
            expect: StateDescriptor | None = None) -> ReadLease | None:
        """A zero-copy read lease (use as a context manager), or None on a miss.

        expect: the descriptor the caller can use (a ChunkKey expects its own); an object
        stored under another model, revision, kind, dtype, layout or shard is a miss.

        ranges: [(offset, length), ...] when only those bytes will be read (a sparse
        reader). An object on this node is still leased whole; one held only by its home
        nodes comes back as just those ranges (`lease.ranges` set). Read through
        `lease.read(offset, length)`, which works on both (numpy(), tensor() and buffer
        refuse on a ranged lease). Ranges past the object's end, or adding up to more bytes
        than it has, raise RangeError."""
        return self._run(self.core.op_get(key, namespace, accept, ranges, expect))

    def get_into(self, key, out, namespace: str | None = None, verify: bool = False,
                 expect: StateDescriptor | None = None) -> int | None:
        """Copy the object into `out`; returns its size, or None on a miss (as `get`)."""
        return self._run(self.core.op_get_into(key, out, namespace, verify, expect))

    def get_many_into(self, items, namespace: str | None = None,
                      expect: StateDescriptor | None = None) -> list[int | None]:
        """Copy many objects into their buffers: `items` is (key, out) pairs; returns each
        one's size, or None on a miss. The gets go out as one get_many frame per 1,024 keys,
        so many small objects cost about one round trip, not one each. A buffer too small (or
        a refused get) raises after every other item was copied and every lease released."""
        return self._run(batched.get_many_into(self.core, list(items), namespace, expect))

    def get_many(self, keys, namespace: str | None = None,
                 expect: StateDescriptor | None = None) -> list[ReadLease | None]:
        """A zero-copy read lease per key (None on a miss), 1,024 per round trip: `get` for
        many keys. End them together with `release_many(leases)`, which sends one frame,
        or each with `release()`. A refused get raises after every lease was released."""
        return self._run(batched.get_many(self.core, list(keys), namespace, expect))

    def release_many(self, leases) -> None:
        """Release many leases in one frame; None entries and released leases are skipped."""
        self._run(batched.release_many(self.core, list(leases)))

    def lookup(self, keys, namespace: str | None = None, expect: StateDescriptor | None = None) -> LookupResult:
        """How many leading keys hit, each key's tier, and the estimated load time (one round trip per 4096 keys).
        expect: the descriptor every key must be stored under (ChunkKeys expect their own);
        a key stored under another is a miss."""
        return self._run(self.core.op_lookup(list(keys), namespace, expect))

    def delete(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        """Drop objects from every tier; returns how many ids were found. In a cluster,
        scope="cluster" drops every member's copies, scope="node" only this node's."""
        return self._run(self.core.op_batch(m.Delete, list(keys), namespace, scope=scope))

    def pin(self, keys, ttl_s: float | None = None, namespace: str | None = None, scope: str = "cluster") -> int:
        """Keep objects resident (never evicted) until unpinned or `ttl_s` passes; returns how
        many were pinned somewhere. A pin never shortens an earlier one's expiry. In a
        cluster, scope="cluster" pins this node's copies and the home nodes' (an object held
        only by its homes stays there), "node" only this node's."""
        return self._run(self.core.op_batch(m.Pin, list(keys), namespace, ttl_s=ttl_s, scope=scope))

    def unpin(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        """Undo pins; returns how many ids were still pinned somewhere. In a cluster,
        scope="cluster" reaches every live member (a pin made from any node may hold a
        copy there), "node" only this node's copies."""
        return self._run(self.core.op_batch(m.Unpin, list(keys), namespace, scope=scope))

    def prefetch(self, keys, tier: str = "host", policy: str = "best_effort",
                 timeout_s: float | None = None, namespace: str | None = None) -> int:
        """Bring objects to `tier`; returns how many are resident there. With the host tier
        as the only tier this moves nothing and reports what is resident."""
        return self._run(self.core.op_batch(m.Prefetch, list(keys), namespace,
                                            tier=tier, policy=policy, timeout_s=timeout_s))

    def put_group(self, items, hints: Hints | None = None, routes=None) -> group_ops.GroupPutResult:
        """Store objects that are only usable together as one group (kvstore/groups.py):
        `items` are (key, data) pairs (a ChunkKey carries its descriptor) or (key, data,
        descriptor) triples, all in one namespace. The daemon makes every member and the
        group's manifest visible at once, or stores nothing and this raises; members it
        holds already are not copied. `result.existed`: the whole group was stored.
        routes: per item a kvstore.route.Route or None (as put_many's)."""
        return self._run(group_ops.put_group(self.core, list(items), hints, routes))

    def put_groups(self, groups, hints: Hints | None = None, routes=None) -> list:
        """put_group for many groups (each a list of items), a window of them per two round
        trips. Never raises for one group's failure: per group its GroupPutResult, or the
        exception that refused it (that group stored nothing). routes: per group None or
        its items' routes (as put_group's)."""
        return self._run(group_ops.put_groups(self.core, [list(items) for items in groups], hints, routes))

    def lookup_groups(self, groups, namespace: str | None = None) -> group_ops.GroupLookup:
        """Per group (a list of member keys: ChunkKeys, or kvstore.groups.Member) whether it
        is complete: its manifest and every member held, live and under the descriptor the
        key expects, on any tier. `leading` counts the complete groups before the first
        incomplete one."""
        return self._run(group_ops.lookup_groups(self.core, list(groups), namespace))

    def get_groups(self, groups, namespace: str | None = None) -> list:
        """get_group for many groups in one round trip (per window of leases): per group a
        GroupLease, or None with nothing of it leased."""
        return self._run(group_ops.get_groups(self.core, [list(members) for members in groups], namespace))

    def get_group(self, members, namespace: str | None = None) -> group_ops.GroupLease | None:
        """Read leases on every member of the group (a GroupLease, a context manager), or
        None and nothing leased: never part of a group."""
        return self._run(group_ops.get_group(self.core, list(members), namespace))

    def stats(self) -> dict:
        return self._run(self.core.op_simple(m.Stats())).document

    def check_integrity(self) -> None:
        """Ask the daemon to verify its allocators, index, leases and policies now."""
        self._run(self.core.op_simple(m.Check()))

    def get_into_device(self, key, out, namespace: str | None = None,
                        expect: StateDescriptor | None = None) -> int | None:
        """Copy the object into `out`, a contiguous torch tensor (on the GPU, typically);
        returns its size, or None on a miss. Where the daemon runs a GPU tier the read is a
        device-to-device copy from its copy of the object (mapped once per client by CUDA
        IPC); else a copy from the host lease."""
        return self._run(op_get_into_device(self.core, key, out, namespace, expect))

    def gpu_handle(self) -> GpuHandleReply:
        """The daemon's GPU tier buffer, exported for this process: map it with
        client.gpu.GpuMapping (a ServiceError when the daemon runs no GPU tier)."""
        return self._run(self.core.op_simple(m.GpuHandle()))
