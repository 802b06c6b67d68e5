"""Hybrid SSM models through KVStoreConnector: attention KV and Mamba state stored and hit as
one store group, in vLLM's real scheduler ("align" mode), against a real daemon.

The engine (vllm_engine.Engine) plays the model runner: each step reads the Mamba state at
its first token and records any difference from what the model computes (`state_errors`),
so a state loaded wrong, stale, from another prefix or not at all shows, as does KV.
"""

import signal

import pytest
import torch

from vllm_engine import (BLOCK, LAYER_NAMES, MAMBA_NAMES, Engine, base_config, expected_blocks,  # noqa: F401 (a fixture)
                         make_request, mamba_config, mamba_kv_cache_config, tokens_of)

pytestmark = pytest.mark.engines

PROMPT = 100  # steps of 64 tokens: vLLM offers the state at 64 and at 96 (the prompt's last cacheable boundary)


def mamba_engine(base, socket, sliding=False, shapes=((3, 32), (2, 4, 8)), **kwargs) -> Engine:
    return Engine(mamba_config(base), socket,
                  make_kv_config=lambda n: mamba_kv_cache_config(n, sliding=sliding, shapes=shapes), **kwargs)


def saved(base, daemon, seed, sliding=False) -> tuple[Engine, list]:
    """An engine that ran one prompt to the end (saving it), and the prompt."""
    tokens = tokens_of(PROMPT, seed)
    a = mamba_engine(base, daemon.socket, sliding)
    a.add(make_request(seed, tokens))
    a.run_to_end()
    assert not a.state_errors
    return a, tokens


def full_blocks_exact(engine, request, tokens, count) -> bool:
    full = engine.group_blocks[request.request_id][0]
    want = expected_blocks(tokens, count)
    names = [LAYER_NAMES[0], LAYER_NAMES[2]] if len(engine.groups) == 3 else LAYER_NAMES
    rows = [0, 2] if len(engine.groups) == 3 else list(range(len(LAYER_NAMES)))
    return all(torch.equal(engine.block_kv(full[i], names), want[i][rows]) for i in range(count))


@pytest.mark.parametrize("sliding", [False, True], ids=["attention+mamba", "attention+window+mamba"])
def test_a_prefix_and_its_state_load_bit_exact_in_a_fresh_engine(base_config, daemon, sliding):
    a, tokens = saved(base_config, daemon, 31 + sliding, sliding)
    assert a.worker.num_saved_groups == 2  # chunks 1 and 2 end where vLLM offered a state (64, 96)
    desc = a.connector.groups[-1][0]
    assert (desc.kind.value, desc.dtype.value, str(desc.layout)) == (
        "recurrent", "fp32", "mamba(layers=2,states=3x32:fp16+2x4x8:fp32)")
    b = mamba_engine(base_config, daemon.socket, sliding)
    again = make_request(100 + sliding, tokens)
    b.add(again)
    out = b.step_until_scheduled(again)
    assert out.num_scheduled_tokens[again.request_id] == PROMPT - 96  # 96 tokens and the state at 96 loaded
    assert b.worker.num_loaded_states == 1 and not b.failed_receives
    assert full_blocks_exact(b, again, tokens, 96 // BLOCK)
    b.run_to_end()
    assert not b.state_errors  # the first step after the load read exactly the model's state at 96


def test_states_of_odd_sizes_round_trip(base_config, daemon):
    """A conv state of 3x3 fp16 (18 bytes) puts the fp32 SSM state at an odd offset of the object."""
    tokens = tokens_of(PROMPT, 35)
    a = mamba_engine(base_config, daemon.socket, shapes=((3, 3), (2, 4, 8)))
    a.add(make_request(150, tokens))
    a.run_to_end()
    assert str(a.connector.groups[-1][0].layout) == "mamba(layers=2,states=3x3:fp16+2x4x8:fp32)"
    b = mamba_engine(base_config, daemon.socket, shapes=((3, 3), (2, 4, 8)))
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
    from vllm_engine import expected_state
    d = daemon_factory("64MiB", config={"nvme": {"enabled": True, "capacity_bytes": "64MiB", "file_bytes": "16MiB",
                                                 "write_policy": "write_through"}})
    tokens = tokens_of(PROMPT, 91)
    a = mamba_engine(base_config, d.socket)
    a.add(make_request(800, tokens))
    a.run_to_end()
    d.stop(signal.SIGKILL)
    spec = mamba_kv_cache_config().kv_cache_groups[-1].kv_cache_spec
    # the whole state object at 96: layer after layer, conv state then SSM state
    needle = b"".join(t.numpy().tobytes() for t in expected_state(tokens, 96, spec, MAMBA_NAMES))
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
