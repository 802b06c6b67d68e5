"""The shared index's layout: what the daemon writes and clients read, byte for byte.

Per namespace the daemon keeps a second memfd beside the arena: a 64-byte header, then a
fixed-size open-addressing table of 96-byte records, one per object a client may read
without asking (server/tiering/shared_index.py writes it; client/shared_reads.py reads it).
Pure: no I/O here, only the record format, where an id's slots are, and the descriptor
digest both ends compute the same way.

    header   magic u64 | version u64 | slots u64 | record bytes u64 | alive_until f64 | (24 reserved)
    record   seq u64 | object id 32 B | offset u64 | size u64 | checksum 16 B (xxh3-128)
             | descriptor digest u64 | expires_at f64 (CLOCK_MONOTONIC) | flags u64

An id lives in one of the PROBE_SLOTS slots starting at `home_slot(digest)` (wrapping); a
reader looks at all of them, a writer takes the first free one. Records never move, so a
removal only clears its own slot (no tombstones, no shifting).
"""

from __future__ import annotations

import functools
import struct

import xxhash

MAGIC = int.from_bytes(b"kvsindex", "little")
VERSION = 1
HEADER = struct.Struct("<QQQQd24x")
HEADER_BYTES = HEADER.size  # 64
# alive_until (CLOCK_MONOTONIC): the daemon moves it ALIVE_S ahead every housekeeping pass (1 s)
# and to 0 when it stops. A reader past it asks the daemon: a dead daemon's frozen table is
# not read, and the client meets DaemonUnavailable as on every other call.
ALIVE = struct.Struct("<d")
ALIVE_AT = 32
ALIVE_S = 5.0
RECORD = struct.Struct("<Q32sQQ16sQdQ")
RECORD_BYTES = RECORD.size  # 96
SEQ = struct.Struct("<Q")
OCCUPIED = 1  # flags: the record holds an object (an id of 32 zero bytes is a valid id)
# Slots one id may occupy: a reader checks at most this many records on a miss, and a writer
# that finds them all taken does not publish (readers then ask the daemon, as before).
PROBE_SLOTS = 8
# Table sizes: one slot per KiB of arena (objects below a page share pages: tiers/slabs.py),
# a power of two, between these bounds (96 B per slot: 96 MiB at the top, touched only where
# records land). Past a full table's 8-slot windows an object is not published: its readers
# ask the daemon.
MIN_SLOTS = 1024
MAX_SLOTS = 1 << 20


def slots_for(arena_bytes: int, bytes_per_slot: int = 1024) -> int:
    """The table's slot count for an arena of `arena_bytes`."""
    wanted = max(MIN_SLOTS, min(MAX_SLOTS, arena_bytes // bytes_per_slot))
    return 1 << (wanted - 1).bit_length()


def file_bytes(slots: int) -> int:
    """Bytes of the memfd holding a table of `slots` records, rounded up to whole pages."""
    return -(-(HEADER_BYTES + slots * RECORD_BYTES) // 4096) * 4096


def home_slot(digest: bytes, slots: int) -> int:
    """The first of an id's PROBE_SLOTS slots. Hashed: chunk ids are BLAKE2b outputs, but a
    caller's own ids may differ only in a few bytes (a counter). Ids that collide anyway only
    leave their own namespace's objects unpublished (read through the daemon)."""
    return xxhash.xxh3_64_intdigest(digest) & (slots - 1)


def record_at(slot: int) -> int:
    """Byte offset of `slot`'s record in the file."""
    return HEADER_BYTES + slot * RECORD_BYTES


@functools.lru_cache(maxsize=1024)
def descriptor_digest(descriptor) -> int:
    """A u64 naming a StateDescriptor: equal descriptors give equal digests in every process.
    Readers compare it with the one their `expect` gives; a different descriptor is a miss
    (two distinct descriptors share one with probability 2^-64)."""
    wire = descriptor.to_wire()
    canonical = "\x1f".join(f"{key}={wire[key]}" for key in sorted(wire))
    return xxhash.xxh3_64_intdigest(canonical.encode())
