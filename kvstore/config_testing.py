"""The `[testing]` table: delays at the daemon's race windows, for tests and the checker only.

A race window is an await between reading state and acting on it (an NVMe write between
"this entry is live" and "NVMe holds it", a promotion between the read and the publish). On
an idle machine they last microseconds and a delete, a cancel or a restart rarely lands in
one; with a delay there, it does (FoundationDB's BUGGIFY, TigerBeetle's VOPR). The daemon
sleeps a random delay_min_ms..delay_max_ms at each named point, drawn from delay_seed. Off unless
`delay_points` names some; never for production (every such await costs latency).

    [testing]
    delay_points = ["nvme_write", "nvme_read"]   # of WINDOWS below; ["all"] for every one
    delay_min_ms = 0                             # a window always this wide (a test that
    delay_max_ms = 20                            # must land a delete inside one)
    delay_seed = 0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvstore.errors import InvalidArgument

# The race windows the daemon can widen, and where each is.
WINDOWS = {
    "nvme_write": "a host entry being copied to NVMe: before the write and before NVMe is said to hold it",
    "nvme_read": "a promotion from NVMe: after the read, before the host entry is published",
    "nvme_delete": "a delete, an eviction or an expiry of an NVMe copy: before the record is removed",
    "victims": "host victims chosen, before they are written down and evicted",
}
# A delay past this is a typo: a whole window lasting a minute tests nothing more.
MAX_DELAY_MS = 60_000.0


@dataclass(frozen=True, slots=True)
class TestingConfig:
    __test__ = False  # not a pytest test class, whatever its name says
    delay_points: tuple = ()
    delay_min_ms: float = 0.0
    delay_max_ms: float = 20.0
    delay_seed: int = 0

    def __post_init__(self) -> None:
        points = tuple(self.delay_points)
        unknown = [p for p in points if p not in WINDOWS and p != "all"]
        if unknown:
            raise InvalidArgument(f"testing.delay_points: unknown {unknown}; known: {sorted(WINDOWS)} or 'all'")
        for name in ("delay_min_ms", "delay_max_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and 0 <= value <= MAX_DELAY_MS):
                raise InvalidArgument(f"testing.{name} must be 0..{MAX_DELAY_MS:g}, got {value!r}")
        if self.delay_min_ms > self.delay_max_ms:
            raise InvalidArgument(f"testing.delay_min_ms ({self.delay_min_ms}) is more than delay_max_ms "
                                  f"({self.delay_max_ms})")
        if type(self.delay_seed) is not int:
            raise InvalidArgument(f"testing.delay_seed must be an integer, got {self.delay_seed!r}")

    @property
    def points(self) -> frozenset:
        """The windows to widen ("all" named: every one)."""
        return frozenset(WINDOWS) if "all" in self.delay_points else frozenset(self.delay_points)
