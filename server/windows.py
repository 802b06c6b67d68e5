"""Delays at the daemon's race windows (the `[testing]` table, kvstore/config_testing.py).

`RaceWindows.at(point)` sleeps a random delay_min_ms..delay_max_ms when `point` is one of the widened
windows; `NoWindows.at` returns at once (the production path: one await of a finished
coroutine). Who calls them: server/tiering/nvme_mover.py at its windows, so the race tests
and the history checker (tests/checker/) make deletes, cancels and restarts land inside them.
"""

from __future__ import annotations

import asyncio
import logging
import random

from kvstore.config_testing import WINDOWS, TestingConfig

log = logging.getLogger("kvstore.testing")


class NoWindows:
    """No delays: what a daemon without `[testing] delay_points` runs."""

    async def at(self, point: str) -> None:
        return None


class RaceWindows:
    """Random delays at the named windows, from one seeded generator (reproducible in order,
    not in time: the event loop interleaves what else runs)."""

    def __init__(self, config: TestingConfig):
        self.points = config.points
        self.min_s, self.max_s = config.delay_min_ms / 1000, config.delay_max_ms / 1000
        self._rng = random.Random(config.delay_seed)
        self.num_delays = {point: 0 for point in self.points}
        log.warning("event=race_windows_widened points=%s min_ms=%g max_ms=%g seed=%d (testing only: every "
                    "such await is slower)", ",".join(sorted(self.points)), config.delay_min_ms,
                    config.delay_max_ms, config.delay_seed)

    async def at(self, point: str) -> None:
        if point not in WINDOWS:
            raise ValueError(f"unknown race window {point!r}")
        if point in self.points:
            self.num_delays[point] += 1
            await asyncio.sleep(self._rng.uniform(self.min_s, self.max_s))


def race_windows(config: TestingConfig):
    """RaceWindows when the config widens any window, else NoWindows."""
    return RaceWindows(config) if config.points else NoWindows()
