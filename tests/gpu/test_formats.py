"""FP8 / MXFP8: the reference against hand-computed cases and its written error bounds, and
the Triton kernels against the reference."""

from __future__ import annotations

import pytest
import torch

from kvstore.gpu import formats as ref
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.layout import Layout

NAN, INF = float("nan"), float("inf")


def codes(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).flatten().tolist()


def block_with(values: list[float]) -> torch.Tensor:
    x = torch.zeros(1, 32)
    x[0, : len(values)] = torch.tensor(values)
    return x


# --- MXFP8 reference, hand-computed -------------------------------------------------------


def test_mx_scale_is_floor_log2_amax_minus_8():
    # amax 1.0: floor(log2) = 0, e = -8, byte 119; 1.0 / 2^-8 = 256 = e4m3 exponent 8 -> 0x78
    mx = ref.quantize_mxfp8(block_with([1.0, -0.5]))
    assert mx.scales.tolist() == [[119]]
    assert codes(mx.elements)[:2] == [0x78, 0x80 | 0x70]  # -0.5 * 256 = -128 = 2^7
    # amax 448: e = 0 (byte 127), 448 is the largest e4m3 code 0x7E
    mx = ref.quantize_mxfp8(block_with([448.0]))
    assert mx.scales.tolist() == [[127]] and codes(mx.elements)[0] == 0x7E


def test_mx_rounds_to_nearest_even():
    # 256 in the block pins e = 0; 1.0625 is halfway between 1.0 and 1.125 -> 1.0 (even),
    # 1.1875 is halfway between 1.125 and 1.25 -> 1.25 (even)
    mx = ref.quantize_mxfp8(block_with([256.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10]))
    out = ref.dequantize_mxfp8(mx, torch.float32)[0, :5].tolist()
    assert out == [256.0, 1.0, 1.25, 0.0, 2.0**-9 * 2]  # subnormals: step 2^-9, ties to even


def test_mx_saturates_and_bound_is_tight():
    # amax 511.9: floor(log2) = 8, e = 0; 511.9 > 448 saturates: the worst case of the bound
    x = block_with([511.9, 1.0])
    out = ref.dequantize_mxfp8(ref.quantize_mxfp8(x), torch.float32)
    assert out[0, 0].item() == 448.0
    err = (511.9 - 448.0) / 511.9
    assert 0.12 < err <= 2.0**-3


def test_mx_zero_block_gets_scale_byte_zero():
    mx = ref.quantize_mxfp8(torch.zeros(2, 64))
    assert mx.scales.flatten().tolist() == [0, 0, 0, 0]
    assert codes(mx.elements) == [0] * 128
    assert torch.equal(ref.dequantize_mxfp8(mx, torch.float32), torch.zeros(2, 64))


def test_mx_nan_stays_nan_and_spares_its_neighbours():
    clean = block_with([3.0, -1.5, 0.25])
    dirty = clean.clone()
    dirty[0, 10] = NAN
    a, b = ref.quantize_mxfp8(clean), ref.quantize_mxfp8(dirty)
    assert torch.equal(a.scales, b.scales)
    out = ref.dequantize_mxfp8(b, torch.float32)
    assert torch.isnan(out[0, 10]) and torch.isnan(out).sum() == 1
    assert out[0, :3].tolist() == [3.0, -1.5, 0.25]


def test_mx_inf_saturates_to_largest_finite_of_the_block():
    out = ref.dequantize_mxfp8(ref.quantize_mxfp8(block_with([INF, -INF, 1.0])), torch.float32)
    # X = 2^(0 - 8) from the finite amax 1.0; +-inf -> +-448 * X
    assert out[0, :3].tolist() == [448 / 256, -448 / 256, 1.0]


def test_mx_scale_byte_255_dequantizes_to_nan():
    mx = ref.quantize_mxfp8(torch.ones(1, 64))
    mx.scales[0, 1] = 255
    out = ref.dequantize_mxfp8(mx, torch.float32)
    assert torch.isnan(out[0, 32:]).all() and not torch.isnan(out[0, :32]).any()


def test_mx_needs_whole_blocks():
    with pytest.raises(InvalidArgument):
        ref.quantize_mxfp8(torch.ones(3, 40))


# --- FP8 with fp32 scales, hand-computed ---------------------------------------------------


def test_fp8_per_tensor_scale_maps_amax_to_max_finite():
    q = ref.quantize_fp8(torch.tensor([1.0, -2.0, 4.0]), DType.FP8_E4M3)
    assert q.scale.item() == pytest.approx(4.0 / 448.0)
    assert q.data.float().tolist() == [112.0, -224.0, 448.0]
    assert ref.dequantize_fp8(q, torch.float32).tolist() == pytest.approx([1.0, -2.0, 4.0], rel=1e-6)


@pytest.mark.parametrize("dtype,top", [(DType.FP8_E4M3, 448.0), (DType.FP8_E5M2, 57344.0)])
def test_fp8_saturates_finite_and_inf_keeps_nan(dtype, top):
    x = torch.tensor([1e6, -1e6, INF, -INF, NAN, top])
    q = ref.quantize_fp8(x, dtype, scale=torch.tensor(1.0))
    out = q.data.float()
    assert out[:4].tolist() == [top, -top, top, -top]
    assert torch.isnan(out[4]) and out[5].item() == top


def test_fp8_per_block_scales_each_block():
    x = torch.cat([torch.full((1, 4), 2.0), torch.full((1, 4), 0.5)], dim=1)
    q = ref.quantize_fp8(x, DType.FP8_E5M2, block=4)
    assert q.scale[0].tolist() == pytest.approx([2.0 / 57344.0, 0.5 / 57344.0])
    assert torch.allclose(ref.dequantize_fp8(q, torch.float32), x, rtol=1e-6)


# --- error bounds (module docstring of gpu.formats) ----------------------------------------


def spread(rows: int = 64, cols: int = 128) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    mags = torch.logspace(-20, 20, rows)[:, None]  # blocks across forty decades
    return torch.randn(rows, cols, generator=gen) * mags * torch.rand(rows, cols, generator=gen)


@pytest.mark.parametrize("dtype,rel,sub", [(DType.FP8_E4M3, 2.0**-4, 2.0**-10), (DType.FP8_E5M2, 2.0**-3, 2.0**-17)])
@pytest.mark.parametrize("block", [None, 32])
def test_fp8_round_trip_error_bound(dtype, rel, sub, block):
    x = spread()
    q = ref.quantize_fp8(x, dtype, block=block)
    scale = q.scale if block is None else q.scale.repeat_interleave(block, dim=-1)
    err = (ref.dequantize_fp8(q, torch.float32) - x).abs()
    assert (err <= (rel * x.abs() + sub * scale) * (1 + 2.0**-20)).all()


def test_mxfp8_round_trip_error_bounds():
    x = spread()
    x[::3, ::7] *= 1.99  # push some blocks' amax next to 2^(k+1): saturated elements
    mx = ref.quantize_mxfp8(x)
    err = (ref.dequantize_mxfp8(mx, torch.float32) - x).abs()
    X = ref.e8m0_to_float(mx.scales).repeat_interleave(32, dim=-1)
    unsaturated = x.abs() <= 448 * X
    assert (~unsaturated).any()  # the saturated case is exercised
    assert (err[unsaturated] <= 2.0**-4 * x.abs()[unsaturated] + 2.0**-10 * X[unsaturated]).all()
    assert (err[~unsaturated] < 2.0**-3 * x.abs()[~unsaturated]).all()
    amax = x.abs().reshape(64, -1, 32).amax(-1)
    assert (err.reshape(64, -1, 32).amax(-1) <= 2.0**-3 * amax).all()


# --- segment bytes ----------------------------------------------------------------------


def test_pack_matches_the_layout_segments():
    layout = Layout.parse("paged(order=layer_first,layers=2,block=16,kv_heads=2,head_dim=32)")
    chunk_tokens, seg_elems = 32, 2 * 16 * 2 * 32
    segments = torch.randn(2 * 2, seg_elems)  # (layer, block) in layer_first order
    raw = ref.pack_mxfp8(ref.quantize_mxfp8(segments)).flatten()
    assert raw.numel() == layout.total_bytes(DType.MXFP8, chunk_tokens)
    for layer in range(2):
        for blk in range(2):
            r = layout.segment(layer, blk, DType.MXFP8, chunk_tokens)
            got = ref.dequantize_mxfp8(ref.unpack_mxfp8(raw[r.offset : r.offset + r.length]), torch.float32)
            want = ref.dequantize_mxfp8(ref.quantize_mxfp8(segments[layer * 2 + blk]), torch.float32)
            assert torch.equal(got, want)


def test_unpack_rejects_wrong_sizes():
    with pytest.raises(InvalidArgument):
        ref.unpack_mxfp8(torch.zeros(32, dtype=torch.uint8))


# --- Triton against the reference ---------------------------------------------------------


def specials(dev: str, rows: int = 4, cols: int = 64, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-30, 30, rows)[:, None]
    x[0, 3], x[1, 5], x[2, 7], x[3, 32:] = NAN, INF, -INF, 0.0
    x[2, 0] = 2.0**-130
    return x.to(dtype).to(dev)


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_triton_mxfp8_matches_reference(dev, in_dtype):
    from kvstore.gpu import formats_triton as tri

    x = specials(dev, dtype=in_dtype)
    a, b = ref.quantize_mxfp8(x), tri.quantize_mxfp8(x)
    assert torch.equal(a.scales, b.scales) and codes(a.elements) == codes(b.elements)
    for out in (torch.float32, torch.bfloat16):
        assert_same(ref.dequantize_mxfp8(a, out), tri.dequantize_mxfp8(a, out))


@pytest.mark.parametrize("dtype", [DType.FP8_E4M3, DType.FP8_E5M2])
@pytest.mark.parametrize("block", [None, 32])
def test_triton_fp8_matches_reference(dev, dtype, block):
    from kvstore.gpu import formats_triton as tri

    x = specials(dev) * 1e-25  # keep the specials, drop the overflowing rows
    for scale in (None, torch.tensor(0.5, device=dev) if block is None else torch.full((4, 2), 0.5, device=dev)):
        a = ref.quantize_fp8(x, dtype, block=block, scale=scale)
        b = tri.quantize_fp8(x, dtype, block=block, scale=scale)
        assert torch.equal(a.scale, b.scale) and codes(a.data) == codes(b.data)
        assert_same(ref.dequantize_fp8(a, torch.float32), tri.dequantize_fp8(a, torch.float32))
        # the interpreter truncates fp32 -> bf16 stores where hardware rounds: one bf16 ulp
        torch.testing.assert_close(ref.dequantize_fp8(a), tri.dequantize_fp8(a), rtol=2.0**-7, atol=0, equal_nan=True)


@pytest.mark.gpu
def test_triton_formats_at_real_shape_on_gpu():
    from kvstore.gpu import formats_triton as tri

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 3
    a, b = ref.quantize_mxfp8(x), tri.quantize_mxfp8(x)
    assert torch.equal(a.scales, b.scales)
    assert torch.equal(a.elements.view(torch.uint8), b.elements.view(torch.uint8))
    assert torch.equal(ref.dequantize_mxfp8(a), tri.dequantize_mxfp8(a))
    for block in (None, 128):
        qa, qb = ref.quantize_fp8(x, DType.FP8_E4M3, block=block), tri.quantize_fp8(x, DType.FP8_E4M3, block=block)
        assert torch.equal(qa.scale, qb.scale)
        assert torch.equal(qa.data.view(torch.uint8), qb.data.view(torch.uint8))
        assert torch.equal(ref.dequantize_fp8(qa), tri.dequantize_fp8(qa))  # hardware bf16 stores round


def test_u8_bytes_convert_to_no_values():
    with pytest.raises(InvalidArgument, match="u8"):
        ref.encode_segments(torch.randn(3, 64), DType.U8)
    with pytest.raises(InvalidArgument, match="u8"):
        ref.decode_segments(torch.zeros(3, 64, dtype=torch.uint8), DType.U8, torch.float32)


@pytest.mark.parametrize("dtype", [d for d in DType if d is not DType.U8], ids=lambda d: d.value)
def test_segments_round_trip_within_their_format(dtype):
    x = torch.randn(3, 64) * 4
    raw = ref.encode_segments(x, dtype)
    assert raw.dtype == torch.uint8 and raw.shape == (3, dtype.segment_bytes(64))
    back = ref.decode_segments(raw, dtype, torch.float32)
    tolerance = {DType.FP32: 0, DType.BF16: 2.0**-8, DType.FP16: 2.0**-11}.get(dtype, 2.0**-3)
    assert ((back - x).abs() <= tolerance * x.abs().amax(-1, keepdim=True)).all()
