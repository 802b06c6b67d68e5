"""Ranged reads of chunk objects: what a sparse-attention page selection turns into.

A selection names (layer, page) pairs; page p of a request is block p % blocks_per_chunk of
chunk p // blocks_per_chunk. The reader turns {chunk: [(layer, block), ...]} into the byte
ranges of `Layout.ranges` (adjacent segments merged) and copies only those out of the
chunk's read lease. It keeps one lease per chunk of a request until `release(request_id)`, so
later steps pay a memcpy, not a round trip; the daemon neither moves nor evicts a leased object.
The get names the ranges: a chunk that only its home nodes hold (a cluster) comes back as
just those bytes, so a sparse step moves its pages over the network, not the whole chunk;
such a lease serves that step only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from kvstore.identity import StateDescriptor
from kvstore.ranges import MAX_RANGES


@dataclass(slots=True)
class _Leases:
    keys: list = field(default_factory=list)  # ChunkKeys of the request's full chunks
    by_chunk: dict = field(default_factory=dict)  # chunk -> ReadLease


class SegmentReader:
    def __init__(self, link, descriptor: StateDescriptor, keys_of):
        """link: a FailSoftLink; keys_of(token_ids) -> the ChunkKeys of those tokens."""
        self.link = link
        self.descriptor = descriptor
        self.bytes_read = 0
        self._keys_of = keys_of
        self._requests: dict = {}

    def read(self, request_id, token_ids, wanted: dict) -> dict | None:
        """{chunk: [(layer, block), ...]} -> {(chunk, layer, block): uint8 array, the caller's};
        None on any store failure or miss (the caller recomputes)."""
        req = self._requests.setdefault(request_id, _Leases())
        desc, chunk_tokens = self.descriptor, self.descriptor.chunk_tokens
        last = max(wanted, default=-1)
        if len(req.keys) <= last:
            req.keys = self._keys_of(token_ids[:(last + 1) * chunk_tokens])
            if len(req.keys) <= last:
                raise InvalidArgument(f"chunk {last} is not a full chunk of the {len(token_ids)} tokens")

        def read(client):
            out = {}
            for chunk in [c for c, lease in req.by_chunk.items() if lease.closed]:
                del req.by_chunk[chunk]  # its connection died (the link reconnected): the daemon took it back
            for chunk, pairs in wanted.items():
                spans = desc.layout.ranges(pairs, desc.dtype, chunk_tokens)
                lease = req.by_chunk.get(chunk)
                if lease is None:
                    asked = [(s.offset, s.length) for s in spans] if len(spans) <= MAX_RANGES else None
                    lease = client.get(req.keys[chunk], ranges=asked)  # expects its descriptor
                    if lease is None:
                        return None
                    if lease.ranges is None:  # whole and on this node: keep it for later steps
                        req.by_chunk[chunk] = lease
                try:
                    for span in spans:
                        data = lease.read(span.offset, span.length).copy()
                        self.bytes_read += span.length
                        for layer, block in pairs:
                            seg = desc.layout.segment(layer, block, desc.dtype, chunk_tokens)
                            if span.offset <= seg.offset < span.offset + span.length:
                                out[(chunk, layer, block)] = data[seg.offset - span.offset:][:seg.length]
                finally:
                    if lease.ranges is not None:  # just this step's pages, fetched from a home node
                        lease.release()
            return out

        return self.link.call(read)

    def release(self, request_id) -> None:
        req = self._requests.pop(request_id, None)
        for lease in (req.by_chunk.values() if req is not None else ()):
            lease.release()

    def close(self) -> None:
        for request_id in list(self._requests):
            self.release(request_id)
