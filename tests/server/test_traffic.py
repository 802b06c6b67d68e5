"""Traffic.pause: background copies wait for the clients to pause, and never longer than
their bound. On a simulated clock: each sleep advances it, and clients act at set times."""

import asyncio

import pytest

from kvstore.messages import TOUCH_WITHIN_S
from kvstore.server.traffic import Traffic


class Timeline:
    """A clock that sleeps advance; `at` holds what clients do at which time."""

    def __init__(self, at: dict[float, str]):
        self.now, self.at, self.slept = 0.0, dict(sorted(at.items())), []
        self.traffic = Traffic(clock=lambda: self.now, sleep=self.sleep)

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        end = self.now + seconds
        for t in [t for t in self.at if t <= end]:  # what clients did meanwhile, in order
            self.now = t
            getattr(self.traffic, self.at.pop(t))()
        self.now = end


def pause(timeline: Timeline, quiet_s: float, at_most_s: float) -> float:
    """When (on the timeline) the pause ended."""
    asyncio.run(timeline.traffic.pause(quiet_s, at_most_s))
    return timeline.now


def test_no_client_heard_yet_means_no_wait():
    timeline = Timeline({})
    assert pause(timeline, 0.01, 1.0) == 0.0 and timeline.slept == []


def test_a_copy_goes_once_the_clients_fell_quiet():
    timeline = Timeline({0.004: "heard", 0.013: "heard"})
    timeline.traffic.heard()  # at 0
    assert pause(timeline, 0.01, 1.0) == pytest.approx(0.013 + 0.01)  # quiet since the last request


def test_steady_requests_delay_a_copy_by_the_bound_only():
    timeline = Timeline({t / 1000: "heard" for t in range(1, 500, 3)})  # a request every 3 ms
    timeline.traffic.heard()
    assert pause(timeline, 0.01, 0.2) == pytest.approx(0.2)


def test_a_report_of_shared_index_reads_counts_as_reading_until_the_next_report_is_due():
    timeline = Timeline({0.002: "reading"})
    timeline.traffic.heard()
    assert pause(timeline, 0.01, 1.0) == pytest.approx(0.002 + TOUCH_WITHIN_S + 0.01)
    later = Timeline({})
    later.traffic.reading()
    later.traffic.heard()  # a request right after does not shorten the span the report covers
    assert pause(later, 0.01, 1.0) == pytest.approx(TOUCH_WITHIN_S + 0.01)
