"""The NVMe tier's configuration and the records it hands back (NvmePut, NvmeMeta)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from tiers.allocator import Extent
from tiers.nvme_io import ALIGN

DURABILITIES = ("sync", "group")
CHECKSUM_BYTES = 16  # xxh3-128


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """Where the tier lives and how much of the disk it takes (all of it preallocated)."""

    path: str
    capacity_bytes: int
    file_bytes: int = 1 << 30
    durability: str = "sync"
    group_commit_ms: float = 5.0
    io_threads: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise InvalidArgument(f"nvme path must be a non-empty string, got {self.path!r}")
        for name in ("capacity_bytes", "file_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0 or value % ALIGN:
                raise InvalidArgument(f"nvme {name} must be a positive multiple of {ALIGN}, got {value!r}")
        if self.durability not in DURABILITIES:
            raise InvalidArgument(f"nvme durability must be one of {DURABILITIES}, got {self.durability!r}")
        ms = self.group_commit_ms
        if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not math.isfinite(ms) or not 0 < ms <= 10_000:
            raise InvalidArgument(f"nvme group_commit_ms must be in (0, 10000], got {ms!r}")
        if type(self.io_threads) is not int or not 1 <= self.io_threads <= 256:
            raise InvalidArgument(f"nvme io_threads must be an int in 1..256, got {self.io_threads!r}")

    def file_sizes(self) -> list[int]:
        """Sizes of the data files: file_bytes each, the last one holds the remainder."""
        full, rest = divmod(self.capacity_bytes, self.file_bytes)
        return [self.file_bytes] * full + ([rest] if rest else [])


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
