"""RemoteTier: objects kept by their home nodes, asked for over pooled peer links (the package
docstring says what each call does and how a failing peer is handled)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Mapping

import xxhash

from kvstore.errors import Conflict, KVStoreError, PermissionDenied, ProtocolError, RangeError
from kvstore.identity import ObjectId
from kvstore.ownership import home_nodes
from kvstore.peer_messages import PeerDelete, PeerGet, PeerLookup, PeerPin, PeerPut, RemoteMeta
from kvstore.peer_replies import PeerDeleteReply, PeerGetReply, PeerLookupReply, PeerPinReply, PeerPutReply
from kvstore.protocol import MAX_BATCH
from kvstore.ranges import total as ranges_total
from kvstore.replies import ReplyMessage
from kvstore.tiers.remote.links import LinkPools, PeerLink, PeerUnavailable

log = logging.getLogger("kvstore.remote")


def host_digest(buffer) -> bytes:
    """xxh3-128 of a host buffer (the checksum every object carries from its put)."""
    return xxhash.xxh3_128_digest(memoryview(buffer).cast("B"))


@dataclass(slots=True)
class RemoteCounters:
    num_gets: int = 0
    num_ranged_gets: int = 0  # of num_gets: only some byte ranges asked for
    num_hits: int = 0
    num_misses: int = 0
    num_puts: int = 0
    num_lookups: int = 0
    num_deletes: int = 0
    num_pins: int = 0  # pin and unpin calls that asked the homes
    num_peer_failures: int = 0  # timeouts, closed links, protocol breaks
    num_peer_skips: int = 0  # calls not tried: the peer failed within the last timeout_s
    num_checksum_failures: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class RemoteTier:
    """Client side of the remote tier for node `node_id`.

    members: returns the live {node_id: address}, this node included (a Membership's
    `members`). connect: opens an authenticated PeerLink to an address. digest: checksum of a
    received buffer (default: xxh3-128 of host memory; pass a device hash for CUDA buffers).
    """

    def __init__(self, node_id: str, members: Callable[[], Mapping[str, str]],
                 connect: Callable[[str], Awaitable[PeerLink]], replicas: int = 1,
                 timeout_s: float = 1.0, digest: Callable[[Any], bytes] | None = None, clock=time.monotonic,
                 on_state: Callable[[str, bool], None] | None = None):
        """on_state(node, up): called on the loop when a peer is marked down, and when one
        marked down answers again."""
        self.node_id, self.members, self.connect = node_id, members, connect
        self.digest = digest or host_digest
        self.replicas, self.timeout_s, self.clock = replicas, timeout_s, clock
        self.on_state = on_state
        self.counters = RemoteCounters()
        self._links = LinkPools(connect, timeout_s)
        self._down_until: dict[str, float] = {}

    def homes(self, object_id: ObjectId) -> list[str]:
        """Home nodes of the object among live members, best first (may include this node)."""
        return home_nodes(object_id, self.members(), self.replicas)

    def remote_homes(self, object_id: ObjectId) -> list[str]:
        return [n for n in self.homes(object_id) if n != self.node_id]

    # --- the three operations --------------------------------------------------------

    async def get_into(self, namespace: str, object_id: ObjectId,
                       alloc: Callable[[RemoteMeta], Any]) -> RemoteMeta | None:
        """Fetch from the first home that has it into `alloc(meta)` (a buffer of meta.size
        bytes, or None to decline it: no other home is asked then). Returns the meta once the
        bytes are in and verified; None on a miss, in which case whatever `alloc` returned
        holds nothing usable. `alloc` may be called once per home tried."""
        got = await self._get(namespace, object_id, alloc, None)
        return None if got is None else got[0]

    async def get_ranges_into(self, namespace: str, object_id: ObjectId, ranges: tuple,
                              alloc: Callable[[RemoteMeta], Any]) -> tuple[RemoteMeta, bytes] | None:
        """Fetch only `ranges` of the object (kvstore.ranges), packed into `alloc(meta)` (a
        buffer of exactly their total length, or None to decline; called once the home has
        answered). Returns (meta of the whole object, xxh3-128 of the packed bytes) once
        they are in and match the checksum the home computed over its checked copy; None on
        a miss. Ranges that do not fit the object raise the home's RangeError."""
        return await self._get(namespace, object_id, alloc, ranges)

    async def _get(self, namespace: str, object_id: ObjectId, alloc, ranges) -> tuple[RemoteMeta, bytes] | None:
        self.counters.num_gets += 1
        self.counters.num_ranged_gets += ranges is not None
        args = PeerGet(namespace, object_id, ranges).to_args()
        for node in self.remote_homes(object_id):
            target: list = []

            def into(result: dict):  # the reply announced bytes: decoded before they arrive
                got = PeerGetReply.from_wire(result)
                meta = got.meta
                if meta is None:
                    raise ProtocolError("PeerGetReply.meta: bytes came with no metadata")
                if meta.descriptor.namespace != namespace:  # never another tenant's bytes
                    raise ProtocolError(f"peer answered for namespace {meta.descriptor.namespace!r}")
                expected = meta.checksum if ranges is None else got.ranges_checksum
                buf = alloc(meta)
                target[:] = [meta, buf, expected]
                return buf

            try:
                # No reply class: a reply without bytes is a miss whatever else it says, and
                # one with bytes is decoded by `into` (once, before the bytes are read).
                result = await self._call(node, PeerGet.op, args, None, into=into, raising=ranges is not None)
            except RangeError:  # the caller's ranges do not fit: every home would say the same
                self.counters.num_misses += 1
                raise
            if target and target[1] is None:
                break  # the caller declined the object (e.g. its dtype): every home holds the same
            if result is None or not target:
                continue
            meta, buf, expected = target
            self.counters.bytes_in += meta.size if ranges is None else ranges_total(ranges)
            digest = self.digest(buf)
            if digest != expected:
                self.counters.num_checksum_failures += 1
                log.warning("event=remote_checksum_mismatch node=%s namespace=%s id=%s", node, namespace, object_id)
                continue
            self.counters.num_hits += 1
            return meta, digest
        self.counters.num_misses += 1
        return None

    async def put(self, namespace: str, object_id: ObjectId, meta: RemoteMeta, buffer,
                  raising: bool = False) -> list[str]:
        """Send to every home node but this one, in parallel; returns the nodes that now hold
        it (stored or already had it). Failures are counted and logged, not raised; with
        `raising`, a home holding the id with another size or descriptor raises Conflict
        (once every send has ended: none reads `buffer` any more)."""
        nodes = self.remote_homes(object_id)
        calls = [self.put_to(n, namespace, object_id, meta, buffer, raising) for n in nodes]
        if len(calls) == 1:
            results = [await calls[0]]
        else:
            results = await asyncio.gather(*calls, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return [n for n, held in zip(nodes, results) if held]

    async def put_to(self, node: str, namespace: str, object_id: ObjectId, meta: RemoteMeta, buffer,
                     raising: bool = False) -> bool:
        """Send to one node (a home, or a new home while re-homing). True once it holds it.
        raising: the node's Conflict (it holds the id as another state) is raised."""
        self.counters.num_puts += 1
        args = PeerPut(namespace, object_id, meta.size, meta.checksum, meta.descriptor, meta.hints,
                       meta.created_at).to_args()
        reply = await self._call(node, PeerPut.op, args, PeerPutReply, payload=buffer, raising=raising)
        if reply is None:
            return False
        if reply.stored:
            self.counters.bytes_out += meta.size
        return True

    async def held_on(self, node: str, namespace: str, ids: list[ObjectId]) -> list[bool] | None:
        """Which of `ids` `node` holds in any tier (one round trip per MAX_BATCH ids); None
        when the node could not be asked."""
        held: list[bool] = []
        for start in range(0, len(ids), MAX_BATCH):
            part = tuple(ids[start:start + MAX_BATCH])
            reply = await self._call(node, PeerLookup.op, PeerLookup(namespace, part).to_args(), PeerLookupReply)
            if reply is None or len(reply.metas) != len(part):
                return None
            held += [meta is not None for meta in reply.metas]
        return held

    async def delete(self, namespace: str, ids: list[ObjectId]) -> list[bool]:
        """Ask every other live member to drop `ids` (homes and nodes holding fetched copies
        alike), all at once. Per id: whether some peer held it. Unreachable nodes are counted
        as peer failures and keep their copies."""
        self.counters.num_deletes += 1
        found = [False] * len(ids)
        calls, spans = [], []
        for node in (n for n in self.members() if n != self.node_id):
            for start in range(0, len(ids), MAX_BATCH):
                part = tuple(ids[start:start + MAX_BATCH])
                calls.append(self._call(node, PeerDelete.op, PeerDelete(namespace, part).to_args(), PeerDeleteReply))
                spans.append((start, len(part)))
        replies = await asyncio.gather(*calls) if calls else []
        for (start, n), reply in zip(spans, replies):
            if reply is not None and len(reply.found) == n:
                for i, flag in enumerate(reply.found):
                    found[start + i] = found[start + i] or flag
        return found

    async def pin(self, namespace: str, ids: list[ObjectId], ttl_s: float | None, unpin: bool = False) -> list[bool]:
        """Pin the ids on every remote home, or unpin them on every other live member (a pin
        from any node, or an old home's copy kept after re-homing, may hold one); one
        batched call per node, all nodes at once. Per id: whether some node held it and
        changed its pin. Unreachable nodes are counted as peer failures."""
        self.counters.num_pins += 1
        by_node: dict[str, list[int]] = {}
        others = [n for n in self.members() if n != self.node_id] if unpin else None
        for i, oid in enumerate(ids):
            for node in others if unpin else self.remote_homes(oid):
                by_node.setdefault(node, []).append(i)
        calls, spans = [], []
        for node, indices in by_node.items():
            for start in range(0, len(indices), MAX_BATCH):
                part = indices[start:start + MAX_BATCH]
                args = PeerPin(namespace, tuple(ids[i] for i in part), ttl_s, unpin).to_args()
                calls.append(self._call(node, PeerPin.op, args, PeerPinReply))
                spans.append(part)
        pinned = [False] * len(ids)
        for part, reply in zip(spans, await asyncio.gather(*calls) if calls else []):
            if reply is not None and len(reply.pinned) == len(part):
                for i, flag in zip(part, reply.pinned):
                    pinned[i] = pinned[i] or flag
        return pinned

    async def lookup(self, namespace: str, ids: list[ObjectId]) -> list[RemoteMeta | None]:
        """Metas of the ids held by their home nodes (None: miss), in order. One batched round
        trip per home node, all nodes at once; a second round asks the next replica for ids
        whose first home failed."""
        self.counters.num_lookups += 1
        found: list[RemoteMeta | None] = [None] * len(ids)
        pending = {i: self.remote_homes(oid) for i, oid in enumerate(ids)}
        while pending:
            by_node: dict[str, list[int]] = {}
            for i, nodes in pending.items():
                if nodes:
                    by_node.setdefault(nodes.pop(0), []).append(i)
            if not by_node:
                break
            calls = [self._lookup_on(n, namespace, ids, idx, found, pending) for n, idx in by_node.items()]
            await (calls[0] if len(calls) == 1 else asyncio.gather(*calls))
        return found

    async def _lookup_on(self, node, namespace, ids, indices, found, pending) -> None:
        for start in range(0, len(indices), MAX_BATCH):
            part = indices[start:start + MAX_BATCH]
            args = PeerLookup(namespace, tuple(ids[i] for i in part)).to_args()
            reply = await self._call(node, PeerLookup.op, args, PeerLookupReply)
            if reply is None or len(reply.metas) != len(part):
                continue  # failed: these ids stay pending for their next home
            if any(m is not None and m.descriptor.namespace != namespace for m in reply.metas):
                log.warning("event=peer_bad_reply node=%s op=peer_lookup error=%r", node,
                            f"answered a lookup in {namespace!r} for another namespace")
                continue
            for i, meta in zip(part, reply.metas):
                pending.pop(i, None)
                found[i] = meta

    # --- calls and peer health --------------------------------------------------------

    async def _call(self, node: str, op: str, args: dict, answer: type[ReplyMessage] | None, payload=None,
                    into=None, raising: bool = False) -> Any:
        """One call to `node`: its reply decoded as `answer` (None: left as the peer's map);
        None when the call failed (counted, logged when the peer goes down) or the reply does
        not decode as `answer` (logged; the peer is up, but this call failed).
        raising: a RangeError (the caller's ranges do not fit the object) or a Conflict (the
        peer holds the id as another state) is raised; any other error is the peer's (an old
        version, a bad reply) and makes this call fail."""
        down = self._down_until.get(node)
        if down is not None and down > self.clock():
            self.counters.num_peer_skips += 1
            return None
        address = self.members().get(node)
        if address is None:
            return None
        result = None
        try:
            result = await self._links.call(address, op, args, payload, into)
        except (PeerUnavailable, PermissionDenied) as exc:
            self._mark_down(node, address, op, exc)
            return None
        except KVStoreError as exc:  # the peer answered with an error: it is up
            if raising and isinstance(exc, (RangeError, Conflict)):
                self.mark_up(node)
                raise
            log.info("event=peer_error node=%s op=%s code=%s error=%r", node, op, exc.code, exc.message)
        self.mark_up(node)
        if answer is None or result is None:
            return result
        try:
            return answer.from_wire(result)
        except ProtocolError as exc:
            log.warning("event=peer_bad_reply node=%s op=%s error=%r", node, op, exc.message)
            return None

    def _mark_down(self, node: str, address: str, op: str, exc: KVStoreError) -> None:
        self.counters.num_peer_failures += 1
        first = node not in self._down_until
        if first:  # once per going down, though calls ran in parallel
            log.warning("event=peer_down node=%s address=%s op=%s error=%r", node, address, op, exc.message)
        self._down_until[node] = self.clock() + self.timeout_s
        if first and self.on_state is not None:
            self.on_state(node, False)

    def mark_up(self, node: str) -> None:
        """`node` answered (any successful exchange, either direction): it is up."""
        if self._down_until.pop(node, None) is not None:
            log.info("event=peer_up node=%s address=%s", node, self.members().get(node))
            if self.on_state is not None:
                self.on_state(node, True)

    def down_nodes(self) -> list[str]:
        """Peers marked down: a call to them failed and none succeeded since."""
        return sorted(self._down_until)

    async def probe(self, node: str) -> bool:
        """Open a fresh authenticated link to `node` (kept in its pool, replacing idle links
        that may date from before a restart), whatever its down mark says; marks it up when
        the handshake succeeds. Returns whether it did. A wrong secret marks it down; any
        other failure leaves the mark as it was."""
        address = self.members().get(node)
        if address is None:
            return False
        try:
            await self._links.open_fresh(address)
        except PermissionDenied as exc:  # it answers, with another secret: unusable, so down
            self._mark_down(node, address, "handshake", exc)
            return False
        except PeerUnavailable:
            return False
        self.mark_up(node)
        return True

    async def close(self) -> None:
        await self._links.close()

    def stats(self) -> dict:
        return {**asdict(self.counters), "peers_down": sorted(self._down_until)}

    def check_integrity(self) -> None:
        """Raise RuntimeError on the first broken link-pool invariant."""
        self._links.check_integrity()
