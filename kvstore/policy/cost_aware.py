"""Cost-aware S3-FIFO: S3-FIFO's queues and moves, with a cost-per-byte choice of victim.

    select(Q):                     # Q is S or M, picked exactly as S3-FIFO picks it
        C = []
        while |C| < W and Q yields its next S3-FIFO victim t:    # W = 4; promotions, second
            C.append(t)                                          # chances, pinned skips as usual
        v = the t in C with the lowest score; ties go to the oldest
        push C - {v} back at Q's tail, in their original order
        return v
    score(t)  = recompute_cost(t) * reuse_weight(t) / t.size_bytes
    reuse_weight(t) = (1 + t.freq) * 2 ** (t.priority / 5)
    recompute_cost(t) defaults to t.size_bytes, so an object without a cost hint scores
    reuse_weight(t) alone: plain S3-FIFO order, bent only by priority.
    Costs are compared as given: hint every object of a tier in one unit, or none.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvstore.policy.base import FREQ_MASK, priority_of, size_of
from kvstore.policy.s3fifo import S3FIFO, _Scan

# Wide enough to find a cheap object near the tail, narrow enough that age still
# dominates (a fresh object is never chosen over an old one) and selection stays O(1).
CANDIDATE_WINDOW = 4
# Every 5 priority points double (or halve) an object's worth: priority 10 counts 4x.
PRIORITY_DOUBLING = 5


def score(state: int, recompute_cost: float | None) -> float:
    """Worth of keeping an object (its policy state and cost hint), per byte it occupies;
    the lowest is evicted first."""
    size = size_of(state)
    cost = size if recompute_cost is None else recompute_cost
    reuse_weight = (1 + (state & FREQ_MASK)) * 2 ** (priority_of(state) / PRIORITY_DOUBLING)
    return cost * reuse_weight / size


class CostAwareS3FIFO(S3FIFO):
    """S3-FIFO that evicts the cheapest of up to 4 exhausted candidates at a queue's tail."""

    name = "cost_aware"

    def _select(self, from_small: bool, scan: _Scan) -> tuple[Hashable, int] | None:
        candidates: list[tuple[Hashable, int]] = []
        while len(candidates) < CANDIDATE_WINDOW:
            picked = self._next_candidate(from_small, scan)
            if picked is None:
                break
            candidates.append(picked)
        if not candidates:
            return None
        # min() keeps the first of equal scores: the oldest, as plain FIFO would.
        costs = self._costs
        best = min(range(len(candidates)), key=lambda i: score(candidates[i][1], costs.get(candidates[i][0])))
        self._push_tail(self._queue(from_small), [key for key, _ in candidates[:best] + candidates[best + 1 :]])
        return candidates[best]
