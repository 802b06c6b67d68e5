"""adapters.sglang's v2 interface (hybrid models' extra pools: Mamba, SWA, DSA indexer) through
SGLang's own factory and host pool classes on CPU, against a real daemon, called the way
SGLang's HybridCacheController calls it: a radix node's backup writes its extra pools
(batch_set_v2) and then its KV (batch_set_v1); a prefetch asks batch_exists_v2 with
placeholder keys, reads the KV, then the extra pools with keys re-aligned to the hit."""

import signal

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer,
                                                  PoolTransferResult)
from sglang_helpers import (DSA_PAGE, PAGE, create_backend, create_hybrid_backend, make_dsa_pools, make_mamba_pool,
                            make_pool, page_bytes, page_keys, token_indices)

pytestmark = pytest.mark.engines

TRAILING, ALL_PAGES = PoolHitPolicy.TRAILING_PAGES, PoolHitPolicy.ALL_PAGES
KV_SOURCE, KV_TARGET = [1, 2, 3], [9, 5, 7]  # host pool pages: stored from, loaded into
SWA_SOURCE, SWA_TARGET = [2, 3], [12, 13]  # the SWA window: the node's last 2 pages
MAMBA_SOURCE, MAMBA_TARGET = 5, 11  # host slots
EXTRA = HiCacheStorageExtraInfo()


def mamba(slot, keys):
    return PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=list(keys), hit_policy=TRAILING)


def swa(pages, keys):
    return PoolTransfer(PoolName.SWA, host_indices=token_indices(pages), keys=list(keys), hit_policy=TRAILING)


def ask(*names, window=len(SWA_SOURCE)):
    """The placeholder transfers of SGLang's hit query (components/mamba.py, swa.py)."""
    return [PoolTransfer(name, keys=["__placeholder__"] * (window if name == PoolName.SWA else 1), hit_policy=TRAILING)
            for name in names]


def hybrid(socket, **kwargs):
    """KV, SWA and Mamba host pools and a backend over them (as build_hybrid_mamba_swa_stack)."""
    pools = {PoolName.SWA: make_pool("mha", "page_first", label="swa"), PoolName.MAMBA: make_mamba_pool()}
    kv = make_pool("mha", "page_first")
    return kv, pools, create_hybrid_backend(kv, "mha", socket, pools, **kwargs)


def backup(backend, keys):
    """One radix node's backup: its extra pools first, then its KV (SGLang's order)."""
    stored = backend.batch_set_v2([mamba(MAMBA_SOURCE, keys[-1:]), swa(SWA_SOURCE, keys[-2:])], EXTRA)
    assert stored == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}
    assert backend.batch_set_v1(keys, token_indices(KV_SOURCE)) == [True] * len(keys)


def snapshot(pool) -> torch.Tensor:
    buffers = [pool.temporal_buffer, *pool.conv_buffer] if hasattr(pool, "temporal_buffer") else [pool.kv_buffer]
    return torch.cat([b.reshape(-1).view(torch.uint8) for b in buffers]).clone()


def zero(pool, index: int) -> None:
    pool.set_from_flat_data_page(index, torch.zeros_like(pool.get_dummy_flat_data_page()))


def test_kv_mamba_and_swa_round_trip_bit_exact_into_other_slots_and_nowhere_else(daemon):
    kv, pools, writer = hybrid(daemon.socket)
    keys = page_keys(len(KV_SOURCE))
    backup(writer, keys)
    targets = {kv: [p * PAGE for p in KV_TARGET], pools[PoolName.SWA]: [p * PAGE for p in SWA_TARGET],
               pools[PoolName.MAMBA]: [MAMBA_TARGET]}
    for pool, indices in targets.items():
        for index in indices:
            zero(pool, index)
    before = {pool: snapshot(pool) for pool in targets}

    reader = create_hybrid_backend(kv, "mha", daemon.socket, pools)  # another instance, as after a restart
    found = reader.batch_exists_v2(keys, ask(PoolName.MAMBA, PoolName.SWA), EXTRA)
    assert found == PoolTransferResult(3, {PoolName.KV: 3, PoolName.MAMBA: 3, PoolName.SWA: 3}, [3])
    assert reader.batch_get_v1(keys, token_indices(KV_TARGET)) == [True] * 3  # the v1 KV path, as before
    got = reader.batch_get_v2([mamba(MAMBA_TARGET, keys[-1:]), swa(SWA_TARGET, keys[-2:])], EXTRA)
    assert got == {PoolName.MAMBA: [True], PoolName.SWA: [True, True]}

    for source, target in zip(KV_SOURCE, KV_TARGET):
        assert torch.equal(page_bytes(kv, target), page_bytes(kv, source))
    for source, target in zip(SWA_SOURCE, SWA_TARGET):
        assert torch.equal(page_bytes(pools[PoolName.SWA], target), page_bytes(pools[PoolName.SWA], source))
    state = pools[PoolName.MAMBA]
    assert torch.equal(state.get_data_page(MAMBA_TARGET), state.get_data_page(MAMBA_SOURCE))
    for pool, indices in targets.items():
        for index in indices:
            zero(pool, index)
        assert torch.equal(snapshot(pool), before[pool])
    assert reader.stats()["num_failures"] == 0 and reader.num_errors == 0


def test_a_prefix_is_restorable_only_where_a_node_left_a_state(daemon):
    kv, state = make_pool("mha", "page_first"), make_mamba_pool()
    backend = create_hybrid_backend(kv, "mha", daemon.socket, {PoolName.MAMBA: state})
    keys = page_keys(4)
    for node, slot in ((keys[:2], 3), (keys[2:], 4)):
        assert backend.batch_set_v2([mamba(slot, node[-1:])], EXTRA) == {PoolName.MAMBA: [True]}
    assert backend.batch_set_v1(keys[:3], token_indices([1, 2, 3])) == [True] * 3

    # KV reaches page 3; the states are after pages 2 and 4: only 2 is restorable.
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA), EXTRA) == PoolTransferResult(
        2, {PoolName.KV: 3, PoolName.MAMBA: 2}, [2])
    assert backend.batch_set_v1(keys[3:], token_indices([4])) == [True]
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA), EXTRA).restorable_prefix_pages == [2, 4]
    assert backend.batch_exists_v2(keys, [], EXTRA) == PoolTransferResult(4, {PoolName.KV: 4}, [1, 2, 3, 4])


def test_a_page_missing_in_one_pool_is_a_miss_in_all(daemon):
    kv, pools, backend = hybrid(daemon.socket)
    keys = page_keys(3)
    backup(backend, keys)
    temporal, conv = backend.sidecars.plan(PoolName.MAMBA).part_ids(keys[-1])
    with daemon.client() as plain:
        assert plain.delete([conv]) == 1  # one of the state's two objects

    state = pools[PoolName.MAMBA]
    zero(state, MAMBA_TARGET)
    assert backend.batch_exists(keys) == 3  # the KV is all there
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA, PoolName.SWA), EXTRA) == PoolTransferResult(
        0, {PoolName.KV: 3}, [])
    assert backend.batch_exists_v2(keys, ask(PoolName.SWA), EXTRA).kv_hit_pages == 3
    assert backend.batch_get_v2([mamba(MAMBA_TARGET, keys[-1:])], EXTRA) == {PoolName.MAMBA: [False]}
    assert not state.get_data_page(MAMBA_TARGET).any()  # the temporal half was not written either

    backup(backend, keys)  # the state again: its group is whole
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA, PoolName.SWA), EXTRA).kv_hit_pages == 3
    _, v = backend.sidecars.plan(PoolName.SWA).part_ids(keys[1])
    with daemon.client() as plain:
        assert plain.delete([v]) == 1  # the V half of the window's first page
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA, PoolName.SWA), EXTRA) == PoolTransferResult(
        0, {PoolName.KV: 3, PoolName.MAMBA: 3}, [])
    assert backend.batch_get_v2([swa(SWA_TARGET, keys[-2:])], EXTRA) == {PoolName.SWA: [False, False]}
    assert backend.num_errors == 0


def test_a_killed_daemon_is_a_miss_and_a_failed_write_with_nothing_raised(daemon, tmp_path):
    kv, pools, backend = hybrid(daemon.socket)
    keys = page_keys(3)
    backup(backend, keys)
    daemon.stop(signal.SIGKILL)
    absent = create_hybrid_backend(kv, "mha", str(tmp_path / "no-daemon.sock"), pools)

    transfers = [mamba(MAMBA_TARGET, keys[-1:]), swa(SWA_TARGET, keys[-2:])]
    for dead in (backend, absent):
        assert dead.batch_exists_v2(keys, ask(PoolName.MAMBA, PoolName.SWA), EXTRA) == PoolTransferResult(0, {}, [])
        assert dead.batch_get_v2(transfers, EXTRA) == {PoolName.MAMBA: [False], PoolName.SWA: [False, False]}
        assert dead.batch_set_v2(transfers, EXTRA) == {PoolName.MAMBA: [False], PoolName.SWA: [False, False]}
        assert dead.batch_get_v1(keys, token_indices(KV_TARGET)) == [False] * 3
        assert dead.stats()["num_failures"] >= 1 and dead.num_errors == 0


def test_transfers_sglang_never_sends_are_failures_not_exceptions(daemon):
    kv, pools, backend = hybrid(daemon.socket)
    keys = page_keys(2)
    assert backend.batch_set_v1(keys, token_indices([1, 2])) == [True, True]
    wrong_indices = PoolTransfer(PoolName.SWA, host_indices=token_indices([1]), keys=keys, hit_policy=TRAILING)
    assert backend.batch_set_v2([wrong_indices], EXTRA) == {PoolName.SWA: [False, False]}
    unregistered = PoolTransfer(PoolName.INDEXER, host_indices=token_indices([1]), keys=keys[:1])
    assert backend.batch_get_v2([unregistered], EXTRA) == {PoolName.INDEXER: [False]}
    assert backend.batch_exists_v2(keys, [unregistered], EXTRA).kv_hit_pages == 0
    assert backend.num_errors == 3


def test_mamba_states_are_per_tp_rank_while_mla_kv_is_shared(daemon):
    kv, state = make_pool("mla", "page_first"), make_mamba_pool()
    keys = page_keys(2)
    rank0 = create_hybrid_backend(kv, "mla", daemon.socket, {PoolName.MAMBA: state}, tp=(0, 2))
    assert rank0.batch_set_v2([mamba(MAMBA_SOURCE, keys[-1:])], EXTRA) == {PoolName.MAMBA: [True]}
    assert rank0.batch_set_v1(keys, token_indices([1, 2])) == [True, True]

    rank1 = create_hybrid_backend(kv, "mla", daemon.socket, {PoolName.MAMBA: state}, tp=(1, 2))
    temporal, conv = rank1.sidecars.plan(PoolName.MAMBA).part_descs
    assert (temporal.kind.value, temporal.dtype.value, str(temporal.layout), str(temporal.shard)) == (
        "recurrent", "fp32", "mamba(layers=3,states=4x16x16:fp32)", "1/2")
    assert (conv.kind.value, conv.dtype.value, str(conv.layout), str(conv.shard)) == (
        "conv", "bf16", "mamba(layers=3,states=64x3:bf16)", "1/2")
    assert rank1.batch_exists(keys) == 2  # rank 0's latent pages serve every rank
    assert rank1.batch_exists_v2(keys, ask(PoolName.MAMBA), EXTRA) == PoolTransferResult(
        0, {PoolName.KV: 2}, [])
    # SGLang backs the state up on every rank (should_backup), KV only on the writer.
    assert rank1.batch_set_v2([mamba(MAMBA_TARGET, keys[-1:])], EXTRA) == {PoolName.MAMBA: [True]}
    assert rank1.batch_exists_v2(keys, ask(PoolName.MAMBA), EXTRA).restorable_prefix_pages == [2]


def test_conv_only_mamba_states_round_trip(daemon):
    kv, state = make_pool("mha", "page_first"), make_mamba_pool(temporal=None, convs=((64, 3), (32, 3)))
    backend = create_hybrid_backend(kv, "mha", daemon.socket, {PoolName.MAMBA: state})
    assert [d.kind.value for d in backend.sidecars.plan(PoolName.MAMBA).part_descs] == ["conv", "conv"]
    keys = page_keys(1)
    assert backend.batch_set_v2([mamba(MAMBA_SOURCE, keys)], EXTRA) == {PoolName.MAMBA: [True]}
    assert backend.batch_set_v1(keys, token_indices([1])) == [True]
    assert backend.batch_exists_v2(keys, ask(PoolName.MAMBA), EXTRA).kv_hit_pages == 1
    assert backend.batch_get_v2([mamba(MAMBA_TARGET, keys)], EXTRA) == {PoolName.MAMBA: [True]}
    assert torch.equal(state.get_data_page(MAMBA_TARGET), state.get_data_page(MAMBA_SOURCE))


def test_dsa_indexer_pages_ride_on_kv_pages_and_every_one_is_needed(daemon):
    kv, indexer = make_dsa_pools()
    backend = create_hybrid_backend(kv, "mla", daemon.socket, {PoolName.INDEXER: indexer})
    keys = page_keys(3, page=DSA_PAGE)
    source, target = token_indices([1, 2, 3], DSA_PAGE), token_indices([5, 6, 7], DSA_PAGE)
    # Backup: the KV op's keys and host indices (_resolve_sidecar_kv_derived_pool_transfers).
    stored = backend.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=source, keys=keys)], EXTRA)
    assert stored == {PoolName.INDEXER: [True] * 3}
    assert backend.batch_set_v1(keys, source) == [True] * 3
    query = [PoolTransfer(PoolName.INDEXER, keys=None, hit_policy=ALL_PAGES, indices_from_pool=PoolName.KV)]
    assert backend.batch_exists_v2(keys, query, EXTRA) == PoolTransferResult(
        3, {PoolName.KV: 3, PoolName.INDEXER: 3}, [1, 2, 3])

    # Load: each KV batch's indexer pages on the same host indices, no hit policy.
    got = backend.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=target, keys=keys)], EXTRA)
    assert got == {PoolName.INDEXER: [True] * 3}
    rows = indexer.index_k_with_scale_buffer
    assert all(torch.equal(rows[t], rows[s]) for s, t in ((1, 5), (2, 6), (3, 7)))

    with daemon.client() as plain:
        assert plain.delete(backend.sidecars.plan(PoolName.INDEXER).part_ids(keys[1])) == 1
    assert backend.batch_exists_v2(keys, query, EXTRA) == PoolTransferResult(
        1, {PoolName.KV: 3, PoolName.INDEXER: 1}, [1])


def test_pools_kvstore_cannot_carry_are_refused_at_registration(daemon):
    kv = make_pool("mha", "page_first")
    with pytest.raises(ValueError, match="deepseek_v4_c4 host pool is not supported"):
        create_hybrid_backend(kv, "mha", daemon.socket, {PoolName.DEEPSEEK_V4_C4: make_pool("mha", "page_first")})
    side_states = make_mamba_pool()
    side_states.slot_state_device_tensors = [torch.zeros(1)]
    with pytest.raises(ValueError, match="slot side states"):
        create_hybrid_backend(kv, "mha", daemon.socket, {PoolName.MAMBA: side_states})
    assert create_backend(kv, "mha", daemon.socket).batch_exists(page_keys(1)) == 0  # KV-only is unchanged
