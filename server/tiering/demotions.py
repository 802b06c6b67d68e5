"""DemotionTally: what became of the objects a remote tier was sent as they left this node,
counted one way for the peer tier (server/cluster) and a Mooncake pool (server/pool)."""

from __future__ import annotations

import math
import time

# With a home or the pool down every eviction fails alike: one log line a second, not one an object.
LOG_INTERVAL_S = 1.0


class DemotionTally:
    """counters: the remote tier's counters, with num_demoted_remote and num_demotion_failures.
    Loop thread only."""

    def __init__(self, counters, clock=time.monotonic):
        self.counters, self.clock = counters, clock
        self._logged_at = -math.inf

    def count(self, items, results) -> list:
        """results: per item True (the remote tier holds it now), False (it did not take it)
        or None (the object was gone meanwhile: not counted). Items are entries or object
        ids. Returns the failed objects' ids when a log line is due, else []."""
        failed = []
        for item, ok in zip(items, results):
            if ok is None:
                continue
            if ok:
                self.counters.num_demoted_remote += 1
            else:
                self.counters.num_demotion_failures += 1
                failed.append(getattr(item, "object_id", item))
        now = self.clock()
        if not failed or now - self._logged_at < LOG_INTERVAL_S:
            return []
        self._logged_at = now
        return failed
