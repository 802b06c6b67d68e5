"""The public calls of `Client` and `AsyncClient`, written once.

Each call builds its op (a generator from client/core.py, client/batched.py, client/groups.py
or client/gpu.py) and hands it to the client's `_run`: `Client._run` drives it to its result;
`AsyncClient._run` is a coroutine, and `awaited` makes each of AsyncClient's calls a
coroutine function that awaits it, with the same signature and docstring.
"""

from __future__ import annotations

import functools

from kvstore import messages as m
from kvstore.fields import pin_ttl
from kvstore.client import batched
from kvstore.client import groups as group_ops
from kvstore.client.core import ClientCore, key_list
from kvstore.client.gpu import op_get_into_device
from kvstore.client.lease import ReadLease
from kvstore.client.results import LookupResult, PutResult
from kvstore.hints import Hints
from kvstore.identity import StateDescriptor
from kvstore.replies import GpuHandleReply


def _document(op):
    """The op's reply's `document` (a stats reply as a dict)."""
    reply = yield from op
    return reply.document


def _done(op):
    """The op run for its effect: None, whatever its reply."""
    yield from op


class ClientCalls:
    """The calls a client offers; the subclass provides `core` (a ClientCore) and `_run`."""

    def _new_core(self, previous: ClientCore | None = None) -> ClientCore:
        """The state of a new connection; `previous`, the closed one, hands its deferred puts
        and unreported results over (ClientCore.adopt)."""
        core = ClientCore(self.namespace, self.token, self._release, self.shared_index)
        if previous is not None:
            core.adopt(previous)
        return core

    def put(self, key, data, desc: StateDescriptor | None = None, hints: Hints | None = None,
            tier: str = "host", wait: bool = True) -> PutResult | None:
        """Store `data` (bytes-like, numpy array or CPU tensor) under `key`.

        wait=False: a deferred put. It returns None once the item is checked and its bytes
        kept (copied, unless `data` is a `bytes`: the buffer may be reused at once); the
        client stores deferred puts together, in order, as one put_many once 8 MiB or 1,024
        of them are held, before any other call on this client (so its own reads, deletes
        and lookups see them), and on close. Until then no other process sees them, and
        they are lost if this process dies. `flush()` stores what is held and returns every
        deferred put's PutResult since the last flush, errors included.

        Two phases: reserve an extent, copy straight into the shared arena, commit with
        the xxh3-128 checksum. An id the daemon already holds with the same size and
        descriptor is not copied again (`existed=True`); held with another size or
        descriptor, the put raises Conflict and the stored object stays. A ChunkKey carries
        the descriptor its id was computed for: `desc` may be left out, and another `desc`
        raises InvalidArgument. Raises CapacityError when nothing can be evicted to make room.
        tier="remote" (a clustered daemon): the commit returns once the object's home nodes
        hold it, and this node keeps no copy unless it is a home; `result.tier` says where
        it ended up ("host" if no home could take it) and `result.homes` names the homes.
        On a daemon whose remote tier is a Mooncake pool: once the pool holds it (no homes).
        """
        if not wait:
            return self._run(batched.put_later(self.core, key, data, desc, hints, tier), deferred_first=False)
        return self._run(batched.put(self.core, key, data, desc, hints, tier))

    def flush(self) -> list[PutResult]:
        """Store the deferred puts (put(wait=False)) still held, and return the PutResult of
        every deferred put made since the last flush, in order: `error` None where it was
        stored, else why not (as put_many's results; a flush never raises for one item)."""
        return self._run(batched.flush(self.core), deferred_first=False)

    def put_many(self, items, desc: StateDescriptor | None = None, hints: Hints | None = None,
                 tier: str = "host", routes=None) -> list[PutResult]:
        """Store many `(key, data)` pairs: per window of up to 1,024 objects one reserve_many
        and one commit_many round trip (packed columns, one frame each). Never raises for one
        item's failure (an empty item, a key whose descriptor differs, a Conflict, no room):
        each result carries its own `error` (None on success; `object_id` None when the key
        itself was not one) and the other items are stored. routes: per item a
        kvstore.route.Route or None, the engine's names for its blocks (a put's route is
        `hints.route`); the daemon's KV events publish them."""
        return self._run(batched.put_many(self.core, list(items), desc, hints, tier, routes))

    def get(self, key, namespace: str | None = None, accept=None, ranges=None,
            expect: StateDescriptor | None = None) -> ReadLease | None:
        """A zero-copy read lease (use as a context manager), or None on a miss.

        expect: the descriptor the caller can use (a ChunkKey expects its own); an object
        stored under another model, revision, kind, dtype, layout or shard is a miss.

        ranges: [(offset, length), ...] when only those bytes will be read (a sparse
        reader). An object on this node is still leased whole; one held only by its home
        nodes comes back as just those ranges (`lease.ranges` set). Read through
        `lease.read(offset, length)`, which works on both (numpy(), tensor() and buffer
        refuse on a ranged lease). Ranges past the object's end, or adding up to more bytes
        than it has, raise RangeError."""
        return self._run(self.core.op_get(key, namespace, accept, ranges, expect))

    def get_into(self, key, out, namespace: str | None = None, verify: bool = False,
                 expect: StateDescriptor | None = None) -> int | None:
        """Copy the object into `out`; returns its size, or None on a miss (as `get`). A miss
        leaves `out` as it was, with one exception: an object over 1 MiB read from the
        shared index and removed while it was being copied may leave part of its bytes in
        `out` (staging such reads would cost a second copy; they are never a hit)."""
        return self._run(self.core.op_get_into(key, out, namespace, verify, expect))

    def get_many_into(self, items, namespace: str | None = None,
                      expect: StateDescriptor | None = None) -> list[int | None]:
        """Copy many objects into their buffers: `items` is (key, out) pairs; returns each
        one's size, or None on a miss (its buffer as get_into leaves it). The gets go out as
        one get_many frame per 1,024 keys,
        so many small objects cost about one round trip, not one each. A buffer too small (or
        a refused get) raises after every other item was copied and every lease released."""
        return self._run(batched.get_many_into(self.core, list(items), namespace, expect))

    def get_many(self, keys, namespace: str | None = None,
                 expect: StateDescriptor | None = None) -> list[ReadLease | None]:
        """A read lease per key (None on a miss), 1,024 per round trip: `get` for many keys.
        An object of at most 16 KiB found in the shared index comes as a lease over a private
        copy (no round trip, nothing held in the daemon), as with `get` (64 KiB there: a
        batch shares its round trip); the others are zero-copy leases. End them together
        with `release_many(leases)`, which sends one frame, or each with `release()`. A
        refused get raises after every lease was released."""
        return self._run(batched.get_many(self.core, key_list(keys), namespace, expect))

    def release_many(self, leases) -> None:
        """Release many leases in one frame; None entries and released leases are skipped."""
        return self._run(_done(batched.release_many(self.core, list(leases))))

    def lookup(self, keys, namespace: str | None = None, expect: StateDescriptor | None = None,
               pin_ttl_s: float | None = None) -> LookupResult:
        """How many leading keys hit, each key's tier, and the estimated load time (one round trip per 4096 keys).
        expect: the descriptor every key must be stored under (ChunkKeys expect their own);
        a key stored under another is a miss. pin_ttl_s: also pin the keys, in the same
        round trip, right after the lookup (as `pin`: those held stay resident until
        unpinned or pin_ttl_s passes), so what was found is still there to load."""
        if pin_ttl_s is not None:
            pin_ttl_s = pin_ttl(pin_ttl_s)
        return self._run(self.core.op_lookup(key_list(keys), namespace, expect, pin_ttl_s))

    def delete(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        """Drop objects from every tier; returns how many ids were found. In a cluster,
        scope="cluster" drops every member's copies, scope="node" only this node's. `keys`
        here and in every call that takes many: an iterable of keys, or one key alone."""
        return self._run(self.core.op_batch(m.Delete, key_list(keys), namespace, scope=scope))

    def pin(self, keys, ttl_s: float | None = None, namespace: str | None = None, scope: str = "cluster") -> int:
        """Keep objects resident (never evicted) until unpinned or `ttl_s` passes; returns how
        many were pinned somewhere. A pin never shortens an earlier one's expiry. In a
        cluster, scope="cluster" pins this node's copies and the home nodes' (an object held
        only by its homes stays there), "node" only this node's. `ttl_s` is seconds in
        (0, a century] (kvstore.units.MAX_DURATION_S), else InvalidArgument before anything is sent."""
        ttl_s = pin_ttl(ttl_s)
        return self._run(self.core.op_batch(m.Pin, key_list(keys), namespace, ttl_s=ttl_s, scope=scope))

    def unpin(self, keys, namespace: str | None = None, scope: str = "cluster") -> int:
        """Undo pins; returns how many ids were still pinned somewhere. In a cluster,
        scope="cluster" reaches every live member (a pin made from any node may hold a
        copy there), "node" only this node's copies."""
        return self._run(self.core.op_batch(m.Unpin, key_list(keys), namespace, scope=scope))

    def prefetch(self, keys, tier: str = "host", policy: str = "best_effort",
                 timeout_s: float | None = None, namespace: str | None = None) -> int:
        """Bring objects to `tier`; returns how many are resident there. With the host tier
        as the only tier this moves nothing and reports what is resident."""
        return self._run(self.core.op_batch(m.Prefetch, key_list(keys), namespace,
                                            tier=tier, policy=policy, timeout_s=timeout_s))

    def put_group(self, items, hints: Hints | None = None, routes=None) -> group_ops.GroupPutResult:
        """Store objects that are only usable together as one group (kvstore/groups.py):
        `items` are (key, data) pairs (a ChunkKey carries its descriptor) or (key, data,
        descriptor) triples, all in one namespace. The daemon makes every member and the
        group's manifest visible at once, or stores nothing and this raises; members it
        holds already are not copied. `result.existed`: the whole group was stored.
        routes: per item a kvstore.route.Route or None (as put_many's)."""
        return self._run(group_ops.put_group(self.core, list(items), hints, routes))

    def put_groups(self, groups, hints: Hints | None = None, routes=None) -> list:
        """put_group for many groups (each a list of items), a window of them per two round
        trips. Never raises for one group's failure: per group its GroupPutResult, or the
        exception that refused it (that group stored nothing). routes: per group None or
        its items' routes (as put_group's)."""
        return self._run(group_ops.put_groups(self.core, [list(items) for items in groups], hints, routes))

    def lookup_groups(self, groups, namespace: str | None = None) -> group_ops.GroupLookup:
        """Per group (a list of member keys: ChunkKeys, or kvstore.groups.Member) whether it
        is complete: its manifest and every member held, live and under the descriptor the
        key expects, on any tier. `leading` counts the complete groups before the first
        incomplete one."""
        return self._run(group_ops.lookup_groups(self.core, list(groups), namespace))

    def get_groups(self, groups, namespace: str | None = None) -> list:
        """get_group for many groups in one round trip (per window of leases): per group a
        GroupLease, or None with nothing of it leased."""
        return self._run(group_ops.get_groups(self.core, [list(members) for members in groups], namespace))

    def get_group(self, members, namespace: str | None = None) -> group_ops.GroupLease | None:
        """Read leases on every member of the group (a GroupLease, a context manager), or
        None and nothing leased: never part of a group."""
        return self._run(group_ops.get_group(self.core, list(members), namespace))

    def stats(self) -> dict:
        """The daemon's counters (what /v1/stats reports of this daemon, as a dict)."""
        return self._run(_document(self.core.op_simple(m.Stats())))

    def check_integrity(self) -> None:
        """Ask the daemon to verify its allocators, index, leases and policies now."""
        return self._run(_done(self.core.op_simple(m.Check())))

    def get_into_device(self, key, out, namespace: str | None = None,
                        expect: StateDescriptor | None = None) -> int | None:
        """Copy the object into `out`, a contiguous torch tensor (on the GPU, typically);
        returns its size, or None on a miss. Where the daemon runs a GPU tier the read is a
        device-to-device copy from its copy of the object (mapped once per client by CUDA
        IPC); else a copy from the host lease."""
        return self._run(op_get_into_device(self.core, key, out, namespace, expect))

    def gpu_handle(self) -> GpuHandleReply:
        """The daemon's GPU tier buffer, exported for this process: map it with
        client.gpu.GpuMapping (a ServiceError when the daemon runs no GPU tier)."""
        return self._run(self.core.op_simple(m.GpuHandle()))


PUBLIC = tuple(name for name, value in vars(ClientCalls).items() if callable(value) and not name.startswith("_"))


def awaited(cls):
    """Class decorator: each public call of ClientCalls on `cls` as a coroutine function that
    awaits what cls._run returns (so inspect and frameworks see async methods)."""
    for name in PUBLIC:
        call = getattr(ClientCalls, name)

        @functools.wraps(call)
        async def method(self, *args, _call=call, **kwargs):
            return await _call(self, *args, **kwargs)

        setattr(cls, name, method)
    return cls
