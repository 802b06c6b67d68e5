"""The vLLM connector's plan (adapters.vllm_plan), without vLLM: hybrid groups, the null
block, and sliding-window blocks that vLLM hands out again (issue 12, SupportsHMA)."""

from kvstore.adapters.vllm_plan import NULL_BLOCK, plan_request
from kvstore.identity import StateDescriptor, chunk_keys

BLOCK, CHUNK = 16, 32  # two blocks per chunk


def desc(layers: int) -> StateDescriptor:
    return StateDescriptor("default", "m", "r1", kind="kv", dtype="fp16",
                           layout=f"paged(order=layer_first,layers={layers},block={BLOCK},kv_heads=2,head_dim=8)",
                           chunk_tokens=CHUNK)


def hybrid_plan(tokens=100):
    groups = [(desc(2), ["layout", "vllm-group:0/2:full"]), (desc(1), ["layout", "vllm-group:1/2:sliding:16"])]
    return plan_request("r", list(range(tokens)), groups, BLOCK)


def test_one_group_keeps_the_single_group_ids():
    plan = plan_request("r", list(range(100)), [(desc(3), ["layout"])], BLOCK, ["cache_salt:s"])
    want = [k.object_id for k in chunk_keys(list(range(100)), desc(3), extra_keys=["cache_salt:s", "layout"])]
    assert plan.ids == [want] and plan.lookup_ids == want


def test_groups_never_share_ids_and_a_hit_needs_every_group():
    plan = hybrid_plan()
    assert len(plan.ids) == 2 and not set(plan.ids[0]) & set(plan.ids[1])
    assert plan.lookup_ids == plan.ids[0] + plan.ids[1]
    assert plan.hits_of([True, True, True, True, False, True]) == 1  # group 1 holds only chunk 0
    assert plan.hits_of([True] * 6) == 3


def test_loads_leave_out_the_null_block_and_name_their_group():
    plan = hybrid_plan()
    plan.matched_tokens(3, 0)
    plan.num_load_tokens, plan.load_pending = 96, True
    plan.set_blocks([[1, 2, 3, 4, 5, 6, 7], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 8, 9, 10]], True)
    loads = plan.loads()
    assert [(spec.group, spec.blocks) for spec in loads] == [
        (0, ((0, 1), (1, 2))), (0, ((0, 3), (1, 4))), (0, ((0, 5), (1, 6))), (1, ((0, 8), (1, 9)))]
    assert loads[3].object_id == plan.ids[1][2]


def test_a_block_handed_out_again_is_never_saved_as_part_of_a_chunk():
    plan = hybrid_plan()
    plan.matched_tokens(0, 0)
    plan.set_blocks([[1, 2, 3], [4, 5, 6]], True)  # step 1: tokens 0-47
    assert [(s.group, s.block_ids) for s in plan.saves(48)] == [(0, (1, 2)), (1, (4, 5))]
    # vLLM freed the window's block 6 (chunk 1, not saved yet) and hands it out again.
    plan.forget_reused({6, 11}, groups=[1])
    assert plan.block_ids == [[1, 2, 3], [4, 5, NULL_BLOCK]]
    plan.set_blocks([[7, 8], [6, 11]], False)  # step 2: tokens 48-95
    assert plan.saves(96) == []  # chunk 1 lost a block, so chunk 2 is unreachable too
    assert plan.num_unsaved_chunks == 2 and plan.num_stored_chunks == 3


def test_saved_positions_are_left_alone():
    plan = hybrid_plan()
    plan.matched_tokens(0, 0)
    plan.set_blocks([[1, 2], [4, 5]], True)
    plan.saves(32)
    plan.forget_reused({4, 5}, groups=[1])  # chunk 0 is stored: its ids no longer matter
    assert plan.block_ids == [[1, 2], [4, 5]]


def mamba_plan(tokens=100):
    state = StateDescriptor("default", "m", "r1", kind="recurrent", dtype="fp32",
                            layout="mamba(layers=2,states=3x32:fp16+2x4x8:fp32)", chunk_tokens=CHUNK)
    groups = [(desc(2), ["layout", "vllm-group:0/2:full"]), (state, ["layout", "vllm-group:1/2:mamba"])]
    return plan_request("r", list(range(tokens)), groups, BLOCK)


def test_a_chunk_ending_at_an_offered_state_is_saved_with_it_as_one_group():
    plan = mamba_plan()
    assert plan.attention == [0] and plan.mamba == [1] and plan.lookup_ids == plan.ids[0]
    plan.matched_tokens(0, 0)
    plan.set_blocks([[1, 2, 3, 4], [NULL_BLOCK, 9, NULL_BLOCK, 10]], True)  # Mamba tables are never read
    saves = plan.saves(64, [(1, 10, 64), (1, 11, 48), (0, 5, 64)])  # only group 1's offer at a chunk end counts
    assert [(s.group, s.block_ids, s.joint) for s in saves] == [(0, (1, 2), None), (0, (3, 4), 1), (1, (10,), 1)]
    assert saves[2].object_id == plan.ids[1][1] and {s.request_id for s in saves} == {"r"}


def test_a_mamba_hit_ends_at_a_whole_group_and_loads_its_state_into_vllms_block():
    plan = mamba_plan()
    assert plan.state_candidates(3, 0) == [1, 2, 3] and plan.state_candidates(3, 64) == [3]
    assert [m.object_id for m in plan.state_members(2)] == [plan.ids[0][1], plan.ids[1][1]]
    assert plan.matched_tokens(3, 0, exact=True) == 96
    assert mamba_plan(96).matched_tokens(3, 0, exact=True) == 0  # 96 would leave no prompt token to compute
    plan.num_load_tokens, plan.load_pending = 64, True
    plan.set_blocks([[1, 2, 3, 4, 5], [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 7, 8]], True)
    plan.set_state_blocks(plan.block_ids)
    loads = plan.loads()
    assert [(s.group, s.blocks, s.joint) for s in loads] == [
        (0, ((0, 1), (1, 2)), None), (0, ((0, 3), (1, 4)), 1), (1, ((0, 7),), 1)]
