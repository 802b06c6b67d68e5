"""Per-client limits of the local protocol: leases held, and bytes reserved but not committed.

One client (a connection) cannot take the whole arena by reserving and never committing, nor
exhaust the lease table: `[limits] max_leases_per_client` and `max_inflight_bytes_per_client`.
"""

from __future__ import annotations

from kvstore.config import LimitsConfig
from kvstore.errors import LimitExceeded
from kvstore.tiers.leases import LeaseTable, Owner


class ClientQuotas:
    def __init__(self, limits: LimitsConfig, leases: LeaseTable):
        self.limits = limits
        self.leases = leases
        self.inflight_bytes: dict[Owner, int] = {}  # owner -> bytes of its reserved, uncommitted puts

    def check_lease(self, owner: Owner) -> None:
        """LimitExceeded if `owner` may not take one more lease."""
        limit = self.limits.max_leases_per_client
        if self.leases.count(owner) >= limit:
            raise LimitExceeded(
                f"this client holds {limit} leases (limits.max_leases_per_client); release some first"
            )

    def check_reserve(self, owner: Owner, size: int) -> None:
        """LimitExceeded if reserving `size` more bytes would take `owner` over its limit."""
        limit = self.limits.max_inflight_bytes_per_client
        held = self.inflight_bytes.get(owner, 0)
        if held + size > limit:
            raise LimitExceeded(
                f"reserving {size} bytes would bring this client's uncommitted puts to {held + size} bytes, over "
                f"limits.max_inflight_bytes_per_client ({limit}); commit or abort some first"
            )

    def room(self, owner: Owner) -> tuple[int, int]:
        """(leases, bytes) `owner` may still take before check_lease / check_reserve refuse."""
        limits = self.limits
        return (limits.max_leases_per_client - self.leases.count(owner),
                limits.max_inflight_bytes_per_client - self.inflight_bytes.get(owner, 0))

    def reserved(self, owner: Owner, size: int) -> None:
        self.inflight_bytes[owner] = self.inflight_bytes.get(owner, 0) + size

    def settled(self, owner: Owner, size: int) -> None:
        """A reservation ended (committed, aborted, or its lease expired)."""
        left = self.inflight_bytes.pop(owner) - size
        if left:
            self.inflight_bytes[owner] = left

    def check_integrity(self, reserved: dict) -> None:
        """reserved: owner -> bytes of the puts pending under its write leases."""
        if reserved != self.inflight_bytes:
            raise RuntimeError(f"uncommitted bytes per client: {self.inflight_bytes} counted, {reserved} reserved")
