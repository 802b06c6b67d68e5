"""KVStoreSecondaryTier under vLLM's real TieringOffloadingManager (issue 12, vLLM tiering).

The same kind of tests vLLM's tiering tests run against its example tier, with the daemon
behind it: vLLM's SecondaryTierFactory loads the tier from `module_path`; the CPU primary
tier's chunks cascade into the store; a fresh manager (as after a restart) finds them by
batched async lookups and promotes them bit-exact; a daemon that dies is a miss and a failed
job, never an exception; a chunk lost between lookup and load fails alone.
"""

import signal
import time
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from adapters.common import engine_object_id

pytestmark = pytest.mark.engines

CHUNKS, ROW = 4, 8192


class Tiers:
    """A CPU primary tier over a real memoryview, with kvstore as its only secondary tier."""

    def __init__(self, socket_path):
        region = MagicMock()
        self.rows = torch.zeros((CHUNKS, ROW), dtype=torch.int8).numpy()
        region.create_kv_memoryview.return_value = memoryview(self.rows)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
        config = {"type": "KVStoreSecondaryTier", "module_path": "adapters.vllm_tier", "socket_path": socket_path,
                  "model": "facebook/opt-125m", "dtype": "float16", "retry_after_s": 0.05}
        self.tier = SecondaryTierFactory.create_secondary_tier(config, memoryview(self.rows), MagicMock())
        self.manager = TieringOffloadingManager(primary_tier=self.primary, secondary_tiers=[self.tier])

    def end_step(self):
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        list(self.manager.take_events())

    def settle(self):
        """Steps until the tier's jobs and lookups are through (bounded: not a timing claim)."""
        for _ in range(200):
            self.tier.drain_jobs()
            self.end_step()
            if not self.manager.has_pending_work():
                return
            time.sleep(0.01)
        raise AssertionError("the tier never finished its jobs")

    def lookup_until_resolved(self, key, ctx):
        for _ in range(500):
            result = self.manager.lookup(key, ctx)
            if result is not LookupResult.RETRY:
                return result
            self.end_step()
            time.sleep(0.01)
        raise AssertionError("lookup stayed RETRY")

    def store(self, keys, ctx, payloads):
        out = self.manager.prepare_store(keys, ctx)
        for key, chunk in zip(out.keys_to_store, out.store_spec.block_ids):
            self.rows[chunk] = payloads[key]
        self.manager.complete_store(keys, ctx, success=True)
        self.settle()

    def load(self, keys, ctx):
        """Lookup (promoting from kvstore), then read the chunks vLLM would copy to the GPU."""
        results = [self.lookup_until_resolved(k, ctx) for k in keys]
        self.settle()
        hits = [k for k, r in zip(keys, results) if r in (LookupResult.HIT, LookupResult.HIT_PENDING)]
        present = [k for k in hits if self.manager.lookup(k, ctx) is LookupResult.HIT]
        spec = self.manager.prepare_load(present, ctx) if present else None
        rows = {} if spec is None else {k: self.rows[c].copy() for k, c in zip(present, spec.block_ids)}
        if present:
            self.manager.complete_load(present, ctx)
        return rows


def stored(socket_path, numbers, seed):
    """Keys, payloads and the Tiers that cascaded them into the store (request finished)."""
    keys = keys_of(*numbers)
    payloads = payloads_for(keys, seed)
    tiers = Tiers(socket_path)
    ctx = ReqContext(req_id=f"store-{seed}")
    tiers.manager.on_new_request(ctx)
    tiers.store(keys, ctx, payloads)
    tiers.manager.on_request_finished(ctx)
    return keys, payloads, tiers


def keys_of(*numbers):
    return [make_offload_key(f"block-{n}".encode().ljust(32, b"."), 0) for n in numbers]


def payloads_for(keys, seed):
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-128, 128, ROW, dtype=np.int8) for k in keys}


def test_the_factory_loads_the_tier_and_it_is_complete(daemon):
    tiers = Tiers(daemon.socket)
    assert type(tiers.tier).__name__ == "KVStoreSecondaryTier"
    assert not getattr(type(tiers.tier), "__abstractmethods__", None)
    assert str(tiers.tier.desc.layout) == f"raw(bytes={ROW // 2})"  # fp16 elements
    assert tiers.tier.desc.object_bytes == ROW


def test_chunks_cascade_into_the_store_and_a_fresh_manager_promotes_them_bit_exact(daemon):
    keys, payloads, a = stored(daemon.socket, (1, 2, 3), 1)
    with daemon.client() as c:
        ids = [engine_object_id(a.tier.desc, "vllm-offload", k) for k in keys]
        assert c.lookup(ids).hits == 3
    b = Tiers(daemon.socket)  # empty primary tier, as after a restart
    ctx = ReqContext(req_id="r2")
    b.manager.on_new_request(ctx)
    rows = b.load(keys + keys_of(9), ctx)
    assert set(rows) == set(keys), "the three stored chunks hit, the unknown one misses"
    for key in keys:
        assert np.array_equal(rows[key], payloads[key])
    assert b.tier.store.num_failures == 0


def test_a_dead_daemon_is_a_miss_and_a_failed_store_never_an_exception(daemon):
    tiers = Tiers(daemon.socket)
    daemon.stop(signal.SIGKILL)
    ctx = ReqContext(req_id="r")
    tiers.manager.on_new_request(ctx)
    keys = keys_of(4, 5)
    tiers.store(keys, ctx, payloads_for(keys, 2))  # the cascade fails inside the tier
    other = Tiers(daemon.socket)
    ctx2 = ReqContext(req_id="r2")
    other.manager.on_new_request(ctx2)
    assert other.lookup_until_resolved(keys[0], ctx2) is LookupResult.MISS
    assert tiers.tier.store.num_failures >= 1 and other.tier.store.num_failures >= 1


def test_lookups_are_batched_and_a_chunk_lost_before_its_promotion_fails_alone(daemon):
    keys, payloads, _ = stored(daemon.socket, (6, 7, 8), 3)
    b = Tiers(daemon.socket)
    calls = []
    real_contains = b.tier.store.contains
    b.tier.store.contains = lambda ids: calls.append(len(ids)) or real_contains(ids)
    ctx = ReqContext(req_id="r2")
    b.manager.on_new_request(ctx)
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
    b.end_step()  # the step's three keys go to the daemon as one lookup
    for _ in range(500):
        if b.tier.store.num_hits == 3:
            break
        time.sleep(0.01)
    assert calls == [3] and b.tier.store.num_hits == 3
    with daemon.client() as c:  # the middle chunk goes away before the promotion reads it
        c.delete([engine_object_id(b.tier.desc, "vllm-offload", keys[1])])
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
    b.settle()
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    spec = b.manager.prepare_load([keys[0], keys[2]], ctx)
    for key, chunk in zip((keys[0], keys[2]), spec.block_ids):
        assert np.array_equal(b.rows[chunk], payloads[key])
