"""Client operations written once, as generators, and driven by the sync or asyncio client.

Each `op_*` generator yields a list of `Request`s and receives the list of their
`Reply`s (None for no-reply requests); its return value is the call's result. The
drivers (client/sync.py, client/aio.py) only move frames. This keeps the sync and
asyncio clients identical in behaviour.

An op may also overlap its own work with the daemon's: it yields `Later(requests)`, which
the driver sends at once and answers with a handle, and later `Collect(handle)`, which
answers with those requests' replies (put_many copies one step while the daemon reserves
the next and commits the last). Replies of requests sent with Later that are not collected
by the time the op ends are dropped.
"""

from __future__ import annotations

import itertools
import mmap
import os
from collections import deque
import functools

import numpy as np
import xxhash

from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import ChecksumError, DaemonUnavailable, InvalidArgument, ProtocolError, from_wire
from kvstore.identity import ChunkKey, ObjectId, StateDescriptor, check_name, check_object_size, descriptor_differences
from kvstore.protocol import MAX_BATCH, Reply, Request
from kvstore.ranges import normalize as normalize_ranges
from kvstore.client import copies
from kvstore.client.buffers import as_u8, as_writable_u8
from kvstore.client.lease import ReadLease
from kvstore.client.pinning import pin_for_cuda
from kvstore.client.results import LookupResult, PutResult
from kvstore.client.shared_reads import ReportingCodec, SharedReads

# Bytes of reserved-but-uncommitted puts one put_many keeps in flight.
PUT_WINDOW_BYTES = 64 << 20

# A single put of at most this many bytes sends its bytes in its request (PutInline): one
# round trip instead of reserve and commit, where the round trip costs more than the frame's
# extra copies (docs/architecture.md: "One round trip for a small put"). The daemon's own
# limit, from hello, caps it; a daemon that names none gets two-phase puts only.
INLINE_PUT_BYTES = 64 << 10


class Later(list):
    """Requests to send now; the op goes on and collects their replies with Collect."""


class Collect(list):
    """The replies of requests sent with Later: yield Collect(handle), handle being what the
    Later was answered with."""


@functools.lru_cache(maxsize=256)
def _opaque(namespace: str) -> StateDescriptor:
    """The descriptor of a put that gives none (made once: building one costs ~25 us)."""
    return StateDescriptor(namespace, "opaque", "0")


def to_object_id(key) -> ObjectId:
    if isinstance(key, ObjectId):
        return key
    if isinstance(key, ChunkKey):
        return key.object_id
    if isinstance(key, bytes):
        return ObjectId(key)
    if isinstance(key, str):
        return ObjectId.from_hex(key)
    raise InvalidArgument(f"a key is an ObjectId, ChunkKey, 32 bytes or 64 hex chars, not {type(key).__name__}")


def key_list(keys) -> list:
    """The keys of a call that takes many: an iterable of keys, or one key alone (delete(oid)
    iterated an ObjectId's bytes and refused an int)."""
    return [keys] if isinstance(keys, (ObjectId, ChunkKey, bytes, str)) else list(keys)


def resolve_keys(keys: list, expect: StateDescriptor | None) -> tuple[list, list]:
    """(each key's ObjectId, what a read of each expects: `expectation(key, expect)`), with
    no call per key where every key is an ObjectId or none carries a descriptor of its own
    (4,096 keys took ~0.6 ms one by one)."""
    kinds = set(map(type, keys))
    ids = keys if kinds <= {ObjectId} else [to_object_id(k) for k in keys]
    if expect is not None or not any(issubclass(kind, ChunkKey) for kind in kinds):
        return ids, [expectation(None, expect)] * len(keys)
    return ids, [expectation(k, None) for k in keys]


def expectation(key, expect: StateDescriptor | None) -> StateDescriptor | None:
    """What a read of `key` expects: `expect`, else the descriptor a ChunkKey carries."""
    if expect is not None and not isinstance(expect, StateDescriptor):
        raise InvalidArgument(f"expect must be a StateDescriptor, not {type(expect).__name__}")
    return expect or (key.descriptor if isinstance(key, ChunkKey) else None)


def _expect_fields(wanted: list) -> tuple:
    """Lookup's (expect, expect_of) for per-key expectations (None: none)."""
    first = wanted[0]
    if wanted.count(first) == len(wanted):  # the common case: keys of one chunk_keys call
        return (None, None) if first is None else ((first,), None)
    index: dict = {}  # descriptor -> its place in expect
    by_object: dict = {}  # id(descriptor) -> the same: hashing a descriptor costs ~1 us, id() does not
    of = bytearray()
    for _, run in itertools.groupby(wanted, key=id):  # keys come in runs of one chunk_keys call
        run = list(run)
        d = run[0]
        if d is None:
            at = m.NO_EXPECTATION
        elif (at := by_object.get(id(d))) is None:
            at = by_object[id(d)] = min(index.setdefault(d, len(index)), m.NO_EXPECTATION - 1)  # past it: refused
        of += bytes((at,)) * len(run)
    if len(index) > m.MAX_EXPECTED_DESCRIPTORS:
        raise InvalidArgument(f"one lookup may expect at most {m.MAX_EXPECTED_DESCRIPTORS} distinct descriptors")
    if len(index) == 1 and m.NO_EXPECTATION not in of:
        return tuple(index), None
    return tuple(index), bytes(of)


def _batches(ids):
    for start in range(0, len(ids), MAX_BATCH):
        yield ids[start:start + MAX_BATCH]


class ClientCore:
    """State of one connection: request ids, the codec, mapped arenas, received fds."""

    def __init__(self, namespace: str, token: str | None, release, shared_index: bool = True):
        self.namespace = check_name("namespace", namespace)  # refused at connect, not at the first call
        self.token = token
        self.shared = SharedReads(self, shared_index, _opaque)  # hits read without a round trip
        self.codec = ReportingCodec(self.shared)
        self.fds: deque[int] = deque()  # arrived with SCM_RIGHTS, in order
        self.arenas: dict[str, np.ndarray] = {}
        self._unmapped: set[str] = set()  # opened to read, but no arena there yet
        self._maps: list[mmap.mmap] = []
        self.pinned: dict[str, str] = {}  # namespace -> whether its arena is pinned for CUDA, and why not
        self.gpu_mapping = None  # client.gpu.GpuMapping of the daemon's GPU tier; False: it runs none
        self._ids = itertools.count(1)
        self.release_cb = release
        self.max_inflight_bytes = PUT_WINDOW_BYTES  # the daemon's limit, from hello
        self.max_leases: int | None = None  # the daemon's lease quota per client, from hello
        self.closed = False  # the connection is gone: so are its leases
        self.lease_ttl_s: float | None = None  # the daemon's, from hello
        self.inline_put_bytes = 0  # puts up to this size go inline (PutInline); from hello
        # put(wait=False): puts held to store together (oid, descriptor, bytes, hints, tier),
        # their bytes, the batch being stored (its items, their results so far), and the
        # results that flush() hands back (client/batched.py: put_later, store_deferred).
        self.deferred: list[tuple] = []
        self.deferred_bytes = 0
        self.storing: tuple[list, list] | None = None
        self.deferred_results: list[PutResult] = []

    def request(self, msg: m.Message, no_reply: bool = False) -> Request:
        return Request(next(self._ids), msg.op, msg.to_args(), no_reply)

    @staticmethod
    def result(reply: Reply, kind: type[r.ReplyMessage]):
        """The typed reply of `kind`, or the daemon's error raised."""
        if reply.error is not None:
            raise from_wire(reply.error)
        return kind.from_wire(reply.result)

    def release_request(self, lease_id: int) -> Request:
        return self.request(m.Release(lease_id), no_reply=True)

    def settle_deferred(self, error: Exception | None) -> None:
        """End the batch of deferred puts being stored: its results join deferred_results,
        `error` standing for those that have none (not stored, or not known to be)."""
        if self.storing is not None:
            pending, outcome = self.storing
            self.storing = None
            self.deferred_results.extend(
                result or PutResult(item[0], False, error=error) for result, item in zip(outcome, pending))

    def close(self, keep_deferred: bool = False) -> None:
        """The connection is gone (its leases with it). Deferred puts never sent are lost,
        each result saying so, unless `keep_deferred` (a call abandoned mid-way: the next
        connection stores them, ClientCore.adopt); a batch being stored is lost either way
        (whether the daemon stored it is unknown)."""
        if self.storing is not None:
            self.settle_deferred(DaemonUnavailable(
                "the connection to the daemon closed while this deferred put was being stored: it may not be stored"))
        if self.deferred and not keep_deferred:  # lost with the connection: flush() says so
            lost = DaemonUnavailable("the connection to the daemon closed before this deferred put was stored")
            self.deferred_results.extend(PutResult(item[0], False, error=lost) for item in self.deferred)
            self.deferred, self.deferred_bytes = [], 0
        self.closed = True
        self.shared.close()
        while self.fds:
            os.close(self.fds.popleft())
        # Mappings stay valid for leases still in the caller's hands; the GC unmaps them.
        self.arenas.clear()
        self._unmapped.clear()

    def adopt(self, previous: ClientCore) -> None:
        """Take over what the closed connection `previous` leaves to this one: results of
        deferred puts not yet reported by flush(), and the deferred puts it kept."""
        self.deferred_results[:0] = previous.deferred_results
        self.deferred[:0] = previous.deferred
        self.deferred_bytes += previous.deferred_bytes
        previous.deferred_results, previous.deferred, previous.deferred_bytes = [], [], 0

    # --- ops ----------------------------------------------------------------------

    def op_hello(self, name: str):
        (reply,) = yield [self.request(m.Hello(name, os.getpid()))]
        info = self.result(reply, r.HelloReply)
        self.max_inflight_bytes = info.limits.max_inflight_bytes or PUT_WINDOW_BYTES
        self.max_leases = info.limits.max_leases
        self.lease_ttl_s = info.limits.lease_ttl_s
        self.inline_put_bytes = min(INLINE_PUT_BYTES, info.limits.max_inline_put_bytes or 0)
        self.shared.offered = info.shared_index
        return info

    def op_open(self, namespace: str, create: bool = True):
        """Map the namespace's arena. Reads open with create False: a namespace nobody put
        into has no arena (the daemon makes none for a read), and its reads are misses."""
        if namespace in self.arenas or (not create and namespace in self._unmapped):
            return
        (reply,) = yield [self.request(m.OpenNamespace(namespace, self.token, create, self.shared.wanted))]
        opened = self.result(reply, r.OpenReply)
        size = opened.arena_bytes
        if size == 0:  # no arena there yet: nothing to map
            self._unmapped.add(namespace)
            return
        self._unmapped.discard(namespace)
        if len(self.fds) < 1 + bool(opened.index_bytes):
            raise ProtocolError("open succeeded but its arena (or index) fd did not arrive with the reply")
        # Both fds are taken off the queue before anything here can fail, so a later open
        # never takes this one's (the daemon sends them with the reply: arena, then index).
        fd = self.fds.popleft()
        index_fd = self.fds.popleft() if opened.index_bytes else None
        self.shared.attach(namespace, opened.index_bytes, index_fd)
        try:
            # Page tables at once (puts into fresh pages then run ~2x faster), but only over
            # memory the daemon allocated: populating a lazy arena would allocate all of it.
            populate = getattr(mmap, "MAP_POPULATE", 0) if opened.prefaulted else 0
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self._maps.append(mapping)
        arena = self.arenas[namespace] = np.frombuffer(mapping, dtype=np.uint8)
        self.pinned[namespace] = pin_for_cuda(mapping, arena)

    def _descriptor(self, desc: StateDescriptor | None) -> StateDescriptor:
        return desc or _opaque(self.namespace)

    def put_item(self, key, data, desc: StateDescriptor | None):
        """(object id, descriptor, bytes) of one put item; InvalidArgument names its problem."""
        oid = to_object_id(key)
        carried = key.descriptor if isinstance(key, ChunkKey) else None
        if carried is not None and desc is not None and desc != carried:
            raise InvalidArgument(
                f"key {oid.hex} was computed for another descriptor than the put's "
                f"({descriptor_differences(carried, desc)}; key != put): compute the key with "
                "chunk_keys(tokens, desc) for the descriptor you store, or put without desc")
        src = as_u8(data)
        if src.size == 0:
            raise InvalidArgument(f"object {oid.hex}: cannot store an empty object")
        descriptor = carried or self._descriptor(desc)
        check_object_size(descriptor, src.size)
        return oid, descriptor, src

    def op_get(self, key, namespace: str | None, accept, ranges=None, expect: StateDescriptor | None = None,
               gpu: bool = False):
        expect = expectation(key, expect)
        namespace = namespace or self.namespace
        yield from self.op_open(namespace, create=False)
        accept = tuple(accept) if accept else None
        oid = to_object_id(key)
        if ranges is not None:
            ranges = normalize_ranges(ranges)  # InvalidArgument before anything is sent
        if (hit := (yield from self.shared.op_get(namespace, oid, accept, ranges, expect, gpu))) is not None:
            return hit
        (reply,) = yield [self.request(m.Get(namespace, oid, accept, ranges, expect, gpu))]
        got = self.result(reply, r.GetReply)
        if not got.hit:
            return None
        if namespace not in self.arenas:  # made since we opened (a put, or a promotion for this get)
            yield from self.op_open(namespace)
        return self._lease(got, namespace, oid, ranges, expect)

    def _lease(self, got: r.GetReply, namespace: str, oid: ObjectId, ranges, expect) -> ReadLease | None:
        """The ReadLease of a get hit (None, released, if it is not the expected state)."""
        on_gpu = got.tier == "gpu"  # its bytes are in the GPU buffer (client/gpu.py), not the arena
        array = None if on_gpu else self.arenas[namespace][got.offset:got.offset + got.size]
        lease = ReadLease(self.release_cb, got.lease, oid, got.size, got.checksum, got.descriptor, got.tier,
                          array, got.ranges, self, asked_ranges=ranges is not None, device_offset=on_gpu and got.offset)
        if expect is not None and lease.descriptor != expect:  # a daemon that answered for another one
            lease.release()
            return None
        return lease

    def op_get_into(self, key, out, namespace, verify: bool, expect: StateDescriptor | None = None):
        dst = as_writable_u8(out)
        want, oid = expectation(key, expect), to_object_id(key)
        if (size := (yield from self.shared.op_read_into(namespace or self.namespace, oid, dst, want))) is not None:
            return size
        lease = yield from self.op_get(key, namespace, None, None, expect)
        if lease is None:
            return None
        with lease:
            if lease.size > dst.size:
                raise InvalidArgument(f"object is {lease.size} bytes, the output buffer only {dst.size}")
            copies.copy(dst[:lease.size], lease.numpy())
            if verify and xxhash.xxh3_128_digest(dst[:lease.size]) != lease.checksum:
                raise ChecksumError(f"object {lease.object_id.hex}: copied bytes fail their checksum")
        return lease.size

    def op_lookup(self, keys, namespace: str | None, expect: StateDescriptor | None = None,
                  pin_ttl_s: float | None = None):
        ids, wanted = resolve_keys(keys, expect)
        namespace = namespace or self.namespace
        yield from self.op_open(namespace, create=False)
        if not ids:
            return LookupResult(0, (), 0, 0.0)
        requests = []
        for start in range(0, len(ids), MAX_BATCH):
            batch = tuple(ids[start:start + MAX_BATCH])
            fields = _expect_fields(wanted[start:start + MAX_BATCH])
            requests.append(self.request(m.Lookup(namespace, batch, *fields, codes=True)))
        lookups = len(requests)
        if pin_ttl_s is not None:  # after the lookups, in the same round trip
            requests += [self.request(m.Pin(namespace, b, ttl_s=pin_ttl_s)) for b in _batches(ids)]
        replies = yield requests
        for reply in replies[lookups:]:
            self.result(reply, r.PinReply)
        replies = replies[:lookups]
        tiers, hits, hit_bytes, est, leading = [], 0, 0, 0.0, True
        for reply in replies:
            found = self.result(reply, r.LookupReply)
            names = found.names()
            tiers.extend(names)
            if leading:
                hits, hit_bytes, est = hits + found.hits, hit_bytes + found.hit_bytes, est + found.est_load_s
                leading = found.hits == len(names)
        return LookupResult(hits, tuple(tiers), hit_bytes, est)

    def op_batch(self, cls, keys, namespace: str | None, **extra):
        """delete / pin / unpin / prefetch over any number of keys; returns the summed count
        (ids deleted, pinned, unpinned; for prefetch, ids resident)."""
        namespace = namespace or self.namespace
        yield from self.op_open(namespace, create=False)
        ids = [to_object_id(k) for k in keys]
        if not ids:
            return 0
        replies = yield [self.request(cls(namespace, tuple(b), **extra)) for b in _batches(ids)]
        kind = r.REPLIES[cls.op]
        return sum(self.result(reply, kind).count for reply in replies)

    def op_simple(self, msg: m.Message):
        """One request; its typed reply (kvstore.replies), or None for an op that answers nothing."""
        (reply,) = yield [self.request(msg)]
        if reply.error is not None:
            raise from_wire(reply.error)
        kind = r.REPLIES[msg.op]
        return None if kind is None else kind.from_wire(reply.result)
