"""Copy bytes into an arena and hash what landed there, in one pass: what a client does
for every put, and what the daemon does for a put whose bytes came in its frame
(kvstore/messages.py: PutInline). Buffers of bytes (uint8 arrays, bytes, memoryviews of
them), through memoryviews: as fast as numpy's copyto here, and kvstore stays free of
numpy at import time."""

from __future__ import annotations

import xxhash

# Copy-and-hash granularity: fits in L2 with room to spare.
HASH_BLOCK_BYTES = 256 << 10


def copy_and_hash(dst, src) -> bytes:
    """Copy src into dst (the same number of bytes) and return the xxh3-128 of what landed
    in dst.

    Block by block, so each block is hashed while it is still in cache: one pass over
    memory instead of two.
    """
    dst, src = memoryview(dst), memoryview(src)
    size = len(src)
    if size <= HASH_BLOCK_BYTES:
        dst[:] = src
        return xxhash.xxh3_128_digest(dst)
    hasher = xxhash.xxh3_128()
    for start in range(0, size, HASH_BLOCK_BYTES):
        block = dst[start:start + HASH_BLOCK_BYTES]
        block[:] = src[start:start + HASH_BLOCK_BYTES]
        hasher.update(block)
    return hasher.digest()
