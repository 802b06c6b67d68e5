"""What the client's put and lookup calls answer (reads answer leases: client/lease.py)."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import KVStoreError
from kvstore.identity import ObjectId


@dataclass(frozen=True, slots=True)
class PutResult:
    object_id: ObjectId
    existed: bool  # the daemon already held this id; nothing was copied
    tier: str | None = None
    durability: str | None = None  # "memory" in the host tier
    error: KVStoreError | None = None  # put_many only: this item failed
    homes: tuple = ()  # tier="remote" puts: the object's home nodes (none for a Mooncake pool)


@dataclass(frozen=True, slots=True)
class LookupResult:
    hits: int  # leading keys that hit
    tiers: tuple  # per key: "host", ... or None for a miss
    hit_bytes: int  # bytes of the leading hits
    est_load_s: float  # estimated time to load the leading hits
