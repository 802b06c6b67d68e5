"""TierMover.flush_host's plan (nvme_flush.py: plan_flush): which host objects a clean stop writes to NVMe, in what order."""

import math

from kvstore.hints import Hints
from kvstore.identity import ObjectId, StateDescriptor
from kvstore.server.tiering.nvme_flush import plan_flush
from kvstore.server.tiering.objects import ObjectEntry, lone_entry
from kvstore.tiers.allocator import Extent


def entry(i: int, size: int, hits: int = 0, pinned: bool = False, created_at: float = 0.0) -> ObjectEntry:
    e = lone_entry(ObjectId(bytes([i]) * 32), "t", Extent(i * 4096, 4096), size, b"\0" * 16,
                           StateDescriptor("t", "m", "r"), Hints(), now=0.0, created_at=created_at, pin=pinned)
    e.num_hits = hits
    return e


def test_pinned_then_most_read_then_newest_go_first_and_what_does_not_fit_is_counted():
    old, new, hot, pinned, big = (entry(1, 100, created_at=1.0), entry(2, 100, created_at=2.0),
                                  entry(3, 100, hits=5), entry(4, 100, pinned=True), entry(5, 1000, hits=9))
    planned, no_room = plan_flush([old, new, hot, pinned, big], free_bytes=350, now=0.0)
    assert planned == [pinned, hot, new] and no_room == 2  # big does not fit; old is last and finds no room
    assert plan_flush([old], free_bytes=0, now=0.0) == ([], 1)
    assert math.isinf(pinned.pinned_until)
