"""Index operations over the chain of tiers: lookup, delete, pin, prefetch, operator eviction.

Composed with the tiers (server/tiering/chain.py); the tier manager and the admin API call
them. Each asks the host tier first, then NVMe, then the remote tier, through the tiers'
public surface. Like the manager it runs on the event loop; a call that needs NVMe or peer I/O
returns an awaitable instead of its result (server/later.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import NamedTuple

import numpy as np

from kvstore.errors import NotFound
from kvstore.identity import ObjectId
from kvstore.replies import LookupReply, PrefetchReply, tier_names
from kvstore.server.later import MaybeAwaitable, then
from kvstore.server.tiering.objects import ObjectEntry

log = logging.getLogger("kvstore.tiers")

# Fixed cost of loading one object on top of its bytes (one request and its lease).
PER_OBJECT_LOAD_S = 20e-6
# Where a batch's ids are, as codes in an array (_placed_here) and in a lookup's reply:
# indexes of their names in kvstore.replies.TIER_NAMES.
MISS, HOST, NVME, REMOTE = 0, 1, 2, 3


class Placements(NamedTuple):
    """Per id (in the order asked) its tier ("host", "nvme", "remote" or None) and size in
    bytes (0 where None)."""
    tiers: list
    sizes: list


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("event=promotion_failed error=%r", task.exception())


class Evicted(NamedTuple):
    """An object that left host memory by an explicit evict (what the admin API reports)."""

    namespace: str
    object_id: ObjectId
    size: int


class HereOps:
    """This node's copies alone: what a delete or pin does here, and what a peer's delete or
    pin asks of this node (server/cluster/serving.py). Made before the remote tier, which is
    handed it; IndexOps goes on from it to the remote tier."""

    def __init__(self, host, nvme):
        self.host, self.nvme = host, nvme

    def delete_here(self, namespace: str, ids) -> MaybeAwaitable[list[bool]]:
        """Delete from this node's tiers only (what a peer's delete asks). Per id whether it
        was held, or an awaitable of that when NVMe copies must be deleted too."""
        ns = self.host.namespaces.get(namespace)
        deleted = set()
        for oid in ids if ns is not None else ():
            entry = ns.objects.get(oid)
            if entry is not None:
                self.host.delete(ns, entry)
                deleted.add(oid)
        # NVMe forgets its copies in this same step (a promotion under way publishes nothing),
        # and answers once their records are removed.
        on_nvme = self.nvme.delete(namespace, list(ids))
        return then(on_nvme, lambda held: [oid in deleted or h for oid, h in zip(ids, held)])

    def pin_here(self, namespace: str, ids, ttl_s: float | None, unpin: bool = False) -> list[bool]:
        """Pin (until now + ttl_s, or until unpinned) or unpin this node's host copies; per id,
        whether it was held here (for an unpin: held and still pinned). A pin never shortens
        another's: pins reach a copy from every node, and the latest expiry wins."""
        ns = self.host.namespaces.get(namespace)
        if ns is None:
            return [False] * len(ids)
        now = self.host.clock()
        until = math.inf if ttl_s is None else now + ttl_s
        flags = []
        for oid in ids:
            entry = ns.objects.get(oid)
            if entry is None or (unpin and entry.pinned_until <= now):
                flags.append(False)
                continue
            entry.pinned_until = 0.0 if unpin else max(entry.pinned_until, until)
            flags.append(True)
        return flags


class IndexOps:
    def __init__(self, host, nvme, here: HereOps, below, sink):
        """host: the host tier; nvme: the NVMe tier (or NoNvme); here: this node's copies'
        delete and pin; below: the remote tier (server/tiering/chain.py: Homes), asked on a
        local miss and for a delete or pin of scope "cluster"; sink: where the host tier's
        victims go (server/tiering/chain.py: victim_sink; None: dropped)."""
        self.host, self.nvme, self.here, self.below, self.sink = host, nvme, here, below, sink

    def lookup(self, namespace: str, ids, expect: list | None = None) -> MaybeAwaitable[LookupReply]:
        """Per key its tier ("host", "nvme" or None), the leading hits, their bytes, and the
        estimated time to load them at each tier's measured bandwidth (docs/architecture.md,
        "Load estimates"). expect: per key the descriptor the reader can use, or None; an
        object stored under another descriptor is a miss."""
        codes, sizes = self._placed_here(namespace, ids, expect)
        misses = np.flatnonzero(codes == MISS)
        hits = int(misses[0]) if len(misses) else len(codes)
        host_bytes = int(sizes[:hits][codes[:hits] == HOST].sum())
        nvme_bytes = int(sizes[:hits].sum()) - host_bytes
        est = self.load_estimate_s(hits, host_bytes, nvme_bytes)
        result = LookupReply(hits, (), host_bytes + nvme_bytes, est, codes.tobytes())
        if hits == len(ids):
            return result
        misses = misses.tolist()
        metas = self.below.lookup_remote(namespace, [ids[i] for i in misses])
        return then(metas, lambda metas: self._with_remote(result, misses, metas, sizes.tolist(), expect))

    def placements(self, namespace: str, ids, expect: list | None = None) -> MaybeAwaitable[Placements]:
        """Where every id would load from and its size, not only the leading ones: what the
        admin API's batched lookup needs to score many prefixes from one call. Tiers as in
        lookup plus "remote" (the misses are asked of their homes, one round trip per home);
        expect as in lookup. Opens no namespace. An awaitable when peers are asked."""
        codes, sizes = self._placed_here(namespace, ids, expect)
        misses = np.flatnonzero(codes == MISS).tolist()
        tiers, sizes = list(tier_names(codes.tolist())), sizes.tolist()
        if not misses:
            return Placements(tiers, sizes)
        metas = self.below.lookup_remote(namespace, [ids[i] for i in misses])
        return then(metas, lambda metas: self._placed_remote(tiers, sizes, misses, metas, expect))

    def load_estimate_s(self, num_objects: int, host_bytes: int, nvme_bytes: int = 0, remote_bytes: int = 0) -> float:
        """lookup's est_load_s for loading these objects and bytes from each tier."""
        est = num_objects * PER_OBJECT_LOAD_S + host_bytes / self.host.bandwidth_bytes_s
        if nvme_bytes:
            est += nvme_bytes / self.nvme.bandwidth_bytes_s
        if remote_bytes:
            est += remote_bytes / self.below.bandwidth_bytes_s
        return est

    def _placed_here(self, namespace: str, ids, expect: list | None) -> tuple[np.ndarray, np.ndarray]:
        """Per id its tier on this node (MISS, HOST or NVME: an index of TIER_NAMES) and its size
        (0 for MISS), as arrays: the host index and the NVMe table each probed once for the
        whole batch."""
        ns = self.host.namespaces.get(namespace)
        if ns is None:
            rows = np.full(len(ids), -1, np.int64)
            sizes = np.zeros(len(ids), np.int64)
        else:
            rows = ns.objects.live_rows(ids, self.host.clock())
            sizes = np.where(rows >= 0, ns.objects.c_size[rows], 0).astype(np.int64)
        codes = (rows >= 0).astype(np.int8)  # HOST where found, else MISS
        missed = np.flatnonzero(rows < 0).tolist()
        if missed:
            for i, size in zip(missed, self.nvme.sizes_of(namespace, [ids[i] for i in missed])):
                if size is not None:
                    codes[i], sizes[i] = NVME, size
        if expect is not None:  # (a loop over lists: a numpy item read costs ~3x)
            for i, (wanted, code, row) in enumerate(zip(expect, codes.tolist(), rows.tolist())):
                if wanted is not None and code != MISS and not self._as_expected(ns, namespace, ids[i], row, wanted):
                    codes[i], sizes[i] = MISS, 0
        return codes, sizes

    @staticmethod
    def _placed_remote(tiers: list, sizes: list, misses: list[int], metas: list, expect) -> Placements:
        for i, meta in zip(misses, metas):
            if meta is not None and (expect is None or expect[i] is None or meta.descriptor == expect[i]):
                tiers[i], sizes[i] = "remote", meta.size
        return Placements(tiers, sizes)

    def _as_expected(self, ns, namespace: str, oid, row: int, wanted) -> bool:
        """Whether a held object (on host row `row`, else on NVMe) has the descriptor `wanted`.
        (`is` first: descriptors off the wire come from one decoding cache, so an object and
        its reader's expectation are mostly the same object.)"""
        if row >= 0:
            held = ns.objects.descriptor_at(row)
            return held is wanted or held == wanted
        meta = self.nvme.remote_meta(namespace, ObjectId(bytes(oid)))
        return meta is not None and meta.descriptor == wanted

    def _with_remote(self, result: LookupReply, misses: list[int], metas: list, sizes: list, expect) -> LookupReply:
        """Merge what the home nodes hold of the local misses (one round trip per home)."""
        if not any(meta is not None for meta in metas):
            return result
        codes = bytearray(result.codes)
        for i, meta in zip(misses, metas):
            if meta is not None and (expect is None or expect[i] is None or meta.descriptor == expect[i]):
                codes[i] = REMOTE
        hits = codes.find(MISS)
        if hits < 0:
            hits = len(codes)
        remote_bytes = sum(meta.size for i, meta in zip(misses, metas) if meta is not None and i < hits)
        # Local hits behind the first local miss lead now too: their bytes count as well.
        later = [(result.codes[i], sizes[i]) for i in range(result.hits, hits) if result.codes[i] != MISS]
        host_bytes = sum(size for code, size in later if code == HOST)
        nvme_bytes = sum(size for code, size in later if code == NVME)
        est = result.est_load_s + self.load_estimate_s(hits - result.hits, host_bytes, nvme_bytes, remote_bytes)
        hit_bytes = result.hit_bytes + remote_bytes + host_bytes + nvme_bytes
        return LookupReply(hits, (), hit_bytes, est, bytes(codes))

    def delete(self, namespace: str, ids, scope: str = "cluster") -> MaybeAwaitable[int]:
        """Delete from every tier of this node and, in a cluster with scope "cluster", of
        every live member. Returns how many ids were found anywhere, or an awaitable of that
        count when NVMe copies or peers are involved."""
        found = self.here.delete_here(namespace, ids)
        if scope == "cluster":
            return self.below.delete_everywhere(namespace, ids, found)
        return then(found, sum)

    def prefetch(self, namespace: str, ids, tier: str, policy: str,
                 timeout_s: float | None) -> MaybeAwaitable[PrefetchReply]:
        """Bring objects into the host tier. best_effort starts promotions and answers at
        once; wait answers when all are resident; timeout answers after timeout_s at most.
        Returns how many of them are resident."""
        ns = self.host.namespaces.get(namespace)
        objects = ns.objects if ns is not None else {}
        mover = self.nvme
        absent = [oid for oid in ids if oid not in objects]
        missing = [oid for oid, size in zip(absent, mover.sizes_of(namespace, absent)) if size is not None]
        resident = sum(1 for oid in ids if oid in objects)
        if tier != "host" or not missing:
            return PrefetchReply(resident, len(ids))
        tasks = [asyncio.ensure_future(mover.promote(namespace, oid)) for oid in missing]
        if policy == "best_effort":
            for task in tasks:
                task.add_done_callback(_log_failure)
            return PrefetchReply(resident, len(ids), len(tasks))
        return self._prefetch_wait(namespace, ids, tasks, None if policy == "wait" else (timeout_s or 1.0))

    async def _prefetch_wait(self, namespace: str, ids, tasks, timeout_s: float | None) -> PrefetchReply:
        done, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for task in pending:
            task.add_done_callback(_log_failure)  # keeps running; its result lands in the host tier
        for task in done:
            _log_failure(task)
        ns = self.host.namespaces.get(namespace)
        objects = ns.objects if ns is not None else {}
        return PrefetchReply(sum(1 for oid in ids if oid in objects), len(ids))

    def pin(self, namespace: str, ids, ttl_s: float | None, scope: str = "cluster") -> MaybeAwaitable[int]:
        """Pin this node's host copies and, in a cluster with scope "cluster", the homes'.
        Returns how many ids were pinned somewhere, or an awaitable of that count."""
        return self._pin_scoped(namespace, ids, ttl_s, scope, unpin=False)

    def unpin(self, namespace: str, ids, scope: str = "cluster") -> MaybeAwaitable[int]:
        return self._pin_scoped(namespace, ids, None, scope, unpin=True)

    def _pin_scoped(self, namespace: str, ids, ttl_s, scope: str, unpin: bool) -> MaybeAwaitable[int]:
        flags = self.here.pin_here(namespace, ids, ttl_s, unpin)
        if scope == "cluster":
            return self.below.pin_everywhere(namespace, ids, ttl_s, unpin, flags)
        return sum(flags)

    def evict(self, namespace: str, num_bytes: int | None, match=None) -> MaybeAwaitable[list[Evicted]]:
        """Operator eviction in one existing namespace, in the policy's victim order.

        Evicts until `num_bytes` are freed, or, with num_bytes None, every object `match`
        accepts (`match(entry) -> bool`; None accepts all). Leased and pinned objects are
        never chosen. Evicted means out of host memory, not gone: where a tier below keeps
        the host tier's victims (NVMe, the cluster's homes), they go there first, as under
        pressure (a victim read or pinned meanwhile stays). Returns what left host memory
        (Evicted each), or an awaitable of it when the victims are written down first. Raises
        NotFound for an unknown namespace.
        """
        ns = self.host.namespaces.get(namespace)
        if ns is None:
            raise NotFound(f"no namespace {namespace!r}")
        now = self.host.clock()

        def chosen(row: int) -> bool:
            return ns.objects.idle(row, now) and (match is None or match(ns.objects.entry_at(row)))

        if num_bytes is None:
            num_bytes = sum(e.size for e in ns.objects.values() if chosen(e.row))
        victims = [ns.objects.entry_at(row) for row in ns.policy.victims(num_bytes, chosen)]
        # What each victim is, read now: an entry's row may hold another object once it left.
        told = [Evicted(e.namespace, e.object_id, e.size) for e in victims]
        if self.sink is None or not victims:
            for entry in victims:
                self.host.evict(ns, entry)
            return told
        return self._evicted_below(ns, victims, told)

    async def _evicted_below(self, ns, victims: list[ObjectEntry], told: list[Evicted]) -> list[Evicted]:
        await self.sink(ns, victims)
        return [what for what, entry in zip(told, victims) if not ns.objects.holds(entry)]
