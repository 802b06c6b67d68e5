"""The records the NVMe tier hands back (NvmePut, NvmeMeta) and counts (NvmeCounters). Its
configuration is `kvstore.config.NvmeTierConfig`, the daemon's `[nvme]` table."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.tiers.allocator import Extent
from kvstore.tiers.nvme.index import NvmeRecord

CHECKSUM_BYTES = 16  # xxh3-128


@dataclass(frozen=True, slots=True)
class NvmePut:
    """Where a put landed and how durable it is: "sync" = on disk and indexed when put
    returned; "group" = readable now, durable at the next group commit."""

    file: int
    extent: Extent
    size: int
    durability: str
    deduplicated: bool = False  # the id was already stored; nothing was written


@dataclass(frozen=True, slots=True)
class NvmeMeta:
    """What the index says about one object (list, meta)."""

    namespace: str
    object_id: ObjectId
    size: int
    checksum: bytes
    descriptor: StateDescriptor
    hints: Hints
    created_at: float
    file: int
    extent: Extent
    durability: str  # "sync" once durable, "group" while waiting for its group commit

    @classmethod
    def of(cls, namespace: str, object_id: ObjectId, record: NvmeRecord, durability: str) -> NvmeMeta:
        return cls(
            namespace, object_id, record.size, record.checksum, StateDescriptor.from_wire(record.descriptor),
            Hints.from_record(record.hints), record.created_at, record.file, record.extent, durability,
        )


@dataclass(slots=True)
class NvmeCounters:
    """What stats() reports besides sizes, in its order. The tier's lock guards every change."""

    reads: int = 0
    writes: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    num_checksum_failures: int = 0
    num_dedup_puts: int = 0
    num_deletes: int = 0
    num_io_errors: int = 0
    num_put_checksum_mismatches: int = 0
