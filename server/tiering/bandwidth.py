"""How fast a tier below the host arena delivers: a moving average of its reads, which the
prefetch estimates read (server/tiering/index_ops.py)."""

from __future__ import annotations


def moving_bandwidth(current: float, size: int, seconds: float) -> float:
    """The average after one read of `size` bytes in `seconds` (each read weighs 0.2)."""
    return 0.8 * current + 0.2 * size / max(seconds, 1e-6)
