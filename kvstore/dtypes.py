"""Storage dtypes and how many bytes a run of elements takes in each."""

from __future__ import annotations

import enum

from kvstore.errors import InvalidArgument, parse_enum

# OCP Microscaling v1.0: one shared e8m0 scale per block of 32 elements.
MX_BLOCK = 32


class DType(str, enum.Enum):
    """Element type of a stored object.

    `mxfp8` is OCP MX: e4m3 elements followed, within each addressable segment, by one
    e8m0 scale byte per 32 elements (see `segment_bytes`).
    """

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    MXFP8 = "mxfp8"
    # bytes whose element type the engine does not hand over (LMCache's multiprocess mode gives
    # its L2 adapters uint8 buffers and vLLM's raw int8 Mamba pages); a label, never a conversion
    U8 = "u8"

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        return parse_enum(cls, value, "dtype")

    @property
    def element_bytes(self) -> int:
        return _ELEMENT_BYTES[self]

    @property
    def torch_name(self) -> str:
        """Name of the torch dtype that holds the elements (scales excluded)."""
        return _TORCH_NAME[self]

    @property
    def is_block_scaled(self) -> bool:
        return self is DType.MXFP8

    def segment_bytes(self, num_elements: int) -> int:
        """Bytes that `num_elements` take, scales included.

        For mxfp8 the element count must be a multiple of 32 so that a segment never
        shares a scale block with its neighbour; ranged reads depend on that.
        """
        if num_elements < 0:
            raise InvalidArgument(f"element count must be >= 0, got {num_elements}")
        if self.is_block_scaled:
            if num_elements % MX_BLOCK:
                raise InvalidArgument(
                    f"mxfp8 segments need a multiple of {MX_BLOCK} elements, got {num_elements}"
                )
            return num_elements + num_elements // MX_BLOCK
        return num_elements * self.element_bytes


_ELEMENT_BYTES = {
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP32: 4,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.MXFP8: 1,
    DType.U8: 1,
}

_TORCH_NAME = {
    DType.BF16: "bfloat16",
    DType.FP16: "float16",
    DType.FP32: "float32",
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP8_E5M2: "float8_e5m2",
    DType.MXFP8: "float8_e4m3fn",
    DType.U8: "uint8",
}
