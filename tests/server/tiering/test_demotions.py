"""DemotionTally: the peer tier's and the pool's demotion counts and their once-a-second log."""

from kvstore.server.cluster.replicate import ReplicaCounters
from kvstore.server.pool.puts import PoolWriteCounters
from kvstore.server.tiering.demotions import DemotionTally


class Entry:
    def __init__(self, object_id):
        self.object_id = object_id


def test_counts_taken_and_refused_skips_gone_and_logs_once_a_second():
    now = [100.0]
    for counters in (ReplicaCounters(), PoolWriteCounters()):  # both remote tiers' counters
        tally = DemotionTally(counters, clock=lambda: now[0])
        assert tally.count([Entry("a"), "b", "c"], [True, False, None]) == ["b"]  # entries or ids
        assert (counters.num_demoted_remote, counters.num_demotion_failures) == (1, 1)
        now[0] += 0.5
        assert tally.count(["d"], [False]) == []  # counted, not logged again within the second
        assert counters.num_demotion_failures == 2
        now[0] += 0.6
        assert tally.count([Entry("e"), "f"], [False, True]) == ["e"]
        assert (counters.num_demoted_remote, counters.num_demotion_failures) == (2, 3)
        assert tally.count(["g"], [True]) == []  # nothing failed: nothing to log
