"""Hits without a round trip: the daemon's side of a namespace's shared index.

A get costs two Python event loops and a socket each way, about what a whole Redis GET
costs. So the daemon also publishes where each resident object is, in a second memfd per
namespace that clients map read-only (sent with the `open` reply, beside the arena, only to
connections authorised for that namespace), and a client resolves a hit by itself: look the
id up, copy the bytes out of the arena, check them (client/shared_reads.py). The layout is
kvstore/shared_index.py. The daemon stays the only writer of its index and of this table.

Each record is a seqlock: `seq` is odd while the daemon writes the record, and grows by two
with every change, so a reader that sees the same even `seq` before and after it read the
record and copied the bytes knows neither changed meanwhile:

    publish(entry):                         # HostTier.insert: the entry is committed
        slot = first free slot of the id's PROBE_SLOTS   (none: do not publish)
        seq += 1                            # odd: a reader of this slot gives up
        write id, offset, size, checksum, descriptor digest, expires_at, OCCUPIED
        seq += 1                            # even: readable
    remove(entry):                          # HostTier._remove, BEFORE the extent is freed
        seq += 1; clear the record; seq += 1

    reader:                                 # client/shared_reads.py
        s1 = seq; if odd: ask the daemon
        read the record; its id, flags, descriptor, expires_at must match the request
        copy arena[offset:offset+size] into the caller's buffer
        xxh3-128(copy) == checksum, else ask the daemon
        s2 = seq; s2 == s1, else ask the daemon

Why a reader never accepts recycled or half-written bytes. (1) A record turns readable (even
`seq`) only after its object's bytes are complete: a client's put wrote them before its
commit reached the daemon (a message over the socket), and the daemon's own fills (a
promotion from NVMe, a fetch from a peer) finished before `publish` runs on this thread.
Committed objects are immutable. (2) An extent is freed, and so can be reserved and written
again, only after `remove` stored the odd `seq`, on this thread, and its next writer learns
of it only after that (a reply over the socket). On x86 stores become visible in program
order (TSO) and loads are not reordered with other loads, so a reader's load of s2 comes
after its loads of the copied bytes: if any copied byte was written after the extent was
reused, the `seq` store that preceded the free is visible to the s2 load, and s2 != s1.
(3) A record read between a write's two `seq` stores has an odd or a different `seq`, so a
torn record (one object's id with another's offset) is refused too. The xxh3-128 check of
the copy covers what this argument might miss (a store reordered inside a string
instruction, a client writing into a committed extent of its own namespace): a copy that
fails it is a miss, never bytes handed out. CPUs without TSO: the client does not read the
index (client/shared_reads.py checks the machine). A daemon that stops or dies: the header's
alive_until (moved ahead every housekeeping pass, zeroed at close) lapses, and readers ask
the daemon, which raises DaemonUnavailable as every other call does.

What is published: every object that enters the host index (HostTier.insert: commits, a
peer's put, fetches, NVMe promotions), whether pinned or not; what leaves it (evicted,
demoted to NVMe, expired, deleted, dropped, replaced) is cleared first, on the same call.
A full window is just not published (readers ask the daemon). The reader checks TTLs
itself: expires_at is CLOCK_MONOTONIC (system-wide), as time.monotonic() in both processes.

The memfd is sealed against growing, shrinking and, once the daemon mapped it writable,
any further writable mapping or write() (F_SEAL_FUTURE_WRITE): clients can only read it.
Runs on the daemon's event loop thread only, like the rest of the host tier.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import math
import mmap
import os
import time

import numpy as np

from kvstore.shared_index import (
    ALIVE, ALIVE_AT, ALIVE_S, HEADER, HEADER_BYTES, MAGIC, OCCUPIED, PROBE_SLOTS, RECORD, RECORD_BYTES, SEQ, VERSION,
    descriptor_digest, file_bytes, home_slot, record_at, slots_for,
)
from kvstore.server.tiering.objects import ObjectEntry
from kvstore.tiers.arena import MADV_POPULATE_WRITE, memfd_name

log = logging.getLogger("kvstore.tiers")

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1+; Python does not name it
_FLAGS_AT = RECORD_BYTES - 8  # the flags field, the record's last
_EMPTY = (b"\0" * 32, 0, 0, b"\0" * 16, 0, 0.0, 0)
# kvstore.shared_index.RECORD as a numpy record, for whole-table checks.
RECORD_DTYPE = np.dtype([("seq", "<u8"), ("id", "V32"), ("offset", "<u8"), ("size", "<u8"), ("checksum", "V16"),
                         ("descriptor", "<u8"), ("expires_at", "<f8"), ("flags", "<u8")])


class SharedIndex:
    """One namespace's table. `fd` goes to clients with the open reply (the index owns it:
    send it, never close it); `size_bytes` is what they map."""

    enabled = True

    def __init__(self, namespace: str, arena_bytes: int, prefault: bool = False):
        """prefault (as the arena's [host] prefault): populate the table's pages now. Records
        land at random slots, so otherwise most of the first puts fault in a fresh page
        (measured: 1,000 puts of 4 KiB took 44.5 ms against 34.6 ms with no index)."""
        self.slots = slots_for(arena_bytes)
        self.size_bytes = file_bytes(self.slots)
        self.num_published = 0
        self.num_unpublished = 0  # objects whose slots were all taken: readers ask the daemon
        self.fd = os.memfd_create(memfd_name(f"kvstore-index-{namespace}"), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size_bytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, self.size_bytes, flags=mmap.MAP_SHARED)
            if prefault:
                with contextlib.suppress(OSError):  # MADV_POPULATE_WRITE needs Linux 5.14
                    self._map.madvise(MADV_POPULATE_WRITE)
            HEADER.pack_into(self._map, 0, MAGIC, VERSION, self.slots, RECORD_BYTES, time.monotonic() + ALIVE_S)
            try:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
            except OSError as exc:  # a kernel before 5.1: clients could write; only their own tenant's reads
                if exc.errno != errno.EINVAL:
                    raise
                log.warning("event=shared_index_unsealed namespace=%s reason=no_F_SEAL_FUTURE_WRITE", namespace)
        except BaseException:
            os.close(self.fd)
            raise

    def _slots_of(self, digest: bytes):
        """The byte offsets of the id's PROBE_SLOTS records, in probe order: a range where they
        do not wrap around the table's end (all but PROBE_SLOTS - 1 homes), built once per call
        (a generator of record_at per slot cost ~1.5 us of a publish's ~2.6)."""
        home = home_slot(digest, self.slots)
        if home + PROBE_SLOTS <= self.slots:
            first = record_at(home)
            return range(first, first + PROBE_SLOTS * RECORD_BYTES, RECORD_BYTES)
        mask = self.slots - 1
        return [record_at((home + i) & mask) for i in range(PROBE_SLOTS)]

    def _write(self, at: int, fields: tuple) -> None:
        """The seqlock write: seq odd, the record, seq even (each store after the one before)."""
        seq = SEQ.unpack_from(self._map, at)[0]
        SEQ.pack_into(self._map, at, seq + 1)
        RECORD.pack_into(self._map, at, seq + 1, *fields)
        SEQ.pack_into(self._map, at, seq + 2)

    def publish(self, entry: ObjectEntry) -> bool:
        """Make a committed host entry readable by clients; False when its slots are taken."""
        oid = entry.object_id  # bytes itself: .digest would copy it
        for at in self._slots_of(oid):
            if SEQ.unpack_from(self._map, at + _FLAGS_AT)[0] != OCCUPIED:
                offset, size, checksum = entry.placement()
                self._write(at, (oid, offset, size, checksum, descriptor_digest(entry.descriptor), entry.expires_at,
                                 OCCUPIED))
                self.num_published += 1
                return True
        self.num_unpublished += 1
        return False

    def publish_many(self, oids: list, offsets: np.ndarray, sizes: np.ndarray, checksums: bytes,
                     descriptor, expires_at: float = math.inf) -> int:
        """publish() for many committed entries at once (a batch's commits), all under one
        descriptor: each takes the first free slot of its window that no other of the batch
        took in an earlier round (round k tries slot k of every window still looking), and the
        seqlock's three stores go out as three array writes over the slots of a round: every
        record's odd seq before its fields, its fields before its even seq. Returns how many
        were published; the others' windows were full."""
        count = len(oids)
        table = np.frombuffer(self._map, RECORD_DTYPE, self.slots, HEADER_BYTES)
        records = np.zeros(count, RECORD_DTYPE)
        records["id"] = np.frombuffer(b"".join(oids), "V32")
        records["offset"], records["size"] = offsets, sizes
        records["checksum"] = np.frombuffer(checksums, "V16")
        records["descriptor"], records["expires_at"], records["flags"] = descriptor_digest(descriptor), expires_at, OCCUPIED
        homes = np.fromiter((home_slot(oid, self.slots) for oid in oids), np.int64, count)
        pending, mask = np.arange(count), self.slots - 1
        for step in range(PROBE_SLOTS):
            if not len(pending):
                break
            slots = (homes[pending] + step) & mask
            free = table["flags"][slots] != OCCUPIED
            slots, ours = np.unique(slots[free], return_index=True)  # one item of the batch a slot
            items = pending[free][ours]
            seq = table["seq"][slots]
            table["seq"][slots] = seq + 1
            records["seq"][items] = seq + 1
            table[slots] = records[items]
            table["seq"][slots] = seq + 2
            placed = np.zeros(count, bool)
            placed[items] = True
            pending = pending[~placed[pending]]
        self.num_published += count - len(pending)
        self.num_unpublished += len(pending)
        return count - len(pending)

    def remove(self, entry: ObjectEntry) -> None:
        """Clear the entry's record; call before its extent can be freed or reused."""
        oid = entry.object_id  # bytes itself: .digest would copy it
        for at in self._slots_of(oid):
            if SEQ.unpack_from(self._map, at + _FLAGS_AT)[0] == OCCUPIED and self._map[at + 8:at + 40] == oid:
                self._write(at, _EMPTY)
                self.num_published -= 1
                return

    def keep_alive(self) -> None:
        """Tell readers the daemon still keeps this table (every housekeeping pass)."""
        ALIVE.pack_into(self._map, ALIVE_AT, time.monotonic() + ALIVE_S)  # the readers' clock, not an injected one

    def check_integrity(self, objects: dict) -> None:
        """Raise RuntimeError unless every record names an indexed entry's extent, size and checksum."""
        table = np.frombuffer(self._map, RECORD_DTYPE, self.slots, HEADER_BYTES)
        if np.any(table["seq"] & 1) or np.any((table["flags"] != 0) & (table["flags"] != OCCUPIED)):
            raise RuntimeError("shared index: a record left half-written, or with unknown flags")
        used = np.flatnonzero(table["flags"] == OCCUPIED)
        if len(used) != self.num_published:
            raise RuntimeError(f"shared index: {len(used)} records, {self.num_published} counted")
        for slot in used.tolist():
            _, digest, offset, size, checksum, _, _, _ = RECORD.unpack_from(self._map, record_at(slot))
            entry = objects.get(digest)
            if entry is None or (entry.offset, entry.size, entry.checksum) != (offset, size, checksum):
                raise RuntimeError(f"shared index slot {slot}: a record for {digest.hex()} the index does not hold")
        del table  # a live export of the mapping would keep close() from unmapping it

    def close(self) -> None:
        if self.fd >= 0:
            ALIVE.pack_into(self._map, ALIVE_AT, 0.0)  # readers stop now: their next read asks (and finds us gone)
            try:
                self._map.close()
            except BufferError:  # a view still exports it (a failed check's traceback): unmapped with it
                pass
            os.close(self.fd)
            self.fd = -1


class NoSharedIndex:
    """The index switched off (`[host] shared_index = false`): every get is a round trip."""

    enabled = False
    fd = -1
    size_bytes = 0

    def publish(self, entry: ObjectEntry) -> bool:
        return False

    def publish_many(self, oids: list, offsets, sizes, checksums: bytes, descriptor, expires_at: float = math.inf) -> int:
        return 0

    def keep_alive(self) -> None:
        pass

    def remove(self, entry: ObjectEntry) -> None:
        pass

    def check_integrity(self, objects: dict) -> None:
        pass

    def close(self) -> None:
        pass


NO_SHARED_INDEX = NoSharedIndex()


def shared_index(enabled: bool, namespace: str, arena_bytes: int,
                 prefault: bool = False) -> SharedIndex | NoSharedIndex:
    return SharedIndex(namespace, arena_bytes, prefault) if enabled else NO_SHARED_INDEX


def count_shared_hits(host, nvme, namespace: str, ids: tuple) -> None:
    """A client's report of hits it resolved from the index (op `touch`): counted as hits,
    and each object still here is touched as a get would (policy, hit count, NVMe's
    admission and selective writes). host, nvme: the host and NVMe tiers."""
    ns = host.namespaces.get(namespace)
    if ns is None:
        return
    counters = ns.counters
    counters.num_gets += len(ids)
    counters.num_hits += len(ids)
    counters.num_shared_hits += len(ids)
    objects, on_access = ns.objects, ns.policy.on_access
    rows = objects.held_rows(ids)  # probed at once (an id equals its digest: kvstore.identity.ObjectId)
    rows = rows[rows >= 0]
    once, times = np.unique(rows, return_counts=True)  # each row hit, and how often
    nvme.on_hits(objects, once, times)  # (before they are counted: it sees each entry's hits before the batch)
    counters.bytes_out += objects.add_hits(once, times)
    for row in rows.tolist():
        on_access(row)
