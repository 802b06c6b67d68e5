"""adapters.sglang through SGLang's own factory, over SGLang's real host pools on CPU, against a
real daemon: bit-exact page round trips, leading-prefix hits, a dead daemon, every method there;
the daemon's KV events name the pages as SGLang's own events (KVCacheEventRecorder) do."""

import inspect
import signal

import pytest
import torch
from kvs_events import EventSubscriber, all_events, last_seq
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode
from sglang.srt.mem_cache.utils import get_storage_hash_str, hash_str_to_int64
from sglang_helpers import PAGE, create_backend, make_pool, page_bytes, page_keys, token_indices

pytestmark = pytest.mark.engines

POOLS = [("mha", "page_first"), ("mha", "layer_first"), ("mha", "page_first_direct"),
         ("mla", "page_first"), ("mla", "layer_first")]
SOURCE, TARGET = [1, 2, 3], [9, 5, 7]  # host pool pages: stored from SOURCE, loaded into TARGET


@pytest.mark.parametrize("kind, layout", POOLS)
def test_pages_round_trip_bit_exact_into_other_slots_and_nowhere_else(daemon, kind, layout):
    pool = make_pool(kind, layout)
    keys = page_keys(len(SOURCE))
    writer = create_backend(pool, kind, daemon.socket)
    assert writer.batch_set_v1(keys, token_indices(SOURCE)) == [True] * 3
    for page in TARGET:
        pool.set_from_flat_data_page(page * PAGE, torch.zeros_like(pool.get_dummy_flat_data_page()))
    before = pool.kv_buffer.clone()

    reader = create_backend(pool, kind, daemon.socket)  # another instance, as after a restart
    assert reader.batch_exists(keys) == 3
    assert reader.batch_get_v1(keys, token_indices(TARGET)) == [True] * 3

    for source, target in zip(SOURCE, TARGET):
        assert torch.equal(page_bytes(pool, target), page_bytes(pool, source)), (source, target)
        pool.set_from_flat_data_page(target * PAGE, torch.zeros_like(pool.get_dummy_flat_data_page()))
    assert torch.equal(pool.kv_buffer.view(-1).view(torch.uint8), before.view(-1).view(torch.uint8))
    assert reader.stats()["num_failures"] == 0 and reader.num_errors == 0


def test_batch_exists_counts_only_the_leading_pages_held_whole(daemon):
    pool = make_pool("mha", "page_first")
    keys = page_keys(5)
    backend = create_backend(pool, "mha", daemon.socket)
    assert backend.batch_set_v1([keys[0], keys[1], keys[3]], token_indices([1, 2, 4])) == [True] * 3
    assert backend.batch_exists(keys) == 2
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.exists(keys[1]) and not backend.exists(keys[2])

    got = backend.batch_get_v1(keys, token_indices([10, 11, 12, 13, 14]))
    assert got == [True, True, False, False, False]  # SGLang uses the leading run
    assert torch.equal(page_bytes(pool, 11), page_bytes(pool, 2))

    # A page whose V half is gone is not held: K alone must not count as a hit.
    k_id, v_id = backend.plan.part_ids(keys[1])
    assert backend.store.delete([v_id]) == 1
    assert backend.batch_exists(keys) == 1
    assert backend.batch_get_v1(keys[:2], token_indices([10, 11])) == [True, False]


def test_mla_pages_are_shared_across_tp_ranks_mha_pages_and_pipeline_stages_are_not(daemon):
    keys = page_keys(2)
    for kind in ("mla", "mha"):
        pool = make_pool(kind, "page_first")
        rank0 = create_backend(pool, kind, daemon.socket, tp=(0, 2))
        assert rank0.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
        rank1 = create_backend(pool, kind, daemon.socket, tp=(1, 2))
        assert rank1.batch_exists(keys) == (2 if kind == "mla" else 0), kind
        stage1 = create_backend(pool, kind, daemon.socket, tp=(0, 2), pp=(1, 2))
        assert stage1.batch_exists(keys) == 0, kind


def test_a_killed_daemon_is_a_miss_and_a_failed_write_never_an_exception(daemon):
    pool = make_pool("mha", "page_first")
    keys = page_keys(3)
    backend = create_backend(pool, "mha", daemon.socket)
    flat = create_backend(pool, "mha", daemon.socket, interface_v1=False)
    assert backend.batch_set_v1(keys, token_indices([1, 2, 3])) == [True] * 3
    assert flat.set(keys[0], pool.get_data_page(PAGE))
    daemon.stop(signal.SIGKILL)

    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, token_indices([4, 5, 6])) == [False] * 3
    assert backend.batch_set_v1(keys, token_indices([1, 2, 3])) == [False] * 3
    assert not backend.exists(keys[0])
    assert flat.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert flat.batch_get(keys, None) == [None] * 3
    assert not flat.set(keys[1], pool.get_data_page(2 * PAGE))
    assert not flat.batch_set(keys, [pool.get_data_page(p * PAGE) for p in (1, 2, 3)])
    assert backend.stats()["num_failures"] >= 3 and backend.num_errors == 0


def test_older_interface_round_trips_flat_pages_as_sglang_copies_them(daemon):
    """SGLang's _generic_page_set / _generic_page_get, used without interface_v1."""
    pool = make_pool("mla", "page_first")
    keys = page_keys(3)
    backend = create_backend(pool, "mla", daemon.socket, interface_v1=False)
    pages = [pool.get_data_page(p * PAGE) for p in (1, 2)]
    assert backend.batch_set(keys[:2], pages)
    assert backend.set(keys[2], pool.get_data_page(3 * PAGE))
    assert backend.batch_exists(keys) == 3 and backend.exists(keys[2])

    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g.view(torch.uint8), p.view(torch.uint8)) for g, p in zip(got, pages))
    assert backend.get(page_keys(1, seed=9)[0], pool.get_dummy_flat_data_page()) is None
    assert backend.batch_get([page_keys(1, seed=9)[0], keys[0]], None) == [None, None]
    # v1 parts and flat pages are distinct objects: neither mode reads the other's.
    assert create_backend(pool, "mla", daemon.socket).batch_exists(keys) == 0


def test_the_factory_makes_a_complete_backend_that_connects_only_on_the_data_path(tmp_path):
    pool = make_pool("mha", "page_first")
    backend = create_backend(pool, "mha", str(tmp_path / "no-daemon.sock"))
    assert isinstance(backend, HiCacheStorage) and not inspect.isabstract(type(backend))
    # SGLang's base class gives batch_get_v1 / batch_set_v1 bodies that return None, and a
    # batch_exists that asks exists() key by key: each must be ours.
    for name in ("get", "set", "batch_get", "batch_set", "exists", "batch_exists", "batch_get_v1",
                 "batch_set_v1", "register_mem_pool_host"):
        assert getattr(type(backend), name) is not getattr(HiCacheStorage, name), name
    assert backend.store.stats()["num_failures"] == 0  # nothing tried yet
    assert backend.batch_exists(page_keys(1)) == 0
    assert backend.store.stats()["num_failures"] == 1


def test_socket_from_environment_and_namespace_from_extra_config(daemon, monkeypatch):
    monkeypatch.setenv("KVSTORE_SOCKET", daemon.socket)
    pool = make_pool("mha", "layer_first")
    keys = page_keys(2)
    tenant_a = create_backend(pool, "mha", None, namespace="tenant-a")
    assert tenant_a.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    assert create_backend(pool, "mha", None, namespace="tenant-a").batch_exists(keys) == 2
    assert create_backend(pool, "mha", None, namespace="tenant-b").batch_exists(keys) == 0


def test_byte_pools_need_the_fp8_kind_named_and_then_round_trip(daemon):
    pool = make_pool("mha", "page_first", dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        create_backend(pool, "mha", daemon.socket)
    keys = page_keys(2)
    e4m3 = create_backend(pool, "mha", daemon.socket, kv_cache_dtype="fp8_e4m3")
    assert e4m3.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    assert create_backend(pool, "mha", daemon.socket, kv_cache_dtype="fp8_e5m2").batch_exists(keys) == 0
    assert e4m3.batch_get_v1(keys, token_indices([3, 4])) == [True, True]
    assert torch.equal(page_bytes(pool, 3), page_bytes(pool, 1))


def test_indices_that_do_not_match_the_keys_are_a_miss_not_an_exception(daemon):
    pool = make_pool("mha", "page_first")
    keys = page_keys(2)
    backend = create_backend(pool, "mha", daemon.socket)
    assert backend.batch_set_v1(keys, token_indices([1, 2, 3])) == [False, False]
    assert backend.batch_get_v1(keys, token_indices([1])) == [False, False]
    assert backend.num_errors == 2 and backend.batch_exists(keys) == 0


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact (random bytes hold NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_heads_split_for_tp_lcm_size_are_read_by_ranks_of_another_tp_size(daemon):
    """tp_lcm_size=4 over 8 heads in page_head: a TP-2 rank (4 heads) stores each page as the
    two 2-head slices TP-4 ranks hold, and reads the pages TP-4 ranks stored."""
    keys = page_keys(2)
    wide = [make_pool("mha", "page_head", heads=4, label=f"tp2-{r}") for r in range(2)]
    narrow = [make_pool("mha", "page_head", heads=2, label=f"tp4-{r}") for r in range(4)]
    tp2 = [create_backend(wide[r], "mha", daemon.socket, tp=(r, 2), tp_lcm_size=4) for r in range(2)]
    tp4 = [create_backend(narrow[r], "mha", daemon.socket, tp=(r, 4), tp_lcm_size=4) for r in range(4)]

    assert tp2[1].batch_set_v1(keys, token_indices([1, 2])) == [True, True]  # heads 4..7
    assert [rank.batch_exists(keys) for rank in tp4] == [0, 0, 2, 2]
    for r, heads in ((2, slice(0, 2)), (3, slice(2, 4))):
        assert tp4[r].batch_get_v1(keys, token_indices([5, 6])) == [True, True]
        for source, target in ((1, 5), (2, 6)):  # kv_buffer: [k/v, page, head, token, layer, dim]
            assert same_bytes(narrow[r].kv_buffer[:, target], wide[1].kv_buffer[:, source, heads])

    assert tp4[0].batch_set_v1(keys, token_indices([3, 4])) == [True, True]  # heads 0..1
    assert tp2[0].batch_exists(keys) == 0  # heads 2..3 are still missing
    assert tp4[1].batch_set_v1(keys, token_indices([3, 4])) == [True, True]
    assert tp2[0].batch_get_v1(keys, token_indices([7, 8])) == [True, True]
    for source, target in ((3, 7), (4, 8)):
        assert same_bytes(wide[0].kv_buffer[:, target, 0:2], narrow[0].kv_buffer[:, source])
        assert same_bytes(wide[0].kv_buffer[:, target, 2:4], narrow[1].kv_buffer[:, source])
    assert all(rank.num_errors == 0 for rank in tp2 + tp4)


def test_head_splitting_without_interface_v1_is_refused_naming_both_settings():
    pool = make_pool("mha", "page_head", heads=4)
    with pytest.raises(ValueError, match='"tp_lcm_size".*"interface_v1"'):
        create_backend(pool, "mha", None, tp=(0, 2), tp_lcm_size=4, interface_v1=False)


def _tree(chains):
    """SGLang radix nodes, each the child of the one before: (node, its page hashes as HiCache keys)."""
    parent = TreeNode()
    parent.key, parent.hash_value = RadixKey([]), []
    out, prior = [], None
    for tokens, salt in chains:  # the nodes' own hash_value is left to SGLang's recorder
        node = TreeNode()
        node.key, node.parent = RadixKey(tokens, cache_salt=salt), parent
        out.append((node, get_storage_hash_str(node.key, prior, page_size=PAGE)))
        parent, prior = node, out[-1][1][-1]
    return out


def _published(daemon) -> list[dict]:
    sub = EventSubscriber(daemon, "default")
    try:
        with daemon.client() as c:
            last_seq(c, "default")  # every report is in a batch: the replay holds them all
        return [e for e in all_events(sub.replay(0)) if e["type"] == "BlockStored"]
    finally:
        sub.close()


def test_pages_are_named_in_kv_events_by_the_hashes_sglangs_own_events_give_them(daemon_factory):
    d = daemon_factory("16MiB", config={"events": {"enabled": True}})
    pool = make_pool("mha", "page_first")
    tokens = torch.randint(0, 32000, (5 * PAGE,), generator=torch.Generator().manual_seed(3)).tolist()
    (first, first_keys), (second, second_keys) = _tree([(tokens[:3 * PAGE], None), (tokens[3 * PAGE:], None)])
    recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)  # SGLang's own events for these nodes
    for node in (first, second):
        recorder.record_store(node)
    theirs = {h: (e.parent_block_hash if i == 0 else e.block_hashes[i - 1], e.block_size)
              for e in recorder.take() for i, h in enumerate(e.block_hashes)}

    backend = create_backend(pool, "mha", d.socket)
    assert backend.batch_set_v1(first_keys, token_indices([1, 2, 3])) == [True] * 3
    assert backend.batch_set_v1(second_keys, token_indices([4, 5]),
                                HiCacheStorageExtraInfo(prefix_keys=first_keys)) == [True] * 2
    ours = _published(d)
    assert len(ours) == 2 * 5  # a page is two objects (K and V), each named by the page
    assert {e["block_hashes"][0]: (e["parent_block_hash"], e["block_size"]) for e in ours} == theirs
    assert all(len(e["block_hashes"]) == 1 for e in ours)


def test_a_salted_page_is_named_by_its_storage_hash_which_sglangs_events_do_not_use(daemon_factory):
    """SGLang seeds a namespace's (cache_salt, LoRA) event chain otherwise than its storage
    chain, from what a storage backend is not given: a router must match on the page key."""
    d = daemon_factory("16MiB", config={"events": {"enabled": True}})
    pool = make_pool("mha", "page_first")
    ((node, keys),) = _tree([(list(range(100, 100 + 2 * PAGE)), "tenant-a")])
    recorder = KVCacheEventRecorder(enabled=True, page_size=PAGE)
    recorder.record_store(node)
    (event,) = recorder.take()
    backend = create_backend(pool, "mha", d.socket)
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True] * 2
    named = {e["block_hashes"][0] for e in _published(d)}
    assert named == {hash_str_to_int64(k) for k in keys}
    assert not named & set(event.block_hashes)
