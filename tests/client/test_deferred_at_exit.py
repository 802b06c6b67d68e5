"""Deferred puts (put(wait=False)) are never lost silently when a program forgets close()
(issue 41, item 7): the sync client stores them when it is collected and at interpreter exit;
the asyncio client, which has no event loop to store them with then, warns."""

import gc
import os
import subprocess
import sys
import textwrap

import numpy as np

from kvstore.client import Client
from kvstore.identity import ObjectId
from kvs_testing import payload, read_back

SIZE = 4096
KEYS = [ObjectId(bytes([i + 1]) * 32) for i in range(5)]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(body: str, socket: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
        from kvstore.client import AsyncClient, Client
        from kvstore.identity import ObjectId
        from kvs_testing import payload
        SOCKET = {socket!r}
        KEYS = [ObjectId(bytes([i + 1]) * 32) for i in range(5)]
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)


def stored(d) -> list[bool]:
    with d.client() as c:
        return [(got := read_back(c, key, SIZE)) is not None and np.array_equal(got, payload(SIZE, i))
                for i, key in enumerate(KEYS)]


def test_a_script_that_exits_without_close_stores_its_deferred_puts(daemon):
    done = run_script("""
        c = Client.connect(SOCKET)
        for i, key in enumerate(KEYS):
            c.put(key, payload(4096, i), wait=False)
        # no close(), no flush(): the interpreter exits
    """, daemon.socket)
    assert done.returncode == 0, done.stderr
    assert stored(daemon) == [True] * len(KEYS)


def test_a_client_collected_without_close_stores_its_deferred_puts(daemon):
    c = Client.connect(daemon.socket)
    for i, key in enumerate(KEYS):
        c.put(key, payload(SIZE, i), wait=False)
    del c
    gc.collect()
    assert stored(daemon) == [True] * len(KEYS)


def test_an_async_client_left_open_at_exit_says_its_deferred_puts_are_lost(daemon):
    done = run_script("""
        async def main():
            global c
            c = await AsyncClient.connect(SOCKET)
            for i, key in enumerate(KEYS):
                await c.put(key, payload(4096, i), wait=False)
        asyncio.run(main())
    """, daemon.socket)
    assert done.returncode == 0, done.stderr
    assert "5 deferred put(s)" in done.stderr and "were never stored" in done.stderr, done.stderr
    assert stored(daemon) == [False] * len(KEYS)  # and the warning is true
