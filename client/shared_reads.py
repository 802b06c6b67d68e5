"""Hits without a round trip: the client's side of the shared index.

The daemon publishes each namespace's resident objects in a table this client maps
read-only (kvstore/shared_index.py is the layout; server/tiering/shared_index.py explains
the daemon's side and why a reader never accepts recycled or half-written bytes). A get is
then resolved here, with no message to the daemon:

    s1 = record.seq                        even, else ask the daemon
    record's id, flags, descriptor digest (against `expect`), expires_at (CLOCK_MONOTONIC)
    copy arena[offset:offset + size] into the caller's buffer
    xxh3-128(copy) == record.checksum and record.seq == s1, else ask the daemon
    (and first, once per call: the header's alive_until is ahead, else the daemon stopped
    keeping the table; a batch's reads are as of its start)

Anything else asks the daemon, as before: an id not in the table, a record being changed,
an object past READ_INTO_MAX_BYTES (checking a copy costs more than a round trip there), a
buffer too small (the daemon's answer raises the right error), ranges, `accept`, GPU reads,
a namespace not mapped yet, and any CPU but x86-64 (the seqlock argument relies on its
ordering of loads and stores). `get` of an object up to GET_COPY_MAX_BYTES (`get_many`: up to
GET_MANY_COPY_MAX_BYTES) copies it into a private buffer and returns a lease over that copy
(nothing to release at the daemon); bigger ones keep the zero-copy lease.

The daemon does not see these hits, so they are queued and reported in one no-reply
`touch` request (kvstore/messages.py: Touch): every HITS_PER_REPORT hits or once the oldest is
REPORT_AFTER_S old (checked at the next hit), ahead of any other request the client sends
(ReportingCodec), and at close.

A read into the caller's buffer (get_into, get_many_into) of an object up to
WHOLE_COPY_MAX_BYTES lands in a scratch buffer first and is copied out only once it checked:
a miss leaves the caller's buffer untouched. A bigger object is copied (and hashed) straight
into it, block by block: staging it would cost a second pass over memory, and a miss (an
object removed while it was copied) may then leave part of the removed object's bytes there.
"""

from __future__ import annotations

import mmap
import os
import platform
import select
import time

import numpy as np
import xxhash

from kvstore.identity import StateDescriptor
from kvstore.messages import TOUCH_WITHIN_S, Touch
from kvstore.protocol import MAX_BATCH, FrameCodec, Request
from kvstore.shared_index import (
    ALIVE, ALIVE_AT, HEADER, HEADER_BYTES, MAGIC, OCCUPIED, PROBE_SLOTS, RECORD, RECORD_BYTES, SEQ, VERSION,
    descriptor_digest, file_bytes, home_slot,
)
from kvstore.client import copies
from kvstore.client.lease import ReadLease

# The seqlock argument needs x86's ordering (loads not reordered with loads, stores in order).
ORDERED_MACHINES = ("x86_64", "amd64")
# get_into/get_many_into read objects up to this size from the index. A read through the
# daemon (a round trip, the copy, a release) does not hash what it copied; this one must, so
# it pays while the hash costs less than the round trip and release. get_into of one object,
# alternated with a read through the daemon (medians of 200, a machine copying 4 MiB at
# ~20 GB/s): 4 MiB 225-262 against 442-596 us, 8 MiB 434 against 714, 16 MiB 1,296
# against 1,363 (copies of 4 MiB and up on two threads either way, client/copies.py; this
# read has since copied and hashed by blocks, WHOLE_COPY_MAX_BYTES).
READ_INTO_MAX_BYTES = 8 << 20
# A hit up to this size is copied whole and then hashed (it is still in the core's cache:
# 2 MiB of L2 here); a bigger one is copied and hashed block by block (client/copies.py), so
# it crosses memory once. bench/local.py, the two alternated, five runs each: get_into 4 MiB
# 0.59-0.70x memcpy copied whole (on two threads) -> 0.69-0.77x by blocks; 1 MiB 0.66-0.72x
# whole, 0.59-0.67x by blocks.
WHOLE_COPY_MAX_BYTES = 1 << 20
# get() of objects up to this size returns a lease over a private copy; bigger ones keep
# the zero-copy lease of a round trip (their copy would cost more than the trip).
GET_COPY_MAX_BYTES = 64 << 10
# get_many() does the same up to this size: its round trip is shared by up to 1,024 keys,
# so a copy pays only while it costs less than a zero-copy lease's share of the daemon's
# work (~8-12 us a key). 1,000 keys, copies against leases, alternated: 4 KiB 1.8-2.7x,
# 16 KiB 1.04-1.51x, 32 KiB 0.64-1.16x, 64 KiB 0.82-0.83x as fast.
GET_MANY_COPY_MAX_BYTES = 16 << 10
# Hits are reported once this many are queued, or once the oldest is this old (checked at
# the next hit; any other request and close report them too).
HITS_PER_REPORT = 64
REPORT_AFTER_S = TOUCH_WITHIN_S
# Descriptor digests remembered by the descriptor object (engines reuse a few objects).
MAX_KNOWN_DESCRIPTORS = 256


class SharedReads:
    """The shared indexes of one connection's namespaces, and the hits not reported yet.

    Owned by one ClientCore and called on its driver's thread (the sync client's lock, the
    asyncio client's loop). `enabled`: the client's switch (Client(shared_index=...));
    `offered`: the daemon's hello said it publishes indexes."""

    def __init__(self, core, enabled: bool, opaque):
        self._core = core  # its arenas (namespace -> mapped uint8 array) and request()
        self._opaque = opaque  # namespace -> the descriptor of a put that gave none
        self.enabled = enabled and platform.machine().lower() in ORDERED_MACHINES
        self.offered = False
        self._tables: dict[str, tuple[mmap.mmap, int]] = {}  # namespace -> (mapping, slots - 1)
        self._hits: dict[str, list[bytes]] = {}  # namespace -> ids hit, not reported yet
        self.num_pending = 0
        self.num_refused = 0  # copies refused: their record or bytes changed while being copied
        self._oldest = 0.0  # when the oldest unreported hit was
        self._digests: dict[int, tuple[StateDescriptor, int]] = {}  # id(descriptor) -> (it, its digest)
        self._hangup = None  # select.poll on the daemon socket: anything it reports means the daemon left
        self._scratch: np.ndarray | None = None  # where reads into caller buffers land before they are checked

    def watch(self, sock) -> None:
        """Read from the tables only while `sock`, the connection to the daemon, is up: a
        daemon that died (SIGKILL) closes it at once, while its table's keep-alive lapses
        only after ALIVE_S. One poll(0) per read, about half a microsecond."""
        self._hangup = select.poll()
        self._hangup.register(sock.fileno(), select.POLLRDHUP)  # POLLHUP and POLLERR come anyway

    @property
    def wanted(self) -> bool:
        """Ask for the index when opening a namespace."""
        return self.enabled and self.offered

    def attach(self, namespace: str, index_bytes: int, fd: int | None) -> None:
        """The open reply said an index fd came after the arena's (index_bytes > 0): map `fd`
        read-only (and close it). A table of another layout is not used."""
        if fd is None:
            return
        try:
            table = mmap.mmap(fd, index_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, slots, record_bytes, _ = HEADER.unpack_from(table, 0)
        if (magic, version, record_bytes) != (MAGIC, VERSION, RECORD_BYTES) or file_bytes(slots) > index_bytes:
            table.close()
            return
        self._tables[namespace] = (table, slots - 1)

    def close(self) -> None:
        for table, _ in self._tables.values():
            table.close()  # nothing exports it: reads copy out of it
        self._tables.clear()

    # --- reads ---------------------------------------------------------------------

    def _digest(self, descriptor: StateDescriptor) -> int:
        known = self._digests.get(id(descriptor))
        if known is None or known[0] is not descriptor:
            if len(self._digests) >= MAX_KNOWN_DESCRIPTORS:
                self._digests.clear()
            known = self._digests[id(descriptor)] = (descriptor, descriptor_digest(descriptor))
        return known[1]

    def _table(self, namespace: str):
        """(table, slot mask, arena, now) to read `namespace`'s hits from, or None (ask the
        daemon): the checks that hold for a whole call, made once per call."""
        found = self._tables.get(namespace)
        arena = self._core.arenas.get(namespace)
        if found is None or arena is None:
            return None
        if self._hangup is not None and self._hangup.poll(0):  # the daemon closed our connection
            return None
        now = time.monotonic()
        if ALIVE.unpack_from(found[0], ALIVE_AT)[0] <= now:  # the daemon stopped keeping it (or died)
            return None
        return found[0], found[1], arena, now

    def _read(self, namespace: str, items: list, limit: int) -> list:
        """Per (digest, out, want) item (digest: the id's 32 bytes, an ObjectId or bytes):
        (size, out, checksum) of a hit of at most `limit` bytes stored under `want` (None: any
        descriptor), copied into `out` (None: a new array) and verified; or None: ask the
        daemon. The checks that hold for the whole call (`_table`) are made once, so a
        batch's reads are as of its start; each object's are made on its own. Hits are queued
        for the next report. One loop serves one read and a batch: per object, it is what a
        batch costs (~3 us of Python besides the copy)."""
        found: list = [None] * len(items)
        opened = self._table(namespace)
        if opened is None:
            return found
        table, mask, arena, now = opened
        seq_at, record_at, checked = SEQ.unpack_from, RECORD.unpack_from, xxhash.xxh3_128_digest
        slots, end, hits = mask + 1, arena.size, []
        for k, (digest, out, want) in enumerate(items):
            home = home_slot(digest, slots)
            for i in range(PROBE_SLOTS):
                at = HEADER_BYTES + ((home + i) & mask) * RECORD_BYTES
                if table[at + 8:at + 40] == digest:
                    break
            else:
                continue  # not in the table
            s1 = seq_at(table, at)[0]  # before any field (x86: later loads stay later)
            _, oid, offset, size, checksum, desc, expires_at, flags = record_at(table, at)
            if (s1 & 1 or oid != digest or flags != OCCUPIED or size > limit or offset + size > end
                    or (want is not None and desc != self._digest(want))
                    or expires_at <= now):
                continue
            staged = out is not None and size <= WHOLE_COPY_MAX_BYTES  # the caller's buffer: only checked bytes
            if out is None:
                out = np.empty(size, np.uint8)
            elif out.size < size:
                continue
            if size <= WHOLE_COPY_MAX_BYTES:
                # (a memoryview's copy costs ~0.3 us less than np.copyto's)
                copy = memoryview(self._scratch_of() if staged else out)[:size]
                copy[:] = arena[offset:offset + size]
                landed = checked(copy)
            else:  # block by block, each hashed while in cache (8 MiB: on two threads)
                landed = copies.copy_and_hash(out[:size], arena[offset:offset + size])
            if landed != checksum or seq_at(table, at)[0] != s1:
                self.num_refused += 1  # changed while we copied: the daemon answers instead
                continue
            if staged:
                memoryview(out)[:size] = copy
            hits.append(digest)
            found[k] = (size, out, checksum)
        if hits:
            self._hit(namespace, hits)
        return found

    def _scratch_of(self) -> np.ndarray:
        if self._scratch is None:  # made at the first read into a caller's buffer; reused after
            self._scratch = np.empty(WHOLE_COPY_MAX_BYTES, np.uint8)
        return self._scratch

    def op_read_into(self, namespace: str, oid, dst: np.ndarray, want):
        """get_into from the index: the size copied into `dst`, or None (ask the daemon)."""
        if not self._tables:
            return None
        (found,) = self._read(namespace, [(oid.digest, dst, want)], READ_INTO_MAX_BYTES)
        if found is not None and self._due():
            yield self.reports()
        return None if found is None else found[0]

    def op_get(self, namespace: str, oid, accept, ranges, want, gpu: bool):
        """get from the index: a lease over a private copy, or None (ask the daemon)."""
        if not self._tables or accept is not None or ranges is not None or gpu:
            return None
        # The lease names the object's descriptor: `want`, else the one of a put that gave none
        # (stored under any other, it is read through the daemon, whose reply names it).
        descriptor = want if want is not None else self._opaque(namespace)
        (found,) = self._read(namespace, [(oid.digest, None, descriptor)], GET_COPY_MAX_BYTES)
        if found is None:
            return None
        size, copy, checksum = found  # (a new array of `size` bytes)
        if self._due():
            yield self.reports()
        return ReadLease(self._core.release_cb, 0, oid, size, checksum, descriptor, "host", copy)  # 0: no daemon lease

    def op_get_many(self, namespace: str, wanted: list):
        """get_many from the index: per (oid, want) item a lease over a private copy (objects
        up to GET_MANY_COPY_MAX_BYTES), or None (ask the daemon)."""
        if not self._tables:
            return [None] * len(wanted)
        descriptors = [want if want is not None else self._opaque(namespace) for _, want in wanted]
        found = self._read(namespace, [(oid, None, d) for (oid, _), d in zip(wanted, descriptors)],
                           GET_MANY_COPY_MAX_BYTES)
        if self._due():
            yield self.reports()
        release = self._core.release_cb
        return [None if hit is None else ReadLease(release, 0, oid, hit[0], hit[2], d, "host", hit[1])
                for (oid, _), d, hit in zip(wanted, descriptors, found)]

    def op_read_many(self, namespace: str, prepared: list):
        """get_many_into from the index: per (oid, dst, want) item the size copied into dst,
        or None (ask the daemon)."""
        if not self._tables:
            return [None] * len(prepared)
        found = self._read(namespace, prepared, READ_INTO_MAX_BYTES)
        if self._due():
            yield self.reports()
        return [None if hit is None else hit[0] for hit in found]

    # --- reporting hits ----------------------------------------------------------------

    def _hit(self, namespace: str, digests: list) -> None:
        hits = self._hits.get(namespace)
        if hits is None:
            hits = self._hits[namespace] = []
        if not self.num_pending:
            self._oldest = time.monotonic()
        hits.extend(digests)
        self.num_pending += len(digests)

    def _due(self) -> bool:
        return self.num_pending >= HITS_PER_REPORT or (
            self.num_pending > 0 and time.monotonic() - self._oldest >= REPORT_AFTER_S)

    def reports(self) -> list[Request]:
        """The `touch` requests (no reply) of every hit not reported yet; they count as reported."""
        requests = [self._core.request(Touch(namespace, tuple(ids[start:start + MAX_BATCH])), no_reply=True)
                    for namespace, ids in self._hits.items() for start in range(0, len(ids), MAX_BATCH)]
        self._hits.clear()
        self.num_pending = 0
        return requests


class ReportingCodec(FrameCodec):
    """The connection's codec: any request it frames carries the hits not reported yet ahead
    of it, so a request the daemon serves (a stats call, another get) sees them counted."""

    def __init__(self, shared: SharedReads):
        super().__init__()
        self._shared = shared

    def send_request(self, request: Request) -> bytes:
        frame = super().send_request(request)
        if self._shared.num_pending and request.op != Touch.op:
            return b"".join(FrameCodec.send_request(self, r) for r in self._shared.reports()) + frame
        return frame
