"""What the event stream has told routers this node holds: per namespace, per object, in
which media and under which block hashes.

    a tier reports an object stored in a medium   -> add(): kept with its route, medium marked
    a tier reports it removed from a medium       -> remove(): the medium unmarked; the object
                                                     leaves when no medium holds it
    a router asks by block hash (admin API)       -> objects_of(): the objects named by them
    a router asks for a snapshot                  -> items(): every object and its media

It exists because a removal must name the blocks the way the stored event did, and an
object that left host memory for NVMe has no host entry left to read its route from; and
because a router that starts late asks for everything held at once (server/events/stream.py).
A BlockRemoved for an object the stream never published is not sent.

Memory (with `[events]` on only): an object costs its dict slot and a small record
(~120 B), plus its packed route (kvstore/route.py: ~3 B a token id, ~35 B a block hash)
and ~100 B per block hash in the index by hash (one for an object without a route, its
id's int form, with int_block_hashes). For objects of megabytes, well under 0.1%.
Event loop thread only; no I/O.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvstore.route import published_hash, route_fields

# Media as bits of Held.media, in the order a snapshot lists them.
MEDIA = ("CPU", "STORAGE", "PEER")
_BIT = {name: 1 << i for i, name in enumerate(MEDIA)}
_PEER = _BIT["PEER"]
# Objects marked PEER (sent to their home nodes) that a home drops on its own are only
# unmarked when this node next asks for them. So the marks are capped: past this many, the
# oldest is unmarked (a BlockRemoved: a router under-counts, never over-counts for long).
MAX_PEER_OBJECTS = 1_000_000


@dataclass(slots=True)
class Held:
    """One object the stream published. route: its packed kvstore.route.Route (None: it is
    named by its id); block_size: tokens per named block when the route gives none."""
    route: bytes | None
    block_size: int
    session_id: str | None
    media: int = 0

    def in_media(self) -> list[str]:
        return [name for name in MEDIA if self.media & _BIT[name]]


class Holdings:
    """int_block_hashes: hashes are indexed (and asked for) in the form the stream publishes
    them (`[events] int_block_hashes`), so a router asks with what it read; an object put
    without a route is then indexed under its id's int form too."""

    def __init__(self, int_block_hashes: bool = True):
        self.int_block_hashes = int_block_hashes
        self._objects: dict[str, dict[bytes, Held]] = {}
        self._by_hash: dict[str, dict] = {}  # namespace -> block hash -> digest, or a tuple of digests
        self._peer: dict[tuple[str, bytes], None] = {}  # objects marked PEER, oldest first

    def add(self, namespace: str, digest: bytes, medium: str, route: bytes | None, block_size: int,
            session_id: str | None) -> Held | None:
        """Mark `digest` held in `medium`: its record, or None if it was held there already
        (nothing to publish)."""
        objects = self._objects.setdefault(namespace, {})
        held = objects.get(digest)
        if held is None:
            held = objects[digest] = Held(route, block_size, session_id)
            self._index(namespace, digest, route)
        bit = _BIT[medium]
        if held.media & bit:
            return None
        held.media |= bit
        if bit == _PEER:
            self._peer[(namespace, digest)] = None
        return held

    def over_peer_cap(self) -> list[tuple[str, bytes]]:
        """The oldest PEER marks past MAX_PEER_OBJECTS: (namespace, digest) to unmark."""
        excess = len(self._peer) - MAX_PEER_OBJECTS
        return list(itertools.islice(self._peer, excess)) if excess > 0 else []

    def remove(self, namespace: str, digest: bytes, medium: str) -> Held | None:
        """Unmark `digest` in `medium`: its record, or None if it was not held there."""
        objects = self._objects.get(namespace)
        held = None if objects is None else objects.get(digest)
        bit = _BIT[medium]
        if held is None or not held.media & bit:
            return None
        held.media &= ~bit
        if bit == _PEER:
            self._peer.pop((namespace, digest), None)
        if not held.media:
            del objects[digest]
            self._unindex(namespace, digest, held.route)
        return held

    def clear(self, namespace: str) -> None:
        self._objects.pop(namespace, None)
        self._by_hash.pop(namespace, None)
        self._peer = {key: None for key in self._peer if key[0] != namespace}

    def items(self, namespace: str) -> list[tuple[bytes, Held]]:
        """Every object of `namespace` and its record (a copy of the list, in one call)."""
        return list(self._objects.get(namespace, {}).items())

    def get(self, namespace: str, digest: bytes) -> Held | None:
        return self._objects.get(namespace, {}).get(digest)

    def objects_of(self, namespace: str, block_hash) -> tuple[bytes, ...]:
        """The objects whose route names `block_hash` (bytes or int, as published or as the
        route gave it), in no order."""
        found = self._by_hash.get(namespace, {}).get(published_hash(block_hash, self.int_block_hashes))
        if found is None:
            return ()
        return found if isinstance(found, tuple) else (found,)

    def count(self) -> int:
        return sum(map(len, self._objects.values()))

    def _keys(self, digest: bytes, route: bytes | None) -> list:
        """What an object is indexed under: its route's hashes as published; without a route,
        its id's int form (its bytes form is its own key in _objects)."""
        if route is None:
            return [published_hash(digest, True)] if self.int_block_hashes else []
        return [published_hash(h, self.int_block_hashes) for h in route_fields(route)["block_hashes"]]

    def _index(self, namespace: str, digest: bytes, route: bytes | None) -> None:
        keys = self._keys(digest, route)
        if not keys:
            return
        index = self._by_hash.setdefault(namespace, {})
        for h in keys:
            found = index.get(h)
            if found is None:
                index[h] = digest
            elif isinstance(found, tuple):
                if digest not in found:
                    index[h] = found + (digest,)
            elif found != digest:
                index[h] = (found, digest)

    def _unindex(self, namespace: str, digest: bytes, route: bytes | None) -> None:
        index = self._by_hash.get(namespace, {})
        for h in self._keys(digest, route):
            found = index.get(h)
            if found == digest:
                del index[h]
            elif isinstance(found, tuple) and digest in found:
                rest = tuple(d for d in found if d != digest)
                index[h] = rest[0] if len(rest) == 1 else rest
