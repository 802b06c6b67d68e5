"""One namespace of the host tier: its arena, index and policy, and the counters behind its stats.

The host tier (server/tiering/host.py) owns every Namespace and changes it on the daemon's
event loop thread only.
"""

from __future__ import annotations

import ctypes
from dataclasses import InitVar, dataclass, field

from kvstore.server.tiering.group_index import GroupIndex
from kvstore.server.tiering.object_table import ObjectTable
from kvstore.server.tiering.row_policy import RowPolicy, make_row_policy
from kvstore.server.tiering.shared_index import NO_SHARED_INDEX, NoSharedIndex, SharedIndex
from kvstore.tiers.arena import HostArena


@dataclass(slots=True)
class TierCounters:
    num_puts: int = 0
    num_dedup_puts: int = 0
    num_gets: int = 0
    num_hits: int = 0
    num_misses: int = 0
    num_evictions: int = 0
    num_expired: int = 0
    num_deletes: int = 0
    num_checksum_failures: int = 0
    num_shared_hits: int = 0  # hits clients resolved from the shared index (in num_hits too)
    num_group_puts: int = 0  # store groups committed (kvstore/groups.py; their objects are in num_puts)
    bytes_in: int = 0
    bytes_out: int = 0


def give_back_heap() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim); a no-op elsewhere."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


@dataclass(slots=True)
class Namespace:
    name: str
    arena: HostArena
    policy_name: InitVar[str]  # kvstore/policy: POLICIES
    objects: ObjectTable = field(init=False)  # the index: id -> entry, as columns
    policy: RowPolicy = field(init=False)  # over the rows of `objects`
    counters: TierCounters = field(default_factory=TierCounters)
    shared: SharedIndex | NoSharedIndex = NO_SHARED_INDEX  # what clients read without asking
    groups: GroupIndex = field(default_factory=GroupIndex)  # the store groups whose manifest is held here

    def __post_init__(self, policy_name: str) -> None:
        self.objects = ObjectTable(self.name)
        self.policy = make_row_policy(policy_name, self.objects, self.arena.capacity_bytes)

    def compact(self) -> bool:
        """Rebuild the index's columns, the policy's tables and the arena allocator's maps once
        removals left them sparse (none shrinks by itself). True if anything was rebuilt."""
        return self.objects.compact(self.policy.renumber) | self.policy.compact() | self.arena.compact()
