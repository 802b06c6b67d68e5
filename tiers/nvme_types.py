"""The records the NVMe tier hands back (NvmePut, NvmeMeta). Its configuration is
`kvstore.config.NvmeTierConfig`, the daemon's `[nvme]` table."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from tiers.allocator import Extent

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
