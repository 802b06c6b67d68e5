"""Sparse page selection: summaries, scores, top-k with warm start, and the Triton twins."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu import sparse as ref
from kvstore.gpu.sparse import Selection
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.layout import Layout


def test_summary_is_min_and_max_per_channel():
    k_cache = torch.zeros(1, 2, 3, 1, 2)
    k_cache[0, 1] = torch.tensor([[[1.0, -4.0]], [[-2.0, 5.0]], [[0.5, 0.0]]])
    s = ref.page_summaries(k_cache, torch.tensor([1]))
    assert s[0, 0, 0, 0].tolist() == [-2.0, -4.0] and s[0, 0, 1, 0].tolist() == [1.0, 5.0]


def test_score_is_sum_of_channel_maxima_over_grouped_heads():
    # one kv head, channels min [0, -2], max [3, 1]; q = [1, -1] scores 3 + 2 = 5; two query
    # heads share the kv head (GQA): the second, [-1, 0], adds max(0, -3) + 0 = 0
    summaries = torch.tensor([[[[0.0, -2.0]], [[3.0, 1.0]]]])  # [pages=1, 2, kv_heads=1, 2]
    queries = torch.tensor([[[1.0, -1.0], [-1.0, 0.0]]])
    scores = ref.score_pages(queries, summaries, torch.tensor([0]), torch.tensor([0, 1]))
    assert scores.tolist() == [5.0]


def test_score_bounds_every_key_in_the_page():
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.randn(1, 6, 8, 2, 16, generator=gen)
    summaries = ref.page_summaries(k_cache, torch.arange(6))[0]
    q = torch.randn(1, 4, 16, generator=gen)  # 4 query heads over 2 kv heads
    scores = ref.score_pages(q, summaries, torch.arange(6), torch.tensor([0, 6]))
    keys = k_cache[0].repeat_interleave(2, dim=2)  # [pages, tokens, q_heads, dim]
    best = torch.einsum("hd,pthd->pt", q[0], keys).amax(dim=1)  # best token, heads summed
    assert (scores >= best - 1e-4).all()


def test_top_k_over_ragged_requests():
    cu = torch.tensor([0, 4, 5, 8])
    scores = torch.tensor([0.1, 0.9, 0.5, 0.7, 3.0, 2.0, float("nan"), 1.0])
    sel = ref.select_top_k(scores, cu, 2, layer=3, step=10, requests=[7, 8, 9])
    assert [s.page_ids for s in sel] == [(1, 3), (0,), (0, 2)]  # NaN ranks last
    assert [s.request for s in sel] == [7, 8, 9] and all(s.layer == 3 and s.step == 10 for s in sel)
    assert [s.new_page_ids for s in sel] == [s.page_ids for s in sel]


def test_warm_start_reports_only_new_pages():
    cu = torch.tensor([0, 4])
    first = ref.select_top_k(torch.tensor([4.0, 3.0, 2.0, 1.0]), cu, 2, layer=0, step=1)
    second = ref.select_top_k(torch.tensor([4.0, 1.0, 2.0, 3.0]), cu, 2, layer=0, step=2, previous=first)
    assert second[0].page_ids == (0, 3) and second[0].new_page_ids == (3,)
    with pytest.raises(InvalidArgument, match="earlier step"):
        ref.select_top_k(torch.tensor([1.0, 2.0, 3.0, 4.0]), cu, 2, layer=1, step=3, previous=second)


def test_selection_validates_and_maps_to_layout_ranges():
    with pytest.raises(InvalidArgument):
        Selection(0, 0, 0, (3, 1), ())
    with pytest.raises(InvalidArgument):
        Selection(0, 0, 0, (1, 3), (2,))
    sel = Selection(request=0, layer=1, step=5, page_ids=(0, 1, 17, 18), new_page_ids=(1, 17, 18))
    blocks = sel.chunk_blocks(blocks_per_chunk=16)
    assert blocks == {0: [(1, 1)], 1: [(1, 1), (1, 2)]}
    assert sel.chunk_blocks(16, only_new=False)[0] == [(1, 0), (1, 1)]
    layout = Layout.parse("paged(order=layer_first,layers=2,block=16,kv_heads=2,head_dim=8)")
    ranges = layout.ranges(blocks[1], DType.BF16, 256)
    assert len(ranges) == 1 and ranges[0].length == 2 * layout.segment_bytes(DType.BF16)


# --- Triton against the reference -------------------------------------------------------


def fixture_data(dev: str):
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(2, 12, 4, 2, 8, generator=gen).to(torch.bfloat16).to(dev)
    queries = torch.randn(3, 4, 8, generator=gen).to(dev)
    table = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], device=dev).flip(0)
    cu = torch.tensor([0, 5, 7, 12], device=dev)
    return k_cache, queries, table, cu


def test_triton_summaries_match_reference(dev):
    from kvstore.gpu import sparse_triton as tri

    k_cache, *_ = fixture_data(dev)
    ids = torch.tensor([0, 5, 11, 3], device=dev)
    assert torch.equal(ref.page_summaries(k_cache, ids), tri.page_summaries(k_cache, ids))
    a = torch.zeros(2, 12, 2, 2, 8, device=dev)
    b = a.clone()
    ref.update_summaries(k_cache, a, ids)
    tri.update_summaries(k_cache, b, ids)
    assert torch.equal(a, b)


def test_triton_scores_and_selection_match_reference(dev):
    from kvstore.gpu import sparse_triton as tri

    k_cache, queries, table, cu = fixture_data(dev)
    summaries = ref.page_summaries(k_cache, torch.arange(12, device=dev))[1]
    a = ref.score_pages(queries, summaries, table, cu)
    b = tri.score_pages(queries, summaries, table, cu)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ref.select_top_k(a, cu, 3, layer=1, step=0) == ref.select_top_k(b, cu, 3, layer=1, step=0)


@pytest.mark.gpu
def test_triton_sparse_at_real_shape_on_gpu():
    from kvstore.gpu import sparse_triton as tri

    k_cache = torch.randn(4, 4096, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.arange(4096, device="cuda")
    summaries = tri.page_summaries(k_cache, ids)
    assert torch.equal(summaries, ref.page_summaries(k_cache, ids))
    counts = torch.tensor([4096, 100, 1, 2048], device="cuda")
    cu = torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"), counts.cumsum(0)])
    table = torch.cat([torch.randperm(4096, device="cuda")[:n] for n in counts.tolist()])
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    a = ref.score_pages(q, summaries[0], table, cu)
    b = tri.score_pages(q, summaries[0], table, cu)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-2)
