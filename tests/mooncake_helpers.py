"""Real Mooncake Store processes for tests: a `mooncake_master` on loopback (TCP,
P2PHANDSHAKE metadata, free ports) and a keeper (tests/mooncake_keeper.py) that lends the
pool its memory and reads and writes it with Mooncake's own client."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from kvs_testing import payload, free_port, wait_for

START_TIMEOUT_S = 30.0


def mooncake_or_skip() -> str:
    """The mooncake_master executable; skips when the wheel is not installed."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"mooncake does not import ({exc}): pip install -e '.[mooncake]' (and apt-get install "
                    "libibverbs1), as scripts/setup.sh does")
    exe = shutil.which("mooncake_master", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    if exe is None:
        pytest.skip("mooncake_master is not on PATH (the mooncake-transfer-engine-non-cuda wheel ships it)")
    return exe


class Master:
    """A mooncake_master on 127.0.0.1 (`address`); kill() and start() again on the same port."""

    def __init__(self, exe: str, workdir: str):
        self.exe, self.workdir = exe, workdir
        # the daemons know the address before the master starts (and again after a kill)
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Master:
        log = open(os.path.join(self.workdir, "mooncake_master.log"), "a")
        self.proc = subprocess.Popen([self.exe, "--rpc_address=127.0.0.1", f"--rpc_port={self.port}",
                                      f"--metrics_port={self.metrics_port}"],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"mooncake_master exited with {self.proc.returncode}"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return self
            time.sleep(0.05)
        raise AssertionError(f"mooncake_master did not listen on {self.address}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


class Keeper:
    """tests/mooncake_keeper.py: the pool's memory, and Mooncake's own client for the test."""

    def __init__(self, master: Master, segment_bytes: int = 64 << 20):
        keeper = os.path.join(os.path.dirname(__file__), "mooncake_keeper.py")
        self.log = open(os.path.join(master.workdir, "keeper.log"), "a")
        self.proc = subprocess.Popen([sys.executable, keeper, master.address, str(segment_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        assert ready.get("ready"), f"the keeper's Mooncake client did not set up: {ready}"

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def get(self, key: str) -> bytes | None:
        data = self._ask(op="get", key=key)["data"]
        return None if data is None else base64.b64decode(data)

    def put(self, key: str, data: bytes) -> int:
        return self._ask(op="put", key=key, data=base64.b64encode(data).decode())["rc"]

    def remove(self, key: str) -> int:
        return self._ask(op="remove", key=key)["rc"]

    def replace(self, key: str, data: bytes) -> None:
        """Write `data` under `key` in place of its value, as Mooncake's own client can."""
        assert self.remove(key) == 0 and self.put(key, data) == 0

    def flip(self, key: str, at: int, mask: int) -> None:
        """XOR one byte of the value under `key` (at: its offset in the value) with mask."""
        value = bytearray(self.get(key))
        value[at] ^= mask
        self.replace(key, bytes(value))

    def exist(self, keys: list[str]) -> list[int]:
        return self._ask(op="exist", keys=keys)["codes"]

    def fill(self, chunk_bytes: int = 4 << 20) -> int:
        return self._ask(op="fill", bytes=chunk_bytes)["stored"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def pool_config(master: Master, **mooncake) -> dict:
    """A daemon's config for the pool at `master` (a client only: the keeper lends the memory)."""
    return {"remote": {"backend": "mooncake",
                       "mooncake": {"master": master.address, "local_buffer_bytes": "16MiB",
                                    "retry_interval_s": 0.5, **mooncake}}}


def oids(first: int, n: int):
    from kvstore.identity import ObjectId
    return [ObjectId(bytes([first + i]) * 32) for i in range(n)]


def pool_stats(client) -> dict:
    return client.stats()["tiers"]["remote"]


def put_into_pool(client, keys, sizes) -> None:
    """Put payload(sizes[i], i) under each key and wait until the pool holds them all
    (write_through copies each commit there in the background)."""
    for i, key in enumerate(keys):
        client.put(key, payload(sizes[i], i))
    assert wait_for(lambda: pool_stats(client)["num_replicated"] == len(keys))


def pool_up(*clients) -> None:
    """Wait until each daemon's Mooncake client is set up (it connects in the background:
    a commit made before then is not copied to the pool; it goes when it leaves the node)."""
    assert wait_for(lambda: all(pool_stats(c)["pool"]["up"] for c in clients), timeout=60)
