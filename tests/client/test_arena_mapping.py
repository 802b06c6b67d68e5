"""A client maps the namespace's arena without allocating more of it than the daemon did."""

import os

import numpy as np
import pytest

GiB = 1 << 30


def arena_allocated_bytes(pid: int, namespace: str) -> int:
    """Bytes the daemon's arena memfd has allocated (its blocks), found among its open fds."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"/memfd:kvstore-{namespace} "):
            return os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512
    raise AssertionError(f"no arena memfd for namespace {namespace!r} in the daemon's fds")


@pytest.mark.parametrize("prefault", [False, True])
def test_a_client_allocates_no_more_of_a_lazy_arena_than_its_objects(daemon_factory, prefault):
    d = daemon_factory("1GiB", {"host": {"prefault": prefault}})
    with d.client() as c:
        c.put(os.urandom(32), np.full(4096, 7, np.uint8))
        allocated = arena_allocated_bytes(d.proc.pid, "default")
        if prefault:
            assert allocated == GiB
        else:  # mapping with MAP_POPULATE would have allocated the whole GiB here
            assert allocated < 64 << 20, f"{allocated} bytes of a lazy 1 GiB arena are allocated after one 4 KiB put"
