"""What the checker's puts write: bytes that say which version of which key of which namespace
they are, so any read can be decoded and judged without remembering what was written.

    [0:4)    b"KVSC"
    [4:6)    namespace index (u16 little-endian)
    [6:8)    key index (u16)
    [8:16)   version (u64): (worker number << 40) | that worker's put counter, never reused
    [16:)    one u64 word, mixed from the three, repeated (size is a multiple of 8)

A read of another key's or namespace's object, a torn read mixing two versions, or zeroed or
stale memory all fail decode() with a reason.
"""

from __future__ import annotations

import numpy as np

from kvstore import StateDescriptor
from kvstore.identity import ObjectId

MAGIC = b"KVSC"
NAMESPACES = ("x", "y", "z")  # tenants: each its own arena; the same key ids in each
# Per key, its size: small objects (slabs, shared-index reads), page-sized, 64 KiB (inline
# puts), and past 1 MiB (block-by-block shared-index reads, straight into the caller's buffer).
SIZES = (4096, 4096, 16 << 10, 64 << 10, 64 << 10, 256 << 10, 1 << 20, 1536 << 10)
NUM_KEYS = 24
MASK = (1 << 64) - 1


def size_of(key: int) -> int:
    return SIZES[key % len(SIZES)]


def object_id(key: int) -> ObjectId:
    """The id of key `key`: the same in every namespace (isolation is the namespace's)."""
    return ObjectId(key.to_bytes(2, "little") * 16)


def descriptor(ns: int) -> StateDescriptor:
    return StateDescriptor(NAMESPACES[ns], "checker", "1")


def _word(ns: int, key: int, version: int) -> int:
    x = (version * 0x9E3779B97F4A7C15 + (ns << 48) + (key << 32) + 1) & MASK
    x ^= x >> 31
    return (x * 0xBF58476D1CE4E5B9) & MASK


def encode(ns: int, key: int, version: int) -> np.ndarray:
    size = size_of(key)
    words = np.full(size // 8, _word(ns, key, version), np.uint64)
    data = words.view(np.uint8)
    data[:16] = np.frombuffer(MAGIC + ns.to_bytes(2, "little") + key.to_bytes(2, "little")
                              + version.to_bytes(8, "little"), np.uint8)
    return data


def decode(ns: int, key: int, data: np.ndarray) -> int | str:
    """The version `data` is of key `key` in namespace `ns`, or "bad: <why>"."""
    if data.size != size_of(key):
        return f"bad: {data.size} bytes, the key's objects have {size_of(key)}"
    head = data[:16].tobytes()
    if head[:4] != MAGIC:
        return f"bad: no magic (first bytes {head[:8].hex()})"
    got_ns, got_key = int.from_bytes(head[4:6], "little"), int.from_bytes(head[6:8], "little")
    if (got_ns, got_key) != (ns, key):
        return f"bad: bytes of namespace {got_ns} key {got_key}"
    version = int.from_bytes(head[8:16], "little")
    body = data[16:].view(np.uint64)
    wrong = np.flatnonzero(body != _word(ns, key, version))
    if wrong.size:
        return f"bad: version {version:#x}, {wrong.size} of {body.size} words of another value (torn?) from byte {16 + 8 * wrong[0]}"
    return version
