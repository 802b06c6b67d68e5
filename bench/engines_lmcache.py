"""bench/engines.py's LMCache part (run in LMCache's environment): chunks stored and loaded per
second through adapters/lmcache.py, against a memcpy of the same bytes.

The connector is made by LMCache's own CreateConnector (`plugin://kvstore`, wrapped in its
InstrumentedRemoteConnector) over LMCache's LocalCPUBackend on CPU, whose allocator makes the
MemoryObjs: chunks of 256 tokens of a model with 24 layers, 8 KV heads x 128, bf16, in
LMCache's KV_2LTD format (24 MiB a chunk). Calls go through LMCache's storage loop (a thread),
as its RemoteBackend makes them.

    lmcache put   batched_put of a batch of chunks (what RemoteBackend calls: the connector
                  supports batched puts)
    lmcache get   get of each chunk, all submitted at once and then awaited (RemoteBackend's
                  batched_get_blocking); each get allocates its MemoryObj from LMCache
    baseline (memcpy)   np.copyto of each chunk's bytes into / out of one staging buffer

Each timed put stores fresh keys (a put of a held id copies nothing); the puts of a run fit
the bench daemon's 1 GiB arena, and are deleted before the gets. The chunks the last get
returned are checked bit-exact against those put.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import numpy as np

from bench.common import Row
from bench.engines import _timed

LAYERS, CHUNK, HEADS, HEAD_DIM = 24, 256, 8, 128
HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "adapters", "lmcache")


def bench(socket_path: str, quick: bool, suite: str) -> list[Row]:
    if HELPERS not in sys.path:
        sys.path.insert(0, HELPERS)
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache_helpers import PLUGIN, chunk, engine_config, engine_metadata, key, run

    # 4 chunks a batch: (reps + 2) batches of fresh puts, 96 MiB each, fit the 1 GiB arena
    count, reps = 4, (3 if quick else 5)
    config = engine_config(socket_path, chunk_tokens=CHUNK, cpu_gb=1.0, timeout_s=60)
    cpu = LocalCPUBackend(config, engine_metadata((LAYERS, 2, CHUNK, HEADS, HEAD_DIM)), dst_device="cpu")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    connector = CreateConnector(f"plugin://{PLUGIN}", loop, cpu, config, cpu.metadata, plugin_name=PLUGIN)
    ours_connector = connector.getWrappedConnector()
    try:
        sent = [chunk(cpu, seed=i, tokens=CHUNK) for i in range(count)]
        sent_bytes = [np.frombuffer(m.byte_array, np.uint8) for m in sent]
        hashes = iter(range(1 << 30))
        stored = []

        def put_once():
            keys = [key(next(hashes)) for _ in range(count)]
            for memory_obj in sent:
                memory_obj.ref_count_up()  # LMCache's wrapper drops one reference after the put
            run(loop, connector.batched_put(keys, sent))
            stored.extend(keys)
            return keys

        staging = np.empty((count, sent_bytes[0].nbytes), np.uint8)

        def plain_put():
            for i, data in enumerate(sent_bytes):
                np.copyto(staging[i], data)

        ours = _timed(put_once, reps)
        base = _timed(plain_put, reps)
        rows = [Row(suite, "lmcache put", "throughput", "chunks/s", count / ours, "memcpy", count / base)]
        for k in stored:
            ours_connector.remove_sync(k)
        keys = put_once()
        if ours_connector.batched_contains(keys) != count:
            raise RuntimeError("bench: an lmcache put was not stored")

        got = []

        def get_once():
            for memory_obj in got:
                memory_obj.ref_count_down()
            futures = [asyncio.run_coroutine_threadsafe(connector.get(k), loop) for k in keys]
            got[:] = [f.result(60) for f in futures]
            if any(m is None for m in got):
                raise RuntimeError("bench: an lmcache get missed")

        dst = [chunk(cpu, seed=0, tokens=CHUNK) for _ in range(count)]
        dst_bytes = [np.frombuffer(m.byte_array, np.uint8) for m in dst]

        def plain_get():
            for i, data in enumerate(dst_bytes):
                np.copyto(data, staging[i])

        ours = _timed(get_once, reps)
        base = _timed(plain_get, reps)
        rows.append(Row(suite, "lmcache get", "throughput", "chunks/s", count / ours, "memcpy", count / base))
        for i, (a, b) in enumerate(zip(got, sent)):  # the bench's loads must be right to count
            if a.get_shapes() != b.get_shapes() or bytes(a.byte_array) != bytes(b.byte_array):
                raise RuntimeError(f"bench: lmcache chunk {i} loaded wrong")
        stats = ours_connector.stats()
        if stats["num_failures"] or stats["num_refused"] or stats["num_no_memory"]:
            raise RuntimeError(f"bench: the lmcache connector counted failures: {stats}")
        for memory_obj in got + sent + dst:
            memory_obj.ref_count_down()
        for k in stored:
            ours_connector.remove_sync(k)
        return rows
    finally:
        run(loop, connector.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
