import pytest

from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.layout import ByteRange, Layout

PAGED = "paged(order=layer_first,layers=4,block=16,kv_heads=2,head_dim=64)"


@pytest.mark.parametrize("text", [
    PAGED,
    "paged(order=block_first,layers=4,block=16,kv_heads=2,head_dim=64)",
    "mla(order=layer_first,layers=61,block=64,latent_dim=512,rope_dim=64)",
    "indexer(order=layer_first,layers=61,block=64,head_dim=128)",
    "recurrent(layers=3,heads=16,k_dim=128,v_dim=128)",
    "conv(layers=3,channels=4096,width=3)",
    "raw(bytes=4096)",
])
def test_canonical_string_parses_back(text):
    layout = Layout.parse(text)
    assert str(layout) == text and Layout.parse(str(layout)) == layout


def test_defaults_and_spacing_are_canonicalised():
    assert str(Layout.parse("paged( layers=4, block=16, kv_heads=2, head_dim=64)")) == PAGED
    assert str(Layout.parse("mla(layers=1,block=16,latent_dim=512)")).endswith("rope_dim=0)")


@pytest.mark.parametrize("text, match", [
    ("paged", "cannot parse"),
    ("blocks(n=1)", "unknown layout"),
    ("paged(layers=4,block=16,kv_heads=2)", "missing"),
    ("paged(layers=4,block=16,kv_heads=2,head_dim=64,extra=1)", "no parameter"),
    ("paged(layers=4,layers=4,block=16,kv_heads=2,head_dim=64)", "repeated"),
    ("paged(order=sideways,layers=4,block=16,kv_heads=2,head_dim=64)", "order"),
    ("paged(layers=0,block=16,kv_heads=2,head_dim=64)", "> 0"),
    ("paged(layers=x,block=16,kv_heads=2,head_dim=64)", "integer"),
    ("raw(bytes=1)" + "x" * 300, "at most"),
])
def test_bad_layouts_rejected_with_reason(text, match):
    with pytest.raises(InvalidArgument, match=match):
        Layout.parse(text)


def test_segments_tile_the_object_without_gaps_or_overlap():
    for order in ("layer_first", "block_first"):
        layout = Layout.make("paged", order=order, layers=4, block=16, kv_heads=2, head_dim=64)
        total = layout.total_bytes(DType.BF16, 64)
        spans = sorted(layout.segment(l, b, DType.BF16, 64) for l in range(4) for b in range(4))
        assert spans[0].offset == 0 and spans[-1].offset + spans[-1].length == total
        assert all(a.offset + a.length == b.offset for a, b in zip(spans, spans[1:]))
        assert total == 4 * 64 * 2 * 2 * 64 * 2  # layers * tokens * (K,V) * heads * dim * bf16


def test_layer_first_segment_offsets():
    layout = Layout.parse(PAGED)
    seg = 2 * 16 * 2 * 64 * 2
    assert layout.segment(1, 2, DType.BF16, 64) == ByteRange((1 * 4 + 2) * seg, seg)
    with pytest.raises(InvalidArgument, match="outside"):
        layout.segment(4, 0, DType.BF16, 64)


def test_mxfp8_segment_carries_its_scales():
    layout = Layout.parse(PAGED)
    elements = 2 * 16 * 2 * 64
    assert layout.segment_bytes(DType.MXFP8) == elements + elements // 32
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        Layout.parse("raw(bytes=33)").segment_bytes(DType.MXFP8)


def test_ranges_merge_adjacent_and_dedupe():
    layout = Layout.parse(PAGED)
    seg = layout.segment_bytes(DType.FP8_E4M3)
    ranges = layout.ranges([(0, 1), (0, 0), (0, 0), (2, 3)], DType.FP8_E4M3, 64)
    assert ranges == [ByteRange(0, 2 * seg), ByteRange((2 * 4 + 3) * seg, seg)]


def test_chunk_must_be_a_multiple_of_the_block():
    with pytest.raises(InvalidArgument, match="multiple"):
        Layout.parse(PAGED).total_bytes(DType.BF16, 40)


def test_recurrent_has_one_segment_per_layer():
    layout = Layout.parse("recurrent(layers=3,heads=2,k_dim=4,v_dim=4)")
    assert layout.total_bytes(DType.FP32, 256) == 3 * 2 * 4 * 4 * 4
    assert layout.segment(2, 0, DType.FP32, 256) == ByteRange(2 * 128, 128)


def test_a_mamba_layout_names_each_state_and_sizes_the_object_in_bytes():
    from kvstore.dtypes import DType
    from kvstore.layout import Layout, parse_states
    layout = Layout.parse("mamba(layers=2,states=3x32:fp16+2x4x8:fp32)")
    assert parse_states(layout.param("states")) == [((3, 32), "fp16"), ((2, 4, 8), "fp32")]
    # per layer 3*32*2 + 2*4*8*4 bytes, whatever the descriptor's dtype says
    assert layout.total_bytes(DType.FP32, 256) == layout.total_bytes(DType.BF16, 16) == 2 * (192 + 256)
    for bad in ("mamba(layers=2,states=3x:fp16)", "mamba(layers=2,states=3x32:int3)", "mamba(layers=2,states=0x3:fp16)",
                "mamba(layers=2,states=7)", "mamba(layers=0,states=3:fp16)"):
        with pytest.raises(InvalidArgument):
            Layout.parse(bad)
