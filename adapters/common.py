"""What every engine adapter shares: object ids from engine keys, and a fail-soft store.

Engine keys (vLLM block hashes, SGLang page hashes, LMCache chunk keys) already chain the
prefix. An adapter turns one into an object id with `engine_object_id`, which folds in the
namespace salt, model and revision (kvstore-key-v1's root) and the full descriptor (kind,
dtype, layout, shard): the same engine key under another model, dtype, layout or rank is
another object, so a reader never gets state it cannot use.

`SafeStore` is the adapters' only way to the daemon: the engine-facing calls over one
`client/fail_soft.py: FailSoftLink`. Every call returns a plain value and never raises: a
daemon that is down, restarted, slow or full is a miss (counted in `num_failures`, logged once
per outage), a request the store refuses as wrong is a miss too (`num_refused`; the link stays
up), and the engine recomputes. It is thread-safe (the link holds one lock around one
connection): engines call their storage backends from scheduler, worker and I/O threads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from kvstore.errors import InvalidArgument
from kvstore.identity import (ObjectId, StateDescriptor, chain_hash, namespace_salt, object_id, root_hash,
                              tokenless_ids)
from kvstore.client import copies
from kvstore.client.buffers import as_writable_u8
from kvstore.client.fail_soft import FailSoftLink

log = logging.getLogger("kvstore.adapters")
# One lookup request carries at most this many ids (the daemon's batch limit is 4,096).
LOOKUP_BATCH = 4096


def lazy_classes(module_globals: dict, build):
    """A module `__getattr__` for engine-derived classes: an engine's plug-in loader does
    getattr(module, name); only then does `build()` import the engine (and torch) and return
    {name: class}, which the module keeps. Importing the module needs neither."""
    def __getattr__(name: str):
        built = build(name)
        if built is None:
            raise AttributeError(f"module {module_globals['__name__']!r} has no attribute {name!r}")
        module_globals.update(built)
        return built[name]

    return __getattr__


def engine_object_id(desc: StateDescriptor, engine: str, key: bytes | str | int) -> ObjectId:
    """The object id of engine `engine`'s key `key` under descriptor `desc`."""
    if isinstance(key, int):
        key = key.to_bytes((key.bit_length() + 8) // 8 or 1, "little", signed=True)
    salt = namespace_salt(desc.namespace)
    logical = chain_hash(salt, root_hash(salt, desc.model, desc.model_revision), (), (f"engine:{engine}", key))
    return object_id(salt, logical, desc)


def engine_ids(desc: StateDescriptor, engine: str):
    """f(key bytes) = engine_object_id(desc, engine, key), the parts that do not change with
    the key hashed once (for adapters that compute an id per key on the hot path)."""
    salt = namespace_salt(desc.namespace)
    return tokenless_ids(salt, root_hash(salt, desc.model, desc.model_revision), (f"engine:{engine}",), desc)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Where the daemon is and how long to wait for it. Every field has a sane default."""

    socket_path: str | None = None  # None: $KVSTORE_SOCKET, then the daemon's default path
    namespace: str = "default"
    timeout_s: float = 5.0
    retry_after_s: float = 2.0  # after a failure, skip the store this long (then reconnect)

    @classmethod
    def from_mapping(cls, values: dict | None, prefix: str = "") -> StoreConfig:
        """From an engine's free-form extra config: keys `<prefix>socket_path`, `namespace`,
        `timeout_s`, `retry_after_s`; unknown keys are the engine's business."""
        values = values or {}

        def pick(name, default, kind):
            value = values.get(prefix + name, default)
            return default if value is None else kind(value)

        return cls(pick("socket_path", os.environ.get("KVSTORE_SOCKET"), str), pick("namespace", "default", str),
                   pick("timeout_s", 5.0, float), pick("retry_after_s", 2.0, float))


class SafeStore:
    """A thread-safe, never-raising handle on the daemon (see the module docstring)."""

    def __init__(self, config: StoreConfig):
        self.config = config
        self.link = FailSoftLink(config.socket_path, config.namespace, config.timeout_s, config.retry_after_s)
        self.num_hits = 0
        self.num_misses = 0
        self.num_stored = 0

    @property
    def num_failures(self) -> int:
        """Calls answered as a miss because the store failed or was skipped after a failure."""
        return self.link.num_failures

    @property
    def num_refused(self) -> int:
        """Calls the store refused as invalid (answered as a miss; the link stayed up)."""
        return self.link.num_refused

    def contains(self, ids: list[ObjectId], pin_ttl_s: float | None = None) -> list[bool]:
        """Which of `ids` the store holds (any tier), in one round trip per 4,096 ids.
        pin_ttl_s: pin them too, in the same round trip (Client.lookup's pin_ttl_s)."""
        if not ids:
            return []

        def op(client):
            found = []
            for start in range(0, len(ids), LOOKUP_BATCH):
                batch = ids[start:start + LOOKUP_BATCH]
                found += [t is not None for t in client.lookup(batch, pin_ttl_s=pin_ttl_s).tiers]
            return found

        found = self.link.call(op, [False] * len(ids))
        hits = sum(found)
        self.num_hits += hits
        self.num_misses += len(ids) - hits
        return found

    def prefix_hits(self, ids: list[ObjectId]) -> int:
        """How many leading ids the store holds."""
        found = self.contains(ids)
        return next((i for i, ok in enumerate(found) if not ok), len(found))

    def get_into(self, oid: ObjectId, out) -> bool:
        """Copy the object into `out` (a writable buffer, numpy array or CPU tensor of at
        least its size); False on a miss or any store failure (then `out` may be partly
        written: the caller must not use it)."""
        got = self.link.call(lambda client: client.get_into(oid, out, verify=False) or 0, 0)
        return bool(got)

    def get_many_into(self, pairs: list[tuple[ObjectId, object]], expect: StateDescriptor | None = None,
                      exact: bool = False) -> list[bool]:
        """Copy each (id, out) object into its buffer, pipelined (about one round trip per
        1,024); which ones were copied. A miss or any failure is False for that item (a
        store failure: for all of them); a False item's buffer may be partly written.
        expect: the descriptor every object must be stored under (another is a miss);
        exact: an object smaller than its buffer is a miss too."""
        if not pairs:
            return []

        def op(client):
            sizes = client.get_many_into(pairs, expect=expect)
            if not exact:
                return [size is not None for size in sizes]
            return [size is not None and size == as_writable_u8(out).size for size, (_, out) in zip(sizes, pairs)]

        return self.link.call(op, [False] * len(pairs))

    def put_many(self, items: list[tuple[ObjectId, object]], desc: StateDescriptor, routes=None) -> list[bool]:
        """Store (id, bytes-like / numpy / CPU tensor) pairs; which ones the store now holds.
        The data is only read during the call. routes: per item None or its route
        (kvstore.route.Route, or packed): the engine's names for its blocks in KV events."""
        if not items:
            return []

        def op(client):
            results = client.put_many(items, desc, routes=routes)
            refused = [r.error for r in results if r.error is not None]
            if refused:  # the store is up but turned these away (full, wrong size...): say why
                log.warning("kvstore refused %d of %d puts: %s", len(refused), len(results), refused[0])
            return [r.error is None for r in results]

        stored = self.link.call(op, [False] * len(items))
        self.num_stored += sum(stored)
        return stored

    def put_group(self, items: list, hints=None, routes=None) -> bool:
        """Store (key, data, descriptor) triples as one group (kvstore/groups.py): True once
        all of them are visible together; False and nothing new visible otherwise (a full or
        conflicting store is logged as a refusal, not counted as an outage). routes: per
        item None or its route, as put_many's."""
        return self.put_groups([items], hints, None if routes is None else [routes])[0]

    def put_groups(self, groups: list[list], hints=None, routes=None) -> list[bool]:
        """put_group for many groups, batched (two round trips a window): which were stored.
        routes: per group None or its items' routes."""
        if not groups:
            return []

        def op(client):
            results = client.put_groups(groups, hints, routes)
            refused = [r for r in results if isinstance(r, Exception)]
            if refused:  # the store is up but turned these away (full, conflicting): say why
                log.warning("kvstore refused %d of %d group puts: %s", len(refused), len(results), refused[0])
            return [not isinstance(r, Exception) for r in results]

        stored = self.link.call(op, [False] * len(groups))
        self.num_stored += sum(len(items) for items, ok in zip(groups, stored) if ok)
        return stored

    def lookup_groups(self, groups: list[list]) -> list[bool]:
        """Per group (member keys: ChunkKeys or kvstore.groups.Member) whether it is complete."""
        if not groups:
            return []
        found = self.link.call(lambda client: list(client.lookup_groups(groups).complete), [False] * len(groups))
        self.num_hits += sum(found)
        self.num_misses += len(found) - sum(found)
        return found

    def get_group_into(self, members: list, outs: list) -> bool:
        """Copy every member of a group into its buffer (`outs`, in member order), or none:
        False on a miss or any failure (then a buffer may be partly written only if a copy
        itself failed: the caller must not use any of them)."""
        return self.get_groups_into([(members, outs)])[0]

    def get_groups_into(self, groups: list[tuple[list, list]]) -> list[bool]:
        """get_group_into for many (members, outs) pairs, the reads in one round trip: per
        group whether every member was copied (a False group's buffers must not be used)."""
        if not groups:
            return []

        def op(client):
            got = client.get_groups([members for members, _ in groups])
            copied = []
            try:
                for lease, (_, outs) in zip(got, groups):
                    copied.append(lease is not None and _copy_group(lease, outs))
            finally:
                for lease in got:
                    if lease is not None:
                        lease.release()
            return copied

        return self.link.call(op, [False] * len(groups))

    def delete(self, ids: list[ObjectId]) -> int:
        return self.link.call(lambda client: client.delete(ids), 0) if ids else 0

    def unpin(self, ids: list[ObjectId]) -> int:
        return self.link.call(lambda client: client.unpin(ids), 0) if ids else 0

    def stats(self) -> dict:
        return {"num_hits": self.num_hits, "num_misses": self.num_misses, "num_stored": self.num_stored,
                **self.link.stats()}

    def close(self) -> None:
        self.link.close()


def _copy_group(lease, outs) -> bool:
    """Copy a GroupLease's members into `outs`; InvalidArgument when a buffer's size differs."""
    for member, out in zip(lease, outs):
        dst = as_writable_u8(out)
        if member.size != dst.size:
            raise InvalidArgument(f"group member {member.object_id.hex} is {member.size} bytes, its buffer {dst.size}")
        copies.copy(dst, member.numpy())
    return True
