"""What the NVMe index holds after a restart, gathered in recovery's one scan of it, for the
daemon's own index of NVMe objects (server/tiering/nvme_mover.py: TierMover.open).

Building that index from `NvmeTier.list()` decoded every record (descriptor and hints
included) and kept all of them at once: about 15 us and 1 KB of daemon memory per object,
150 s and 10 GB for 10 M objects. Here recovery keeps each good record's raw key, size and
creation time (sizes and times in numpy), and the daemon's index is built from them in bulk,
keyed by these very key objects: a (namespace, digest) pair per object cost 10 M objects
~1.3 GB more and 3.6 s to make.

    key     u16_be(len(ns)) || ns || 32-byte id   (tiers/nvme/index.py)
    size    the record head's fixed-width size
    created the record's last field: msgpack float64, 0xcb then 8 bytes big-endian; records
            are written with created_at last (NvmeRecord.encode). A tail that is not one
            reads as 0.0 (oldest).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_TAIL = 9  # 0xcb, then the float64
_FLOAT64 = 0xCB


def created_at_of(values: list[bytes], picked: list[int]) -> np.ndarray:
    """created_at of values[i] for i in picked (wall clock seconds; 0.0 where unreadable)."""
    tails = np.fromiter((values[i][-_TAIL:] for i in picked), dtype=f"S{_TAIL}", count=len(picked))
    raw = tails.view(np.uint8).reshape(-1, _TAIL)
    times = np.ascontiguousarray(raw[:, 1:]).view(">f8").reshape(-1).astype(np.float64)
    good = (raw[:, 0] == _FLOAT64) & np.isfinite(times)
    return np.where(good, times, 0.0)


@dataclass(slots=True)
class Holdings:
    keys: list[bytes]  # index keys, in index order
    sizes: np.ndarray  # int64, one per key
    created_at: np.ndarray  # float64 wall clock, one per key

    def by_age(self) -> tuple[list[bytes], list[int]]:
        """(index keys, sizes), oldest first: the order an eviction policy should learn them
        in. Index order breaks ties. The keys are the ones recovery read, not copies: the
        daemon's index of NVMe objects keeps them (10 M of them: ~0.8 GB)."""
        order = np.argsort(self.created_at, kind="stable")
        keys = np.fromiter(self.keys, dtype=object, count=len(self.keys))[order].tolist()
        return keys, self.sizes[order].tolist()


class HoldingsBuilder:
    """Recovery adds each chunk's good records; `build` leaves out what it dropped later."""

    def __init__(self):
        self._keys: list[bytes] = []
        self._sizes: list[np.ndarray] = []
        self._created: list[np.ndarray] = []

    def add(self, keys: list[bytes], values: list[bytes], goods: np.ndarray, sizes: np.ndarray) -> None:
        """goods: indexes of the good records in keys/values; sizes: their sizes."""
        picked = goods.tolist()
        self._keys += map(keys.__getitem__, picked)
        self._sizes.append(np.asarray(sizes, dtype=np.int64))
        self._created.append(created_at_of(values, picked))

    def build(self, dropped: set[bytes]) -> Holdings:
        """The holdings, without the keys in `dropped` (records recovery dropped after the scan)."""
        keys = self._keys
        sizes = np.concatenate(self._sizes) if self._sizes else np.zeros(0, np.int64)
        created = np.concatenate(self._created) if self._created else np.zeros(0, np.float64)
        self._keys, self._sizes, self._created = [], [], []
        if dropped:
            kept = np.fromiter((key not in dropped for key in keys), dtype=bool, count=len(keys))
            keys = [key for key, keep in zip(keys, kept.tolist()) if keep]
            sizes, created = sizes[kept], created[kept]
        return Holdings(keys, sizes, created)
