"""Typed requests of store groups (kvstore/groups.py): commit, look up and read a group whole.

Members travel as packed columns (kvstore.fields): n 32-byte ids, and for a commit n u64
write leases (0: the member is already stored, its put answered "exists") and n 16-byte
checksums. The daemon derives the group id from the ids itself; a request never names one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.errors import InvalidArgument
from kvstore.fields import (EXPECT_LIST, EXPECT_OF, NAMESPACE, PACKED_CHECKSUMS, PACKED_IDS, PACKED_U64, _int,
                            unpack_uints)
from kvstore.groups import MAX_GROUP_MEMBERS, check_members
from kvstore.identity import ObjectId
from kvstore.message_base import Message, check_expectations, expectations


def _ids(packed: bytes) -> list[ObjectId]:
    return [ObjectId(packed[i:i + 32]) for i in range(0, len(packed), 32)]


@dataclass(frozen=True, slots=True)
class CommitGroup(Message):
    """Make a group visible at once: its manifest (reserved like any put, under the lease
    `manifest`, its bytes kvstore.groups.manifest_bytes; 0: the manifest is stored already,
    some member is not) and every member. Per member a write lease (0: already stored
    here) and the checksum of its bytes. All or nothing: any refused member frees every
    lease of the request and stores nothing."""
    manifest: int
    members: bytes
    leases: bytes
    checksums: bytes
    op: ClassVar[str] = "commit_group"
    _codecs: ClassVar = {"manifest": _int(0, 2**63 - 1), "members": PACKED_IDS, "leases": PACKED_U64,
                         "checksums": PACKED_CHECKSUMS}

    def __post_init__(self) -> None:
        n = len(self.members) // 32
        if len(self.leases) // 8 != n or len(self.checksums) // 16 != n:
            raise InvalidArgument(f"{self.op}: {n} members but {len(self.leases) // 8} leases and "
                                  f"{len(self.checksums) // 16} checksums")
        check_members(self.member_ids())

    def member_ids(self) -> list[ObjectId]:
        return _ids(self.members)

    def items(self) -> list[tuple[ObjectId, int, bytes]]:
        """(member id, write lease or 0, checksum) per member."""
        sums = self.checksums
        return [(oid, lease, sums[16 * i:16 * i + 16])
                for i, (oid, lease) in enumerate(zip(self.member_ids(), unpack_uints(self.leases)))]


@dataclass(frozen=True, slots=True)
class LookupGroups(Message):
    """Which groups are complete. `members`: every group's member ids, group after group;
    `counts` (u64 each): how many members each group has. `expect` / `expect_of`: per
    member the descriptor the reader can use, as in Lookup (a group's manifest is expected
    under kvstore.groups.group_descriptor of its first member's expectation)."""
    namespace: str
    members: bytes
    counts: bytes
    expect: tuple | None = None
    expect_of: bytes | None = None
    op: ClassVar[str] = "lookup_groups"
    _codecs: ClassVar = {"namespace": NAMESPACE, "members": PACKED_IDS, "counts": PACKED_U64,
                         "expect": EXPECT_LIST, "expect_of": EXPECT_OF}
    _defaults: ClassVar = {"expect": None, "expect_of": None}

    def __post_init__(self) -> None:
        counts = unpack_uints(self.counts)
        if any(not 1 <= c <= MAX_GROUP_MEMBERS for c in counts) or sum(counts) != len(self.members) // 32:
            raise InvalidArgument(f"{self.op}.counts: each group has 1..{MAX_GROUP_MEMBERS} members, and the "
                                  f"counts must add up to the {len(self.members) // 32} member ids sent")
        check_expectations(self.op, self.expect, self.expect_of, len(self.members) // 32)

    def groups(self) -> list[list[ObjectId]]:
        ids, out, start = _ids(self.members), [], 0
        for count in unpack_uints(self.counts):
            out.append(ids[start:start + count])
            start += count
        return out

    def expectations(self) -> list | None:
        return expectations(self.expect, self.expect_of, len(self.members) // 32)


@dataclass(frozen=True, slots=True)
class GetGroup(Message):
    """A read lease on every member of one group, or on none (a miss): the reply says which
    member was missing and why."""
    namespace: str
    members: bytes
    expect: tuple | None = None
    expect_of: bytes | None = None
    op: ClassVar[str] = "get_group"
    _codecs: ClassVar = {"namespace": NAMESPACE, "members": PACKED_IDS, "expect": EXPECT_LIST,
                         "expect_of": EXPECT_OF}
    _defaults: ClassVar = {"expect": None, "expect_of": None}

    def __post_init__(self) -> None:
        check_members(self.member_ids())
        check_expectations(self.op, self.expect, self.expect_of, len(self.members) // 32)

    def member_ids(self) -> list[ObjectId]:
        return _ids(self.members)

    def expectations(self) -> list | None:
        return expectations(self.expect, self.expect_of, len(self.members) // 32)


GROUP_OPS = (CommitGroup, LookupGroups, GetGroup)
