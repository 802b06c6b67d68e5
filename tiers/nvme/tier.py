"""NvmeTier, the NVMe tier's operations (the package docstring walks a put, a get, a
delete and an open; this module checks arguments, keeps the counters and decides, under
one lock, which key may change and which extent may be reused).

Threads: every method blocks and is thread-safe. The daemon calls them through
`tier.executor` (io_threads workers), e.g. `await loop.run_in_executor(tier.executor,
tier.get_into, ns, oid, out)`, so several I/Os are in flight at once. A short lock guards
the allocators and the in-memory state; no data I/O runs under it (index lookups do: one
RocksDB get, microseconds).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Iterator


from kvstore.config import NvmeTierConfig
from kvstore.errors import CapacityError, ChecksumError, Conflict, InvalidArgument, ServiceError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.tiers.allocator import Extent
from kvstore.tiers.nvme.extents import ExtentOwners
from kvstore.tiers.nvme.files import byte_view, round_up
from kvstore.tiers.nvme.group_commit import GroupJournal
from kvstore.tiers.nvme.holdings import Holdings
from kvstore.tiers.nvme.index import NvmeRecord, namespace_prefix, object_key, split_key
from kvstore.tiers.nvme.recovery import RecoveryReport
from kvstore.tiers.nvme.types import CHECKSUM_BYTES, NvmeCounters, NvmeMeta, NvmePut
from kvstore.tiers.nvme.volume import Volume

_log = logging.getLogger("kvstore.tiers.nvme")


class NvmeTier:
    """See the package docstring. Construct with `NvmeTier(config)` or `NvmeTier.open(config)`
    (the same thing): both create what is missing and recover what is there; `recovery`
    says what was found."""

    def __init__(self, config: NvmeTierConfig):
        started = time.monotonic()
        if not isinstance(config, NvmeTierConfig):
            raise InvalidArgument(f"NvmeTier needs an NvmeTierConfig, got {type(config).__name__}")
        if not config.path:
            raise InvalidArgument("NvmeTier needs nvme.path set (the daemon sets <data_dir>/nvme when it is empty)")
        self.config = config
        self._group = config.durability == "group"
        self._counters = NvmeCounters()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._volume = Volume.open(config, started, on_io_error=self._io_failed)
        self._index = self._volume.index
        recovered = self._volume.recovered
        if not self._volume.direct_io:
            _log.warning("event=nvme_buffered_io path=%s reason=o_direct_refused", config.path)
        self.recovery: RecoveryReport = recovered.report
        # Held here only until the daemon takes them (the volume keeps `recovered`).
        self._holdings: Holdings | None = recovered.holdings
        recovered.holdings = None
        self._num_objects, self._num_bytes = recovered.objects, recovered.bytes
        self._busy: set[bytes] = set()  # keys with a put or a synced delete in flight
        self._extents = ExtentOwners(recovered.allocators)
        self._journal = GroupJournal(self._index, self._volume.files, self._lock, self._extents.release, config.path)
        self._closed = False
        if self._group:
            self._journal.start(config.group_commit_ms / 1000)
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-nvme-io")
        _log.info(
            "event=nvme_ready path=%s seconds=%.3f recovered=%d dropped=%d",
            config.path, self.recovery.time_to_ready_s, self.recovery.recovered, self.recovery.dropped,
        )

    @classmethod
    def open(cls, config: NvmeTierConfig) -> NvmeTier:
        return cls(config)

    # -- writes -------------------------------------------------------------------------------

    def put(
        self, namespace: str, object_id: ObjectId, data, checksum: bytes,
        descriptor: StateDescriptor, hints: Hints | None = None, created_at: float | None = None,
    ) -> NvmePut:
        """Store an object. `data` (bytes-like or uint8 ndarray, C-contiguous) is only read,
        and only during the call. The bytes written must hash to `checksum` (xxh3-128) or
        ChecksumError is raised and nothing is stored. An id already stored is not written
        again (`deduplicated`), but an id stored with other bytes raises Conflict. No room:
        CapacityError; a disk error: ServiceError; either way the index is unchanged.
        created_at: when the object was put (wall clock; default now), which its TTL counts
        from: a copy written down later keeps its put's time."""
        key = object_key(namespace, object_id)
        view = byte_view(data, writable=False, what="put data")
        if not len(view):
            raise InvalidArgument("cannot put an empty object")
        if not isinstance(checksum, bytes) or len(checksum) != CHECKSUM_BYTES:
            raise InvalidArgument(f"checksum must be {CHECKSUM_BYTES} bytes (xxh3-128)")
        if not isinstance(descriptor, StateDescriptor) or descriptor.namespace != namespace:
            raise InvalidArgument(f"descriptor must be a StateDescriptor of namespace {namespace!r}")
        hints = Hints() if hints is None else hints
        if not isinstance(hints, Hints):
            raise InvalidArgument(f"hints must be Hints or None, got {type(hints).__name__}")
        placed = self._reserve(key, len(view), checksum)
        if isinstance(placed, NvmePut):
            return placed
        file, extent = placed
        outcome, record, value = "failed", None, b""
        try:
            blocks = self._write(file, extent, view, checksum, namespace, object_id)
            record = NvmeRecord(
                file, extent.offset, len(view), checksum, blocks, descriptor.to_wire(), hints.to_wire(),
                time.time() if created_at is None else created_at,
            )
            value = record.encode()
            if not self._group:
                self._index.put(key, value, sync=True)
            outcome = "indexed"
        except ServiceError:
            if record is not None and self._index.failed is not None:
                outcome = "quarantined"  # the entry may have reached the WAL
            raise
        finally:
            with self._cond:
                self._busy.discard(key)
                self._extents.settle(file, extent, outcome)
                if outcome == "indexed":
                    if self._group:
                        self._journal.add_put(key, record, value)
                    self._num_objects += 1
                    self._num_bytes += len(view)
                    self._counters.writes += 1
                    self._counters.bytes_in += len(view)
                self._cond.notify_all()
        return NvmePut(file, extent, len(view), "group" if self._group else "sync")

    def delete(self, namespace: str, object_id: ObjectId) -> bool:
        """Remove an object; False if it was not there. Idempotent. Its extent is reused
        only after the removal is durable and no read of it is in flight."""
        return self._delete(object_key(namespace, object_id), None)

    def flush(self) -> None:
        """Make every put and delete so far durable now (group durability; a no-op for sync)."""
        self._journal.commit()

    # -- reads --------------------------------------------------------------------------------

    def get_into(self, namespace: str, object_id: ObjectId, out) -> int | None:
        """Read a whole object into out[:size] and return size, or None on a miss. `out` is a
        writable uint8 buffer of at least size bytes, owned by the caller; an aligned one
        (host-arena extent, mmap) is filled by O_DIRECT in place. A checksum mismatch is a
        miss: out[:size] is zeroed, the object dropped, num_checksum_failures counted."""
        key = object_key(namespace, object_id)
        view = byte_view(out, writable=True, what="out")
        record = self._begin_read(key)
        if record is None:
            return None
        try:
            if len(view) < record.size:
                raise InvalidArgument(f"out has {len(view)} bytes; the object needs {record.size}")
            good = self._volume.read(record, view)
        finally:
            self._end_read(record)
        if not good:
            self._checksum_failed(key, record)
            return None
        return self._hit(record.size)

    def read_range(self, namespace: str, object_id: ObjectId, offset: int, length: int, out) -> int | None:
        """Read object bytes [offset, offset+length) into out[:length]; return length, or None
        on a miss. Objects larger than one VERIFY_BLOCK_BYTES block carry per-block xxh3-64
        sums (taken in the same pass as the xxh3-128 at put), and only the blocks the range
        touches are read and verified; a smaller object is read whole and verified whole. A
        failed check is a miss and drops the object, as in get_into."""
        key = object_key(namespace, object_id)
        view = byte_view(out, writable=True, what="out")
        if type(offset) is not int or type(length) is not int or offset < 0 or length <= 0:
            raise InvalidArgument(f"read_range needs offset >= 0 and length > 0, got ({offset!r}, {length!r})")
        if len(view) < length:
            raise InvalidArgument(f"out has {len(view)} bytes; the range needs {length}")
        record = self._begin_read(key)
        if record is None:
            return None
        try:
            if offset + length > record.size:
                raise InvalidArgument(f"range [{offset}, {offset + length}) runs past the object's {record.size} bytes")
            good = self._volume.read_range(record, offset, length, view)
        finally:
            self._end_read(record)
        if not good:
            self._checksum_failed(key, record)
            return None
        return self._hit(length)

    def contains(self, namespace: str, object_id: ObjectId) -> bool:
        key = object_key(namespace, object_id)
        with self._lock:
            return self._journal.holds(key)

    def meta(self, namespace: str, object_id: ObjectId) -> NvmeMeta | None:
        key = object_key(namespace, object_id)
        with self._lock:
            record, durability = self._journal.find(key), self._journal.durability(key)
        return None if record is None else NvmeMeta.of(namespace, object_id, record, durability)

    def take_holdings(self) -> Holdings:
        """What recovery found in the index (keys, sizes, creation times), once: the daemon
        builds its index of NVMe objects from it at start. Later calls raise RuntimeError."""
        held, self._holdings = self._holdings, None
        if held is None:
            raise RuntimeError("the NVMe tier's holdings were taken already (they are kept only until start)")
        return held

    def list(self, namespace: str | None = None) -> Iterator[NvmeMeta]:
        """Metadata of every object (of one namespace), waiting group commits first, then the
        index in key order. Weakly consistent: objects put or deleted meanwhile may or may
        not appear. Takes no lock while the caller consumes it."""
        prefix = b"" if namespace is None else namespace_prefix(namespace)
        for ns, object_id, record, durability in self._journal.records(prefix):
            yield NvmeMeta.of(ns, object_id, record, durability)

    def raw_records(self) -> Iterator[tuple[bytes, bytes]]:
        """(index key, record value) of every object in the index, in key order, undecoded
        (tiers/nvme/index.py: split_key, NvmeRecord.decode): for a caller that reads a few
        fields of millions and skips what it cannot read (the daemon's KV event stream learns
        what NVMe kept at start). Waiting group commits are left out; weakly consistent, as
        the index iterator is. Takes no lock; one thread at a time may advance it."""
        return self._index.items()

    # -- state --------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return {
                "objects": self._num_objects,
                "bytes": self._num_bytes,
                **asdict(self._counters),
                "num_pending_commit": self._journal.num_waiting,
                "capacity_bytes": self.config.capacity_bytes,
                "used_bytes": self._extents.used_bytes,
                "durability": self.config.durability,
                "direct_io": self._volume.direct_io,
                "index_failed": self._index.failed is not None,
            }

    def check_integrity(self) -> None:
        """Raise RuntimeError on the first disagreement between the index and the allocators:
        an indexed extent not allocated, unaligned, outside its file, or overlapping another;
        an allocated extent nobody accounts for; object counts that differ. Reads the whole
        index under the lock: run it in tests and when the daemon is idle."""
        with self._lock:
            # a busy key's entry is being written or removed: _extents accounts for it
            visible = self._journal.visible(skip=self._busy)
            self._extents.check_integrity(visible, self._journal.doomed(), [f.size_bytes for f in self._volume.files])
            if (len(visible), sum(r.size for r in visible.values())) != (self._num_objects, self._num_bytes):
                raise RuntimeError(
                    f"counters say {self._num_objects} objects / {self._num_bytes} bytes, the index "
                    f"{len(visible)} / {sum(r.size for r in visible.values())}"
                )

    def close(self) -> None:
        """Stop the group committer (committing what waits), the executor and the files.
        Idempotent. Call it after the last call has returned, not from an executor thread."""
        if self._closed:
            return
        try:
            self._journal.stop()
        except ServiceError as e:
            _log.error("event=nvme_final_commit_failed path=%s changes_lost=%d error=%r",
                       self.config.path, self._journal.num_waiting, e.message)
        self.executor.shutdown(wait=True)
        with self._lock:
            self._closed = True
        self._volume.close()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._closed:
            raise ServiceError(f"nvme tier {self.config.path} is closed")
        if self._index.failed is not None:
            raise type(self._index.failed)(self._index.failed.message)

    def _reserve(self, key: bytes, size: int, checksum: bytes) -> tuple[int, Extent] | NvmePut:
        """An extent for a new object, or the NvmePut of the stored one with the same checksum
        (dedup; Conflict for other bytes). Marks key busy, so puts and synced deletes of it
        wait for this put."""
        for attempt in range(2):
            with self._cond:
                self._check_writable()
                while key in self._busy:
                    self._cond.wait()
                existing = self._journal.find(key)
                if existing is not None:
                    if existing.checksum != checksum:  # never take a put for a record of other bytes
                        raise Conflict(f"nvme put of {split_key(key)[1].hex}: stored already with other bytes "
                                       "(checksums differ); delete it first to replace it")
                    self._counters.num_dedup_puts += 1
                    return NvmePut(existing.file, existing.extent, existing.size, self._journal.durability(key), True)
                placed = self._extents.reserve(size)
                if placed is not None:
                    self._busy.add(key)
                    return placed
                retry = attempt == 0 and self._journal.has_deletes
            if retry:
                self.flush()  # group deletes free their extents only once committed
        raise self._no_room(size)

    def _write(self, file: int, extent: Extent, view, checksum: bytes, namespace: str, object_id: ObjectId):
        """Write the object, and fdatasync it in sync durability; its block sums, or None."""
        digest, blocks = self._volume.write(file, extent, view, sync=not self._group)
        if digest != checksum:
            with self._lock:
                self._counters.num_put_checksum_mismatches += 1
            raise ChecksumError(
                f"nvme put of {namespace}/{object_id.hex}: the {len(view)} bytes do not match the "
                "checksum given with them (changed while being written?); nothing was stored"
            )
        return blocks

    def _no_room(self, size: int) -> CapacityError:
        if round_up(size) > self.config.file_bytes:
            return CapacityError(
                f"nvme tier {self.config.path}: a {size}-byte object cannot fit in a data file of "
                f"{self.config.file_bytes} bytes; raise file_bytes"
            )
        with self._lock:
            used, largest = self._extents.used_bytes, self._extents.largest_free_bytes
        return CapacityError(
            f"nvme tier {self.config.path}: no free extent of {round_up(size)} bytes for a {size}-byte "
            f"object (capacity {self.config.capacity_bytes} bytes, used {used}, largest free extent "
            f"{largest}); delete or evict objects, or raise capacity_bytes"
        )

    def _delete(self, key: bytes, expect: NvmeRecord | None) -> bool:
        with self._cond:
            self._check_writable()
            while key in self._busy:
                self._cond.wait()
            record = self._journal.find(key)
            if record is None or (expect is not None and (record.file, record.offset) != (expect.file, expect.offset)):
                return False
            self._num_objects -= 1
            self._num_bytes -= record.size
            self._counters.num_deletes += 1
            if self._group:
                self._journal.add_delete(key, record)
                return True
            self._busy.add(key)
            self._extents.start_delete(key, record)
        removed = False
        try:
            self._index.delete(key, sync=True)
            removed = True
        finally:
            with self._cond:
                self._busy.discard(key)
                self._extents.end_delete(key)
                if removed:
                    self._extents.release(record)
                else:
                    self._num_objects += 1
                    self._num_bytes += record.size
                self._cond.notify_all()
        return True

    def _begin_read(self, key: bytes) -> NvmeRecord | None:
        with self._lock:
            if self._closed:
                raise ServiceError(f"nvme tier {self.config.path} is closed")
            self._counters.reads += 1
            record = self._journal.find(key)
            if record is None:
                self._counters.misses += 1
                return None
            self._extents.pin(record)
            return record

    def _end_read(self, record: NvmeRecord) -> None:
        with self._lock:
            self._extents.unpin(record)

    def _io_failed(self) -> None:
        with self._lock:
            self._counters.num_io_errors += 1

    def _hit(self, nbytes: int) -> int:
        with self._lock:
            self._counters.hits += 1
            self._counters.bytes_out += nbytes
        return nbytes

    def _checksum_failed(self, key: bytes, record: NvmeRecord) -> None:
        with self._lock:
            self._counters.num_checksum_failures += 1
            self._counters.misses += 1
        namespace, object_id = split_key(key)
        _log.warning(
            "event=nvme_checksum_mismatch path=%s namespace=%s id=%s file=%d offset=%d bytes=%d action=dropped_as_miss",
            self.config.path, namespace, object_id.hex, record.file, record.offset, record.size,
        )
        try:
            self._delete(key, expect=record)
        except ServiceError as e:
            _log.error("event=nvme_drop_failed path=%s namespace=%s id=%s error=%r",
                       self.config.path, namespace, object_id.hex, e.message)
