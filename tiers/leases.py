"""LeaseTable: who may read or write which extent, and until when. Bookkeeping only, no I/O.

A write lease covers an extent reserved for a put until it commits; a read lease covers a
committed object's extent while a client copies it out. The daemon never evicts, moves or
frees an extent under a lease; it asks `readers(key)` before it does. Leases end on release,
on the owner's disconnect (`release_owner`), or on timeout (`expired`). Ending a lease here only
removes the record: the caller decides what happens to the extent (free an uncommitted write
extent, let a read extent become evictable again).

Times are monotonic seconds passed in by the caller, so tests control the clock.
Not thread-safe: the daemon's event loop thread is the only caller.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.errors import InvalidArgument, NotFound

if TYPE_CHECKING:
    from kvstore.tiers.allocator import Extent

MODES = ("read", "write")


# Who holds a lease: the local service's connection id (any hashable in tests); every
# lease of an owner ends when it disconnects.
Owner = Hashable

@dataclass(frozen=True, slots=True)
class Lease:
    """One lease. `owner` is the connection id; `key` the object key (None allowed only for a
    write lease on a reservation that has no key yet)."""

    lease_id: int
    owner: Hashable
    key: Hashable | None
    extent: Extent
    mode: str
    expires_at: float

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgument(f"lease mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "read" and self.key is None:
            raise InvalidArgument("a read lease needs the key of the object it reads")
        if type(self.lease_id) is not int or self.lease_id <= 0:
            raise InvalidArgument(f"lease_id must be a positive int, got {self.lease_id!r}")
        if not math.isfinite(self.expires_at):
            raise InvalidArgument(f"expires_at must be finite, got {self.expires_at!r}")


class LeaseTable:
    """All live leases of one tier, indexed by id, owner, key (readers) and expiry."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        self._by_owner: dict[Hashable, dict[int, None]] = {}  # dict: ordered set, grant order
        self._readers: dict[Hashable, int] = {}
        self._expiry: list[tuple[float, int]] = []  # heap; entries of released leases linger
        self._last_id = 0

    def grant(
        self, owner: Hashable, key: Hashable | None, extent: Extent, mode: str, ttl_s: float, now: float
    ) -> Lease:
        """Record a new lease that expires at now + ttl_s. Ids increase and are never reused,
        so a stale id from a dead client can never release someone else's lease."""
        if not (isinstance(ttl_s, (int, float)) and 0 < ttl_s < math.inf):
            raise InvalidArgument(f"lease ttl_s must be a positive finite number, got {ttl_s!r}")
        try:
            hash(owner), hash(key)
        except TypeError:
            raise InvalidArgument("lease owner and key must be hashable") from None
        lease = Lease(self._last_id + 1, owner, key, extent, mode, now + ttl_s)
        self._last_id = lease.lease_id
        self._leases[lease.lease_id] = lease
        self._by_owner.setdefault(owner, {})[lease.lease_id] = None
        if mode == "read":
            self._readers[key] = self._readers.get(key, 0) + 1
        heapq.heappush(self._expiry, (lease.expires_at, lease.lease_id))
        return lease

    def grant_writes(self, owner: Hashable, extents: list[Extent], ttl_s: float, now: float) -> list[int]:
        """grant() of a write lease on each extent, all expiring at now + ttl_s; their ids."""
        if not extents:
            return []
        first = self.grant(owner, None, extents[0], "write", ttl_s, now)  # (checks the arguments once)
        ids = list(range(first.lease_id + 1, first.lease_id + len(extents)))
        expires_at = first.expires_at
        self._leases.update((i, Lease(i, owner, None, extent, "write", expires_at)) for i, extent in zip(ids, extents[1:]))
        self._by_owner[owner].update(dict.fromkeys(ids))
        push, heap = heapq.heappush, self._expiry
        for i in ids:
            push(heap, (expires_at, i))
        self._last_id = first.lease_id + len(ids)
        return [first.lease_id, *ids]

    def release(self, lease_id: int) -> Lease:
        """End a lease and return it. An unknown (or already ended) id raises NotFound."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id!r} does not exist (released, expired, or never granted)")
        self._drop(lease)
        return lease

    def get(self, lease_id: int) -> Lease | None:
        """The live lease with this id, or None."""
        return self._leases.get(lease_id)

    def release_owner(self, owner: Hashable) -> list[Lease]:
        """End every lease of one owner (a client that disconnected), in grant order."""
        ids = self._by_owner.get(owner, {})
        leases = [self._leases[i] for i in ids]
        for lease in leases:
            self._drop(lease)
        return leases

    def expired(self, now: float) -> list[Lease]:
        """End and return every lease with expires_at <= now, soonest first."""
        ended = []
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.get(lease_id)
            if lease is not None:
                self._drop(lease)
                ended.append(lease)
        return ended

    def readers(self, key: Hashable) -> int:
        """How many read leases are live on key. O(1)."""
        return self._readers.get(key, 0)

    def count(self, owner: Hashable) -> int:
        """How many leases owner holds (for per-client limits)."""
        return len(self._by_owner.get(owner, ()))

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def __iter__(self):
        """The live leases (do not grant or end leases while iterating)."""
        return iter(self._leases.values())

    def check_integrity(self) -> None:
        """Raise RuntimeError describing the first index that disagrees with the leases."""
        by_owner: dict[Hashable, set[int]] = {}
        readers: dict[Hashable, int] = {}
        for lease_id, lease in self._leases.items():
            if lease.lease_id != lease_id or lease_id > self._last_id:
                raise RuntimeError(f"lease {lease_id} is filed under the wrong id")
            by_owner.setdefault(lease.owner, set()).add(lease_id)
            if lease.mode == "read":
                readers[lease.key] = readers.get(lease.key, 0) + 1
        if {o: set(ids) for o, ids in self._by_owner.items()} != by_owner:
            raise RuntimeError("owner index disagrees with the live leases (empty or stale entry)")
        if self._readers != readers:
            raise RuntimeError(f"reader counts {self._readers} != leases' {readers}")
        queued = {lease_id for _, lease_id in self._expiry}
        if not queued >= self._leases.keys():
            raise RuntimeError(f"leases {sorted(self._leases.keys() - queued)} will never expire")

    def _drop(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        ids = self._by_owner[lease.owner]
        del ids[lease.lease_id]
        if not ids:
            del self._by_owner[lease.owner]
        if lease.mode == "read":
            left = self._readers[lease.key] - 1
            if left:
                self._readers[lease.key] = left
            else:
                del self._readers[lease.key]
        # Released leases leave their heap entry behind; rebuild once they are the majority so
        # short-lived leases with long ttls cannot grow the heap without bound.
        if len(self._expiry) > 2 * len(self._leases) + 64:
            self._expiry = [(live.expires_at, i) for i, live in self._leases.items()]
            heapq.heapify(self._expiry)
