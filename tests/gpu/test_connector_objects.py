"""A hybrid model's chunks through the connector as store groups, over a real daemon.

Codecs here hand the connector fixed bytes per chunk (no engine, no torch): a KV codec with
one object per chunk and a snapshot codec whose object is the state after a chunk. A
snapshot is stored, found and read only with the chunk it ends (gpu.engine.connector_objects)."""

from __future__ import annotations

import pytest

from kvstore.gpu.engine.connector import KVConnector
from kvstore import Layout, StateDescriptor, chunk_keys
from kvs_testing import payload

CHUNK = 64
KV = StateDescriptor("default", "tiny-hybrid", "r1", "kv", "bf16",
                     Layout.make("paged", order="layer_first", layers=2, block=16, kv_heads=1, head_dim=64),
                     chunk_tokens=CHUNK)
SNAPSHOT = KV.with_(kind="recurrent", dtype="fp32", layout=Layout.make("recurrent", layers=2, heads=2, k_dim=16,
                                                                       v_dim=16))
PROMPT = list(range(1000, 1000 + 4 * CHUNK + 10))  # 4 full chunks, all usable


class BytesCodec:
    """Exports seeded bytes per chunk; records what it is handed to import."""

    def __init__(self, descriptor: StateDescriptor, boundary_only: bool, seed: int):
        self.descriptor, self.boundary_only, self.seed = descriptor, boundary_only, seed
        self.missing: set[int] = set()  # chunk ends the engine has no snapshot for
        self.loaded: list[tuple[int, bool]] = []  # (end token, bytes as exported)

    def bytes_of(self, end: int):
        return payload(self.descriptor.object_bytes, self.seed * 100_000 + end)

    def export(self, request_id, start_token, end_token):
        return None if end_token in self.missing else self.bytes_of(end_token)

    def load(self, request_id, start_token, end_token, data):
        self.loaded.append((end_token, bool((data == self.bytes_of(end_token)).all())))


@pytest.fixture
def hybrid(daemon):
    kv, snapshot = BytesCodec(KV, False, 1), BytesCodec(SNAPSHOT, True, 2)
    conn = KVConnector(daemon.socket, [kv, snapshot], prefill_s=lambda tokens: tokens * 1.0)
    yield conn, kv, snapshot
    conn.close()


def save(conn, request_id="writer"):
    conn.save_kv(request_id, PROMPT, len(PROMPT))
    return conn.request_finished(request_id, PROMPT, len(PROMPT))


def members(conn, chunk: int) -> list:
    """Chunk `chunk`'s group as anyone computes it from the key scheme: its KV, then the
    snapshot at its end."""
    return [chunk_keys(PROMPT, KV)[chunk], chunk_keys(PROMPT, SNAPSHOT)[chunk]]


def test_a_chunk_with_its_snapshot_is_saved_as_one_group(daemon, hybrid):
    conn, kv, snapshot = hybrid
    snapshot.missing = {2 * CHUNK}  # the engine has no state after chunk 1
    assert save(conn) == 7  # chunks 0, 2, 3 with their snapshots; chunk 1's KV alone
    assert (conn.stats.num_saved_groups, conn.stats.num_saved_objects) == (3, 7)
    with daemon.client() as client:
        found = client.lookup_groups([members(conn, j) for j in range(4)])
        assert found.complete == (True, False, True, True)
        kv1, snapshot1 = members(conn, 1)
        assert client.lookup([kv1, snapshot1]).tiers == ("host", None)  # never a snapshot alone


def test_snapshots_stored_alone_are_no_hit(daemon, hybrid):
    """Objects put one by one (not as a group) never count: KV without its state is no hit."""
    conn, kv, snapshot = hybrid
    with daemon.client() as client:
        for j in range(4):
            for key, codec in zip(members(conn, j), (kv, snapshot)):
                client.put(key, codec.bytes_of((j + 1) * CHUNK))
    match = conn.get_num_new_matched_tokens("reader", PROMPT)
    assert (match.num_tokens, match.num_hit_tokens, match.reason) == (0, 4 * CHUNK, "no_snapshot")
    assert conn.start_load_kv("reader") == 0 and kv.loaded == snapshot.loaded == []


def test_a_snapshot_deleted_makes_the_hit_end_at_the_last_whole_group(daemon, hybrid):
    conn, kv, snapshot = hybrid
    save(conn)
    with daemon.client() as client:
        client.delete([members(conn, 3)[1], members(conn, 2)[1]])  # plain deletes of two snapshots
    match = conn.get_num_new_matched_tokens("reader", PROMPT)
    assert (match.num_tokens, match.num_hit_tokens, match.reason) == (2 * CHUNK, 4 * CHUNK, "load")
    assert conn.start_load_kv("reader") == 2 * CHUNK
    assert kv.loaded == [(CHUNK, True), (2 * CHUNK, True)] and snapshot.loaded == [(2 * CHUNK, True)]
    assert conn.stats.num_loaded_groups == 1


def test_a_group_broken_after_the_lookup_imports_nothing(daemon, hybrid):
    conn, kv, snapshot = hybrid
    save(conn)
    assert conn.get_num_new_matched_tokens("reader", PROMPT).num_tokens == 4 * CHUNK
    with daemon.client() as client:
        client.delete([members(conn, 3)[1]])  # the last chunk's snapshot goes before the load
    assert conn.start_load_kv("reader") == 0 and kv.loaded == snapshot.loaded == []
    assert conn.match("reader").reason == "evicted" and conn.link.num_errors == 0
    save(conn, "writer-2")  # puts the last group back
    assert conn.get_num_new_matched_tokens("reader-2", PROMPT).num_tokens == 4 * CHUNK
    with daemon.client() as client:
        client.delete([members(conn, 1)[0]])  # a chunk read alone goes after the group was read
    assert conn.start_load_kv("reader-2") == 0 and kv.loaded == snapshot.loaded == []
    assert conn.link.call(lambda client: client.stats())["leases"] == 0  # the group's leases too


def test_a_member_stored_again_with_other_bytes_is_never_imported(daemon, hybrid):
    conn, kv, snapshot = hybrid
    save(conn)
    kv3 = members(conn, 3)[0]
    with daemon.client() as client:
        client.delete([kv3])
        client.put(kv3, kv.bytes_of(0))  # the same id, other bytes
    assert conn.get_num_new_matched_tokens("reader", PROMPT).num_tokens == 4 * CHUNK
    assert conn.start_load_kv("reader") == 0 and kv.loaded == snapshot.loaded == []
    assert conn.match("reader").reason == "evicted"


def test_a_refused_group_put_is_not_an_outage(daemon, hybrid):
    conn, kv, snapshot = hybrid
    with daemon.client() as client:  # chunk 0's snapshot id taken by an object of another kind
        client.put(members(conn, 0)[1].object_id, payload(KV.object_bytes, 9), KV)
    save(conn)
    assert conn.stats.num_saved_groups == 3 and "group of 2" in conn.stats.last_error
    assert conn.link.num_errors == 0 and not conn.link.down
    match = conn.get_num_new_matched_tokens("reader", PROMPT)
    assert (match.num_tokens, match.reason) == (0, "miss")  # chunk 0 was not stored at all
