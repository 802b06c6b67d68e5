"""MooncakePool: this daemon's client of a Mooncake Store pool (the `mooncake.store` bindings
of the mooncake-transfer-engine wheel), on worker threads, with the pool's health tracked.

Every call is batched (a list of keys per Mooncake call) and blocking, so it runs on
`Workers` threads, never on the event loop. Memory given to a call is addressed by pointer:
the caller keeps it alive, and registered (`register`) where the transfer should be
zero-copy (the host arenas); `Workers.run` waits for the call even when its caller is
cancelled, so memory is never given back under a running transfer.

Health: the client is set up in the background (a master that is down at start only delays
the pool: the daemon serves from its local tiers). An RPC failure (the master gone) marks the
pool down: calls are then skipped (misses, failed puts) until a probe every
retry_interval_s finds the master again. A probe runs on its own thread, so a master that
answers slowly never holds up the transfers of the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

from kvstore.config_remote import MooncakeConfig
from kvstore.tiers.mooncake.workers import Workers

log = logging.getLogger("kvstore.mooncake")

# Mooncake's error codes (mooncake-store/include/types.h) that this tier acts on.
NO_AVAILABLE_HANDLE = -200  # no segment has room: the pool is full
INVALID_PARAMS = -600  # also what a read answers when the value does not fit the buffer given
OBJECT_NOT_FOUND = -704
# -9xx are RPC errors (the master did not answer); -8xx transfer errors (a segment's holder).
RPC_ERRORS = range(-999, -899)
# Mooncake retries a setup 20 times by default (some 90 s against a master that is down);
# the daemon retries on its own every retry_interval_s instead.
SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
PROBE_KEY = "kvstore-probe/none"


@dataclass(slots=True)
class PoolCounters:
    num_setup_attempts: int = 0
    num_pool_failures: int = 0  # calls the pool failed (RPC or transfer errors)
    num_pool_skips: int = 0  # calls not tried: the pool was down
    num_pool_full: int = 0  # puts refused for want of room
    num_registered_bytes: int = 0


class MooncakePool:
    """make_store: builds the Mooncake client (default: mooncake.store.MooncakeDistributedStore)."""

    def __init__(self, config: MooncakeConfig, make_store: Callable[[], object] | None = None, clock=time.monotonic):
        self.config, self.clock = config, clock
        self._make_store = make_store
        self.store = None  # the client, once set up
        self.counters = PoolCounters()
        self._workers = Workers(config.io_threads, "mooncake")
        self._probe_workers = Workers(1, "mooncake-probe")
        self._down = True  # until set up
        self._regions: dict[int, int] = {}  # address -> size: registered (or to register once set up)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.last_error = "not set up yet"

    # --- life ------------------------------------------------------------------------

    def start(self) -> None:
        """Set the client up in the background; the pool is usable once `up`."""
        self._task = asyncio.get_running_loop().create_task(self._keep_up())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        store, self.store = self.store, None
        if store is not None:
            try:  # unregister while the memory is still mapped, then let the client go
                await asyncio.wait_for(self._workers.run(self._unregister_all, store), self.config.retry_interval_s)
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 (stopping: log and go on)
                log.warning("event=mooncake_close_failed error=%r", str(exc))
        self._workers.close()
        self._probe_workers.close()

    def _unregister_all(self, store) -> None:
        for address in list(self._regions):
            store.unregister_buffer(address)
        store.close()

    @property
    def up(self) -> bool:
        return self.store is not None and not self._down

    def usable(self) -> bool:
        """May a call be tried now? Not while down (a skip is counted)."""
        if self.up:
            return True
        self.counters.num_pool_skips += 1
        return False

    async def _keep_up(self) -> None:
        while True:
            if self.store is None:
                await self._setup()
            elif self._down:
                await self._probe()
            if self.up:
                self._wake.clear()
                await self._wake.wait()  # until a call marks the pool down
            else:
                await asyncio.sleep(self.config.retry_interval_s)

    async def _setup(self) -> None:
        cfg = self.config
        self.counters.num_setup_attempts += 1
        os.environ.setdefault(SETUP_RETRIES_ENV, "1")
        try:
            store = await self._probe_workers.run(self._new_store)
        except Exception as exc:  # noqa: BLE001 (a broken install or a refused setup: retried)
            self._note_down(f"setup failed: {exc}")
            return
        regions = dict(self._regions)
        for address, size in regions.items():
            rc = await self._probe_workers.run(store.register_buffer, address, size)
            if rc != 0:
                log.warning("event=mooncake_register_failed address=%#x size=%d rc=%d", address, size, rc)
        self.store, self._down = store, False
        log.info("event=mooncake_up master=%s metadata=%s protocol=%s segment_bytes=%d",
                 cfg.master, cfg.metadata_server, cfg.protocol, cfg.global_segment_bytes)

    def _new_store(self):
        cfg = self.config
        if self._make_store is None:
            from mooncake.store import MooncakeDistributedStore
            store = MooncakeDistributedStore()
        else:
            store = self._make_store()
        rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_bytes, cfg.local_buffer_bytes,
                         cfg.protocol, cfg.rdma_devices, cfg.master, None, False, "", cfg.tenant_id)
        if rc != 0:
            raise RuntimeError(f"setup returned {rc} (master {cfg.master} unreachable?)")
        return store

    async def _probe(self) -> None:
        store = self.store
        try:
            codes = await self._probe_workers.run(store.batch_is_exist, [PROBE_KEY])
        except Exception as exc:  # noqa: BLE001
            codes = [str(exc)]
        if codes and isinstance(codes[0], int) and codes[0] >= 0:
            self._down = False
            log.info("event=mooncake_up master=%s", self.config.master)
        else:
            self.last_error = f"probe: {codes[0] if codes else 'no answer'}"

    def _note_down(self, why: str) -> None:
        first = not self._down
        self._down, self.last_error = True, why
        if first or self.counters.num_setup_attempts <= 1:
            log.warning("event=mooncake_down master=%s error=%r note=\"served from the local tiers; retrying every "
                        "%gs\"", self.config.master, why, self.config.retry_interval_s)
        self._wake.set()

    def _checked(self, codes: list[int], what: str, expected: tuple = ()) -> list[int]:
        """Count and act on a batch's error codes: an RPC error marks the pool down. expected:
        codes the caller asked for (not failures of the pool)."""
        worst = next((c for c in codes if c in RPC_ERRORS), None)
        if worst is not None:
            self.counters.num_pool_failures += 1
            self._note_down(f"{what}: rpc error {worst}")
        elif any(c < 0 and c not in (OBJECT_NOT_FOUND, NO_AVAILABLE_HANDLE, *expected) for c in codes):
            self.counters.num_pool_failures += 1
        self.counters.num_pool_full += sum(c == NO_AVAILABLE_HANDLE for c in codes)
        return codes

    # --- memory --------------------------------------------------------------------

    async def register(self, address: int, size: int) -> None:
        """Register memory that transfers use (zero-copy where the transport can); kept across
        reconnects, until `unregister`. Idempotent."""
        if address in self._regions:
            return
        self._regions[address] = size
        self.counters.num_registered_bytes += size
        if self.store is not None:
            rc = await self._workers.run(self.store.register_buffer, address, size)
            if rc != 0:
                log.warning("event=mooncake_register_failed address=%#x size=%d rc=%d", address, size, rc)

    async def unregister(self, address: int) -> None:
        size = self._regions.pop(address, None)
        if size is not None:
            self.counters.num_registered_bytes -= size
            if self.store is not None:
                await self._workers.run(self.store.unregister_buffer, address)

    # --- batched calls (each one Mooncake call; per key a code: >= 0 ok) --------------

    async def exist(self, keys: list[str]) -> list[int]:
        """Per key 1 (held), 0 (not held) or an error code."""
        return self._checked(await self._workers.run(self.store.batch_is_exist, keys), "is_exist")

    async def put_from(self, keys: list[str], parts: list[list[int]], sizes: list[list[int]],
                       soft_pin: bool = False) -> list[int]:
        """Store each key as the concatenation of its parts (addresses, sizes). A key the pool
        holds already is left as it is (0: held now). soft_pin: the master evicts these keys
        last, for its --default_kv_soft_pin_ttl (30 min by default). Per key 0 or an error code."""
        from mooncake.store import ReplicateConfig, SoftPinAction
        config = ReplicateConfig()
        config.replica_num = self.config.replicas
        if soft_pin:
            config.soft_pin_action = SoftPinAction.ENABLE
        codes = await self._workers.run(self.store.batch_put_from_multi_buffers, keys, parts, sizes, config)
        return self._checked(list(codes), "put")

    async def read_ranges(self, address: int, keys: list[str], dst_offsets: list[int], src_offsets: list[int],
                          sizes: list[int]) -> list[int]:
        """One byte range of each key (from src_offset, sizes[i] bytes) into the buffer at
        `address` + dst_offsets[i]. Per key the bytes read or an error code."""
        got = await self._workers.run(self.store.get_into_ranges, [address], [keys],
                                      [[[d] for d in dst_offsets]], [[[s] for s in src_offsets]],
                                      [[[n] for n in sizes]])
        codes = [ranges[0] if ranges else -1 for ranges in got[0]] if got else [-1] * len(keys)
        return self._checked(codes, "get")

    async def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Each key's whole value into a buffer of sizes[i] bytes at addresses[i] (one call).
        Per key the value's size, or an error code: INVALID_PARAMS when the value is larger
        than its buffer (nothing is copied; Mooncake logs a line), which a reader that guessed
        the size may get and is not counted."""
        codes = await self._workers.run(self.store.batch_get_into, keys, addresses, sizes)
        return self._checked(list(codes), "get", expected=(INVALID_PARAMS,))

    async def remove(self, keys: list[str]) -> list[int]:
        """Per key 0 (removed), OBJECT_NOT_FOUND, or an error code."""
        return self._checked(list(await self._workers.run(self.store.batch_remove, keys, True)), "remove")

    def stats(self) -> dict:
        return {**asdict(self.counters), "master": self.config.master, "up": self.up,
                "last_error": None if self.up else self.last_error}
