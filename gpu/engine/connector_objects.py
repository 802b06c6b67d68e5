"""The store objects of a connector's chunks, and the calls that look them up, lease and put them.

Chunk j of a prompt (its kvstore-key-v1 ChunkKey) has one object per per-chunk codec (the KV
of attention layers), keyed for that codec's descriptor. A boundary codec's object (a
recurrent snapshot: the state after the chunk's last token) is never stored or read alone: a
chunk whose end has every boundary codec's snapshot is put as one store group
(kvstore/groups.py), committed, found and read all or nothing,

    members(j) = [chunk j's object of each per-chunk codec] + [each boundary codec's snapshot
                  at its end], both in codec order (the order fixes the group's id)

A hit of n chunks needs the per-chunk objects of chunks 0 .. n-2 held and group n-1
complete; its load reads chunks 0 .. n-2 alone and chunk n-1 with its snapshots as one
group read, so KV and the state after it arrive together or not at all. Without boundary
codecs every object is read and put alone.

Every call here takes a `client.sync.Client` and raises what it raises (a FailSoftLink turns
that into a recompute); the one exception is a group put the store refuses (full, a
conflicting member): that is an outcome of the save, not an outage.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvstore.errors import CapacityError, RequestError
from kvstore.identity import ChunkKey, object_id


@dataclass(frozen=True, slots=True)
class Found:
    """What one lookup found of a prompt's chunks."""

    tiers: list  # per codec, per chunk: the tier holding it, None where not held (boundary codecs: its group's)
    complete: list  # per chunk: its group is complete (False past the per-chunk hits; [] without boundary codecs)
    est_load_s: float  # the daemon's estimate of loading the per-chunk objects it holds
    hit_bytes: int  # their bytes


@dataclass(frozen=True, slots=True)
class Saved:
    """What one put of queued saves stored."""

    codecs: list  # the codec of each object now stored (members of stored groups included)
    num_groups: int  # store groups stored (or found whole already)
    errors: list  # the store's reason for each object or group it refused


class ChunkObjects:
    """Keys of the objects of a connector's codecs. Pure but for the client calls it is handed."""

    def __init__(self, codecs, salt: bytes):
        self.descriptors = [codec.descriptor for codec in codecs]
        self.per_chunk = [c for c, codec in enumerate(codecs) if not codec.boundary_only]
        self.boundary = [c for c, codec in enumerate(codecs) if codec.boundary_only]
        self._salt = salt

    def key(self, chunk: ChunkKey, codec: int) -> ChunkKey:
        """The key of codec `codec`'s object for `chunk`; it carries that codec's descriptor,
        so a read expects it (an object stored under another is a miss)."""
        desc = self.descriptors[codec]
        if desc == chunk.descriptor:
            return chunk
        return replace(chunk, object_id=object_id(self._salt, chunk.logical, desc), descriptor=desc)

    def member_codecs(self) -> list[int]:
        """The codec of each member of a chunk's group, in member order."""
        return self.per_chunk + self.boundary

    def members(self, chunk: ChunkKey) -> list[ChunkKey]:
        return [self.key(chunk, c) for c in self.member_codecs()]

    def look_up(self, client, keys: list[ChunkKey], usable: int) -> Found:
        """One lookup of every per-chunk object; with boundary codecs, one lookup_groups of
        the groups of the leading chunks (at most `usable`) whose per-chunk objects are held."""
        n = len(keys)
        found = client.lookup([self.key(k, c) for c in self.per_chunk for k in keys])
        rows = {c: list(found.tiers[i * n:(i + 1) * n]) for i, c in enumerate(self.per_chunk)}
        hits = next((j for j in range(n) if any(rows[c][j] is None for c in self.per_chunk)), n)
        complete: list = []
        if self.boundary:
            groups = client.lookup_groups([self.members(k) for k in keys[:min(hits, usable)]])
            complete = list(groups.complete) + [False] * (n - len(groups.complete))
            tiers = list(groups.tiers) + [None] * (n - len(groups.tiers))
            rows.update({c: tiers for c in self.boundary})
        return Found([rows[c] for c in range(len(self.descriptors))], complete, found.est_load_s, found.hit_bytes)

    def lease(self, client, keys: list[ChunkKey], n: int) -> dict:
        """Read leases on every object a load of chunks 0 .. n-1 imports, {(codec, chunk):
        ReadLease}, the caller's to release; {} on a miss, and then nothing is leased."""
        leases: dict = {}
        alone = [(c, j) for c in self.per_chunk for j in range(n - 1 if self.boundary else n)]
        try:
            if self.boundary:
                group = client.get_group(self.members(keys[n - 1]))
                if group is None:
                    return {}
                leases.update({(c, n - 1): lease for c, lease in zip(self.member_codecs(), group)})
            for c, j in alone:
                lease = client.get(self.key(keys[j], c))
                if lease is None:
                    _release(leases)
                    return {}
                leases[(c, j)] = lease
        except BaseException:
            _release(leases)
            raise
        return leases

    def put(self, client, singles: list, groups: list) -> Saved:
        """Store `singles`, (codec, key, data) objects put alone (one put_many per codec),
        and `groups`, each a list of (codec, key, data) members put as one store group."""
        stored, errors = [], []
        for c, desc in enumerate(self.descriptors):
            items = [(key, data) for i, key, data in singles if i == c]
            for result in client.put_many(items, desc) if items else ():
                if result.error is None:
                    stored.append(c)
                else:
                    errors.append(str(result.error))
        num_groups = 0
        for members in groups:
            try:
                client.put_group([(key, data) for _, key, data in members])
            except (RequestError, CapacityError) as exc:  # refused (full, conflicting member): the store is up
                errors.append(f"group of {len(members)}: {exc}")
                continue
            num_groups += 1
            stored += [c for c, _, _ in members]
        return Saved(stored, num_groups, errors)


def _release(leases: dict) -> None:
    for lease in leases.values():
        lease.release()
