"""What the NVMe tier holds: its table (server/tiering/nvme_table.py: sizes and eviction order)
and the deadlines of the objects put with a TTL (server/tiering/nvme_deadlines.py), and the
lookups over them: whether NVMe holds an object, its size, the keys it holds.

Apart from the mover (server/tiering/nvme_mover.py: TierMover, which fills it as copies come
and go) because it is what NVMe serves to the tiers around it without I/O: lookups, the remote
tier's peers and re-homing, and the host tier, whose departures ask whether NVMe keeps an
object. Event loop only.
"""

from __future__ import annotations

import time

import numpy as np

from kvstore.identity import ID_BYTES
from kvstore.server.tiering.nvme_deadlines import NvmeDeadlines
from kvstore.server.tiering.nvme_table import NvmeTable
from kvstore.tiers.nvme.index import key_parts, namespace_prefix


class NvmeHeld:
    """What NVMe holds and the lookups over it (module docstring); the mover fills it."""

    def __init__(self, capacity_bytes: int):
        # What NVMe holds, and its eviction order: numpy columns keyed by the NVMe index's own
        # keys (~64 B per object; Python objects per key cost ~190 B: server/tiering/nvme_table.py).
        self.policy = NvmeTable(capacity_bytes)
        self.deadlines = NvmeDeadlines()  # of the objects put with a TTL

    @staticmethod
    def key(namespace: str, oid) -> bytes:  # the table's key of an id (or digest): its NVMe index key
        return namespace_prefix(namespace) + oid

    def holds(self, namespace: str, oid) -> bool:
        """NVMe holds `oid` and it is not past its TTL (an expired one is a miss at once)."""
        key = self.key(namespace, oid)
        return key in self.policy and not self.expired(key)

    def expired(self, key: bytes) -> bool:
        return bool(self.deadlines) and self.deadlines.expired(key, time.time())

    def size_of(self, namespace: str, oid) -> int | None:
        """Size on NVMe of `oid` (an ObjectId or its raw digest), None if NVMe lacks it."""
        key = self.key(namespace, oid)
        return None if self.expired(key) else self.policy.size_of(key)

    def sizes_of(self, namespace: str, oids: list) -> list[int | None]:  # probed together when many
        if len(oids) < 16:
            return [self.size_of(namespace, oid) for oid in oids]
        ids = np.frombuffer(b"".join(oids), np.uint8).reshape(-1, ID_BYTES)
        sizes = [size or None for size in self.policy.sizes_of(namespace_prefix(namespace), ids).tolist()]
        if self.deadlines:
            sizes = [None if size and self.expired(self.key(namespace, oid)) else size
                     for size, oid in zip(sizes, oids)]
        return sizes

    def in_table(self, namespace: str, oids: list, keys: list[bytes]) -> list[bool]:
        """Per id whether the table holds it, past its TTL or not (probed together when many)."""
        if len(oids) < 16:
            return [key in self.policy for key in keys]
        ids = np.frombuffer(b"".join(oids), np.uint8).reshape(-1, ID_BYTES)
        return (self.policy.sizes_of(namespace_prefix(namespace), ids) > 0).tolist()

    def keys(self) -> list[tuple[str, bytes]]:  # (namespace, digest) of every object NVMe holds: a copy
        return list(map(key_parts, self.policy.keys()))

    @property
    def used_bytes(self) -> int:  # bytes of the objects NVMe holds
        return self.policy.tracked_bytes

    def check_integrity(self) -> None:
        self.policy.check_integrity()
        self.deadlines.check_integrity(lambda key: key in self.policy)
