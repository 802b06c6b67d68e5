"""The daemon's KV events name the connector's objects as vLLM's own events name the blocks.

vLLM's real scheduler runs with `enable_kv_cache_events` beside KVStoreConnector and a real
daemon with `[events] enabled = true`. Every batch vLLM would publish (its BlockPool's
events, annotated by its KVCacheManager) is kept; the daemon's stream is read with vLLM's
own decoder. Both are cut into blocks, each block with what names it for a router (group,
hash, parent hash, tokens, block size, LoRA name, extra keys, group kind and window); every
block the daemon published for a saved object must be one vLLM published, field for field,
and every block of every saved chunk must be published.
"""

import copy
import os

import msgspec
import pytest
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvstore.identity import ObjectId
from kvs_events import EventSubscriber, wait_subscribed
from vllm_engine import Engine, base_config, make_request, tokens_of  # noqa: F401 (a fixture)
from vllm_model import BLOCK, hybrid_layers, mamba_config, mamba_layers

pytestmark = pytest.mark.engines

PROMPT = 100  # 3 chunks of 32 tokens (2 blocks each) are saved; vLLM caches 6 blocks per attention group


class Recorder:
    """Stands in for vLLM's event publisher: keeps the batches the scheduler publishes."""

    def __init__(self):
        self.batches: list[KVEventBatch] = []

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


SPARSE = "sparse"  # a block of an event that skipped blocks: its parent and tokens are not its own


def blocks_of(events) -> dict:
    """(group, block hash) -> what a BlockStored says of that block. vLLM leaves the null
    blocks of a Mamba group (align mode) out of block_hashes but not out of token_ids or the
    parent (block_pool.py cache_full_blocks): such an event's blocks are marked SPARSE."""
    out = {}
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        parent = e.parent_block_hash
        sparse = len(e.token_ids) != len(e.block_hashes) * e.block_size
        for i, h in enumerate(e.block_hashes):
            out[(e.group_idx, h)] = {
                "parent": SPARSE if sparse else parent,
                "tokens": SPARSE if sparse else list(e.token_ids[i * e.block_size:(i + 1) * e.block_size]),
                "block_size": e.block_size, "lora_name": e.lora_name,
                "extra_keys": None if e.extra_keys is None else e.extra_keys[i],
                "kind": e.kv_cache_spec_kind, "window": e.kv_cache_spec_sliding_window}
            parent = h
    return out


def engine_with_events(base, socket, **kwargs):
    config = copy.deepcopy(base)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    engine = Engine(config, socket, **kwargs)
    engine.recorder = engine.scheduler.kv_event_publisher = Recorder()
    return engine


def run_and_compare(engine, daemon, requests, num_objects):
    """Run `requests` to the end; the daemon's BlockStored of the connector's objects (read
    until `num_objects` came) against vLLM's own. The compared blocks, by group."""
    sub = EventSubscriber(daemon, "default")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    probes = set()
    try:
        with daemon.client() as c:
            def poke():
                probe = ObjectId(os.urandom(32))
                probes.update((probe.digest, int.from_bytes(probe.digest[-8:], "big")))  # either form
                c.put(probe, b"probe")
            wait_subscribed(sub, poke)
        for request in requests:
            engine.add(request)
        engine.run_to_end()

        def ours(s):
            return [e for _, body in s.received for e in decoder.decode(body).events
                    if isinstance(e, BlockStored) and not probes & set(e.block_hashes)]
        sub.receive_until(lambda s: len(ours(s)) >= num_objects, "the saved objects' events")
        sub.drain()
        published = ours(sub)
    finally:
        sub.close()
    assert len(published) == num_objects  # one event per object, none twice
    assert all(e.medium == "CPU" and e.locality == "LOCAL" for e in published)
    mine = blocks_of(published)
    theirs = blocks_of(e for batch in engine.recorder.batches for e in batch.events)
    assert mine and all(key in theirs for key in mine), sorted(set(mine) - set(theirs))[:4]
    for key, said in mine.items():
        assert said["parent"] != SPARSE  # ours name each block's own parent and tokens
        if theirs[key]["parent"] == SPARSE:
            said = {**said, "parent": SPARSE, "tokens": SPARSE}
        assert said == theirs[key], (key, said, theirs[key])
    groups = {}
    for group, h in mine:
        groups.setdefault(group, set()).add(h)
    return groups


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_saved_chunks_are_named_by_vllms_block_hashes(base_config, daemon_factory, monkeypatch, int_hashes):
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if int_hashes else "0")
    d = daemon_factory("64MiB", config={"events": {"enabled": True, "int_block_hashes": int_hashes}})
    engine = engine_with_events(base_config, d.socket)
    salted = make_request(1, tokens_of(PROMPT, 5), cache_salt="tenant-a")
    plain = make_request(2, tokens_of(PROMPT, 6))
    groups = run_and_compare(engine, d, [salted, plain], num_objects=6)
    assert engine.worker.num_saved_chunks == 6 and engine.connector.routes.num_unnamed == 0
    assert {g: len(h) for g, h in groups.items()} == {0: 12}  # 2 requests x 3 chunks x 2 blocks: all named
    assert all(isinstance(h, int if int_hashes else bytes) for h in groups[0])
    # the salt is in the first block's extra keys, as vLLM publishes it
    first = [k for k in blocks_of(e for b in engine.recorder.batches for e in b.events).items()
             if k[1]["parent"] is None]
    assert sorted(str(said["extra_keys"]) for _, said in first) == ["('tenant-a',)", "None"]


def test_a_hybrid_models_groups_are_named_per_group(base_config, daemon_factory):
    d = daemon_factory("64MiB", config={"events": {"enabled": True}})
    dense = copy.deepcopy(base_config)  # vLLM names (caches) every window block only where it retains them all
    dense.cache_config.prefix_cache_retention_interval = BLOCK
    engine = engine_with_events(dense, d.socket, make_layers=hybrid_layers)
    groups = run_and_compare(engine, d, [make_request(3, tokens_of(PROMPT, 7))], num_objects=9)
    assert {g: len(h) for g, h in groups.items()} == {0: 6, 1: 6, 2: 6}  # two full attention, one sliding window
    assert groups[0] == groups[1] == groups[2]  # one request's hashes, in every group


def test_a_mamba_state_is_named_by_the_block_that_holds_it(base_config, daemon_factory):
    d = daemon_factory("64MiB", config={"events": {"enabled": True}})
    engine = engine_with_events(mamba_config(base_config), d.socket, make_layers=mamba_layers)
    request = make_request(4, tokens_of(PROMPT, 8))
    # 3 attention chunks; the states at 64 and 96 (where vLLM's steps end) join chunks 1 and 2
    groups = run_and_compare(engine, d, [request], num_objects=5)
    assert engine.worker.num_saved_groups == 2
    assert len(groups[0]) == 6 and len(groups[1]) == 2
    vllm = blocks_of(e for b in engine.recorder.batches for e in b.events)
    # the state after token 64 lives in block 3 (tokens 48..63), the one after 96 in block 5
    assert groups[1] == {maybe_convert_block_hash(request.block_hashes[3]),
                         maybe_convert_block_hash(request.block_hashes[5])}
    assert {vllm[(1, h)]["kind"] for h in groups[1]} == {"mamba"}
