"""Restart of the NVMe tier: rebuild the free-space maps from the index and check it.

    scan every record (fixed-width head only: file, offset, size)
      drop it if the key or record is malformed, its file is new or missing, or the extent
      is unaligned or runs past the end of its file
    sort each file's extents; drop every extent that overlaps another (the data of at most
      one of them can be right, and which one is unknowable without reading both)
    build one ExtentAllocator per file from what is left: a live extent is never free
    verify the checksum of a random sample of objects (at most SAMPLE_OBJECTS and
      SAMPLE_BYTES); drop the ones that fail
    delete every dropped record in one synced batch

Reading every object at startup would take minutes for a full disk; instead every read
verifies (files.py), and the sample catches a data file that is wholesale wrong
(replaced, truncated, zeroed) before the first client does. The allocators are rebuilt,
not persisted, so there is no second structure that could disagree with the index.
"""

from __future__ import annotations

import logging
import math
import random
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from kvstore.identity import ID_BYTES
from tiers.allocator import ExtentAllocator
from tiers.nvme.files import ALIGN, DataFile, read_object
from tiers.nvme.index import META_KEY, NvmeIndex, NvmeRecord, decode_extent

_log = logging.getLogger("kvstore.tiers.nvme")

# Startup verification budget: enough to notice a data file that is wrong as a whole,
# small enough to keep a restart with a million objects under a few seconds.
SAMPLE_OBJECTS = 64
SAMPLE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What opening the tier found. `dropped_by_reason` keys: bad_key, bad_record,
    missing_file, outside_file, overlap, checksum."""

    recovered: int
    dropped: int
    dropped_by_reason: dict = field(default_factory=dict)
    sampled: int = 0
    time_to_ready_s: float = 0.0


@dataclass(slots=True)
class Recovered:
    allocators: list[ExtentAllocator]
    objects: int
    bytes: int
    report: RecoveryReport


def recover(index: NvmeIndex, files: list[DataFile], started: float) -> Recovered:
    offsets = [array("q") for _ in files]
    lengths = [array("q") for _ in files]
    sizes = [array("q") for _ in files]
    limit = [-1 if f.created else f.size_bytes for f in files]  # -1: the file is new, its data gone
    dropped: dict[str, list[bytes]] = {}
    sample = _Reservoir(SAMPLE_OBJECTS)
    # the hot loop of a restart: a million turns, so everything is inlined
    for key, value in index.raw_items():
        head = decode_extent(value)
        if len(key) != 2 + int.from_bytes(key[:2], "big") + ID_BYTES or key[:2] == b"\0\0":
            if key != META_KEY:
                dropped.setdefault("bad_key", []).append(key)
            continue
        if head is None:
            dropped.setdefault("bad_record", []).append(key)
            continue
        file, offset, size = head
        length = (size + ALIGN - 1) & -ALIGN
        if file >= len(files) or limit[file] < 0:
            dropped.setdefault("missing_file", []).append(key)
        elif offset % ALIGN or size <= 0 or offset + length > limit[file]:
            dropped.setdefault("outside_file", []).append(key)
        else:
            offsets[file].append(offset)
            lengths[file].append(length)
            sizes[file].append(size)
            sample.offer(key, value)

    allocators, overlapping, objects, total = [], set(), 0, 0
    for f in files:
        off, ln, sz = (np.frombuffer(a, dtype=np.int64) for a in (offsets[f.index], lengths[f.index], sizes[f.index]))
        order = np.argsort(off, kind="stable")
        off, ln, sz = off[order], ln[order], sz[order]
        bad = _overlaps(off, ln)
        if bad.any():
            overlapping.update((f.index, int(o)) for o in off[bad])
            off, ln, sz = off[~bad], ln[~bad], sz[~bad]
        allocators.append(ExtentAllocator(f.size_bytes, ALIGN, allocated=(off.tolist(), ln.tolist())))
        objects += len(off)
        total += int(sz.sum())
    if overlapping:
        for key, value in index.raw_items():
            file, offset, _ = decode_extent(value) or (-1, -1, 0)
            if (file, offset) in overlapping:
                dropped.setdefault("overlap", []).append(key)

    sampled = 0
    budget = SAMPLE_BYTES
    for key, value in sample.items:
        record = NvmeRecord.decode(value)
        if (record.file, record.offset) in overlapping or record.size > budget:
            continue
        budget -= record.size
        sampled += 1
        out = memoryview(bytearray(record.size))
        try:
            good = read_object(files[record.file], record.offset, record.size, out) == record.checksum
        except OSError:
            good = False
        if not good:
            dropped.setdefault("checksum", []).append(key)
            allocators[record.file].free(record.extent)
            objects -= 1
            total -= record.size

    num_dropped = sum(map(len, dropped.values()))
    if num_dropped:
        index.write([], [k for keys in dropped.values() for k in keys], sync=True)
        _log.warning(
            "event=nvme_recovery_dropped path=%s entries=%d reasons=%s",
            index.path, num_dropped, ",".join(f"{r}:{len(k)}" for r, k in sorted(dropped.items())),
        )
    report = RecoveryReport(
        recovered=objects,
        dropped=num_dropped,
        dropped_by_reason={r: len(k) for r, k in dropped.items()},
        sampled=sampled,
        time_to_ready_s=time.monotonic() - started,
    )
    return Recovered(allocators, objects, total, report)


class _Reservoir:
    """A uniform random sample of k items from a stream of unknown length (Li's algorithm L:
    random numbers are drawn only when an item enters, about k log(n/k) times)."""

    def __init__(self, k: int):
        self.k, self.items, self._seen = k, [], 0
        self._w = math.exp(math.log(_uniform()) / k)
        self._next = k + self._skip()

    def offer(self, *item) -> None:
        self._seen += 1
        if len(self.items) < self.k:
            self.items.append(item)
        elif self._seen == self._next:
            self.items[random.randrange(self.k)] = item
            self._w *= math.exp(math.log(_uniform()) / self.k)
            self._next += self._skip()

    def _skip(self) -> int:
        return int(math.log(_uniform()) / math.log(1 - self._w)) + 1 if self._w < 1 else 1


def _uniform() -> float:
    return 1.0 - random.random()  # (0, 1]: log() is defined


def _overlaps(off: np.ndarray, ln: np.ndarray) -> np.ndarray:
    """Mask of extents (sorted by offset) that overlap any other extent."""
    bad = np.zeros(len(off), dtype=bool)
    if len(off) < 2:
        return bad
    reach = np.maximum.accumulate(off + ln)  # furthest end among extents 0..i
    for i in (np.nonzero(off[1:] < reach[:-1])[0] + 1).tolist():
        bad[i] = True  # starts inside an earlier extent; find which ones
        j = i - 1
        while j >= 0 and reach[j] > off[i]:
            if off[j] + ln[j] > off[i]:
                bad[j] = True
            j -= 1
    return bad
