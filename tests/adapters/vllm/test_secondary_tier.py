"""KVStoreSecondaryTier under vLLM's real TieringOffloadingManager (issue 12, vLLM tiering).

The same kind of tests vLLM's tiering tests run against its example tier, with the daemon
behind it: vLLM's SecondaryTierFactory loads the tier from `module_path`; the CPU primary
tier's chunks cascade into the store; a fresh manager (as after a restart) finds them by
batched async lookups and promotes them bit-exact; a daemon that dies is a miss and a failed
job, never an exception; a chunk lost between lookup and load fails alone.

A hybrid model (full attention + Mamba, "align" mode) runs through vLLM's whole offloading
path (OffloadingEngine): vLLM's scheduler with its OffloadingConnector and
TieringOffloadingSpec (the tier made from the documented config), vLLM's worker connector
over CPU caches, and the test as the model runner. Only the GPU<->CPU copies of vLLM's
CPUOffloadingWorker (CUDA only) are done here with CPU copies (HostCopies).
"""

import dataclasses
import signal
import time
from types import SimpleNamespace
from unittest.mock import MagicMock

import msgspec
import numpy as np
import pytest
import torch

from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_offload.base import (LookupResult, ReqContext, ScheduleEndContext, get_offload_block_hash,
                                     get_offload_group_idx, make_offload_key)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

from kvs_events import EventSubscriber, last_seq
from offloading_engine import PROMPT, OffloadingEngine
from vllm_engine import make_request, tokens_of
from vllm_model import BLOCK

pytestmark = pytest.mark.engines

CHUNKS, ROW = 4, 8192


class Tiers:
    """A CPU primary tier over a real memoryview, with kvstore as its only secondary tier."""

    def __init__(self, socket_path):
        region = MagicMock()
        self.rows = torch.zeros((CHUNKS, ROW), dtype=torch.int8).numpy()
        region.create_kv_memoryview.return_value = memoryview(self.rows)
        self.primary = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
        config = {"type": "KVStoreSecondaryTier", "module_path": "kvstore.adapters.vllm_tier", "socket_path": socket_path,
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
        assert c.lookup(a.tier.object_ids(keys)).hits == 3
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
        c.delete(b.tier.object_ids([keys[1]]))
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 3
    b.settle()
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.MISS, LookupResult.HIT]
    spec = b.manager.prepare_load([keys[0], keys[2]], ctx)
    for key, chunk in zip((keys[0], keys[2]), spec.block_ids):
        assert np.array_equal(b.rows[chunk], payloads[key])


# --- a hybrid model through vLLM's whole offloading path -----------------------------------

@pytest.fixture
def engines(daemon):
    made = []

    def make() -> OffloadingEngine:
        made.append(OffloadingEngine(daemon.socket))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown()


def ran(make, tokens, number) -> tuple[OffloadingEngine, list, list]:
    """An engine that ran one prompt to the end, and the attention and Mamba keys its tier stored."""
    a = make()
    request = make_request(number, tokens)
    a.add(request)
    a.run_to_end()
    assert not a.state_errors and a.tier.store.num_failures == 0
    attention = [make_offload_key(h, 0) for h in request.block_hashes[:96 // BLOCK]]  # every whole chunk
    mamba = [make_offload_key(request.block_hashes[n // BLOCK - 1], 1) for n in (64, 96)]  # the states vLLM offered
    assert {k for k in a.stored if get_offload_group_idx(k) == 0} == set(attention)
    assert {k for k in a.stored if get_offload_group_idx(k) == 1} == set(mamba)
    return a, attention, mamba


def test_a_hybrid_models_mamba_states_go_through_the_tier_and_restore_with_their_prefix(daemon, engines):
    tokens = tokens_of(PROMPT, 61)
    a, attention, mamba = ran(engines, tokens, 61)
    desc = a.tier.desc  # from vLLM's OffloadingConfig: the tier's config names no model or dtype
    assert (desc.model, desc.dtype.value, desc.object_bytes) == ("facebook/opt-125m", "fp16", 4096)
    with daemon.client() as c:
        assert c.lookup(a.tier.object_ids(attention + mamba)).hits == 8
    # A state and the attention chunk of the same block hash: two objects, other bytes.
    same_hash = make_offload_key(mamba[1][:-4], 0)
    assert a.tier.object_ids([mamba[1]]) != a.tier.object_ids([same_hash])
    assert not np.array_equal(a.stored[mamba[1]], a.stored[same_hash])

    b = engines()  # empty CPU tier, as after a restart
    again = make_request(62, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 96  # 96 tokens and the state at 96 loaded
    promoted = {k: b.chunks[c].copy() for job in b.promotions for k, c in zip(job.keys, job.chunk_ids)}
    assert set(attention) | {mamba[1]} <= set(promoted) <= set(attention + mamba)
    for key, chunk in promoted.items():  # whole chunks, as the first engine's CPU tier held them
        assert np.array_equal(chunk, a.stored[key])
    assert b.attention_blocks_exact(again.request_id, 96 // BLOCK)
    b.run_to_end()
    assert not b.state_errors  # the step after the load read exactly the model's state at 96


def test_a_hybrid_prefix_hits_only_up_to_the_last_state_the_store_holds(daemon, engines):
    tokens = tokens_of(PROMPT, 71)
    a, attention, mamba = ran(engines, tokens, 71)
    with daemon.client() as c:
        assert c.delete(a.tier.object_ids([mamba[1]])) == 1  # the state at 96
    b = engines()
    again = make_request(72, tokens)
    b.add(again)
    assert b.step_until_scheduled(again).scheduled_new_reqs[0].num_computed_tokens == 64
    b.run_to_end()
    assert not b.state_errors
    with daemon.client() as c:  # every KV chunk still held, and no state at all
        assert c.delete(a.tier.object_ids([mamba[0]])) == 1
        assert c.delete(b.tier.object_ids([mamba[1]])) == 1  # b stored the state at 96 again
        assert c.lookup(a.tier.object_ids(attention)).hits == len(attention)
    fresh = engines()
    third = make_request(73, tokens)
    fresh.add(third)
    assert fresh.step_until_scheduled(third).scheduled_new_reqs[0].num_computed_tokens == 0
    assert fresh.copies.num_loads == 0  # KV without its state is no hit: all computed
    fresh.run_to_end()
    assert not fresh.state_errors


def test_chunk_ids_are_per_chunk_geometry_so_no_engine_reads_chunks_laid_out_otherwise(daemon, engines):
    a = engines()
    config = build_offloading_config(a.config, a.kv_config)
    rows = np.zeros((2, a.tier.block_size_bytes), np.uint8)
    key = make_offload_key(b"h" * 32, 1)

    def ids_under(offloading_config):
        tier = SecondaryTierFactory.create_secondary_tier(
            {"type": "KVStoreSecondaryTier", "module_path": "kvstore.adapters.vllm_tier", "socket_path": daemon.socket},
            memoryview(rows), SimpleNamespace(config=offloading_config))
        try:
            return tier.object_ids([key])
        finally:
            tier.shutdown()

    assert ids_under(config) == a.tier.object_ids([key])
    others = [dataclasses.replace(config, kv_cache_layout="HND"),  # same bytes, another layout
              dataclasses.replace(config, groups=config.groups[:1]),  # the model without its Mamba group
              dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, tp_size=2, world_size=2))]
    assert len({ids_under(c)[0] for c in others} - set(a.tier.object_ids([key]))) == len(others)


def test_the_tiers_chunks_are_named_in_kv_events_by_vllms_block_hashes(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {"enabled": True}})
    engine = OffloadingEngine(d.socket)
    published = []  # what vLLM's scheduler publishes: its BlockPool's events (turned on as --kv-events-config does)
    engine.scheduler.kv_cache_manager.block_pool.enable_kv_cache_events = True
    engine.scheduler.kv_event_publisher = SimpleNamespace(publish=published.append, shutdown=lambda: None)
    sub = EventSubscriber(d, "default")
    try:
        engine.add(make_request(81, tokens_of(PROMPT, 81)))
        engine.run_to_end()
        with d.client() as c:
            last_seq(c, "default")  # every report is in a batch: the replay holds them all
        replayed = sub.replay(0)
    finally:
        sub.close()
        engine.shutdown()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ours = [e for _, body in replayed for e in decoder.decode(body).events if isinstance(e, BlockStored)]
    named = {(e.group_idx, h) for e in ours for h in e.block_hashes}
    # per chunk its OffloadKey's hash (its last block's) and group, as vLLM's tiering events name it
    assert named == {(get_offload_group_idx(k), maybe_convert_block_hash(get_offload_block_hash(k)))
                     for k in engine.stored}
    assert len(ours) == len(engine.stored) == 8 and all(len(e.block_hashes) == 1 for e in ours)
    assert {e.block_size for e in ours} == {BLOCK}
    gpu = {(e.group_idx, h) for batch in published for e in batch.events
           if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    assert named <= gpu  # each a block vLLM's own events named in the same group
