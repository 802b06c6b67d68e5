"""What many test modules share (tests/ is on sys.path: `from kvs_testing import ...`).

Payloads are deterministic, so a reader can check bytes without keeping them; the waits
poll a condition with a liveness bound, never measure time.
"""

from __future__ import annotations

import time

import numpy as np

from kvstore.identity import ObjectId


def payload(size: int, seed) -> np.ndarray:
    """`size` bytes fixed by `seed`: an int, or an ObjectId (its digest seeds them, so the
    bytes of an id are known wherever the id is)."""
    if isinstance(seed, ObjectId):
        seed = int.from_bytes(seed.digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    """Poll until predicate() is true: True, or False once `timeout` s passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def wait_until(predicate, timeout_s: float, what: str) -> None:
    """As wait_for, but an AssertionError naming `what` when it does not come true."""
    if not wait_for(predicate, timeout_s):
        raise AssertionError(f"{what}: not within {timeout_s} s")
