"""Who holds each allocated extent of the NVMe tier's data files.

An extent is allocated while any of these holds it:
    indexed      an index entry (or a waiting group commit) points at it
    reserved     a put is writing it
    doomed       its entry is deleted but the delete is not durable yet (group_commit.py)
    deleting     a synced delete of its entry is in flight
    read         a read is in flight: a deleted extent is freed when the last read ends
    quarantined  an index write for it failed; whether the entry reached the WAL is unknown,
                 so it stays allocated until a restart rebuilds the maps from the index
Only the first is known to the index; the others live here, so check_integrity can account
for every allocated byte.

One ExtentAllocator per data file, first-fit over the files in order. Not thread-safe: the
tier's lock is held around every call.
"""

from __future__ import annotations

from collections import Counter

from kvstore.tiers.allocator import Extent, ExtentAllocator
from kvstore.tiers.nvme.files import ALIGN
from kvstore.tiers.nvme.index import NvmeRecord

Where = tuple[int, int]  # (file, offset)


class ExtentOwners:
    def __init__(self, allocators: list[ExtentAllocator]):
        self.allocators = allocators
        self._reserved: dict[Where, Extent] = {}
        self._readers: Counter = Counter()
        self._deferred: dict[Where, Extent] = {}
        self._quarantined: dict[Where, Extent] = {}
        self._deleting: dict[bytes, NvmeRecord] = {}

    # -- puts ---------------------------------------------------------------------------------

    def reserve(self, size: int) -> tuple[int, Extent] | None:
        for file, allocator in enumerate(self.allocators):
            if allocator.can_alloc(size):
                extent = allocator.alloc(size)
                self._reserved[(file, extent.offset)] = extent
                return file, extent
        return None

    def settle(self, file: int, extent: Extent, outcome: str) -> None:
        """End a reservation: "indexed" (its entry now accounts for it), "failed" (freed) or
        "quarantined"."""
        del self._reserved[(file, extent.offset)]
        if outcome == "failed":
            self.allocators[file].free(extent)
        elif outcome == "quarantined":
            self._quarantined[(file, extent.offset)] = extent

    # -- deletes and reads --------------------------------------------------------------------

    def start_delete(self, key: bytes, record: NvmeRecord) -> None:
        self._deleting[key] = record

    def end_delete(self, key: bytes) -> None:
        del self._deleting[key]

    def release(self, record: NvmeRecord) -> None:
        """The entry of record is gone for good: free its extent, or once its reads end."""
        where = (record.file, record.offset)
        if self._readers[where]:
            self._deferred[where] = record.extent
        else:
            self.allocators[record.file].free(record.extent)

    def pin(self, record: NvmeRecord) -> None:
        self._readers[(record.file, record.offset)] += 1

    def unpin(self, record: NvmeRecord) -> None:
        where = (record.file, record.offset)
        self._readers[where] -= 1
        if not self._readers[where]:
            del self._readers[where]
            extent = self._deferred.pop(where, None)
            if extent is not None:
                self.allocators[record.file].free(extent)

    # -- accounting ---------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(a.used_bytes for a in self.allocators)

    @property
    def largest_free_bytes(self) -> int:
        return max((a.largest_free_bytes for a in self.allocators), default=0)

    def unindexed(self) -> list[Where]:
        """Allocated extents that no index entry accounts for (doomed ones aside)."""
        return [
            *self._reserved, *self._deferred, *self._quarantined,
            *((r.file, r.offset) for r in self._deleting.values()),
        ]

    def check_integrity(self, indexed: dict[bytes, NvmeRecord], doomed: list[NvmeRecord], file_bytes: list[int]) -> None:
        """Raise RuntimeError unless the allocators hold exactly the extents of `indexed`
        (every record a reader sees, by key), `doomed` and unindexed(), and each indexed one
        lies aligned inside its data file (`file_bytes`: their sizes) and is allocated."""
        for allocator in self.allocators:
            allocator.check_integrity()
        owners = Counter((r.file, r.offset) for r in [*indexed.values(), *doomed]) + Counter(self.unindexed())
        for (file, offset), n in owners.items():
            if n > 1:
                raise RuntimeError(f"extent at file {file} offset {offset} has {n} owners")
        allocated = sum(a.num_allocated for a in self.allocators)
        if allocated != len(owners):
            raise RuntimeError(
                f"allocators hold {allocated} extents; the index and the operations in flight "
                f"account for {len(owners)}"
            )
        for key, r in indexed.items():
            if r.file >= len(file_bytes) or r.offset % ALIGN or r.offset + r.extent.length > file_bytes[r.file]:
                raise RuntimeError(f"index entry {key.hex()} lies outside its data file: {r}")
            if not self.allocators[r.file].is_allocated(r.extent):
                raise RuntimeError(f"index entry {key.hex()} points at an extent the allocator holds free: {r}")
