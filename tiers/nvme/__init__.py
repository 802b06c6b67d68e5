"""The NVMe tier: objects in preallocated data files, found through a RocksDB index.

    put:    reserve an extent -> write it (O_DIRECT) -> fdatasync -> index entry
              "sync":  fdatasync (shared by the puts in flight, files.SyncBarrier), then
                       the entry is written with WAL sync (RocksDB groups concurrent ones)
                       before put returns
              "group": the entry waits in a journal (group_commit.py); every
                       group_commit_ms a thread fdatasyncs the files written since and
                       writes the waiting entries in one synced batch. Until then the
                       object is readable but would not survive a crash.
            (A "sync" put that ran a group commit itself measured 0.6x of this here: one
            commit at a time serialises the data flush and the WAL flush, where separate
            puts overlap them.)
    get:    index -> read the extent -> verify xxh3-128 -> bytes, or a miss (and the object
            is dropped) when the check fails; never unverified bytes.
    delete: index entry removed (synced, or in the next group), then the extent is freed;
            an extent under a read is freed when the read ends.
    open:   volume.py opens the directory; recovery.py rebuilds the allocators from the index.

Every index entry points at data that was synced before the entry was written: after a crash,
each entry finds its own bytes, and an extent that was being written but never indexed is
simply free again.

Verification: get_into checks the object's xxh3-128. read_range checks only the 64 KiB
blocks it reads, against xxh3-64 sums that put takes in the same pass as the xxh3-128 and
refuses to store unless that pass matches the caller's checksum, so both vouch for the same
bytes. A restart checks every entry against the data files but checksums only a bounded
random sample (recovery.py); every later read verifies.

The modules, from the top:
    tier.py          NvmeTier: the operations, the lock, keys in flight, counters
    volume.py        the directory: index and data files opened, format checked, closed
    group_commit.py  index changes waiting for the next synced batch ("group" durability)
    extents.py       who holds each allocated extent (indexed, reserved, read, doomed...)
    recovery.py      restart: the allocators rebuilt from the index, a sample verified
    index.py         the RocksDB index: keys, records and their encoding
    files.py         data-file I/O: O_DIRECT, aligned and bounce buffers, checksums in one pass
    types.py         what the tier hands back: NvmePut, NvmeMeta
"""

from kvstore.tiers.nvme.files import ALIGN, VERIFY_BLOCK_BYTES
from kvstore.tiers.nvme.recovery import RecoveryReport
from kvstore.tiers.nvme.tier import NvmeTier
from kvstore.tiers.nvme.types import CHECKSUM_BYTES, NvmeMeta, NvmePut

__all__ = ["ALIGN", "CHECKSUM_BYTES", "VERIFY_BLOCK_BYTES", "NvmeMeta", "NvmePut", "NvmeTier", "RecoveryReport"]
