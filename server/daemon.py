"""Daemon wiring: the Unix socket server, housekeeping, and clean shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
import time
from dataclasses import replace

import numpy as np

from kvstore.config import ServerConfig
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.fields import INLINE_PUT_MAX_BYTES
from kvstore.protocol import MAX_BATCH
from kvstore.replies import ClientLimits, GpuHandleReply
from kvstore.server.data_dir import DataDirLock, HeldLock, ensure_dir, hold_data_dir
from kvstore.server.events import EventStream, NoEvents
from kvstore.server.socket_path import claim_socket_path
from kvstore.server.tiering.chain import compose
from kvstore.server.traffic import Traffic
from kvstore.server.windows import race_windows
from kvstore.server.tiering.gpu_reads import GpuReads
from kvstore.server.host_memory import check_host_tier, host_memory
from kvstore.server.local.service import SERVER_VERSION, LocalConnection, LocalServices
from kvstore.server.tiering.groups import GroupOps
from kvstore.server.tiering.manager import TierManager
from kvstore.tiers.gpu import Availability, GpuTier

log = logging.getLogger("kvstore.daemon")
HOUSEKEEPING_INTERVAL_S = 1.0
INTEGRITY_CHECK_INTERVAL_S = 30.0
# The periodic check walks every indexed object on the event loop, stalling every client
# meanwhile (0.6 s at 100,000 objects here, seconds at millions): it runs only while the
# index is small enough for a stall of a few tens of ms. Tests call it explicitly.
INTEGRITY_CHECK_MAX_OBJECTS = 20_000


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
        # The chain below the host tier, each tier only when enabled and made in two steps
        # (server/tiering/chain.py: compose): NVMe's holdings (before the host tier, whose
        # departures read them), then its mover; the remote tier's sending side (before NVMe,
        # which hands it what it evicts), then the rest.
        holdings = nvme = sends = remote = None
        if config.nvme.enabled:
            from kvstore.server.tiering.nvme_held import NvmeHeld
            from kvstore.server.tiering.nvme_mover import TierMover
            nvme_config = replace(config.nvme, path=config.nvme_path)
            windows = race_windows(config.testing)
            holdings = lambda: NvmeHeld(nvme_config.capacity_bytes)  # noqa: E731
            nvme = lambda host, events, sends, departures, held: TierMover(  # noqa: E731
                host, events, sends, departures, held, nvme_config, windows)
        if config.cluster.enabled:
            from kvstore.server.cluster.link import ClusterLink
            from kvstore.server.cluster.node import PeerNode
            from kvstore.server.cluster.replicate import Replicator
            sends = lambda host, events, held: Replicator(host, events, config.cluster,  # noqa: E731
                                                          PeerNode(config.cluster), held)  # started by the link
            remote = lambda local, replicator: ClusterLink(local, replicator, config.cluster)  # noqa: E731
        elif config.remote.mooncake_enabled:  # a Mooncake Store pool as the remote tier
            from kvstore.server.pool.link import PoolLink
            from kvstore.server.pool.puts import PoolPuts
            sends = lambda host, events, held: PoolPuts(host, events, config.remote.mooncake, held)  # noqa: E731
            remote = lambda local, puts: PoolLink(local, puts, config.remote.mooncake)  # noqa: E731
        self.events = NoEvents()  # the KV event stream for routers, when [events] enabled
        if config.events.enabled:
            from kvstore.server.events.publisher import ZmqPublisher
            self.events = EventStream(config.events.under(config.data_dir), ZmqPublisher)
        traffic = Traffic()  # when clients last asked something: what background copies yield to
        self.tiers = compose(config.host, events=self.events, traffic=traffic, make_holdings=holdings,
                             make_nvme=nvme, make_sends=sends, make_remote=remote)
        self.manager = TierManager(self.tiers, config.limits, verify_puts=config.verify_puts)
        self.ledger = self.manager.ledger  # leases and quotas: what a client's stats say it holds
        self.groups = GroupOps(self.manager, self.ledger, self.tiers.host, self.tiers.index)
        # What the local socket's connections use, each handed to them (server/local/service.py).
        self.local = LocalServices(self.manager, self.tiers.index, self.groups, self.tiers.host, config.limits, self,
                                   traffic)
        self.connections: dict[int, LocalConnection] = self.local.connections
        self.started_at = time.time()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self.admin = None  # server.admin.server.AdminServer when admin.enabled
        self.ready = False  # True once recovery is done and the socket serves (GET /readyz)
        self.recovery: dict = {}
        self._data_dir: DataDirLock | None = None
        self._socket_lock: HeldLock | None = None
        self._mover_open = False
        self._cluster_started = False
        self.gpu_availability: Availability | None = None  # probed at start
        self.gpu: GpuTier | None = None  # when [gpu] enabled

    async def start(self) -> None:
        """Check what needs checking, then take the data directory, then start serving.

        A stop asked for meanwhile (SIGTERM: `request_stop`) interrupts it between steps and
        within an arena's prefault: DaemonError, after which `stop()` undoes what started.
        """
        memory, host = host_memory(), self.config.host
        check_host_tier(host, memory)  # before anything is made
        if host.arena_bytes * host.max_namespaces > memory.total_bytes:  # arenas past the first are lazy
            log.info("event=arenas_may_exceed_memory arena_bytes=%d max_namespaces=%d memory_bytes=%d "
                     "note=\"a namespace whose arena does not fit in the memory available then is refused\"",
                     host.arena_bytes, host.max_namespaces, memory.total_bytes)
        self._data_dir = hold_data_dir(self.config.data_dir)  # before anything is made there
        self.events.start()  # binds its sockets (ipc:// ones in the data directory by default)
        self._start_gpu()
        if self.config.nvme.enabled:
            ensure_dir(self.config.nvme_path, "nvme.path")
        path = self.config.socket_path
        self._socket_lock = claim_socket_path(path)  # before anything is made that a twin would orphan
        if self.config.admin.enabled:  # first, so /readyz can say "recovering"
            from kvstore.server.admin.server import AdminServer
            from kvstore.server.admin.parts import AdminParts
            tiers = self.tiers
            self.admin = AdminServer(AdminParts(self.config.admin, self.config.data_dir, self, tiers.host, tiers.nvme,
                                                tiers.index, self.groups, tiers.remote, self.events))
            await self.admin.start()
        self.tiers.host.bandwidth_bytes_s = measure_copy_bandwidth()
        self._check_not_stopping()
        self.recovery = await self.tiers.nvme.open()
        self._mover_open = True
        self._check_not_stopping()
        for name in self.config.host.namespaces:  # pre-open: no client waits for their arenas
            await self.tiers.host.open_namespace(name)
            self._check_not_stopping()
        await self.tiers.remote.start()  # serve peers and join membership
        self._cluster_started = True
        umask = os.umask(0o077)  # no window in which other users may connect to the new socket
        try:
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: LocalConnection(self.local), path
            )
        finally:
            os.umask(umask)
        os.chmod(path, self.config.socket_mode)
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self.ready = True
        log.info("event=ready socket=%s arena_bytes=%d policy=%s nvme=%s gpu=%s cuda=%r pid=%d version=%s",
                 path, self.config.host.arena_bytes, self.config.host.policy,
                 self.config.nvme_path if self.config.nvme.enabled else "off",
                 "on" if self.gpu is not None else "off", self.gpu_availability.reason, os.getpid(), SERVER_VERSION)

    def _start_gpu(self) -> None:
        """Probe CUDA (reported either way); with [gpu] enabled, make the tier's device buffer
        or refuse to start, saying why."""
        gpu = self.config.gpu
        self.gpu_availability = GpuTier.probe()  # logged with event=ready
        if not gpu.enabled:
            return
        if not self.gpu_availability.available:
            raise DaemonError(f"[gpu] enabled = true, but the GPU tier cannot run here: "
                              f"{self.gpu_availability.reason}. Set [gpu] enabled = false, or fix that")
        self.gpu = GpuTier(gpu)
        self.tiers.attach_gpu(GpuReads(self.gpu, self.tiers.host))
        log.info("event=gpu_tier device=%d capacity_bytes=%d", gpu.device, gpu.capacity_bytes)

    def gpu_stats(self) -> dict:
        """What /v1/stats and `kvstore status` say of the GPU tier."""
        found = self.gpu_availability
        doc = {"enabled": self.config.gpu.enabled, "available": bool(found and found.available),
               "reason": found.reason if found else "not probed yet", "device": self.config.gpu.device}
        copies = self.tiers.gpu.stats()
        if copies is not None:
            doc.update(copies)
        return doc

    def request_stop(self) -> None:
        """SIGTERM / SIGINT: stop serving, or give up starting (an arena's prefault included)."""
        self.tiers.host.stopping.set()
        self._stopped.set()

    def _check_not_stopping(self) -> None:
        if self._stopped.is_set():
            raise DaemonError("start-up interrupted: asked to stop")

    async def serve_forever(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a stop during start-up works too
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start()
        except Exception as exc:
            if not self._stopped.is_set():
                raise
            log.info("event=start_interrupted step=%r", getattr(exc, "message", str(exc)))
        await self._stopped.wait()
        await self.stop()

    async def stop(self) -> None:
        """Undo what start() did, also when it did not finish (interrupted or failed)."""
        log.info("event=stopping clients=%d", len(self.connections))
        self.tiers.host.stopping.set()
        for task in self._tasks:
            task.cancel()
        if self.admin is not None:
            await self.admin.stop()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections.values()):
            conn.transport.close()
        await asyncio.sleep(0)
        if self._server is not None:  # never another daemon's socket: ours only once we served
            await self._server.wait_closed()
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        if self._cluster_started:  # leave membership before we stop serving
            await self.tiers.remote.stop()
        if self._mover_open:
            if self.config.nvme.flush_on_shutdown:
                await self.tiers.nvme.flush_host()
            await self.tiers.nvme.close()
        self.manager.close()
        for name in self.events.namespaces():  # what this daemon held cannot be read until it is back
            self.events.cleared(name)
        self.events.close()  # sends what is pending first
        if self.gpu is not None:
            self.gpu.close()
        if self._socket_lock is not None:  # our socket is gone: the next daemon may take the path
            self._socket_lock.release()
        if self._data_dir is not None:  # last: a successor may start once we are done with it
            self._data_dir.release()
        log.info("event=stopped")

    async def _housekeeping(self) -> None:
        last_check = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                self.manager.expire()
                if time.monotonic() - last_check > INTEGRITY_CHECK_INTERVAL_S:
                    last_check = time.monotonic()
                    if self.manager.num_indexed() <= INTEGRITY_CHECK_MAX_OBJECTS:
                        self.manager.check_integrity()
            except Exception:
                log.exception("event=housekeeping_failed")

    # --- used by connections ----------------------------------------------------

    def authorize(self, namespace: str, token: str | None, peer) -> None:
        """May this local client open `namespace` (and so receive its arena fd)?

        The socket's mode (0600 by default) decides who reaches the daemon at all. On top,
        `[auth.namespaces.<name>]` may require a token (compared in constant time) and/or
        restrict the client's uid, which the kernel reported (SO_PEERCRED: unforgeable).
        Unlisted namespaces follow `auth.unlisted`. Raises PermissionDenied.
        """
        auth = self.config.auth
        rule = auth.namespaces.get(namespace)
        pid, uid, _ = peer
        if rule is None:
            if auth.unlisted == "allow":
                return
            why = f"namespace {namespace!r} is not configured here (auth.unlisted = \"deny\"); ask the operator"
        elif rule.uids and uid not in rule.uids:
            why = f"uid {uid} may not open namespace {namespace!r} (auth.namespaces.{namespace}.uids)"
        elif rule.token and not hmac.compare_digest((token or "").encode(), rule.token.encode()):
            given = "no token was given" if not token else "the token given is wrong"
            why = f"namespace {namespace!r} needs its token (auth.namespaces.{namespace}.token); {given}"
        else:
            return
        log.warning("event=open_denied namespace=%s pid=%d uid=%d reason=%r", namespace[:64], pid, uid, why)
        raise PermissionDenied(why)

    def client_stats(self, owner, opened) -> dict:
        """stats() as one local client sees it. With auth configured, tenants are told apart:
        only the namespaces this client opened and its own leases (operators use the admin API)."""
        stats = self.stats()
        if not self.config.auth.enabled:
            return stats
        return {"version": stats["version"], "uptime_s": stats["uptime_s"], "scoped": True,
                "leases": self.ledger.count(owner),
                "namespaces": {k: v for k, v in stats["namespaces"].items() if k in opened}}

    def gpu_handle(self) -> GpuHandleReply:
        """The GPU tier's buffer exported for one engine process (InvalidArgument without one)."""
        return self.tiers.gpu.handle()

    def limits_for_clients(self) -> ClientLimits:
        limits = self.config.limits
        return ClientLimits(limits.max_frame_bytes, MAX_BATCH, limits.max_leases_per_client,
                            limits.max_inflight_bytes_per_client, limits.lease_ttl_s, INLINE_PUT_MAX_BYTES)

    def stats(self) -> dict:
        return {
            "version": SERVER_VERSION,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "clients": len(self.connections),
            "socket": self.config.socket_path,
            "host_bandwidth_bytes_s": self.tiers.host.bandwidth_bytes_s,
            "recovery": self.recovery,
            "gpu": self.gpu_stats(),
            **self.manager.stats(),
            **({"events": self.events.stats()} if self.events.enabled else {}),
        }


def run(config: ServerConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT (uvloop when installed)."""
    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(Daemon(config).serve_forever())
