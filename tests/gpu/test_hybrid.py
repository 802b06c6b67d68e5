"""The hybrid model (attention + gated delta rule) and its recurrent snapshots through the store.

A prefix hit needs the KV chunks of the attention layers plus one recurrent snapshot at the
hit boundary, stored with the chunk it ends as one store group; with both restored, greedy
tokens are identical to recomputing."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu.engine.connector import KVConnector
from kvstore.gpu.engine.hybrid import HybridConfig, HybridModel
from kvstore.gpu.engine.hybrid_engine import HybridEngine
from kvstore.identity import chunk_keys, namespace_salt, object_id

CHUNK = 128


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    return HybridEngine(HybridConfig(), num_pages=128, chunk_tokens=CHUNK)


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, HybridConfig().vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def connector(engine, socket) -> KVConnector:
    return KVConnector(socket, engine.codecs(), lambda n: n / 1000.0)


def test_snapshots_at_boundaries_do_not_change_the_scan(engine):
    seq = engine.sequence(engine.add_request(tokens(0, 300), 1))
    model = engine.model
    whole, state, _ = model.forward(seq.token_ids, 0, engine.cache, seq.seq_id, seq.state)
    cut, state_cut, snaps = model.forward(seq.token_ids, 0, engine.cache, seq.seq_id, seq.state, (128, 256))
    engine.release(seq.seq_id)
    assert torch.equal(whole, cut) and torch.equal(state, state_cut)
    assert sorted(snaps) == [128, 256] and snaps[128].shape == (2, 4, 32, 32)


def test_recurrent_snapshots_restore_identically(daemon, engine):
    conn = connector(engine, daemon.socket)
    prompt = tokens(1, 300)
    reference = engine.generate(prompt, 8).token_ids
    assert engine.generate(prompt, 8, conn).loaded_tokens == 0  # computes and saves
    assert conn.stats.num_saved_objects == 4  # 2 KV chunks + 2 snapshots
    assert conn.stats.num_saved_groups == 2  # each chunk with the snapshot at its end
    loaded = engine.generate(prompt, 8, conn)
    assert loaded.loaded_tokens == 256 and loaded.token_ids == reference
    branch = prompt[:270] + tokens(2, 40)  # shares two chunks, then differs
    assert engine.generate(branch, 8, conn).token_ids == engine.generate(branch, 8).token_ids
    conn.close()


def test_a_hit_needs_the_snapshot_at_its_boundary(daemon, engine):
    conn = connector(engine, daemon.socket)
    prompt = tokens(3, 300)
    reference = engine.generate(prompt, 6).token_ids
    engine.generate(prompt, 6, conn)
    kv_codec, snapshot_codec = conn.codecs
    chain = conn._keys(prompt)
    salt = namespace_salt(kv_codec.descriptor.namespace)
    with daemon.client() as client:
        client.delete([object_id(salt, chain[1].logical, snapshot_codec.descriptor)])
        seq = engine.add_request(prompt, 6)
        match = conn.get_num_new_matched_tokens(seq, prompt)
        engine.release(seq)
        assert (match.num_tokens, match.num_hit_tokens) == (128, 256)  # back to the older snapshot
        assert engine.generate(prompt, 6, conn).token_ids == reference  # and re-saves 256's
        client.delete([object_id(salt, key.logical, snapshot_codec.descriptor) for key in chain])
        seq = engine.add_request(prompt, 6)
        assert conn.get_num_new_matched_tokens(seq, prompt).reason == "no_snapshot"
        engine.release(seq)
        assert engine.generate(prompt, 6, conn).token_ids == reference
    conn.close()


def group_members(conn, prompt) -> list[list]:
    """Each chunk's store group by the published key scheme: its KV, then the snapshot after it."""
    kv_codec, snapshot_codec = conn.codecs
    return [list(pair) for pair in zip(chunk_keys(prompt, kv_codec.descriptor),
                                       chunk_keys(prompt, snapshot_codec.descriptor))]


def test_a_hybrid_save_is_visible_as_groups(daemon, engine):
    conn = connector(engine, daemon.socket)
    prompt = tokens(6, 300)
    engine.generate(prompt, 4, conn)
    with daemon.client() as client:
        assert client.lookup_groups(group_members(conn, prompt)).complete == (True, True)
    loaded = engine.generate(prompt, 4, conn)
    assert loaded.loaded_tokens == 256 and loaded.match.reason == "load" and conn.stats.num_loaded_groups == 1
    conn.close()


def test_a_snapshot_deleted_after_the_lookup_imports_no_kv(daemon, engine):
    """Never KV without its state: the group read fails whole, and the engine holds nothing."""
    conn = connector(engine, daemon.socket)
    prompt = tokens(7, 300)
    reference = engine.generate(prompt, 6, conn).token_ids
    seq_id = engine.add_request(prompt, 6)
    assert conn.get_num_new_matched_tokens(seq_id, prompt).num_tokens == 256
    with daemon.client() as client:
        client.delete([group_members(conn, prompt)[1][1]])
    assert conn.start_load_kv(seq_id) == 0
    seq = engine.sequence(seq_id)
    assert (seq.kv_tokens, seq.num_computed) == (0, 0)
    engine.release(seq_id)
    assert engine.generate(prompt, 6, conn).token_ids == reference
    conn.close()


def test_wrong_snapshot_changes_the_output(daemon, engine):
    """test_recurrent_snapshots_restore_identically is sensitive: a zeroed state at the boundary shows."""
    conn = connector(engine, daemon.socket)
    prompt = tokens(4, 300)
    reference = engine.generate(prompt, 8, conn).token_ids
    seq_id = engine.add_request(prompt, 8)
    conn.get_num_new_matched_tokens(seq_id, prompt)
    assert conn.start_load_kv(seq_id) == 256
    seq = engine.sequence(seq_id)
    seq.state = torch.zeros_like(seq.state)
    seq.token_ids.append(engine._compute(seq))
    assert engine.run(seq_id) != reference
    engine.release(seq_id)
    conn.close()


def test_prompt_on_a_boundary_computes_its_last_chunk(daemon, engine):
    conn = connector(engine, daemon.socket)
    prompt = tokens(5, 256)
    reference = engine.generate(prompt, 4, conn).token_ids
    again = engine.generate(prompt, 4, conn)
    assert again.loaded_tokens == 128 and again.token_ids == reference
    conn.close()


def test_seeded_weights_are_reproducible():
    a, b = HybridModel(HybridConfig(seed=7)), HybridModel(HybridConfig(seed=7))
    assert all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    assert HybridConfig(seed=7).revision != HybridConfig(seed=8).revision
