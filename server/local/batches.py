"""The batched ops of the local socket (kvstore/messages.py: reserve_many, commit_many,
get_many, release_many): one frame carries many objects, and the daemon serves them in
one pass, each item exactly as its single op would be, in order:

    for i, item in enumerate(batch):
        try:    answer = await resolve(single_op(item))   # waits only where that op would
        except: errors.append([i, error]); continue        # this item fails, the rest go on
        columns[i] = answer's fields

The reply packs the per-item fields into columns (kvstore/replies.py). Refusals are
logged once per batch, not once per item.
"""

from __future__ import annotations

import logging

from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import NotFound
from kvstore.fields import pack_uints
from kvstore.server.later import MaybeAwaitable, each, resolve, then
from kvstore.server.local.errors import error_wire
from kvstore.server.tiering.manager import TierManager

log = logging.getLogger("kvstore.local")
_NO_CHECKSUM = bytes(16)


class _Errors:
    """The failed items of one batch: [index, error map], and one log line for all."""

    def __init__(self, conn_id: int, op: str):
        self.conn_id, self.op, self.items = conn_id, op, []

    def add(self, index: int, exc: Exception) -> None:
        self.items.append([index, error_wire(exc, self.conn_id, self.op, quiet=bool(self.items))])

    def logged(self, count: int) -> tuple:
        if len(self.items) > 1:
            log.info("event=batch_errors conn=%d op=%s failed=%d of=%d", self.conn_id, self.op, len(self.items), count)
        return tuple(self.items)


def reserve_many(mgr: TierManager, owner: int, msg: m.ReserveMany) -> MaybeAwaitable[r.ReserveManyReply]:
    ids, sizes = msg.columns()
    n = len(ids)
    leases, offsets, exists = [0] * n, [0] * n, bytearray(n)
    errors = _Errors(owner, msg.op)

    def left_over():
        """The items the tier manager's plain-case run leaves to its single reserve, in order;
        the run goes on after each (`each` asks for the next item only once this one is done)."""
        i = 0
        while (i := mgr.reserve_run(owner, msg, ids, sizes, i, leases, offsets, exists)) < n:
            yield i
            i += 1

    def done(i: int, reply: r.ReserveReply | None, exc) -> None:
        if exc is not None:
            errors.add(i, exc)
        elif reply.exists:
            exists[i] = 1
        else:
            leases[i], offsets[i] = reply.lease, reply.offset
    return then(each(left_over(), lambda i: mgr.reserve(owner, msg.item(i, ids[i], sizes[i])), done),
                lambda _: r.ReserveManyReply(pack_uints(leases), pack_uints(offsets), bytes(exists), errors.logged(n)))


def commit_many(mgr: TierManager, owner: int, msg: m.CommitMany) -> MaybeAwaitable[r.CommitManyReply]:
    items = msg.items()
    n = len(items)
    codes, others = bytearray(n), []
    errors = _Errors(owner, msg.op)
    existed = r.CommitReply(True)

    def left_over():
        """(item, its reply if committed already) for the items the tier manager's plain-case
        run does not finish itself, in order (as reserve_many's)."""
        i = 0
        while True:
            i, reply = mgr.commit_run(owner, items, i, codes)
            if i == n:
                return
            yield i, reply
            i += 1

    def run(item):
        i, reply = item
        if isinstance(reply, Exception):
            raise reply
        return mgr.commit(owner, *items[i]) if reply is None else reply

    def done(item, reply: r.CommitReply | None, exc) -> None:
        i = item[0]
        if exc is not None:
            codes[i] = r.FAILED
            errors.add(i, exc)
        elif reply is r.IN_MEMORY or reply == r.IN_MEMORY:
            codes[i] = r.STORED
        elif reply == existed:
            codes[i] = r.EXISTED
        else:
            codes[i] = r.OTHER
            others.append([i, reply.to_wire()])
    return then(each(left_over(), run, done),
                lambda _: r.CommitManyReply(bytes(codes), tuple(others), errors.logged(n)))


def get_many(mgr: TierManager, owner: int, msg: m.GetMany) -> MaybeAwaitable[r.GetManyReply]:
    ids = msg.object_ids()
    if not mgr.has_arena(msg.namespace):
        return _get_many_without_arena(mgr, owner, msg, ids) if mgr.tiered else _misses(len(ids))
    n = len(ids)
    hits, leases, offsets, sizes = bytearray(n), [0] * n, [0] * n, [0] * n
    checksums, descriptor_of = [_NO_CHECKSUM] * n, [0] * n
    descriptors: list[dict] = []
    seen: dict[int, int] = {}  # id() of a descriptor map -> its index in descriptors
    errors = _Errors(owner, msg.op)

    def hit(i: int, lease: int, offset: int, size: int, checksum: bytes, wire: dict) -> None:
        hits[i], leases[i], offsets[i], sizes[i], checksums[i] = 1, lease, offset, size, checksum
        at = seen.get(id(wire))
        if at is None:  # each object keeps its own map: equal ones are sent once
            at = next((j for j, d in enumerate(descriptors) if d == wire), len(descriptors))
            if at == len(descriptors):
                descriptors.append(wire)
            seen[id(wire)] = at
        descriptor_of[i] = at

    def done(item, reply: r.GetReply | None, exc) -> None:
        if exc is not None:
            errors.add(item[0], exc)
        elif reply.hit:
            hit(item[0], reply.lease, reply.offset, reply.size, reply.checksum, reply.descriptor)

    def reply(_) -> r.GetManyReply:
        return r.GetManyReply(bytes(hits), pack_uints(leases), pack_uints(offsets), pack_uints(sizes), b"".join(checksums),
                              tuple(descriptors), pack_uints(descriptor_of, 2),
                              errors.logged(n))
    get, terms = mgr.get, m.Get(msg.namespace, ids[0] if ids else None, expect=msg.expect)  # the same for every id

    def left_over():
        """(index, id) of the items the tier manager's plain-case run leaves to its single get,
        in order (as reserve_many's)."""
        i = 0
        while (i := mgr.get_run(owner, msg, ids, i, hit)) < n:
            yield i, ids[i]
            i += 1

    def served():
        return then(each(left_over(), lambda item: get(owner, terms, item[1]), done), reply)

    ahead = mgr.fetch_many(msg.namespace, ids)  # local misses read together, where the remote tier can
    if ahead is None:
        return served()

    async def after_fetch() -> r.GetManyReply:
        await ahead
        return await resolve(served())
    return after_fetch()


def _misses(n: int) -> r.GetManyReply:
    zeros = bytes(8 * n)
    return r.GetManyReply(bytes(n), zeros, zeros, zeros, bytes(16 * n), (), bytes(2 * n))


async def _get_many_without_arena(mgr: TierManager, owner: int, msg: m.GetMany, ids) -> r.GetManyReply:
    """A namespace with no arena here: served once one is made for what is held elsewhere."""
    if not await mgr.arena_if_held(msg.namespace, tuple(oid.digest for oid in ids)):
        return _misses(len(ids))
    return await resolve(get_many(mgr, owner, msg))


def release_many(mgr: TierManager, owner: int, msg: m.ReleaseMany) -> None:
    """End every lease held; then a NotFound naming those that were not."""
    missing = []
    for lease in msg.items():
        try:
            mgr.release(owner, lease)
        except NotFound:
            missing.append(lease)
    if missing:
        raise NotFound(f"{len(missing)} of {len(msg.items())} leases were not held by this client "
                       f"(expired or already released), e.g. {missing[:4]}")
