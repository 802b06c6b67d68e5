"""What many test modules share (tests/ is on sys.path: `from kvs_testing import ...`).

Payloads are deterministic, so a reader can check bytes without keeping them; the waits
poll a condition with a liveness bound, never measure time.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

from bench.baselines import free_port  # noqa: F401 (tests import it from here)

from kvstore import messages as m
from kvstore import replies as r
from kvstore.config import GPU_ALIGNMENT_BYTES
from kvstore.errors import from_wire
from kvstore.identity import ObjectId
from kvstore.tiers.allocator import Extent, ExtentAllocator


def payload(size: int, seed) -> np.ndarray:
    """`size` bytes fixed by `seed`: an int, or an ObjectId (its digest seeds them, so the
    bytes of an id are known wherever the id is)."""
    if isinstance(seed, ObjectId):
        seed = int.from_bytes(seed.digest[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sent_ops(client) -> list:
    """The ops `client` sends from now on, in order (its requests are recorded as made)."""
    sent, request = [], client.core.request

    def record(msg, no_reply=False):
        sent.append(msg.op)
        return request(msg, no_reply)
    client.core.request = record
    return sent


def read_back(client, key, size: int) -> np.ndarray | None:
    """The object's `size` bytes read with get_into; None on a miss or another size."""
    out = np.empty(size, np.uint8)
    return out if client.get_into(key, out) == size else None


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


def commit_one(client, lease: int, checksum: bytes) -> r.CommitReply:
    """Commit one write lease the way clients do, as a commit_many of one (client/batched.py):
    its CommitReply, or the error the daemon reported for it raised (the wire has no
    single-object commit). Asserts the reply holds that one item and no other error."""
    done = client._run(client.core.op_simple(m.CommitMany.of([lease], [checksum])))
    assert len(done.codes) == 1, done
    if done.codes[0] == r.FAILED:
        ((index, error),) = done.errors
        assert index == 0, done
        raise from_wire(error)
    assert not done.errors, done
    return done.results()[0]


class NumpyDevice:
    """GpuTier's surface over host memory (what GpuCopies and the daemon need of a device): the
    one stand-in for a GPU, which this machine lacks. The real GpuTier runs in gpu-marked tests."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.allocator = ExtentAllocator(capacity_bytes, GPU_ALIGNMENT_BYTES)
        self.buffer = np.zeros(capacity_bytes, dtype=np.uint8)
        self.fail_next_copy = False

    def can_alloc(self, size_bytes: int) -> bool:
        return self.allocator.can_alloc(size_bytes)

    def alloc(self, size_bytes: int) -> Extent | None:
        return self.allocator.alloc(size_bytes)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def view(self, extent: Extent) -> np.ndarray:
        return self.buffer[extent.offset : extent.end]

    def copy_from_host(self, extent: Extent, src: np.ndarray) -> None:
        if self.fail_next_copy:
            self.fail_next_copy = False
            raise RuntimeError("copy failed (as a CUDA error would)")
        self.view(extent)[: src.size] = src

    def check_integrity(self) -> None:
        self.allocator.check_integrity()


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def reserved_huge_pages(count: int):
    """`count` more huge pages reserved while the block runs (root), then put back."""
    try:
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before + count))
        with open(NR_HUGEPAGES) as f:
            got = int(f.read()) - before
    except OSError as exc:
        pytest.skip(f"cannot reserve huge pages here ({exc}): needs root and a kernel with hugetlbfs")
    try:
        if got < count:
            pytest.skip(f"the kernel reserved {got} of {count} huge pages (memory too fragmented)")
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))
