"""The Ledger: who holds what, and how much. Leases, the puts pending under write leases,
and each client's quotas, in one place with its own surface.

A write lease holds an extent reserved for a put until it is committed (`take_put`) or
ended; a read lease holds what a get leased: a host entry (a reader on it), a device copy
(released through the callable the grant was given), or a transient extent of fetched
ranges (freed). Ending a lease undoes exactly what its grant did, whichever way it ends:
released, aborted, its client gone (`drop_owner`), or expired (`expire`).

The tier manager (server/tiering/manager.py) decides what to lease; the Ledger keeps the
books and checks them (`check_integrity`). Runs on the daemon's event loop thread only.
"""

from __future__ import annotations

import logging
from typing import Callable

from kvstore.config import LimitsConfig
from kvstore.errors import NotFound
from kvstore.identity import ObjectId
from kvstore.server.tiering.host import HostTier, Namespace
from kvstore.server.tiering.objects import ObjectEntry, PendingPut
from kvstore.server.tiering.quotas import ClientQuotas
from kvstore.tiers.allocator import Extent
from kvstore.tiers.leases import Lease, LeaseTable, Owner

log = logging.getLogger("kvstore.tiers")


class Ledger:
    def __init__(self, host: HostTier, limits: LimitsConfig):
        """host: the tier whose extents and entries the leases hold; the `[limits]` table."""
        self.host = host
        self.clock = host.clock
        self.ttl_s = limits.lease_ttl_s
        self._leases = LeaseTable()
        self._quotas = ClientQuotas(limits, self._leases)
        self._pending: dict[int, PendingPut] = {}  # write lease id -> reserved put
        self._reading: dict[int, ObjectEntry] = {}  # read lease id -> entry it covers
        self._ranged: dict[int, tuple[Namespace, Extent]] = {}  # read lease id -> transient extent of fetched ranges
        self._on_gpu: dict[int, Callable[[], None]] = {}  # read lease id -> what releases its device copy

    # --- quotas -----------------------------------------------------------------

    def check_lease(self, owner: Owner) -> None:
        """LimitExceeded if `owner` may not take one more lease."""
        self._quotas.check_lease(owner)

    def check_reserve(self, owner: Owner, size: int) -> None:
        """LimitExceeded if reserving `size` more bytes would take `owner` over its limit."""
        self._quotas.check_reserve(owner, size)

    def room(self, owner: Owner) -> tuple[int, int]:
        """(leases, bytes) `owner` may still take before the checks above refuse."""
        return self._quotas.room(owner)

    def count(self, owner: Owner) -> int:
        """Leases `owner` holds."""
        return self._leases.count(owner)

    def __len__(self) -> int:
        return len(self._leases)

    # --- writes -----------------------------------------------------------------

    def grant_write(self, owner: Owner, put: PendingPut, now: float | None = None) -> int:
        """A write lease on the put's reserved extent, its bytes counted against the owner's
        quota until it is taken or ends; its id. `now`: the clock read once for a batch."""
        lease = self._leases.grant(owner, None, put.extent, "write", self.ttl_s, self.clock() if now is None else now)
        self._pending[lease.lease_id] = put
        self._quotas.reserved(owner, put.size)
        return lease.lease_id

    def grant_writes(self, owner: Owner, puts: list[PendingPut], now: float) -> list[int]:
        """grant_write of each put, the clock read once for the batch; their lease ids."""
        ids = self._leases.grant_writes(owner, [put.extent for put in puts], self.ttl_s, now)
        self._pending.update(zip(ids, puts))
        self._quotas.reserved(owner, sum(put.size for put in puts))
        return ids

    def pending_put(self, lease_id: int) -> PendingPut:
        """The put a write lease reserved (check the lease with own_lease first)."""
        return self._pending[lease_id]

    def _owned(self, owner: Owner, lease_id: int, mode: str) -> Lease | None:
        """`owner`'s lease `lease_id` of `mode`, or None: the one ownership rule."""
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.owner == owner and lease.mode == mode else None

    def own_put(self, owner: Owner, lease_id: int) -> PendingPut | None:
        """The put of `owner`'s write lease `lease_id`; None if it holds no such lease."""
        return self._pending.get(lease_id) if self._owned(owner, lease_id, "write") else None

    def take_put(self, owner: Owner, lease_id: int) -> PendingPut:
        """End a write lease whose bytes are written: its put, extent still allocated."""
        put = self._pending.pop(lease_id)
        self._quotas.settled(owner, put.size)
        self._leases.release(lease_id)
        return put

    def take_puts(self, owner: Owner, lease_ids: list[int]) -> list[PendingPut]:
        """take_put of many of `owner`'s write leases (each checked: own_put)."""
        pending, release = self._pending, self._leases.release
        puts = [pending.pop(lease_id) for lease_id in lease_ids]
        for lease_id in lease_ids:
            release(lease_id)
        self._quotas.settled(owner, sum(put.size for put in puts))
        return puts

    # --- reads ------------------------------------------------------------------

    def grant_read(self, owner: Owner, entry: ObjectEntry, on_gpu: Extent | None = None,
                   release_gpu: Callable[[], None] | None = None) -> int:
        """A read lease on a host entry (a reader on it until the lease ends), or on its device
        copy `on_gpu` (release_gpu() when the lease ends); its id."""
        oid = entry.object_id
        lease = self._leases.grant(owner, oid, entry.extent if on_gpu is None else on_gpu, "read", self.ttl_s,
                                   self.clock())
        if on_gpu is not None:
            self._on_gpu[lease.lease_id] = release_gpu
        else:
            self._reading[lease.lease_id] = entry
            entry.readers += 1
        return lease.lease_id

    def grant_ranged(self, owner: Owner, ns: Namespace, oid: ObjectId, extent: Extent) -> int:
        """A read lease on a transient extent holding some ranges of `oid` (never indexed),
        freed when the lease ends; its id."""
        self._quotas.check_lease(owner)
        lease = self._leases.grant(owner, oid, extent, "read", self.ttl_s, self.clock())
        self._ranged[lease.lease_id] = (ns, extent)
        return lease.lease_id

    # --- ending -----------------------------------------------------------------

    def own_lease(self, owner: Owner, lease_id: int, mode: str) -> Lease:
        """`owner`'s lease `lease_id` of `mode`; NotFound if it holds no such lease."""
        lease = self._owned(owner, lease_id, mode)
        if lease is None:
            raise NotFound(f"no {mode} lease {lease_id} held by this client (expired or already released)")
        return lease

    def end(self, owner: Owner, lease_id: int, mode: str) -> None:
        """Release (a read) or abort (a write) `owner`'s lease: NotFound if it holds none."""
        self.own_lease(owner, lease_id, mode)
        self._undo(self._leases.release(lease_id))

    def drop_owner(self, owner: Owner) -> int:
        """A client went away: end every lease it held. Returns how many."""
        leases = self._leases.release_owner(owner)
        for lease in leases:
            self._undo(lease)
        return len(leases)

    def expire(self) -> None:
        """End every lease past its ttl (logged: a client that forgot one, or died slowly)."""
        for lease in self._leases.expired(self.clock()):
            log.warning("event=lease_expired lease=%d owner=%s mode=%s", lease.lease_id, lease.owner, lease.mode)
            self._undo(lease)

    def _undo(self, lease: Lease) -> None:
        """Undo what a lease holds: a write lease frees its extent, a read lease drops a reader."""
        if lease.mode == "write":
            put = self._pending.pop(lease.lease_id)
            self._quotas.settled(lease.owner, put.size)
            self.host.namespace(put.namespace).arena.free(put.extent)
            return
        release_gpu = self._on_gpu.pop(lease.lease_id, None)
        if release_gpu is not None:
            release_gpu()
            return
        ranged = self._ranged.pop(lease.lease_id, None)
        if ranged is not None:
            self.host.track_transient(ranged[0], ranged[1], add=False)
            ranged[0].arena.free(ranged[1])
            return
        self.host.drop_reader(self._reading.pop(lease.lease_id))

    # --- checks -----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the leases, the quotas, the pending puts and the host tier's
        readers and extents disagree."""
        self._leases.check_integrity()
        reserved: dict = {}
        for lease_id, put in self._pending.items():
            lease = self._leases.get(lease_id)
            owner = None if lease is None else lease.owner  # None: a reservation without its lease
            reserved[owner] = reserved.get(owner, 0) + put.size
        self._quotas.check_integrity(reserved)
        self.host.check_integrity([(p.namespace, p.extent) for p in self._pending.values()])
        if set(self._reading) & set(self._ranged):
            raise RuntimeError("a read lease is both a whole-object lease and a ranged one")
        for lease_id, (ns, extent) in self._ranged.items():
            lease = self._leases.get(lease_id)
            if lease is None or lease.mode != "read" or not self.host.holds_transient(ns, extent):
                raise RuntimeError(f"ranged lease {lease_id}: no read lease, or its extent is not accounted for")
        if sum(1 for lease in self._leases if lease.mode == "read") != len(self._reading) + len(self._ranged) + len(self._on_gpu):
            raise RuntimeError("read leases and the leases the ledger tracks disagree")
        readers = self.host.readers()
        if readers != len(self._reading) + self.host.num_holds:
            raise RuntimeError(f"{readers} readers counted on entries, {len(self._reading)} read leases "
                               f"and {self.host.num_holds} daemon holds")
