"""Eviction policies: pure objects that track a tier's objects and choose its victims.

A policy never does I/O and imports nothing outside the standard library and
`kvstore.errors`; tiers own the bytes and act on what a policy decides.
"""

from __future__ import annotations

from kvstore.errors import InvalidArgument
from kvstore.policy.base import EvictionPolicy
from kvstore.policy.cost_aware import CostAwareS3FIFO
from kvstore.policy.lru import LRU
from kvstore.policy.s3fifo import S3FIFO

# The registry a tier's config names its policy from.
POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (S3FIFO, CostAwareS3FIFO, LRU)}


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    """Build the policy registered as `name` for a tier of `capacity_bytes`."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgument(
            f"unknown eviction policy {name!r}; use one of: {', '.join(sorted(POLICIES))}"
        )
    return cls(capacity_bytes)


__all__ = ["POLICIES", "LRU", "S3FIFO", "CostAwareS3FIFO", "EvictionPolicy", "make_policy"]
