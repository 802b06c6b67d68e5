"""put_inline (kvstore/messages.py: PutInline): a small put whose bytes came in its frame.

A client's put is two round trips (reserve, then commit after it copied into the arena);
for a small object the round trips cost more than the bytes. Here the daemon does all of
it for one request, through the same tier-manager calls a client's two would take:

    reserve (make room, quotas, dedup)  ->  copy + hash into the arena  ->  commit

so what the reply means (stored, exists, durability, homes) is exactly what a two-phase
put's commit says, and every refusal is the one a reserve or commit would give.
"""

from __future__ import annotations

from kvstore import messages as m
from kvstore import replies as r
from kvstore.checksums import copy_and_hash
from kvstore.server.later import MaybeAwaitable, then
from kvstore.server.tiering.manager import TierManager


def put_inline(mgr: TierManager, owner: int, msg: m.PutInline) -> MaybeAwaitable[r.CommitReply]:
    def write(reserved: r.ReserveReply) -> MaybeAwaitable[r.CommitReply]:
        if reserved.exists:  # the same state is held already: nothing to copy
            return r.CommitReply(True)
        try:
            checksum = copy_and_hash(mgr.reserved_view(reserved.lease), msg.data)
        except BaseException:
            mgr.abort(owner, reserved.lease)
            raise
        return mgr.commit(owner, reserved.lease, checksum)

    return then(mgr.reserve(owner, msg.reserve()), write)
