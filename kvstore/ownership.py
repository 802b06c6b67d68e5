"""Which nodes are an object's home: rendezvous (highest-random-weight) hashing.

    weight(node, id) = u64 of BLAKE2b-64(u32_le(len(node)) || node || id, person="kvstore-home-v1")
    home_nodes(id)   = the `replicas` live nodes of highest weight (ties: smaller node id first)

Every node computes the same answer from the same member list, with no coordination and no
Python `hash` (whose seed differs per process). When a node leaves, only the objects it was
home to move, each to the next node of its own ranking; when one joins, it takes only the
objects where it now ranks among the top `replicas`: about 1/N of them, the minimum.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable

from kvstore.errors import InvalidArgument
from kvstore.identity import ObjectId

_PERSON = b"kvstore-home-v1"


def weight(node_id: str, object_id: ObjectId | bytes) -> int:
    """The node's rendezvous weight for this object (a stable 64-bit integer)."""
    digest = object_id.digest if isinstance(object_id, ObjectId) else bytes(object_id)
    name = node_id.encode()
    h = hashlib.blake2b(struct.pack("<I", len(name)) + name + digest, digest_size=8, person=_PERSON)
    return int.from_bytes(h.digest(), "little")


def home_nodes(object_id: ObjectId | bytes, members: Iterable[str], replicas: int = 1) -> list[str]:
    """The object's home nodes, best first: at most `replicas`, fewer if fewer members."""
    if not isinstance(replicas, int) or replicas < 1:
        raise InvalidArgument(f"replicas must be an integer >= 1, got {replicas!r}")
    ranked = sorted(set(members), key=lambda node: (-weight(node, object_id), node))
    return ranked[:replicas]


def is_home(node_id: str, object_id: ObjectId | bytes, members: Iterable[str], replicas: int = 1) -> bool:
    return node_id in home_nodes(object_id, members, replicas)


def new_homes(object_ids: Iterable[ObjectId], before: Iterable[str], after: Iterable[str],
              replicas: int = 1) -> dict[str, list[ObjectId]]:
    """What a membership change asks for: {node: ids it is home to now but was not before}.

    The re-homing pass sends each listed object to the listed node (from any node that
    still holds it). Nodes that left simply stop being asked.
    """
    before, after = list(before), list(after)
    out: dict[str, list[ObjectId]] = {}
    for oid in object_ids:
        old = set(home_nodes(oid, before, replicas))
        for node in home_nodes(oid, after, replicas):
            if node not in old:
                out.setdefault(node, []).append(oid)
    return out
