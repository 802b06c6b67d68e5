"""TinyLFU-style admission: a count-min sketch of recent reads decides what a lower tier takes.

    record(key):   increment the key's 4 counters (saturating at 15)
                   every `sample_size` records, halve every counter (recent reads count more)
    estimate(key): the minimum of the key's 4 counters
    admit(key):    estimate(key) >= min_hits

Pure bookkeeping, no I/O. The in-process hash of a key is fine here: the sketch never
leaves the process and a collision only over-estimates a frequency.
"""

from __future__ import annotations

from typing import Hashable

from kvstore.errors import InvalidArgument

_ROWS = 4
_MAX_COUNT = 15
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1


class FrequencyAdmission:
    def __init__(self, width: int = 1 << 16, min_hits: int = 1, sample_size: int | None = None):
        if width < 16 or width & (width - 1):
            raise InvalidArgument(f"sketch width must be a power of two >= 16, got {width}")
        if min_hits < 0:
            raise InvalidArgument(f"min_hits must be >= 0, got {min_hits}")
        self.width = width
        self.min_hits = min_hits
        self.sample_size = sample_size or 10 * width
        self._rows = [bytearray(width) for _ in range(_ROWS)]
        self._records = 0
        self.num_admitted = 0
        self.num_rejected = 0

    def _slots(self, key: Hashable):
        h = hash(key) & _MASK64
        for seed in _SEEDS:
            yield ((h * seed) & _MASK64) >> (64 - self.width.bit_length() + 1)

    def record(self, key: Hashable) -> None:
        for row, slot in zip(self._rows, self._slots(key)):
            if row[slot] < _MAX_COUNT:
                row[slot] += 1
        self._records += 1
        if self._records >= self.sample_size:
            self._age()

    def _age(self) -> None:
        self._records = 0
        for row in self._rows:
            row[:] = bytes(c >> 1 for c in row)

    def estimate(self, key: Hashable) -> int:
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key)))

    def admit(self, key: Hashable) -> bool:
        admitted = self.estimate(key) >= self.min_hits
        if admitted:
            self.num_admitted += 1
        else:
            self.num_rejected += 1
        return admitted
