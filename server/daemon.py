"""Daemon wiring: the Unix socket server, housekeeping, and clean shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import time

import numpy as np

from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError
from kvstore.protocol import MAX_BATCH, MAX_FRAME_BYTES
from server.local_service import SERVER_VERSION, LocalConnection
from server.tier_manager import TierManager

log = logging.getLogger("kvstore.daemon")
HOUSEKEEPING_INTERVAL_S = 1.0
INTEGRITY_CHECK_INTERVAL_S = 30.0


class DaemonError(KVStoreError):
    code = "daemon"


def measure_copy_bandwidth(num_bytes: int = 32 << 20) -> float:
    """Bytes per second of a warm memcpy here: the host tier's load-time estimate."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return num_bytes / best


class Daemon:
    """One per node. Start with `await start()`, stop with `await stop()` or SIGTERM."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.manager = TierManager(config)
        self.connections: dict[int, LocalConnection] = {}
        self.started_at = time.time()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self.admin = None  # server.admin.AdminServer when admin.enabled
        self.ready = False  # True once recovery is done and the socket serves (GET /readyz)
        self.recovery: dict = {}
        if config.nvme.enabled:
            from server.movement import TierMover
            self.manager.mover = TierMover(self.manager, config)

    async def start(self) -> None:
        path = self.config.socket_path
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        os.makedirs(self.config.data_dir, mode=0o700, exist_ok=True)
        _claim_socket_path(path)
        if self.config.admin.enabled:  # first, so /readyz can say "recovering"
            from server.admin import AdminServer
            self.admin = AdminServer(self)
            await self.admin.start()
        self.manager.host_bandwidth_bytes_s = measure_copy_bandwidth()
        if self.manager.mover is not None:
            self.recovery = await self.manager.mover.open()
        for name in self.config.host.namespaces:  # pre-open: no client waits for their arenas
            await self.manager.open_namespace(name)
        self._server = await asyncio.get_running_loop().create_unix_server(
            lambda: LocalConnection(self), path
        )
        os.chmod(path, self.config.socket_mode)
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self.ready = True
        log.info("event=ready socket=%s arena_bytes=%d policy=%s nvme=%s pid=%d version=%s",
                 path, self.config.host.arena_bytes, self.config.host.policy,
                 self.config.nvme_path if self.config.nvme.enabled else "off", os.getpid(), SERVER_VERSION)

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopped.set)
        await self.start()
        await self._stopped.wait()
        await self.stop()

    async def stop(self) -> None:
        log.info("event=stopping clients=%d", len(self.connections))
        for task in self._tasks:
            task.cancel()
        if self.admin is not None:
            await self.admin.stop()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections.values()):
            conn.transport.close()
        await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()
        try:
            os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass
        if self.manager.mover is not None:
            if self.config.nvme.flush_on_shutdown:
                await self.manager.mover.flush_host()
            await self.manager.mover.close()
        self.manager.close()
        log.info("event=stopped")

    async def _housekeeping(self) -> None:
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                self.manager.expire()
                if time.monotonic() - last_check > INTEGRITY_CHECK_INTERVAL_S:
                    last_check = time.monotonic()
                    self.manager.check_integrity()
            except Exception:
                log.exception("event=housekeeping_failed")

    # --- used by connections ----------------------------------------------------

    def authorize(self, namespace: str, token: str | None, peer) -> None:
        """May this local client open `namespace`? The socket's 0600 mode admits only the
        daemon's user; per-namespace tokens come with the hardening work."""

    def limits_for_clients(self) -> dict:
        return {"max_frame_bytes": MAX_FRAME_BYTES, "max_batch": MAX_BATCH,
                "max_leases": self.config.limits.max_leases_per_client}

    def stats(self) -> dict:
        return {
            "version": SERVER_VERSION,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "clients": len(self.connections),
            "socket": self.config.socket_path,
            "host_bandwidth_bytes_s": self.manager.host_bandwidth_bytes_s,
            "recovery": self.recovery,
            **self.manager.stats(),
        }


def _claim_socket_path(path: str) -> None:
    """Remove a stale socket left by a dead daemon; refuse to start beside a live one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise DaemonError(f"{path} exists and is not a socket; remove it or choose another socket_path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a stale socket
        return
    finally:
        probe.close()
    raise DaemonError(f"a daemon is already serving at {path}; stop it or use another socket_path")


def run(config: ServerConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT (uvloop when installed)."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(Daemon(config).serve_forever())
