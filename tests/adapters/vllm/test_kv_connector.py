"""KVStoreConnector inside vLLM's real scheduler, against a real daemon (issue 12, vLLM).

vLLM's factory creates the connector from `kv_connector_module_path`; its scheduler calls
the scheduler role; the test plays the model runner: it binds the step's metadata to a
worker-role connector over CPU paged caches, runs start_load_kv, writes the KV a model would
compute for the scheduled tokens, runs wait_for_save and reports back to the scheduler.
The "model" is deterministic: the KV of position p depends on every token up to p, the
layer, K or V, the head and the dim, so a wrong, shifted or stale block is seen.
"""

import copy
import signal

import pytest
import torch

from tests.v1.kv_connector.unit.utils import create_scheduler
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_engine import NUM_BLOCKS, Engine, base_config, make_request, tokens_of  # noqa: F401 (a fixture)
from vllm_model import BLOCK, LAYER_NAMES, attention_layers, expected_blocks, hybrid_layers, plan_kv_cache

pytestmark = pytest.mark.engines

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_vllm_loads_a_prefix_saved_by_another_engine_bit_exact(base_config, daemon, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA (the paged caches on the GPU)")
    tokens = tokens_of(100, 1)
    a = Engine(base_config, daemon.socket, device)
    a.add(make_request(1, tokens))
    a.run_to_end()
    assert a.worker.num_saved_chunks == 3  # 100 prompt tokens: three whole 32-token chunks
    # A fresh engine, as after a restart: its scheduler finds the prefix in the store.
    b = Engine(base_config, daemon.socket, device)
    again = make_request(2, tokens)
    b.add(again)
    out = b.step()
    # 96 tokens came from the store; vLLM computes only the last 4.
    assert out.num_scheduled_tokens[again.request_id] == 4
    assert b.worker.num_loaded_chunks == 3
    for index, want in enumerate(expected_blocks(tokens, 6)):
        assert torch.equal(b.block_kv(again.request_id, index), want), \
            f"block {index} differs from what the model computed"
    assert not b.load_errors
    b.run_to_end()


def test_a_dead_daemon_means_recompute_and_no_error_reaches_vllm(base_config, daemon):
    tokens = tokens_of(80, 3)
    a = Engine(base_config, daemon.socket)
    a.add(make_request(3, tokens))
    a.run_to_end()
    assert a.worker.num_saved_chunks == 2
    daemon.stop(signal.SIGKILL)
    b = Engine(base_config, daemon.socket)
    request = make_request(4, tokens)
    b.add(request)
    out = b.step()
    assert out.num_scheduled_tokens[request.request_id] == 64  # all from scratch (token budget 64)
    b.run_to_end()
    assert b.connector.store.num_failures >= 1 and b.worker.store.num_failures >= 1
    assert b.worker.num_loaded_chunks == 0


def test_a_chunk_lost_between_lookup_and_load_is_recomputed(base_config, daemon):
    tokens = tokens_of(70, 5)
    a = Engine(base_config, daemon.socket)
    a.add(make_request(5, tokens))
    a.run_to_end()
    b = Engine(base_config, daemon.socket)
    again = make_request(6, tokens)
    b.add(again)
    # The scheduler's lookup hits; then both chunks vanish before the worker loads them.
    lost = []
    real_build = b.connector.build_connector_meta

    def build_then_delete(scheduler_output):
        meta = real_build(scheduler_output)
        lost.extend(spec.object_id for spec in meta.loads)
        with daemon.client() as c:
            c.delete(lost)
        return meta

    b.connector.build_connector_meta = build_then_delete
    out = b.step()
    b.connector.build_connector_meta = real_build
    assert len(lost) == 2 and out.num_scheduled_tokens[again.request_id] == 6
    assert len(b.load_errors) == 4  # the four blocks of the two chunks
    b.run_to_end()
    # vLLM recomputed the failed blocks (recompute policy): they hold what the model computes.
    for index, want in enumerate(expected_blocks(tokens, 4)):
        assert torch.equal(b.block_kv(again.request_id, index), want), f"block {index} was not recomputed"


def test_cache_salt_and_model_revision_keep_requests_apart(base_config, daemon):
    tokens = tokens_of(70, 7)
    a = Engine(base_config, daemon.socket)
    a.add(make_request(7, tokens, cache_salt="tenant-a"))
    a.run_to_end()
    b = Engine(base_config, daemon.socket)
    assert b.connector.get_num_new_matched_tokens(make_request(8, tokens), 0) == (0, False)
    salted = make_request(9, tokens, cache_salt="tenant-a")
    assert b.connector.get_num_new_matched_tokens(salted, 0) == (64, False)
    # vLLM's local prefix cache already holds 32 tokens: only the rest is ours to load.
    assert b.connector.get_num_new_matched_tokens(make_request(10, tokens, cache_salt="tenant-a"), 32) == (32, False)
    other = copy.deepcopy(base_config)
    other.kv_transfer_config.kv_connector_extra_config.update(socket_path=daemon.socket, model_revision="v2")
    c = create_scheduler(other, num_blocks=NUM_BLOCKS,
                         kv_cache_config=plan_kv_cache(other, attention_layers(), NUM_BLOCKS))
    assert c.connector.get_num_new_matched_tokens(make_request(11, tokens, cache_salt="tenant-a"), 0) == (0, False)


# --- hybrid models (SupportsHMA) ---------------------------------------------------------------

def test_a_hybrid_model_keeps_vllm_hybrid_manager_and_loads_each_group_bit_exact(base_config, daemon):
    assert base_config.scheduler_config.disable_hybrid_kv_cache_manager is False  # SupportsHMA: vLLM keeps it on
    tokens = tokens_of(100, 11)
    a = Engine(base_config, daemon.socket, make_layers=hybrid_layers)
    a.add(make_request(21, tokens))
    a.run_to_end()
    assert len(a.groups) == 3  # vLLM's grouping: full attention layers 0 and 2 a group each, the window one
    assert a.worker.num_saved_chunks == 9  # three whole chunks, each group its own object
    b = Engine(base_config, daemon.socket, make_layers=hybrid_layers)
    again = make_request(22, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)  # several groups: the load takes a step of its own
    assert out.num_scheduled_tokens[again.request_id] == 4  # 96 tokens from the store
    assert not b.load_errors and not b.failed_receives
    rid = again.request_id
    want = expected_blocks(tokens, 6)
    for index in range(6):
        assert torch.equal(b.block_kv(rid, index, [LAYER_NAMES[0], LAYER_NAMES[2]]), want[index][[0, 2]]), \
            f"full-attention block {index} differs"
    held = [index for index in range(6) if b.block_of(rid, LAYER_NAMES[1], index) != 0]
    assert 0 < len(held) < 6, f"the sliding-window group should hold only its window, holds blocks {held}"
    for index in held:
        assert torch.equal(b.block_kv(rid, index, [LAYER_NAMES[1]]), want[index][[1]]), \
            f"sliding-window block {index} differs"
    b.run_to_end()


def test_a_hybrid_prefix_missing_in_one_group_is_no_hit(base_config, daemon):
    tokens = tokens_of(70, 13)
    a = Engine(base_config, daemon.socket, make_layers=hybrid_layers)
    a.add(make_request(23, tokens))
    a.run_to_end()
    b = Engine(base_config, daemon.socket, make_layers=hybrid_layers)
    plan_ids = b.connector._plan(make_request(24, tokens)).ids
    assert len(plan_ids) == 3 and len({ids[0] for ids in plan_ids}) == 3  # the groups never share an id
    with daemon.client() as c:
        c.delete([plan_ids[b.group_of[LAYER_NAMES[1]]][1]])  # the sliding-window group's second chunk
    assert b.connector.get_num_new_matched_tokens(make_request(25, tokens), 0) == (32, True)  # async: several groups


def test_a_mamba_group_outside_align_mode_is_refused_naming_the_setting(base_config, daemon):
    from tests.v1.kv_connector.unit.utils import make_kv_cache_config
    config = copy.deepcopy(base_config)
    config.kv_transfer_config.kv_connector_extra_config["socket_path"] = daemon.socket
    with pytest.raises(ValueError, match=r"does not support: group 1: mamba_cache_mode='none' != 'align'"):
        KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER,
                                            make_kv_cache_config(BLOCK, mamba_enabled=True))


def test_a_window_that_moves_while_a_chunk_is_computed_loads_back_bit_exact(base_config, daemon):
    """Small steps (24 tokens), 64-token chunks, a one-block window and a small block pool:
    vLLM frees the window's old blocks while a chunk is still being computed and hands freed
    blocks out again. Whatever the connector saved must load back bit-exact. (Which blocks
    vLLM reuses when is its allocator's business: tests/adapters/test_vllm_plan.py pins the
    plan's side, a reused id never saved as part of a chunk.)"""
    small_steps = copy.deepcopy(base_config)
    small_steps.scheduler_config.max_num_batched_tokens = 24
    small_steps.kv_transfer_config.kv_connector_extra_config["chunk_tokens"] = 64
    # vLLM keeps every window block it computed only with dense retention (an interval of one
    # block); with its default, 0, it drops them as the window moves, and no chunk is whole to save.
    small_steps.cache_config.prefix_cache_retention_interval = BLOCK
    tokens = tokens_of(200, 17)

    def tight():
        return hybrid_layers(window=BLOCK)

    a = Engine(small_steps, daemon.socket, make_layers=tight, num_blocks=34)  # 26 for the two full-attention groups
    a.add(make_request(26, tokens))
    a.run_to_end()
    assert a.worker.num_saved_chunks > 0
    b = Engine(small_steps, daemon.socket, make_layers=tight)
    again = make_request(27, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert not b.load_errors and not b.failed_receives
    from_store = out.scheduled_new_reqs[0].num_computed_tokens  # a fresh engine: nothing local
    assert from_store > 0 and from_store % 64 == 0
    want = expected_blocks(tokens, 200 // BLOCK)
    rid, loaded = again.request_id, from_store // 64
    for index in range(from_store // BLOCK):
        assert torch.equal(b.block_kv(rid, index, [LAYER_NAMES[0], LAYER_NAMES[2]]), want[index][[0, 2]]), \
            f"full-attention block {index} differs ({loaded} chunks loaded)"
        if b.block_of(rid, LAYER_NAMES[1], index) != 0:
            assert torch.equal(b.block_kv(rid, index, [LAYER_NAMES[1]]), want[index][[1]]), \
                f"sliding-window block {index} differs ({loaded} chunks loaded)"
