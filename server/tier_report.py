"""Integrity checks and statistics of the tier manager (a mixin of TierManager)."""

from __future__ import annotations


class TierReport:
    def check_integrity(self) -> None:
        """Raise RuntimeError if the index, leases, policy and arenas disagree."""
        self.leases.check_integrity()
        inflight: dict = {}
        for lease_id, put in self._pending.items():
            lease = self.leases.get(lease_id)
            owner = None if lease is None else lease.owner  # None: a reservation without its lease
            inflight[owner] = inflight.get(owner, 0) + put.size
        if inflight != self._inflight_bytes:
            raise RuntimeError(f"uncommitted bytes per client: {self._inflight_bytes} counted, {inflight} reserved")
        for ns in self.namespaces.values():
            ns.arena.check_integrity()
            ns.policy.check_integrity()
            if len(ns.policy) != len(ns.objects) or any(oid not in ns.policy for oid in ns.objects):
                raise RuntimeError(f"namespace {ns.name}: policy tracks {len(ns.policy)} keys, index has {len(ns.objects)}")
            live = [e.extent for e in ns.objects.values()]
            live += [p.extent for p in self._pending.values() if p.namespace == ns.name]
            live += [z.extent for z in self._zombies.values() if z.namespace == ns.name]
            live += [x for name, x in self._transient.values() if name == ns.name]
            if ns.arena.allocator.num_allocated != len(live) or sum(x.length for x in live) != ns.arena.allocator.used_bytes:
                raise RuntimeError(
                    f"namespace {ns.name}: arena holds {ns.arena.allocator.num_allocated} extents / {ns.arena.allocator.used_bytes} B, "
                    f"index accounts for {len(live)} / {sum(x.length for x in live)} B"
                )
            for entry in ns.objects.values():
                if entry.readers < 0 or entry.deleted:
                    raise RuntimeError(f"namespace {ns.name}: bad entry state for {entry.object_id.hex}")
        if set(self._reading) & set(self._ranged):
            raise RuntimeError("a read lease is both a whole-object lease and a ranged one")
        for lease_id, (ns, extent) in self._ranged.items():
            lease = self.leases.get(lease_id)
            if lease is None or lease.mode != "read" or self._transient.get(id(extent)) != (ns.name, extent):
                raise RuntimeError(f"ranged lease {lease_id}: no read lease, or its extent is not accounted for")
        if sum(1 for lease in self.leases if lease.mode == "read") != len(self._reading) + len(self._ranged):
            raise RuntimeError("read leases and the leases the tier manager tracks disagree")
        readers = sum(e.readers for ns in self.namespaces.values() for e in ns.objects.values())
        readers += sum(z.readers for z in self._zombies.values())
        if readers != len(self._reading) + self._num_holds:
            raise RuntimeError(f"{readers} readers counted on entries, {len(self._reading)} read leases "
                               f"and {self._num_holds} daemon holds")
        if self.mover is not None:
            self.mover.check_integrity()

    def stats(self) -> dict:
        """Per namespace and per tier. used_bytes counts whole arena pages (tiers.arena.PAGE_BYTES,
        4 KiB): every object takes at least one, so 1 KiB objects fill an arena at a quarter of
        its capacity in payload."""
        namespaces = {}
        for ns in self.namespaces.values():
            c = ns.counters
            namespaces[ns.name] = {
                "objects": len(ns.objects),
                "capacity_bytes": ns.arena.capacity_bytes,
                "used_bytes": ns.arena.allocator.used_bytes,
                "pinned": sum(1 for e in ns.objects.values() if e.is_pinned(self.clock())),
                **{k: getattr(c, k) for k in c.__slots__},
            }
        tiers = {"host": {
            "capacity_bytes": sum(n["capacity_bytes"] for n in namespaces.values()),
            "used_bytes": sum(n["used_bytes"] for n in namespaces.values()),
            "objects": sum(n["objects"] for n in namespaces.values()),
        }}
        if self.mover is not None:
            tiers["nvme"] = self.mover.stats()
        if self.cluster is not None:
            tiers["remote"] = self.cluster.stats()
        return {"leases": len(self.leases), "namespaces": namespaces, "tiers": tiers}
