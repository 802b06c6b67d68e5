"""The NVMe tier: objects in preallocated data files, found through a RocksDB index.

    put:    reserve an extent -> write it (O_DIRECT) -> fdatasync -> index entry
              "sync":  fdatasync (shared by the puts in flight, nvme_io.SyncBarrier), then
                       the entry is written with WAL sync (RocksDB groups concurrent ones)
                       before put returns
              "group": the entry waits in a journal (tiers/nvme_group.py); every
                       group_commit_ms a thread fdatasyncs the files written since and
                       writes the waiting entries in one synced batch. Until then the
                       object is readable but would not survive a crash.
            (A "sync" put that ran a group commit itself measured 0.6x of this here: one
            commit at a time serialises the data flush and the WAL flush, where separate
            puts overlap them.)
    get:    index -> read the extent -> verify xxh3-128 -> bytes, or a miss (and the object
            is dropped) when the check fails; never unverified bytes.
    delete: index entry removed (synced, or in the next group), then the extent is freed;
            an extent under a read is freed when the read ends.
    open:   tiers/nvme_recovery.py rebuilds the allocators from the index.

Every index entry points at data that was synced before the entry was written: after a crash,
each entry finds its own bytes, and an extent that was being written but never indexed is
simply free again.

Verification: get_into checks the object's xxh3-128. read_range checks only the 64 KiB
blocks it reads, against xxh3-64 sums that put takes in the same pass as the xxh3-128 and
refuses to store unless that pass matches the caller's checksum, so both vouch for the same
bytes. A restart checks every entry against the data files but checksums only a bounded
random sample (tiers/nvme_recovery.py); every later read verifies.

Threads: every method blocks and is thread-safe. The daemon calls them through
`tier.executor` (io_threads workers), e.g. `await loop.run_in_executor(tier.executor,
tier.get_into, ns, oid, out)`, so several I/Os are in flight at once. A short lock guards
the allocators and the in-memory state; no data I/O runs under it (index lookups do: one
RocksDB get, microseconds).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np

from kvstore.config import NvmeTierConfig
from kvstore.errors import CapacityError, ChecksumError, InvalidArgument, ServiceError
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from tiers.allocator import Extent
from tiers.nvme_extents import ExtentOwners
from tiers.nvme_group import GroupJournal
from tiers.nvme_index import FORMAT_VERSION, NvmeIndex, NvmeRecord, namespace_prefix, object_key, split_key
from tiers.nvme_io import (
    ALIGN, VERIFY_BLOCK_BYTES, DataFile, byte_view, io_error, open_data_file, read_blocks, read_object,
    round_up, write_object,
)
from tiers.nvme_recovery import RecoveryReport, recover
from tiers.nvme_types import CHECKSUM_BYTES, NvmeMeta, NvmePut

_log = logging.getLogger("kvstore.tiers.nvme")


class NvmeTier:
    """See the module docstring. Construct with `NvmeTier(config)` or `NvmeTier.open(config)`
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
        os.makedirs(config.path, mode=0o700, exist_ok=True)  # the index names every tenant's objects
        self._index = NvmeIndex(os.path.join(config.path, "index"))
        self._files: list[DataFile] = []
        try:
            self._check_format()
            for i, size in enumerate(config.file_sizes()):
                self._files.append(open_data_file(i, os.path.join(config.path, f"data-{i:05d}.kvs"), size))
            recovered = recover(self._index, self._files, started)
        except BaseException:
            self._close_files(remove_created=True)  # they hold nothing yet
            raise
        if not all(f.direct for f in self._files):
            _log.warning("nvme tier %s: the file system refuses O_DIRECT; using buffered I/O", config.path)
        self.recovery: RecoveryReport = recovered.report
        self._num_objects, self._num_bytes = recovered.objects, recovered.bytes
        self._counters = Counter()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._busy: set[bytes] = set()  # keys with a put or a synced delete in flight
        self._extents = ExtentOwners(recovered.allocators)
        self._journal = GroupJournal(self._index, self._files, self._lock, self._extents.release, config.path)
        self._closed = False
        if self._group:
            self._journal.start(config.group_commit_ms / 1000)
        self.executor = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvstore-nvme-io")
        _log.info(
            "nvme tier %s ready in %.3f s: %d objects recovered, %d dropped",
            config.path, self.recovery.time_to_ready_s, self.recovery.recovered, self.recovery.dropped,
        )

    @classmethod
    def open(cls, config: NvmeTierConfig) -> NvmeTier:
        return cls(config)

    # -- writes -------------------------------------------------------------------------------

    def put(
        self, namespace: str, object_id: ObjectId, data, checksum: bytes,
        descriptor: StateDescriptor, hints: Hints | None = None,
    ) -> NvmePut:
        """Store an object. `data` (bytes-like or uint8 ndarray, C-contiguous) is only read,
        and only during the call. The bytes written must hash to `checksum` (xxh3-128) or
        ChecksumError is raised and nothing is stored. An id already stored is not written
        again (`deduplicated`). No room: CapacityError; a disk error: ServiceError; either
        way the index is unchanged."""
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
        placed = self._reserve(key, len(view))
        if isinstance(placed, NvmePut):
            return placed
        file, extent = placed
        outcome, record, value = "failed", None, b""
        try:
            blocks = self._write(file, extent, view, checksum, namespace, object_id)
            record = NvmeRecord(
                file, extent.offset, len(view), checksum, blocks, descriptor.to_wire(), hints.to_wire(), time.time()
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
                    self._counters["writes"] += 1
                    self._counters["bytes_in"] += len(view)
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
            digest = self._io(read_object, record, record.size, view)
        finally:
            self._end_read(record)
        if digest != record.checksum:
            np.frombuffer(view, dtype=np.uint8)[: record.size] = 0
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
            if record.blocks is None:
                whole = memoryview(bytearray(record.size))
                good = self._io(read_object, record, record.size, whole) == record.checksum
                if good:
                    view[:length] = whole[offset : offset + length]
            else:
                good = self._io(read_blocks, record, record.size, record.blocks, offset, length, view[:length])
        finally:
            self._end_read(record)
        if not good:
            self._checksum_failed(key, record)
            return None
        return self._hit(length)

    def contains(self, namespace: str, object_id: ObjectId) -> bool:
        key = object_key(namespace, object_id)
        with self._lock:
            known, record = self._journal.lookup(key)
            return record is not None if known else self._index.get(key) is not None

    def meta(self, namespace: str, object_id: ObjectId) -> NvmeMeta | None:
        key = object_key(namespace, object_id)
        with self._lock:
            record = self._lookup_locked(key)
            durability = "group" if self._journal.is_pending(key) else "sync"
        return None if record is None else _meta(namespace, object_id, record, durability)

    def list(self, namespace: str | None = None) -> Iterator[NvmeMeta]:
        """Metadata of every object (of one namespace), waiting group commits first, then the
        index in key order. Weakly consistent: objects put or deleted meanwhile may or may
        not appear. Takes no lock while the caller consumes it."""
        prefix = b"" if namespace is None else namespace_prefix(namespace)
        with self._lock:
            pending = [(k, r) for k, r in self._journal.pending() if k.startswith(prefix)]
            hides = self._journal.hides
        for key, record in pending:
            yield _meta(*split_key(key), record, "group")
        for key, value in self._index.items(prefix):
            with self._lock:
                hidden = hides(key)
            if not hidden and (parts := split_key(key)) is not None:
                yield _meta(*parts, NvmeRecord.decode(value), "sync")

    # -- state --------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            c = self._counters
            return {
                "objects": self._num_objects,
                "bytes": self._num_bytes,
                "reads": c["reads"], "writes": c["writes"], "hits": c["hits"], "misses": c["misses"],
                "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
                "num_checksum_failures": c["num_checksum_failures"],
                "num_dedup_puts": c["num_dedup_puts"], "num_deletes": c["num_deletes"],
                "num_io_errors": c["num_io_errors"], "num_put_checksum_mismatches": c["num_put_checksum_mismatches"],
                "num_pending_commit": self._journal.num_waiting,
                "capacity_bytes": self.config.capacity_bytes,
                "used_bytes": self._extents.used_bytes,
                "durability": self.config.durability,
                "direct_io": all(f.direct for f in self._files),
                "index_failed": self._index.failed is not None,
            }

    def check_integrity(self) -> None:
        """Raise RuntimeError on the first disagreement between the index and the allocators:
        an indexed extent not allocated, unaligned, outside its file, or overlapping another;
        an allocated extent nobody accounts for; object counts that differ. Reads the whole
        index under the lock: run it in tests and when the daemon is idle."""
        with self._lock:
            visible = dict(self._journal.pending())
            for key, value in self._index.items():
                # a busy key's entry is being written or removed: _extents accounts for it
                if not self._journal.hides(key) and key not in self._busy:
                    visible[key] = NvmeRecord.decode(value)
            doomed = [(r.file, r.offset) for r in self._journal.doomed()]
            self._extents.check_integrity([(r.file, r.offset) for r in visible.values()] + doomed)
            for key, r in visible.items():
                f = self._files[r.file] if r.file < len(self._files) else None
                if f is None or r.offset % ALIGN or r.offset + r.extent.length > f.size_bytes:
                    raise RuntimeError(f"index entry {key.hex()} lies outside its data file: {r}")
                if not self._extents.allocators[r.file].is_allocated(r.extent):
                    raise RuntimeError(f"index entry {key.hex()} points at an extent the allocator holds free: {r}")
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
            _log.error("nvme tier %s: final group commit failed, %d changes lost: %s",
                       self.config.path, self._journal.num_waiting, e.message)
        self.executor.shutdown(wait=True)
        with self._lock:
            self._closed = True
        self._close_files()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _check_format(self) -> None:
        meta = {"format": FORMAT_VERSION, "file_bytes": self.config.file_bytes, "verify_block_bytes": VERIFY_BLOCK_BYTES}
        stored = self._index.read_meta()
        if stored is None:
            self._index.write_meta(meta)
        elif stored != meta:
            raise InvalidArgument(
                f"nvme tier {self.config.path} was created with {stored}, this config gives {meta}; "
                "start with the same file_bytes or an empty directory"
            )

    def _check_writable(self) -> None:
        if self._closed:
            raise ServiceError(f"nvme tier {self.config.path} is closed")
        if self._index.failed is not None:
            raise type(self._index.failed)(self._index.failed.message)

    def _lookup_locked(self, key: bytes) -> NvmeRecord | None:
        known, record = self._journal.lookup(key)
        if known:
            return record
        value = self._index.get(key)
        return None if value is None else NvmeRecord.decode(value)

    def _reserve(self, key: bytes, size: int) -> tuple[int, Extent] | NvmePut:
        """An extent for a new object, or the NvmePut of the stored one (dedup). Marks key
        busy, so puts and synced deletes of it wait for this put."""
        for attempt in range(2):
            with self._cond:
                self._check_writable()
                while key in self._busy:
                    self._cond.wait()
                existing = self._lookup_locked(key)
                if existing is not None:
                    self._counters["num_dedup_puts"] += 1
                    durability = "group" if self._journal.is_pending(key) else "sync"
                    return NvmePut(existing.file, existing.extent, existing.size, durability, True)
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
        f = self._files[file]
        try:
            digest, blocks = write_object(f, extent.offset, view)
            if not self._group:
                f.barrier.sync(f.barrier.ticket())
        except OSError as e:
            self._count("num_io_errors")
            raise io_error(e, f"writing {len(view)} bytes at offset {extent.offset} of", f.path) from None
        if digest != checksum:
            self._count("num_put_checksum_mismatches")
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
            record = self._lookup_locked(key)
            if record is None or (expect is not None and (record.file, record.offset) != (expect.file, expect.offset)):
                return False
            self._num_objects -= 1
            self._num_bytes -= record.size
            self._counters["num_deletes"] += 1
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
            self._counters["reads"] += 1
            record = self._lookup_locked(key)
            if record is None:
                self._counters["misses"] += 1
                return None
            self._extents.pin(record)
            return record

    def _end_read(self, record: NvmeRecord) -> None:
        with self._lock:
            self._extents.unpin(record)

    def _io(self, fn, record: NvmeRecord, *args):
        f = self._files[record.file]
        try:
            return fn(f, record.offset, *args)
        except OSError as e:
            self._count("num_io_errors")
            raise io_error(e, f"reading {record.size} bytes at offset {record.offset} of", f.path) from None

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _hit(self, nbytes: int) -> int:
        with self._lock:
            self._counters["hits"] += 1
            self._counters["bytes_out"] += nbytes
        return nbytes

    def _checksum_failed(self, key: bytes, record: NvmeRecord) -> None:
        with self._lock:
            self._counters["num_checksum_failures"] += 1
            self._counters["misses"] += 1
        namespace, object_id = split_key(key)
        _log.warning(
            "nvme tier %s: object %s/%s failed its checksum (file %d, offset %d, %d bytes); dropped, served as a miss",
            self.config.path, namespace, object_id.hex, record.file, record.offset, record.size,
        )
        try:
            self._delete(key, expect=record)
        except ServiceError as e:
            _log.error("nvme tier %s: could not drop the corrupt object: %s", self.config.path, e.message)

    def _close_files(self, remove_created: bool = False) -> None:
        for f in self._files:
            os.close(f.fd)
            if remove_created and f.created:
                os.unlink(f.path)
        self._files = []
        self._index.close()


def _meta(namespace: str, object_id: ObjectId, record: NvmeRecord, durability: str) -> NvmeMeta:
    return NvmeMeta(
        namespace, object_id, record.size, record.checksum, StateDescriptor.from_wire(record.descriptor),
        Hints.from_wire(record.hints), record.created_at, record.file, record.extent, durability,
    )
