"""Hybrid SSM models through KVStoreConnector: attention KV and Mamba state stored and hit as
one store group, in vLLM's real scheduler ("align" mode), against a real daemon.

The engine (vllm_engine.Engine) plays the model runner over the caches vLLM's own code plans,
allocates and binds (vllm_model), registered as a vLLM 0.33 worker registers them: each step
reads the Mamba state at its first token and records any difference from what the model
computes (`state_errors`), so a state loaded wrong, stale, from another prefix or not at all
shows, as does KV.
"""

import copy
import signal

import pytest
import torch

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_engine import NUM_BLOCKS, Engine, base_config, make_request, tokens_of  # noqa: F401 (a fixture)
from vllm_model import (BLOCK, LAYER_NAMES, MAMBA_NAMES, STATE_DTYPES, STATE_SHAPES, expected_blocks, expected_state,
                        mamba_config, mamba_layers)

pytestmark = pytest.mark.engines

PROMPT = 100  # steps of 64 tokens: vLLM offers the state at 64 and at 96 (the prompt's last cacheable boundary)


def mamba_engine(base, socket, sliding=False, shapes=STATE_SHAPES, dtypes=STATE_DTYPES, **kwargs) -> Engine:
    return Engine(mamba_config(base), socket, make_layers=lambda: mamba_layers(sliding, shapes, dtypes), **kwargs)


def saved(base, daemon, seed, sliding=False) -> tuple[Engine, list]:
    """An engine that ran one prompt to the end (saving it), and the prompt."""
    tokens = tokens_of(PROMPT, seed)
    a = mamba_engine(base, daemon.socket, sliding)
    a.add(make_request(seed, tokens))
    a.run_to_end()
    assert not a.state_errors
    return a, tokens


def full_blocks_exact(engine, request, tokens, count) -> bool:
    """The first `count` blocks of every full-attention layer hold what the model computed."""
    want = expected_blocks(tokens, count)
    rows = [i for i, name in enumerate(LAYER_NAMES) if engine.layers[name].spec.sliding_window is None]
    names = [LAYER_NAMES[i] for i in rows]
    return all(torch.equal(engine.block_kv(request.request_id, i, names), want[i][rows]) for i in range(count))


CONTENT = 3 * 32 * 2 + 2 * 4 * 8 * 4  # a Mamba layer's state bytes a block: conv 3x32 fp16, then SSM 2x4x8 fp32


def test_the_raw_page_views_vllm_registers_for_mamba_layers_are_accepted(base_config, daemon):
    """Issue 41, item 0: vLLM 0.33's model runner registers one raw int8 page view
    [num_blocks, 1, 1, C] per Mamba layer (allocate_kv_cache; the layer unpacks it itself),
    which the connector refused at worker start, wanting lists of per-state tensors. A state
    object is every layer's C bytes of the block, conv then SSM, none of the page's padding."""
    engine = mamba_engine(base_config, daemon.socket)  # registers what vLLM's model runner allocated
    pages = [engine.registered[name] for name in MAMBA_NAMES]
    assert all(isinstance(p, torch.Tensor) and p.dtype == torch.int8 for p in pages)
    assert {tuple(p.shape) for p in pages} == {(NUM_BLOCKS, 1, 1, CONTENT)}
    assert all(p.stride(0) > CONTENT for p in pages)  # vLLM padded the page to the attention page
    desc = engine.connector.groups[1][0]
    assert desc.object_bytes == len(MAMBA_NAMES) * CONTENT
    tokens = tokens_of(PROMPT, 21)
    engine.add(make_request(21, tokens))
    engine.run_to_end()
    assert engine.worker.num_saved_groups == 2 and not engine.state_errors
    state_at_96 = engine.connector._plan(make_request(22, tokens)).ids[1][2]
    held = bytearray(desc.object_bytes)
    with daemon.client() as c:
        assert c.get_into(state_at_96, held) == len(held)
    want = expected_state(tokens, 96, engine.mamba[1], MAMBA_NAMES)  # layer after layer, conv then SSM
    assert bytes(held) == b"".join(t.numpy().tobytes() for t in want)


def test_mamba_caches_other_than_vllms_page_views_are_refused_naming_what_to_register(base_config, daemon):
    """The per-state lists the connector once wanted (no vLLM 0.33 path registers them) and a
    page of the wrong size are refused at worker start, saying what vLLM registers."""
    engine = mamba_engine(base_config, daemon.socket)
    page = engine.registered[MAMBA_NAMES[0]]
    for wrong, got in [(list(engine.layers[MAMBA_NAMES[0]].kv_cache), "got list"),  # the layer's (conv, SSM) views
                       (page[..., :CONTENT - 4], rf"got Tensor \({NUM_BLOCKS}, 1, 1, {CONTENT - 4}\)")]:
        worker = KVConnectorFactory.create_connector(engine.config, KVConnectorRole.WORKER,
                                                     copy.deepcopy(engine.kv_config))
        with pytest.raises(ValueError, match=rf"group 1's Mamba caches must be vLLM 0.33's raw page views, one tensor "
                                             rf"per layer shaped \[num_blocks={NUM_BLOCKS}, 1, 1, {CONTENT}\].*{got}"):
            worker.register_kv_caches({**engine.registered, MAMBA_NAMES[0]: wrong})


@pytest.mark.parametrize("sliding", [False, True], ids=["attention+mamba", "attention+window+mamba"])
def test_a_prefix_and_its_state_load_bit_exact_in_a_fresh_engine(base_config, daemon, sliding):
    a, tokens = saved(base_config, daemon, 31 + sliding, sliding)
    assert a.worker.num_saved_groups == 2  # chunks 1 and 2 end where vLLM offered a state (64, 96)
    # vLLM's grouping: the three Mamba layers one group, or (beside a window) a group each
    assert len(a.mamba) == (3 if sliding else 1)
    desc = a.connector.groups[-1][0]
    assert (desc.kind.value, desc.dtype.value, str(desc.layout)) == (
        "recurrent", "fp32", f"mamba(layers={1 if sliding else 3},states=3x32:fp16+2x4x8:fp32)")
    b = mamba_engine(base_config, daemon.socket, sliding)
    again = make_request(100 + sliding, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert out.num_scheduled_tokens[again.request_id] == PROMPT - 96  # 96 tokens and the state at 96 loaded
    assert b.worker.num_loaded_states == len(b.mamba) and not b.failed_receives
    assert full_blocks_exact(b, again, tokens, 96 // BLOCK)
    b.run_to_end()
    assert not b.state_errors  # the first step after the load read exactly the model's state at 96


def test_with_vllms_default_retention_the_prompts_last_state_is_the_hit(base_config, daemon):
    """vLLM 0.33's default (--prefix-cache-retention-interval 0) keeps, and offers, only the
    state at the prompt's last cacheable boundary (96), not where its first step ended (64)."""
    config = mamba_config(base_config, retention_tokens=0)
    tokens = tokens_of(PROMPT, 25)
    a = Engine(config, daemon.socket, make_layers=mamba_layers)
    a.add(make_request(25, tokens))
    a.run_to_end()
    assert a.worker.num_saved_groups == 1 and not a.state_errors
    b = Engine(config, daemon.socket, make_layers=mamba_layers)
    again = make_request(26, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert out.num_scheduled_tokens[again.request_id] == PROMPT - 96 and b.worker.num_loaded_states == 1
    b.run_to_end()
    assert not b.state_errors and full_blocks_exact(b, again, tokens, PROMPT // BLOCK)


def test_states_of_odd_sizes_round_trip(base_config, daemon):
    """A conv state of 3x3 fp16 (18 bytes) puts the SSM state at byte 18 of the page (vLLM's own
    layer unpacks it there; an fp32 state it could not view at that offset), 48 bytes a layer."""
    tokens = tokens_of(PROMPT, 35)
    odd = {"shapes": ((3, 3), (3, 5)), "dtypes": (torch.float16, torch.float16)}
    a = mamba_engine(base_config, daemon.socket, **odd)
    a.add(make_request(150, tokens))
    a.run_to_end()
    assert str(a.connector.groups[-1][0].layout) == "mamba(layers=3,states=3x3:fp16+3x5:fp16)"
    assert tuple(a.registered[MAMBA_NAMES[0]].shape[1:]) == (1, 1, 48)
    b = mamba_engine(base_config, daemon.socket, **odd)
    again = make_request(151, tokens)
    b.add(again)
    b.step_until_scheduled(again)
    b.run_to_end()
    assert b.worker.num_loaded_states == 1 and not b.state_errors and not b.failed_receives


def test_a_prefix_whose_state_is_deleted_is_no_hit_beyond_the_last_whole_group(base_config, daemon):
    a, tokens = saved(base_config, daemon, 41)
    b = mamba_engine(base_config, daemon.socket)
    plan = b.connector._plan(make_request(200, tokens))
    with daemon.client() as c:
        assert c.delete([plan.ids[1][2]]) == 1  # the state at 96
    assert b.connector.get_num_new_matched_tokens(make_request(201, tokens), 0) == (64, True)
    with daemon.client() as c:
        assert c.delete([plan.ids[1][1]]) == 1  # the state at 64: no state left, every KV chunk still held
        assert c.lookup(plan.ids[0]).hits == 3
    assert b.connector.get_num_new_matched_tokens(make_request(202, tokens), 0) == (0, False)
    again = make_request(203, tokens)
    b.add(again)
    out = b.step()
    assert out.num_scheduled_tokens[again.request_id] == 64  # computed from the start
    b.run_to_end()
    assert b.worker.num_loaded_chunks == 0 and not b.state_errors


def test_a_group_lost_between_lookup_and_load_is_a_failed_receive_and_vllm_recomputes(base_config, daemon):
    a, tokens = saved(base_config, daemon, 51)
    b = mamba_engine(base_config, daemon.socket)
    again = make_request(300, tokens)
    b.add(again)
    real_build = b.connector.build_connector_meta

    def build_then_delete(scheduler_output):  # the scheduler's lookup hit; the state goes before the load
        meta = real_build(scheduler_output)
        with daemon.client() as c:
            c.delete([spec.object_id for spec in meta.loads if spec.group == 1])
        return meta

    b.connector.build_connector_meta = build_then_delete
    b.step()
    b.connector.build_connector_meta = real_build
    assert b.failed_receives == {again.request_id}
    assert b.worker.num_loaded_states == 0 and b.worker.num_loaded_chunks == 0  # no KV without its state
    out = b.step_until_scheduled(again)
    # vLLM looked up again: the group ending at 64 is whole, the one ending at 96 is not.
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64 and b.worker.num_loaded_states == 1
    b.run_to_end()
    assert not b.state_errors and full_blocks_exact(b, again, tokens, PROMPT // BLOCK)


def test_a_daemon_killed_during_a_group_put_leaves_no_partial_hit(base_config, daemon_factory):
    d = daemon_factory("64MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                                 "write_policy": "write_through"}})
    tokens = tokens_of(PROMPT, 61)
    a = mamba_engine(base_config, d.socket)
    real_put = a.worker.store.put_groups
    calls = []

    def put_then_die(groups, hints=None, routes=None):  # the second group's put meets a dead daemon
        calls.extend(len(items) for items in groups)
        if len(calls) == 2:
            d.stop(signal.SIGKILL)
        return real_put(groups, hints, routes)

    a.worker.store.put_groups = put_then_die
    a.add(make_request(400, tokens))
    a.run_to_end()
    assert calls == [2, 2] and a.worker.num_saved_groups == 1
    d.start("64MiB")
    b = mamba_engine(base_config, d.socket)
    again = make_request(401, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64  # the first group, durable; never the second
    b.run_to_end()
    assert not b.state_errors and not b.failed_receives


def test_the_scheduler_never_hits_kv_whose_state_was_evicted(base_config, daemon_factory):
    """Prompts through a small arena: the daemon evicts objects of either kind (the first
    prompt's KV is pinned, so only its states and manifests can go). Whatever a fresh engine
    finds it loads whole, and the state it reads is always the model's."""
    d = daemon_factory("256KiB")
    prompts = [tokens_of(PROMPT, 70 + i) for i in range(24)]
    a = mamba_engine(base_config, d.socket, num_blocks=256)
    first = a.connector._plan(make_request(999, prompts[0]))
    for i, tokens in enumerate(prompts):
        a.add(make_request(1000 + i, tokens))
        a.run_to_end()
        if i == 0:
            with d.client() as c:
                assert c.pin(first.ids[0]) == 3
    with d.client() as c:
        assert c.lookup(first.ids[0]).hits == 3  # its KV is all there...
        assert None in c.lookup(first.ids[1][1:]).tiers  # ... a state of it is not
        state_at_96 = c.lookup([first.ids[1][2]]).hits == 1
    b = mamba_engine(base_config, d.socket, num_blocks=256)
    hits = []  # newest prompt first
    for i, tokens in reversed(list(enumerate(prompts))):  # the newest first: they are still held
        request = make_request(2000 + i, tokens)
        b.add(request)
        out = b.step_until_scheduled(request)
        hits.append(out.scheduled_new_reqs[0].num_computed_tokens if out.scheduled_new_reqs else None)
        b.run_to_end()
    assert not b.state_errors and not b.failed_receives
    assert set(hits) <= {0, 64, 96} and min(hits) < 96 == max(hits)  # some prompts lost objects, some none
    assert hits[-1] < 96 or state_at_96  # the pinned KV is never a hit past the states it lost


def test_a_state_corrupted_on_disk_is_never_loaded(base_config, daemon_factory):
    """A flipped byte in the stored state at 96 (on NVMe, across a restart), caught by the
    restart's sample check or by the group read's checksum (then the receive fails and vLLM
    looks up again): the hit lands on the last whole group (64), and the state the engine
    reads is always the model's."""
    import os
    d = daemon_factory("64MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                                 "write_policy": "write_through"}})
    tokens = tokens_of(PROMPT, 91)
    a = mamba_engine(base_config, d.socket)
    a.add(make_request(800, tokens))
    a.run_to_end()
    d.stop(signal.SIGKILL)
    # the whole state object at 96: layer after layer, conv state then SSM state
    needle = b"".join(t.numpy().tobytes() for t in expected_state(tokens, 96, a.mamba[1], MAMBA_NAMES))
    flipped = 0
    for root, _, files in os.walk(os.path.join(d.data_dir, "nvme")):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                blob = f.read()
                if (at := blob.find(needle)) >= 0:
                    f.seek(at + 500)
                    f.write(bytes([blob[at + 500] ^ 0xFF]))
                    flipped += 1
    assert flipped == 1
    d.start("64MiB")
    b = mamba_engine(base_config, d.socket)
    again = make_request(801, tokens)
    b.add(again)
    out = b.step_until_scheduled(again, max_steps=8)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 64
    b.run_to_end()
    assert not b.state_errors
