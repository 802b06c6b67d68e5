"""The client's copies between caller buffers and the arena, on two threads when large.

One thread's copy here runs at 7-9 GB/s; memory takes more. A large copy is split: a
helper thread copies the second half while the calling thread copies the first (and, for a
put, hashes it block by block while it is in cache, then hashes the second half once the
helper's copy has landed). numpy's copy and xxhash release
the GIL, so the halves run at once (docs/architecture.md: "What bounds a 4 MiB put or
get"). KVSTORE_COPY_THREADS=1 keeps every copy on the calling thread (a process whose
cores are all busy already).

The helper is one thread per process, made at first use; a process forked from one that
had made it makes its own (a forked child has no copy of the parent's threads).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash

from kvstore.checksums import HASH_BLOCK_BYTES
from kvstore.checksums import copy_and_hash as copy_and_hash_one_thread
from kvstore.errors import InvalidArgument

# Copies from this size are split across two threads; a put's copy and hash from the
# second. Measured here over 64 distinct 4 KiB-aligned slots, one thread against two: a
# copy of 2 MiB 225 -> 233 us, 4 MiB 452 -> 347, 8 MiB 886 -> 600, 16 MiB 1790 -> 1069;
# copy and hash of 4 MiB 579 -> 639 us (the halves share memory bandwidth, and the second
# is hashed after), 8 MiB 1157 -> 976, 16 MiB 2296 -> 1799, 32 MiB 4716 -> 3631.
PARALLEL_BYTES = 4 << 20
PARALLEL_HASHED_BYTES = 8 << 20


def _threads() -> int:
    value = os.environ.get("KVSTORE_COPY_THREADS", "2")
    if value not in ("1", "2"):
        raise InvalidArgument(f"KVSTORE_COPY_THREADS must be 1 or 2, got {value!r}")
    return int(value)


THREADS = _threads()
_helper: tuple[int, ThreadPoolExecutor] | None = None


def _pool() -> ThreadPoolExecutor:
    global _helper
    if _helper is None or _helper[0] != os.getpid():
        _helper = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvstore-copy"))
    return _helper[1]


def _split(size: int) -> int:
    """Where the calling thread's half ends: a whole number of hash blocks."""
    return max(HASH_BLOCK_BYTES, (size // 2) // HASH_BLOCK_BYTES * HASH_BLOCK_BYTES)


def join(second: Future) -> None:
    """Wait for the helper's half, through a KeyboardInterrupt too (raised again once it has
    landed): the helper reads or writes memory the caller gives back when this returns (an
    arena extent whose lease or reservation then ends and which may hold another object
    next), so it must not be left running."""
    interrupted = None
    while True:
        try:
            second.result()
            break
        except KeyboardInterrupt as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src (uint8 arrays of one size)."""
    if src.size < PARALLEL_BYTES or THREADS == 1:
        np.copyto(dst, src)
        return
    half = _split(src.size)
    second = _pool().submit(np.copyto, dst[half:], src[half:])
    try:
        np.copyto(dst[:half], src[:half])
    finally:
        join(second)


def copy_and_hash(dst: np.ndarray, src: np.ndarray) -> bytes:
    """Copy src into dst and return the xxh3-128 of what landed in dst (as
    kvstore.checksums.copy_and_hash, which serves objects under PARALLEL_HASHED_BYTES)."""
    if src.size < PARALLEL_HASHED_BYTES or THREADS == 1:
        return copy_and_hash_one_thread(dst, src)
    return copy_and_hash_in_halves(dst, src)


def copy_and_hash_in_halves(dst: np.ndarray, src: np.ndarray) -> bytes:
    """copy_and_hash on two threads, whatever the size (bench/copies.py times it at any): the
    helper copies the second half while this thread copies and hashes the first block by
    block, then hashes the second half once it has landed."""
    half = _split(src.size)
    second = _pool().submit(np.copyto, dst[half:], src[half:])
    try:
        hasher = xxhash.xxh3_128()
        # kvstore.checksums.copy_and_hash's loop copies through memoryviews, which hold the
        # GIL; np.copyto releases it, so the helper's half runs meanwhile (32 MiB: that loop
        # here measured 3.4-4.0 ms, this one 2.8-3.1).
        for start in range(0, half, HASH_BLOCK_BYTES):
            block = dst[start:start + HASH_BLOCK_BYTES]
            np.copyto(block, src[start:start + HASH_BLOCK_BYTES])
            hasher.update(block)
    finally:
        join(second)
    hasher.update(dst[half:])
    return hasher.digest()
