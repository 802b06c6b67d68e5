"""SegmentReader (the sparse engine's page reads) against a real daemon: whole leases kept
across steps are dropped when their connection dies, never read after the daemon took them."""

import numpy as np

from kvstore.gpu.engine.connector_ranged import SegmentReader
from kvstore import StateDescriptor, chunk_keys

DESC = StateDescriptor("default", "m", "r", kind="kv", dtype="fp32", chunk_tokens=32,
                       layout="paged(order=layer_first,layers=2,block=16,kv_heads=1,head_dim=8)")
SIZE = DESC.layout.total_bytes(DESC.dtype, DESC.chunk_tokens)
TOKENS = list(range(32))


class Link:
    """The FailSoftLink shape SegmentReader uses: call(op) runs op on the current client."""

    def __init__(self, client):
        self.client = client

    def call(self, op):
        return op(self.client)


def chunk_bytes(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


def test_a_kept_lease_whose_connection_died_is_not_read_again(daemon):
    key = chunk_keys(TOKENS, DESC)[0]
    seg = DESC.layout.segment(1, 1, DESC.dtype, DESC.chunk_tokens)
    with daemon.client() as c, daemon.client() as other:
        c.put(key, chunk_bytes(1), DESC)
        reader = SegmentReader(Link(c), DESC, lambda tokens: chunk_keys(tokens, DESC))
        first = reader.read(7, TOKENS, {0: [(1, 1)]})
        kept = reader._requests[7].by_chunk[0]
        assert np.array_equal(first[(0, 1, 1)], chunk_bytes(1)[seg.offset:seg.offset + seg.length])
        c.reconnect()  # what FailSoftLink does when a call fails: the daemon drops the old leases
        assert kept.closed
        # The chunk's old place now holds other bytes; the chunk itself lives elsewhere.
        other.delete([key])
        other.put(chunk_keys([t + 1000 for t in TOKENS], DESC)[0], chunk_bytes(2), DESC)
        other.put(key, chunk_bytes(1), DESC)
        again = reader.read(7, TOKENS, {0: [(1, 1)]})
        assert np.array_equal(again[(0, 1, 1)], chunk_bytes(1)[seg.offset:seg.offset + seg.length])
        assert reader._requests[7].by_chunk[0] is not kept
        reader.release(7)
        c.check_integrity()
        assert c.stats()["leases"] == 0
