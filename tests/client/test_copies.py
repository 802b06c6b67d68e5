"""client/copies.py: large copies on two threads land the same bytes and the same checksum
as one thread's, at every size around the thresholds, and survive a fork."""

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.checksums import HASH_BLOCK_BYTES
from kvstore.client import copies
from kvs_testing import payload

MiB = 1 << 20
SIZES = [1, HASH_BLOCK_BYTES + 1, copies.PARALLEL_BYTES - 1, copies.PARALLEL_BYTES, copies.PARALLEL_BYTES + 4097,
         copies.PARALLEL_HASHED_BYTES - 1, copies.PARALLEL_HASHED_BYTES, copies.PARALLEL_HASHED_BYTES + 12345,
         3 * copies.PARALLEL_HASHED_BYTES + 7]


@pytest.mark.parametrize("size", SIZES)
def test_a_copy_lands_every_byte_and_nothing_past_it(size):
    src = payload(size, size)
    dst = np.zeros(size + 64, np.uint8)
    copies.copy(dst[:size], src)
    assert np.array_equal(dst[:size], src) and not dst[size:].any()


@pytest.mark.parametrize("size", SIZES)
def test_a_hashed_copy_returns_the_xxh3_of_what_landed(size):
    src = payload(size, size + 1)
    dst = np.zeros(size + 64, np.uint8)
    digest = copies.copy_and_hash(dst[:size], src)
    assert np.array_equal(dst[:size], src) and not dst[size:].any()
    assert digest == xxhash.xxh3_128_digest(src)


def test_large_copies_use_the_helper_thread_and_small_ones_do_not():
    copies._helper = None
    copies.copy(np.empty(MiB, np.uint8), payload(MiB, 1))
    assert copies._helper is None  # under the threshold: the calling thread alone
    size = copies.PARALLEL_HASHED_BYTES
    copies.copy_and_hash(np.empty(size, np.uint8), payload(size, 2))
    assert copies._helper is not None and copies._helper[0] == os.getpid()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_a_forked_child_copies_with_its_own_helper():
    code = """
import os, numpy as np, xxhash
from kvstore.client import copies
n = copies.PARALLEL_HASHED_BYTES
src = np.arange(n, dtype=np.uint64).view(np.uint8)[:n]
copies.copy_and_hash(np.empty(n, np.uint8), src)  # the parent's helper exists
pid = os.fork()
if pid == 0:
    ok = copies.copy_and_hash(np.empty(n, np.uint8), src) == xxhash.xxh3_128_digest(src)
    os._exit(0 if ok and copies._helper[0] == os.getpid() else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "child 0"


def test_one_copy_thread_by_setting_and_a_bad_setting_is_named():
    code = """
import numpy as np
from kvstore.client import copies
n = copies.PARALLEL_HASHED_BYTES
copies.copy_and_hash(np.empty(n, np.uint8), np.ones(n, np.uint8))
copies.copy(np.empty(n, np.uint8), np.ones(n, np.uint8))
print(copies.THREADS, copies._helper)
"""
    done = _run(code, KVSTORE_COPY_THREADS="1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1 None"
    done = _run("import kvstore.client", KVSTORE_COPY_THREADS="4")
    assert done.returncode != 0
    assert "KVSTORE_COPY_THREADS must be 1 or 2, got '4'" in done.stderr


def test_an_interrupted_copy_returns_only_once_the_helpers_half_has_landed():
    """A KeyboardInterrupt while a two-thread copy waited for its helper left the helper
    copying into memory the caller then gave back (an arena extent, which may hold another
    object next). The wait now goes on, and the interrupt is raised once the half landed."""
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with ThreadPoolExecutor(1) as pool:
            half = pool.submit(time.sleep, 0.3)  # the helper's half, still under way
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(KeyboardInterrupt):
                copies.join(half)
            assert half.done(), "the call returned while its helper was still copying"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
