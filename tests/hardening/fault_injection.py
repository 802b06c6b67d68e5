"""Fault injection for the NVMe tier, and a daemon running inside the test process.

The daemon is the real one (server.daemon.Daemon, real socket, real RocksDB and data
files) on its own event loop in a thread, so a test can replace the `os` module that
tiers/nvme/files.py uses (monkeypatch) and have the daemon's own I/O threads fail: EIO or
ENOSPC from pwritev/preadv/fdatasync, or writes and reads that move only part of what
was asked (legal for both calls; the tier must loop). Nothing here is in the product.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
from dataclasses import dataclass

from kvstore.config import ServerConfig
from kvstore.server.daemon import Daemon
from kvstore.tiers.nvme import ALIGN


@dataclass
class Rates:
    write_eio: float = 0.0
    write_enospc: float = 0.0
    short_write: float = 0.0
    read_eio: float = 0.0
    short_read: float = 0.0
    sync_eio: float = 0.0


class FaultyOs:
    """Stands in for `os` inside tiers.nvme.files; everything but the three calls is the real os."""

    def __init__(self, rates: Rates, seed: int = 0):
        self.rates = rates
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected = {name: 0 for name in vars(rates)}

    def __getattr__(self, name):
        return getattr(os, name)

    def _roll(self, name: str) -> bool:
        with self.lock:
            hit = self.rng.random() < getattr(self.rates, name)
            self.injected[name] += hit
            return hit

    def _fail(self, name: str, code: int) -> None:
        if self._roll(name):
            raise OSError(code, f"injected {os.strerror(code)}")

    def _shorten(self, name: str, buffers: list) -> list:
        """A prefix of the buffers, a whole number of ALIGN blocks long (O_DIRECT needs that)."""
        total = sum(len(b) for b in buffers)
        if total <= ALIGN or not self._roll(name):
            return buffers
        with self.lock:
            keep = self.rng.randrange(1, total // ALIGN) * ALIGN
        out = []
        for b in buffers:
            out.append(b[:keep])
            keep -= len(out[-1])
            if not keep:
                break
        return out

    def pwritev(self, fd, buffers, offset):
        self._fail("write_eio", errno.EIO)
        self._fail("write_enospc", errno.ENOSPC)
        return os.pwritev(fd, self._shorten("short_write", list(buffers)), offset)

    def preadv(self, fd, buffers, offset):
        self._fail("read_eio", errno.EIO)
        return os.preadv(fd, self._shorten("short_read", list(buffers)), offset)

    def fdatasync(self, fd):
        self._fail("sync_eio", errno.EIO)
        return os.fdatasync(fd)


class InProcessDaemon:
    """A Daemon on its own loop in a thread; `call(fn)` runs fn on that loop and returns."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.daemon = Daemon(config)
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="in-process-daemon", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.daemon.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    def start(self) -> InProcessDaemon:
        self.thread.start()
        self._started.wait(60)
        if self._error is not None:
            raise self._error
        return self

    def call(self, fn, timeout: float = 30):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def client(self, **kwargs):
        from kvstore.client import Client
        return Client.connect(self.config.socket_path, **kwargs)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.daemon.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
