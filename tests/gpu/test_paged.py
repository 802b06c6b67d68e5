"""Paged gather/scatter: the reference against the byte layout of `kvstore.layout`, and the
Triton kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu import paged as ref
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.layout import Layout

PAGED = "paged(order={order},layers=2,block=4,kv_heads=2,head_dim=8)"
MLA = "mla(order={order},layers=3,block=4,latent_dim=8,rope_dim=4)"
PAGE_IDS = [[3, 7], [-1, 0], [9, 2]]  # three chunks of two blocks; -1: block not here


def make_caches(layout: str, pages: int = 10, dtype=torch.bfloat16, device="cpu") -> list[torch.Tensor]:
    geo = ref.PagedGeometry.from_layout(layout)
    gen = torch.Generator().manual_seed(3)
    shape = (geo.layers, pages, geo.page_tokens, *geo.token_shape)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(geo.parts)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return ref.as_bits(t)


@pytest.mark.parametrize("order", ["layer_first", "block_first"])
@pytest.mark.parametrize("template", [PAGED, MLA], ids=["paged", "mla"])
def test_gather_places_each_page_at_its_layout_segment(template, order):
    text = template.format(order=order)
    layout, geo = Layout.parse(text), ref.PagedGeometry.from_layout(text)
    caches = make_caches(text)
    chunks = ref.gather_chunks(caches, torch.tensor(PAGE_IDS), text)
    chunk_tokens, size = 2 * geo.page_tokens, caches[0].element_size()
    for c, row in enumerate(PAGE_IDS):
        raw = chunks[c].view(torch.uint8)
        assert raw.numel() == layout.total_bytes(DType.BF16, chunk_tokens)
        for layer in range(geo.layers):
            for blk, page in enumerate(row):
                r = layout.segment(layer, blk, DType.BF16, chunk_tokens)
                seg = raw[r.offset : r.offset + r.length].view(torch.bfloat16)
                want = torch.cat([cache[layer, page].flatten() for cache in caches]) if page >= 0 \
                    else torch.zeros(r.length // size, dtype=torch.bfloat16)
                assert torch.equal(bits(seg), bits(want))


@pytest.mark.parametrize("template", [PAGED, MLA], ids=["paged", "mla"])
def test_scatter_undoes_gather_and_skips_missing_blocks(template):
    text = template.format(order="layer_first")
    caches = make_caches(text)
    ids = torch.tensor(PAGE_IDS)
    chunks = ref.gather_chunks(caches, ids, text)
    fresh = [torch.zeros_like(c) for c in caches]
    ref.scatter_chunks(chunks, fresh, ids, text)
    used = sorted(p for row in PAGE_IDS for p in row if p >= 0)
    for old, new in zip(caches, fresh):
        assert torch.equal(bits(old[:, used]), bits(new[:, used]))
        untouched = [p for p in range(old.shape[1]) if p not in used]
        assert not bits(new[:, untouched]).any()


def test_validation_names_the_problem():
    text = PAGED.format(order="layer_first")
    k, v = make_caches(text)
    with pytest.raises(InvalidArgument, match="2 cache tensor"):
        ref.gather_chunks([k], torch.tensor(PAGE_IDS), text)
    with pytest.raises(InvalidArgument, match="does not match"):
        ref.gather_chunks([k[:, :, :2], v[:, :, :2]], torch.tensor(PAGE_IDS), text)
    with pytest.raises(InvalidArgument, match="outside"):
        ref.gather_chunks([k, v], torch.tensor([[10, 0]]), text)
    with pytest.raises(InvalidArgument, match="chunks must be"):
        ref.scatter_chunks(torch.zeros(1, 5, dtype=k.dtype), [k, v], torch.tensor([[1, 2]]), text)
    with pytest.raises(InvalidArgument, match="paged or mla"):
        ref.PagedGeometry.from_layout("recurrent(layers=1,heads=1,k_dim=1,v_dim=1)")


# --- Triton against the reference -------------------------------------------------------


def strided_kv(text: str, dev: str) -> list[torch.Tensor]:
    """K and V as views of one [2, layers, pages + 1, ...] tensor, one spare page per layer:
    layer and page strides differ from a packed cache."""
    geo = ref.PagedGeometry.from_layout(text)
    both = torch.randn(2, geo.layers, 11, geo.page_tokens, *geo.token_shape).to(torch.bfloat16).to(dev)
    return [both[0, :, :10], both[1, :, :10]]


@pytest.mark.parametrize("order", ["layer_first", "block_first"])
@pytest.mark.parametrize("template", [PAGED, MLA], ids=["paged", "mla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32], ids=str)
def test_triton_matches_reference(dev, template, order, dtype):
    from kvstore.gpu import paged_triton as tri

    text = template.format(order=order)
    caches = make_caches(text, dtype=dtype, device=dev)
    ids = torch.tensor(PAGE_IDS, device=dev)
    a, b = ref.gather_chunks(caches, ids, text), tri.gather_chunks(caches, ids, text)
    assert torch.equal(bits(a), bits(b))
    fresh_ref = [torch.zeros_like(c) for c in caches]
    fresh_tri = [torch.zeros_like(c) for c in caches]
    ref.scatter_chunks(a, fresh_ref, ids, text)
    tri.scatter_chunks(a, fresh_tri, ids, text)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(fresh_ref, fresh_tri))


def test_triton_honours_strided_caches(dev):
    from kvstore.gpu import paged_triton as tri

    text = PAGED.format(order="layer_first")
    caches = strided_kv(text, dev)
    ids = torch.tensor(PAGE_IDS, device=dev, dtype=torch.int32)
    assert torch.equal(bits(ref.gather_chunks(caches, ids, text)), bits(tri.gather_chunks(caches, ids, text)))
    chunks = ref.gather_chunks(caches, ids, text)
    targets = [torch.zeros_like(c) for c in strided_kv(text, dev)]
    tri.scatter_chunks(chunks, targets, ids.flip(0), text)
    check = [torch.zeros_like(c) for c in strided_kv(text, dev)]
    ref.scatter_chunks(chunks, check, ids.flip(0), text)
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(targets, check))


@pytest.mark.gpu
def test_triton_gather_scatter_at_real_shape_on_gpu():
    from kvstore.gpu import paged_triton as tri

    text = "paged(order=layer_first,layers=8,block=16,kv_heads=8,head_dim=128)"
    caches = make_caches(text, pages=1024, device="cuda")
    ids = torch.randperm(1024, device="cuda")[: 32 * 16].view(32, 16)  # 32 chunks of 256 tokens
    a, b = ref.gather_chunks(caches, ids, text), tri.gather_chunks(caches, ids, text)
    assert torch.equal(bits(a), bits(b))
    fresh = [torch.zeros_like(c) for c in caches]
    tri.scatter_chunks(b, fresh, ids, text)
    flat = ids.flatten().long()
    assert all(torch.equal(bits(x[:, flat]), bits(y[:, flat])) for x, y in zip(caches, fresh))
