"""The peer service: answers other daemons' peer_get / peer_put / peer_lookup / peer_delete / peer_pin.

Every channel starts with the HMAC handshake (server.peer.auth); a peer that fails it gets
an error and a closed channel, nothing else. Requests then run one at a time per channel,
against a `PeerBackend` the daemon supplies (the tier manager; bench/peer_service.py runs the
service alone over a dict, for benchmarks and tests). Payloads go straight from the backend's buffer to the
channel and from the channel into the backend's reserved buffer; bytes received are checked
against their checksum before `commit`. A payload the backend does not want is drained so the
channel stays in step. Sends and receives of payloads are bounded by the peer timeout plus
transfer time: a stalled peer cannot hold a read lease or a reservation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Protocol

import numpy as np

from kvstore import ranges
from kvstore.errors import ChecksumError, KVStoreError, PermissionDenied, ProtocolError
from kvstore.identity import ObjectId
from kvstore.protocol import Reply, Request
from kvstore.server.later import resolve
from kvstore.server.peer.auth import authenticate_server
from kvstore.server.peer.transport import Channel, nbytes_of, payload_bytes
from kvstore.peer_messages import PEER_OPS, PeerDelete, PeerGet, PeerPin, PeerPut, RemoteMeta
from kvstore.peer_replies import PEER_MISS, PeerDeleteReply, PeerGetReply, PeerLookupReply, PeerPinReply, PeerPutReply
from kvstore.tiers.remote import MIN_PEER_BANDWIDTH_BYTES_S, host_digest

log = logging.getLogger("kvstore.peer")
# A copy that passed its checksum this recently is not hashed again before ranges of it go out.
RANGED_RECHECK_S = 1.0
CHECKED_COPIES = 4096


def _noop() -> None:
    pass


@dataclass(frozen=True, slots=True)
class PeerRead:
    """A committed object to send: `buffer` stays valid (leased) until `release()`. `copy`
    names this stored copy (never reused for another); None: the buffer's address does."""

    meta: RemoteMeta
    buffer: Any
    release: Callable[[], None] = _noop
    copy: Any = None


@dataclass(frozen=True, slots=True)
class PeerWrite:
    """A reserved extent of meta.size bytes: the service fills `buffer`, then calls exactly
    one of `commit()` (bytes verified) or `abort()`."""

    buffer: Any
    commit: Callable[[], None]
    abort: Callable[[], None] = _noop


class PeerBackend(Protocol):
    """What the peer service asks of the daemon. Called on the event loop; each method may
    return its result or an awaitable of it. Namespaces are always explicit: a backend never
    answers for a namespace other than the one asked."""

    def read(self, namespace: str, object_id: ObjectId) -> PeerRead | None: ...
    def reserve(self, namespace: str, object_id: ObjectId, meta: RemoteMeta) -> PeerWrite | None:
        """None: the object is already held (the payload is dropped). May raise CapacityError."""
    def lookup(self, namespace: str, ids: tuple[ObjectId, ...]) -> list[RemoteMeta | None]: ...
    def delete(self, namespace: str, ids: tuple[ObjectId, ...]) -> list[bool]:
        """Drop the ids from every tier; per id, whether it was held."""
    def pin(self, namespace: str, ids: tuple[ObjectId, ...], ttl_s: float | None, unpin: bool) -> list[bool]:
        """Pin (ttl_s None: until unpinned) or unpin the ids' resident copies; per id, whether held."""


@dataclass(slots=True)
class ServiceCounters:
    num_channels: int = 0
    num_auth_failures: int = 0
    num_requests: int = 0
    num_errors: int = 0
    num_checksum_failures: int = 0
    num_copy_checks: int = 0  # whole-copy hashes before serving byte ranges
    bytes_in: int = 0
    bytes_out: int = 0


class PeerService:
    def __init__(self, backend: PeerBackend, transport, secret: bytes, node_id: str, timeout_s: float = 1.0,
                 digest: Callable[[Any], bytes] = host_digest, recheck_s: float = RANGED_RECHECK_S,
                 on_peer: Callable[[str], None] = lambda node: None):
        """on_peer(node): a peer authenticated a channel (it is up; see PeerNode)."""
        self.backend, self.transport, self.secret = backend, transport, secret
        self.on_peer = on_peer
        self.node_id, self.timeout_s, self.digest = node_id, timeout_s, digest
        self.recheck_s = recheck_s
        self._checked: collections.OrderedDict = collections.OrderedDict()  # copy -> when it last passed
        self.counters = ServiceCounters()
        self.listener = None

    async def start(self, listen: str) -> str:
        """Accept peers on `listen` (host:port, port 0 for any); returns the bound address."""
        self.listener = await self.transport.listen(listen, self.serve)
        log.info("event=peer_service_ready node=%s address=%s transport=%s",
                 self.node_id, self.listener.address, self.transport.name)
        return self.listener.address

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.close()

    def stats(self) -> dict:
        return asdict(self.counters)

    async def serve(self, channel: Channel) -> None:
        """Handle one channel until it closes. Never raises."""
        self.counters.num_channels += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                peer = await authenticate_server(channel, self.secret, self.node_id)
        except PermissionDenied:
            self.counters.num_auth_failures += 1
            channel.close()
            return
        except Exception as exc:
            log.info("event=peer_handshake_failed peer=%s error=%r", channel.peer, exc)
            channel.close()
            return
        log.debug("event=peer_connected node=%s peer=%s", peer, channel.peer)
        self.on_peer(peer)
        try:
            while True:
                request = await channel.recv()
                if not isinstance(request, Request):
                    raise ProtocolError("peers send requests on their own channels")
                await self._handle(channel, request)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except Exception as exc:
            log.info("event=peer_channel_closed node=%s peer=%s error=%r", peer, channel.peer, exc)
        finally:
            channel.close()

    def _budget(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / MIN_PEER_BANDWIDTH_BYTES_S

    async def _handle(self, channel: Channel, request: Request) -> None:
        self.counters.num_requests += 1
        pending = payload_bytes(request.args)  # bytes still on the wire after this frame
        args = {k: v for k, v in request.args.items() if k != "payload_bytes"}
        try:
            cls = PEER_OPS.get(request.op)
            if cls is None:
                raise ProtocolError(f"unknown peer op {request.op[:64]!r}; known: {', '.join(PEER_OPS)}")
            msg = cls.from_args(args)
            if isinstance(msg, PeerGet):
                return await self._get(channel, request.id, msg)
            if isinstance(msg, PeerPut):
                pending, nbytes = 0, pending
                result = await self._put(channel, msg, nbytes)
            elif isinstance(msg, PeerDelete):
                result = PeerDeleteReply(tuple(await resolve(self.backend.delete(msg.namespace, msg.ids))))
            elif isinstance(msg, PeerPin):
                result = PeerPinReply(tuple(await resolve(self.backend.pin(msg.namespace, msg.ids, msg.ttl_s, msg.unpin))))
            else:  # PeerLookup
                result = PeerLookupReply(tuple(await resolve(self.backend.lookup(msg.namespace, msg.ids))))
        except KVStoreError as exc:
            self.counters.num_errors += 1
            if pending:
                async with asyncio.timeout(self._budget(pending)):
                    await channel.discard(pending)
            await channel.send(Reply(request.id, error=exc.to_wire()))
            return
        await channel.send(Reply(request.id, result.to_wire()))

    async def _get(self, channel: Channel, rid: int, msg: PeerGet) -> None:
        read = await resolve(self.backend.read(msg.namespace, msg.object_id))
        if read is None:
            await channel.send(Reply(rid, PEER_MISS.to_wire()))
            return
        payload, ranges_checksum = read.buffer, None
        if msg.ranges is not None:  # only those bytes, packed: the copy ends the hold at once
            try:
                ranges.check_within(msg.ranges, read.meta.size)
                # The reader cannot check part of an object against the put's checksum, so
                # this node checks its whole copy first: bytes that rotted here are never sent.
                if not self._copy_checked(msg, read):
                    self.counters.num_checksum_failures += 1
                    log.warning("event=peer_get_checksum_mismatch namespace=%s id=%s", msg.namespace, msg.object_id)
                    raise ChecksumError(f"object {msg.object_id} fails its checksum on node {self.node_id}; not sent")
                payload = ranges.pack(read.buffer, msg.ranges)
            finally:
                read.release()
            ranges_checksum = self.digest(payload)
        try:
            size = nbytes_of(payload)
            wire = PeerGetReply(read.meta, ranges_checksum).to_wire()
            wire["payload_bytes"] = size  # the transport's field, after the reply's own
            async with asyncio.timeout(self._budget(size)):
                await channel.send(Reply(rid, wire), payload)
            self.counters.bytes_out += size
        finally:
            if msg.ranges is None:
                read.release()

    def _copy_checked(self, msg: PeerGet, read: PeerRead) -> bool:
        """Whether this node's copy matches the put's checksum. Hashed, unless the same copy
        passed within `recheck_s`: a sparse decode asks for each chunk once per layer per
        step, and a chunk can be many MiB."""
        copy = read.copy if read.copy is not None else np.frombuffer(read.buffer, np.uint8).ctypes.data
        key = (msg.namespace, msg.object_id, read.meta.checksum, copy)
        now = time.monotonic()
        at = self._checked.get(key)
        if at is not None and now - at < self.recheck_s:
            return True
        self.counters.num_copy_checks += 1
        if self.digest(read.buffer) != read.meta.checksum:
            self._checked.pop(key, None)
            return False
        self._checked[key] = now
        self._checked.move_to_end(key)
        while len(self._checked) > CHECKED_COPIES:
            self._checked.popitem(last=False)
        return True

    async def _put(self, channel: Channel, msg: PeerPut, nbytes: int) -> PeerPutReply:
        async with asyncio.timeout(self._budget(nbytes)):
            if nbytes != msg.size or msg.descriptor.namespace != msg.namespace:
                await channel.discard(nbytes)
                raise ProtocolError(f"peer_put: payload_bytes {nbytes} != size {msg.size}" if nbytes != msg.size
                                    else "peer_put: descriptor.namespace differs from the request's namespace")
            try:
                write = await resolve(self.backend.reserve(msg.namespace, msg.object_id, msg.meta))
            except KVStoreError:
                await channel.discard(nbytes)
                raise
            if write is None:
                await channel.discard(nbytes)
                return PeerPutReply(False)
            try:
                await channel.recv_into(write.buffer)
            except BaseException:
                write.abort()
                raise
        self.counters.bytes_in += nbytes
        if self.digest(write.buffer) != msg.checksum:
            write.abort()
            self.counters.num_checksum_failures += 1
            log.warning("event=peer_put_checksum_mismatch peer=%s namespace=%s id=%s",
                        channel.peer, msg.namespace, msg.object_id)
            raise ChecksumError(f"object {msg.object_id} arrived with a different checksum; dropped")
        write.commit()
        return PeerPutReply(True)
