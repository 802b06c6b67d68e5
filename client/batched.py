"""Many objects per frame: put_many, get_many_into, get_many and release_many.

Generators over a ClientCore, driven like its op_* (client/core.py). Each batch is one
request of a batched op (kvstore/messages.py) and one reply of packed columns:

    put_many:       reserve_many  -> copy + hash each item into the arena -> commit_many
    get_many_into:  get_many      -> copy each hit into its buffer        -> release_many (no reply)
    get_many:       get_many      -> a ReadLease per hit (release_many ends many at once)

so 1,000 objects cost two frames each way, not two thousand, and the daemon serves each
frame in one pass.
"""

from __future__ import annotations

import itertools
import warnings

from kvstore import messages as m
from kvstore import replies as r
from kvstore.errors import InvalidArgument, KVStoreError, ServiceError, from_wire
from kvstore.fields import unpack_uints
from kvstore.hints import Hints
from kvstore.identity import ChunkKey, ObjectId, StateDescriptor
from kvstore.protocol import MAX_BATCH
from kvstore.route import packed_route
from kvstore.client import copies
from kvstore.client.buffers import as_writable_u8
from kvstore.client.core import PUT_WINDOW_BYTES, ClientCore, Collect, Later, resolve_keys
from kvstore.client.lease import ReadLease
from kvstore.client.results import PutResult

# Objects one window of put_many (or one batch of get_many) keeps leased at once: at most
# half the daemon's lease quota per client (limits.max_leases_per_client, 4,096 by default),
# leaving room for the leases an engine holds at the same time.
WINDOW_ITEMS = 1024


# A put_many window's routes (kvstore.route, up to 64 KiB each) stay under this many bytes,
# so its reserve_many frames stay well inside the 4 MiB frame limit.
ROUTES_PER_FRAME_BYTES = 1 << 20


# Bytes per step of a put window's pipeline: copying one step (~1 ms) overlaps the daemon's
# work on the next and the last.
PIPE_BYTES = 8 << 20
# Objects per step: a window of small objects goes in steps too, since the daemon's ~10 us
# an object (reserve and commit) is what the client's work overlaps there. 1,000 x 4 KiB
# put_many, medians of 8 calls, step sizes alternated: one step 15.6 ms, steps of 500
# 13.9, 250 13.7, 125 14.1, 64 15.3.
STEP_ITEMS = 256


def _window(core: ClientCore) -> int:
    return max(1, min(WINDOW_ITEMS, (core.max_leases or 2 * WINDOW_ITEMS) // 2))


def _errors(reply: r.ReserveManyReply | r.CommitManyReply | r.GetManyReply) -> dict[int, Exception]:
    return {index: from_wire(error) for index, error in reply.errors}


def _groups(items: list, key) -> list[list]:
    """`items` split by key(item) (an identity: id() of a descriptor), each group in order."""
    groups: dict[object, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


# --- put_many ---------------------------------------------------------------------


def put_many(core: ClientCore, items, desc: StateDescriptor | None, hints: Hints | None, tier: str = "host",
             routes=None):
    """Per item a PutResult; an item that cannot be stored carries its error (its
    object_id is None when the key itself is not one) and the others are stored.
    routes: per item a kvstore.route.Route or None (its blocks as the engine names them)."""
    hints = Hints.of(hints)
    if tier not in m.PUT_TIERS:
        raise InvalidArgument(f"put tier must be one of {m.PUT_TIERS}, got {tier!r}")
    packed = _packed_routes(routes, len(items))
    results: list[PutResult | None] = [None] * len(items)
    sources = []  # (index, oid, descriptor, bytes) of the items to send
    for i, (key, data) in enumerate(items):
        try:
            sources.append((i, *core.put_item(key, data, desc)))
        except InvalidArgument as exc:
            oid = key.object_id if isinstance(key, ChunkKey) else key if isinstance(key, ObjectId) else None
            results[i] = PutResult(oid, False, error=exc)
    yield from _put_sources(core, sources, hints, tier, results, packed)
    return results


def _put_sources(core: ClientCore, sources: list, hints: Hints, tier: str, results: list, packed: list | None,
                 step_bytes: int = PIPE_BYTES):
    """Store `sources` ((index, oid, descriptor, bytes), in order) window by window, in
    pipeline steps of step_bytes; each item's PutResult goes to results[index]."""
    for namespace in {d.namespace for _, _, d, _ in sources}:
        yield from core.op_open(namespace)
    # Reservations hold arena space until committed: a window of them at a time, not the
    # whole batch, so a large batch cannot fill the arena (or the lease quota) by itself.
    arena_bytes = min((core.arenas[d.namespace].size for _, _, d, _ in sources), default=0)
    limit = max(1, min(PUT_WINDOW_BYTES, arena_bytes // 4, core.max_inflight_bytes))
    max_items = _window(core)
    if packed:  # a reserve_many frame carries its routes: keep them well inside one frame
        max_items = max(1, min(max_items, ROUTES_PER_FRAME_BYTES // max(map(len, filter(None, packed)))))
    for window in _runs(sources, limit, max_items):
        yield from _put_window(core, window, hints, tier, results, packed, step_bytes)


def _packed_routes(routes, n: int) -> list | None:
    if routes is None:
        return None
    routes = list(routes)
    if len(routes) != n:
        raise InvalidArgument(f"put_many: {n} items but {len(routes)} routes")
    packed = [packed_route(r) for r in routes]
    return packed if any(packed) else None


def _runs(sources: list, max_bytes: int, max_items: int) -> list[list]:
    """`sources` cut in order into runs of at most max_items items and max_bytes bytes (an
    item larger than max_bytes alone)."""
    runs, run_bytes = [], 0
    for item in sources:
        if not runs or (run_bytes + item[3].size > max_bytes or len(runs[-1]) == max_items):
            runs.append([])
            run_bytes = 0
        runs[-1].append(item)
        run_bytes += item[3].size
    return runs


def _put_window(core: ClientCore, sources: list, hints: Hints, tier: str, results: list, routes: list | None,
                step_bytes: int = PIPE_BYTES):
    """Reserve, copy and commit a window in steps of step_bytes, overlapped: the daemon
    reserves step k+1 and commits step k-1 while this process copies and hashes step k."""
    steps = [_groups(step, lambda item: id(item[2])) for step in _runs(sources, step_bytes, STEP_ITEMS)]
    reserving = yield Later(_reserves(core, steps[0], hints, tier, routes))
    committing = []
    for k, groups in enumerate(steps):
        replies = yield Collect(reserving)
        if k + 1 < len(steps):
            reserving = yield Later(_reserves(core, steps[k + 1], hints, tier, routes))
        commits, written = _copy_reserved(core, groups, replies, results)
        if commits:
            committing.append(((yield Later(commits)), written))
    for handle, written in committing:
        _settle_commits(written, (yield Collect(handle)), results)


def _reserves(core: ClientCore, groups: list, hints: Hints, tier: str, routes: list | None) -> list:
    """One reserve_many per descriptor."""
    return [core.request(m.ReserveMany.of(g[0][2].namespace, [oid for _, oid, _, _ in g],
                                          [src.size for _, _, _, src in g], g[0][2], hints, tier,
                                          None if routes is None else [routes[i] for i, _, _, _ in g]))
            for g in groups]


def _copy_reserved(core: ClientCore, groups: list, replies: list, results: list) -> tuple[list, list]:
    """Copy and hash each reserved item into the arena: (commit_many requests, per request
    the (index, id) of the items it commits)."""
    commits, committed = [], []
    for group, reply in zip(groups, replies):
        if reply.error is not None:  # the whole request was refused
            for i, oid, _, _ in group:
                results[i] = PutResult(oid, False, error=from_wire(reply.error))
            continue
        reserved = r.ReserveManyReply.from_wire(reply.result)
        errors = _errors(reserved)
        arena = core.arenas[group[0][2].namespace]
        leases, checksums, written = [], [], []
        for k, (lease, offset, (i, oid, _, src)) in enumerate(zip(unpack_uints(reserved.leases),
                                                                  unpack_uints(reserved.offsets), group)):
            if k in errors:
                results[i] = PutResult(oid, False, error=errors[k])
            elif reserved.exists[k]:
                results[i] = PutResult(oid, True)
            else:
                checksums.append(copies.copy_and_hash(arena[offset:offset + src.size], src))
                leases.append(lease)
                written.append((i, oid))
        if leases:
            commits.append(core.request(m.CommitMany.of(leases, checksums)))
            committed.append(written)
    return commits, committed


def _settle_commits(committed: list, replies: list, results: list) -> None:
    for written, reply in zip(committed, replies):
        if reply.error is not None:
            for i, oid in written:
                results[i] = PutResult(oid, False, error=from_wire(reply.error))
            continue
        done = r.CommitManyReply.from_wire(reply.result)
        errors = _errors(done)
        for k, ((i, oid), put) in enumerate(zip(written, done.results())):
            if put is None:
                results[i] = PutResult(oid, False, error=errors.get(k) or InvalidArgument("commit failed"))
            else:
                results[i] = PutResult(oid, put.exists, put.tier, put.durability, homes=put.homes or ())


def put(core: ClientCore, key, data, desc: StateDescriptor | None, hints: Hints | None, tier: str = "host"):
    """One object: a put_many of one, whose error is raised (a route travels in its hints).
    A small one goes inline: its bytes in one put_inline request, one round trip."""
    oid, d, src = core.put_item(key, data, desc)  # the caller's mistakes raise here
    if src.size <= core.inline_put_bytes and tier in m.PUT_TIERS:
        yield from core.op_open(d.namespace)
        done = yield from core.op_simple(m.PutInline(d.namespace, oid, d, memoryview(src), Hints.of(hints), tier))
        return PutResult(oid, done.exists, done.tier, done.durability, homes=done.homes or ())
    (result,) = yield from put_many(core, [(oid, src)], d, hints, tier)
    if result.error is not None:
        raise result.error
    return result


# --- deferred puts: put(wait=False) and flush() --------------------------------------

# Deferred puts a client holds before it stores them as one put_many: enough to amortise
# its two round trips over many objects (docs/architecture.md: "Deferred puts").
DEFER_BYTES = PIPE_BYTES
# Their put_many's pipeline steps: a quarter of a batch, so the daemon reserves the next step
# while this process copies one (8 MiB steps: 32-34 us a 64 KiB put, 2 MiB: 27-30).
DEFER_STEP_BYTES = 2 << 20


def put_later(core: ClientCore, key, data, desc: StateDescriptor | None, hints: Hints | None, tier: str = "host"):
    """Take one put to store with the next ones: the caller's mistakes raise now, the bytes
    are kept (a copy unless they are an immutable `bytes`), and once DEFER_BYTES or a
    window's worth are held they are stored, in order, as put_many does. Their results
    wait in core.deferred_results for flush()."""
    if tier not in m.PUT_TIERS:
        raise InvalidArgument(f"put tier must be one of {m.PUT_TIERS}, got {tier!r}")
    hints = Hints.of(hints)  # checked now: a held put the wire would refuse would fail its whole batch
    oid, d, src = core.put_item(key, data, desc)
    yield from core.op_open(d.namespace)  # a namespace this client may not write raises here (once per namespace)
    if type(data) is not bytes and src.size < DEFER_BYTES:  # a large one is stored before this returns
        src = src.copy()  # the caller may reuse its buffer once put returns
    core.deferred.append((oid, d, src, hints, tier))
    core.deferred_bytes += src.size
    if core.deferred_bytes >= DEFER_BYTES or len(core.deferred) >= _window(core):
        yield from store_deferred(core)


def store_deferred(core: ClientCore):
    """Store every deferred put, in the order they were made: one put_many per run of
    puts with the same hints and tier. Their PutResults join core.deferred_results. A run
    the daemon refuses whole (its namespace's open) gets that error as each put's result,
    and the next runs go on; the daemon lost under it (the driver raises, and
    ClientCore.close settles the batch) or any other error stops it, with every unstored
    put's result that error."""
    if core.storing is not None:  # a store whose call was interrupted in its driver
        core.settle_deferred(ServiceError("the call storing this deferred put was interrupted: it may not be stored"))
    while core.deferred:
        pending, core.deferred, core.deferred_bytes = core.deferred, [], 0
        outcome: list[PutResult | None] = [None] * len(pending)
        core.storing = (pending, outcome)
        try:
            runs = itertools.groupby(enumerate(pending), key=lambda item: (item[1][3], item[1][4]))
            for (hints, tier), run in runs:
                run = [(i, oid, d, src) for i, (oid, d, src, _, _) in run]
                try:
                    yield from _put_sources(core, run, hints, tier, outcome, None, DEFER_STEP_BYTES)
                except KVStoreError as refused:
                    for i, oid, _, _ in run:
                        outcome[i] = outcome[i] or PutResult(oid, False, error=refused)
        except Exception as exc:
            core.settle_deferred(exc)
            raise
        core.settle_deferred(None)


def flush(core: ClientCore):
    """Store the deferred puts; return the results of every deferred put since the last
    flush, in order (each with its error, or None)."""
    yield from store_deferred(core)
    results, core.deferred_results = core.deferred_results, []
    return results


def warn_unreported(core: ClientCore) -> None:
    """At close: a warning naming deferred puts that failed and were never flushed."""
    failed = [result for result in core.deferred_results if result.error is not None]
    core.deferred_results = []
    if failed:
        warnings.warn(f"{len(failed)} deferred put(s) (put(wait=False)) failed and no flush() reported "
                      f"it; the first, {failed[0].object_id.hex}: {failed[0].error}", RuntimeWarning, stacklevel=3)


def after_deferred(core: ClientCore, op):
    """`op`, run once the deferred puts are stored (a client's reads see its own writes)."""
    yield from store_deferred(core)
    return (yield from op)


# --- get_many ---------------------------------------------------------------------


class _Got:
    """One get_many reply, read by column: hits, leases, offsets, sizes, checksums."""

    def __init__(self, reply: r.GetManyReply):
        self.hits = reply.hits
        self.leases, self.offsets = unpack_uints(reply.leases), unpack_uints(reply.offsets)
        self.sizes = unpack_uints(reply.sizes)
        self.checksums, self.descriptors = reply.checksums, reply.descriptors
        self.descriptor_of = unpack_uints(reply.descriptor_of, 2)
        self.errors = _errors(reply)

    def expected(self, k: int, want: StateDescriptor | None) -> bool:
        """Item k's descriptor is `want` (a daemon that answered for another one is a miss)."""
        return want is None or self.descriptors[self.descriptor_of[k]] == want.to_wire()

    def hit(self, k: int, position: int, oid: ObjectId) -> tuple:
        return (position, oid, self.leases[k], self.offsets[k], self.sizes[k], self.checksums[16 * k:16 * k + 16],
                self.descriptors[self.descriptor_of[k]])


def _get_window(core: ClientCore, window: list, ids: list, expects: list, namespace: str):
    """get_many requests for the ids at the positions in `window`, each expecting its
    `expects` item (a request per expectation). Returns (hits, unwanted, error): per
    expected hit (position in ids, oid, lease, offset, size, checksum, descriptor), the
    leases of hits stored under another descriptor, and the first error of a refused get."""
    wanted = [(i, ids[i], expects[i]) for i in window]
    batches = _groups(wanted, lambda item: id(item[2]))
    replies = yield [core.request(m.GetMany.of(namespace, [oid for _, oid, _ in b], b[0][2])) for b in batches]
    if namespace not in core.arenas and any(reply.error is None for reply in replies):
        yield from core.op_open(namespace)  # made since we opened (a promotion for this get)
    hits, unwanted, first_error = [], [], None
    for batch, reply in zip(batches, replies):
        if reply.error is not None:
            first_error = first_error or from_wire(reply.error)
            continue
        got = _Got(r.GetManyReply.from_wire(reply.result))
        for k, (p, oid, want) in enumerate(batch):
            if k in got.errors:
                first_error = first_error or got.errors[k]
            if got.hits[k]:
                if got.expected(k, want):
                    hits.append(got.hit(k, p, oid))
                else:
                    unwanted.append(got.leases[k])
    return hits, unwanted, first_error


def get_many_into(core: ClientCore, items, namespace: str | None, expect: StateDescriptor | None = None):
    """Copy many objects into caller buffers: per item its size, or None on a miss. Every
    lease is released (one release_many, no reply awaited) before an error (a buffer too
    small, a refused get) is raised for the first item that had one."""
    namespace = namespace or core.namespace
    yield from core.op_open(namespace, create=False)
    outs = [as_writable_u8(out) for _, out in items]
    ids, expects = resolve_keys([key for key, _ in items], expect)
    sizes: list[int | None] = yield from core.shared.op_read_many(  # hits from the shared index first
        namespace, list(zip(ids, outs, expects)))
    asked = [i for i, size in enumerate(sizes) if size is None]  # the rest: asked of the daemon
    first_error = None
    step = _window(core)
    for start in range(0, len(asked), step):
        window = asked[start:start + step]
        hits, leased, error = yield from _get_window(core, window, ids, expects, namespace)
        first_error = first_error or error
        arena = core.arenas.get(namespace)
        for p, oid, lease, offset, size, _, _ in hits:
            leased.append(lease)
            dst = outs[p]
            if size > dst.size:
                first_error = first_error or InvalidArgument(
                    f"object {oid.hex} is {size} bytes, its output buffer only {dst.size}")
                continue
            copies.copy(dst[:size], arena[offset:offset + size])
            sizes[p] = size
        if leased:
            yield [core.request(m.ReleaseMany.of(leased), no_reply=True)]
    if first_error is not None:
        raise first_error
    return sizes


def get_many(core: ClientCore, keys, namespace: str | None, expect: StateDescriptor | None = None):
    """Per key a ReadLease, or None on a miss; end them with release_many (or each with
    release()). Raises the first refused get's error after releasing what was leased."""
    namespace = namespace or core.namespace
    yield from core.op_open(namespace, create=False)
    # Small hits from the shared index first: leases over private copies, nothing to release.
    ids, expects = resolve_keys(keys, expect)
    leases: list[ReadLease | None] = yield from core.shared.op_get_many(namespace, list(zip(ids, expects)))
    asked = [i for i, lease in enumerate(leases) if lease is None]  # the rest: asked of the daemon
    first_error, unwanted = None, []
    step = _window(core)
    for start in range(0, len(asked), step):
        window = asked[start:start + step]
        hits, refused, error = yield from _get_window(core, window, ids, expects, namespace)
        first_error, unwanted = first_error or error, unwanted + refused
        arena = core.arenas.get(namespace)
        for p, oid, lease, offset, size, checksum, descriptor in hits:
            leases[p] = ReadLease(core.release_cb, lease, oid, size, checksum, descriptor, "host",
                                          arena[offset:offset + size], core=core)
    if first_error is not None:
        unwanted += [lease_id for lease in leases if lease is not None and (lease_id := lease.detach()) is not None]
    if unwanted:
        yield [core.request(m.ReleaseMany.of(unwanted), no_reply=True)]
    if first_error is not None:
        raise first_error
    return leases


def release_many(core: ClientCore, leases):
    """End many read leases in one frame (no reply awaited); None entries and leases
    already ended are skipped."""
    ids = [lease_id for lease in leases if lease is not None and (lease_id := lease.detach()) is not None]
    for start in range(0, len(ids), MAX_BATCH):
        yield [core.request(m.ReleaseMany.of(ids[start:start + MAX_BATCH]), no_reply=True)]
