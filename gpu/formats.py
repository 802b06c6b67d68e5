"""FP8 and MXFP8 state formats: the torch reference (the specification the kernels match).

FP8 with an fp32 scale (`quantize_fp8`)
    Elements are `torch.float8_e4m3fn` or `torch.float8_e5m2`; the scale is a *dequantization*
    scale: x ~= q * scale. Per tensor (`block=None`): one scale, shape []. Per block: one scale
    per `block` consecutive elements of the last dim, shape [..., n // block].
    scale = max(amax / max_finite, 2^-126), amax over the finite elements of the tensor/block, so
    that finite inputs never saturate (and an all-zero block gets a harmless tiny scale).

MXFP8 (`quantize_mxfp8`, OCP Microscaling v1.0)
    Per 32 consecutive elements of the last dim, one shared scale X = 2^e stored as an e8m0 byte
    e + 127, with e = floor(log2(amax)) - 8 (8 = emax of e4m3) clamped to [-127, 127]; elements
    are e4m3 of x / X, rounded to nearest even and saturated to +-448. An all-zero block gets
    e = -127 (byte 0). Byte 255 (the e8m0 NaN) is never produced; on dequantize it makes the
    whole block NaN, as the spec says.

Special values (both formats, one rule)
    NaN stays NaN (e4m3 and e5m2 code 0x7F, sign kept). +-inf saturates to the largest finite
    magnitude of the target (+-max_finite * scale). Scales come from finite elements only, so a
    NaN or inf never spoils its neighbours. (A block holding only infs and zeros therefore comes
    back as +-448 * 2^-127: inf in a KV cache means the model already diverged.)

Error bounds (round trip x -> q -> x_hat, fp32 arithmetic; tests/gpu/test_formats.py checks them)
    fp8 e4m3 (3 mantissa bits): |x_hat - x| <= 2^-4 |x| + 2^-10 scale   (second term: subnormals)
    fp8 e5m2 (2 mantissa bits): |x_hat - x| <= 2^-3 |x| + 2^-17 scale
    mxfp8: with y = x / X, |y| < 512 because X = 2^(floor(log2 amax) - 8).
        |y| <= 448: |x_hat - x| <= 2^-4 |x| + 2^-10 X       (round to nearest even)
        448 < |y| < 512 (saturated): |x_hat - x| = |x| - 448 X < 2^-3 |x|
      hence per block max |x_hat - x| <= 2^-3 amax, and the 2^-3 is tight (y just under 512).

Segment bytes (`pack_mxfp8` / `unpack_mxfp8`)
    A store segment of n elements is n e4m3 bytes followed by n / 32 scale bytes (see
    `kvstore.dtypes.DType.segment_bytes`). Scale blocks run over the segment's elements in
    row-major order, so quantize a batch of segments as a [num_segments, segment_elements]
    tensor; for KV with head_dim % 32 == 0 that is the same as blocking along head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.dtypes import MX_BLOCK, DType
from kvstore.errors import InvalidArgument

MIN_NORMAL_FP32 = 2.0**-126
E8M0_NAN = 255


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """Bit layout of one FP8 format (no inf in e4m3fn; NaN code 0x7F in both)."""

    dtype: DType
    mantissa_bits: int
    bias: int
    max_finite: float
    max_code: int  # largest finite magnitude code
    subnormal_step: float  # value of code 1
    emax: int  # exponent of the largest binade (OCP MX: 8 for e4m3)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.torch_name)


E4M3 = Fp8Format(DType.FP8_E4M3, 3, 7, 448.0, 0x7E, 2.0**-9, 8)
E5M2 = Fp8Format(DType.FP8_E5M2, 2, 15, 57344.0, 0x7B, 2.0**-16, 15)
_FORMATS = {DType.FP8_E4M3: E4M3, DType.FP8_E5M2: E5M2}


def fp8_format(dtype: DType | str) -> Fp8Format:
    dtype = DType.parse(dtype)
    if dtype not in _FORMATS:
        raise InvalidArgument(f"{dtype.value} is not an fp8 element format; use fp8_e4m3 or fp8_e5m2")
    return _FORMATS[dtype]


@dataclass(frozen=True, slots=True)
class Fp8Tensor:
    """FP8 elements and their fp32 dequantization scales (x ~= data * scale).

    block=None: one scale (shape []); else one scale per `block` elements of the last dim.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: int | None


@dataclass(frozen=True, slots=True)
class MxTensor:
    """MXFP8: e4m3 elements [..., n] and e8m0 scale bytes (uint8) [..., n // 32]."""

    elements: torch.Tensor
    scales: torch.Tensor


def check_blocked(x: torch.Tensor, block: int, what: str) -> None:
    """Raise unless the last dim of `x` splits into whole blocks."""
    if x.dim() == 0 or x.shape[-1] % block:
        raise InvalidArgument(
            f"{what} needs a last dim that is a multiple of {block}, got shape {tuple(x.shape)}"
        )


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exactly 2^e as fp32 for integer e in [-127, 127], built from bits (no libm rounding)."""
    e = exponent.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    return torch.where(e == -127, torch.full_like(normal, 2.0**-127), normal)


def finite_amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| over finite elements (NaN and +-inf count as 0)."""
    mag = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    return mag.amax() if dim is None else mag.amax(dim)


def amax_scale(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """max(amax / max_finite, 2^-126), rounded as IEEE division on every device: torch on CUDA
    multiplies by the reciprocal when the divisor is a Python number (an ulp off now and
    then, seen on an H200), so the divisor is a tensor on amax's device."""
    divisor = torch.tensor(fmt.max_finite, dtype=amax.dtype, device=amax.device)
    return (amax / divisor).clamp_min(MIN_NORMAL_FP32)


def _encode(y: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    # torch's casts differ by format and device on overflow (e4m3fn saturates on CPU, e5m2 goes
    # to inf): clamp first; clamp keeps NaN.
    return y.clamp(-fmt.max_finite, fmt.max_finite).to(fmt.torch_dtype)


def quantize_fp8(
    x: torch.Tensor,
    dtype: DType | str = DType.FP8_E4M3,
    block: int | None = None,
    scale: torch.Tensor | None = None,
) -> Fp8Tensor:
    """Quantize to FP8 with a per-tensor (`block=None`) or per-block fp32 scale.

    `scale`, when given, is used as is (shape [] or [..., n // block]); otherwise it is
    computed from the finite amax. Returns new tensors on x's device.
    """
    fmt = fp8_format(dtype)
    xf = x.float()
    if block is None:
        if scale is None:
            scale = amax_scale(finite_amax(xf), fmt)
        scale = scale.to(xf.device, torch.float32).reshape(())  # a CPU scalar would divide inexactly
        return Fp8Tensor(_encode(xf / scale, fmt), scale, None)
    check_blocked(x, block, f"per-block fp8 (block={block})")
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    if scale is None:
        scale = amax_scale(finite_amax(blocks, -1), fmt)
    scale = scale.float().reshape(blocks.shape[:-1])
    data = _encode(blocks / scale[..., None], fmt).reshape(x.shape)
    return Fp8Tensor(data, scale, block)


def dequantize_fp8(q: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x_hat = data * scale, computed in fp32 and cast to `out_dtype`."""
    values = q.data.float()
    if q.block is None:
        return (values * q.scale).to(out_dtype)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // q.block, q.block)
    return (blocks * q.scale[..., None]).reshape(values.shape).to(out_dtype)


def quantize_mxfp8(x: torch.Tensor) -> MxTensor:
    """OCP MX v1.0 MXFP8 along the last dim (a multiple of 32); see the module docstring."""
    check_blocked(x, MX_BLOCK, "mxfp8")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // MX_BLOCK, MX_BLOCK)
    amax = finite_amax(blocks, -1)
    # floor(log2(amax)) is the biased exponent field minus 127 for normal amax; zero and
    # subnormal amax give <= -127 and the clamp takes them to byte 0.
    log2_floor = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
    shared = (log2_floor - E4M3.emax).clamp(-127, 127)
    elements = _encode(blocks * pow2(-shared)[..., None], E4M3)
    return MxTensor(elements.reshape(x.shape), (shared + 127).to(torch.uint8))


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes to fp32 powers of two; byte 255 is NaN."""
    value = pow2(scales.to(torch.int32) - 127)
    return torch.where(scales == E8M0_NAN, torch.full_like(value, float("nan")), value)


def dequantize_mxfp8(mx: MxTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x_hat = element * 2^(scale - 127); exact in fp32 and bf16 (at most 4 significant bits)."""
    values = mx.elements.float()
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // MX_BLOCK, MX_BLOCK)
    out = blocks * e8m0_to_float(mx.scales)[..., None]
    return out.reshape(values.shape).to(out_dtype)


def pack_mxfp8(mx: MxTensor) -> torch.Tensor:
    """Segment bytes: uint8 [..., n + n // 32], elements then scales (a new tensor)."""
    return torch.cat([mx.elements.view(torch.uint8), mx.scales.to(torch.uint8)], dim=-1)


def unpack_mxfp8(raw: torch.Tensor) -> MxTensor:
    """Inverse of `pack_mxfp8`: views into `raw` (uint8 [..., 33 * k]), no copy."""
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % (MX_BLOCK + 1):
        raise InvalidArgument(
            f"mxfp8 segment bytes must be uint8 [..., 33*k], got {raw.dtype} {tuple(raw.shape)}"
        )
    n = raw.shape[-1] // (MX_BLOCK + 1) * MX_BLOCK
    return MxTensor(raw[..., :n].view(torch.float8_e4m3fn), raw[..., n:])


def _convertible(dtype: DType | str) -> DType:
    dtype = DType.parse(dtype)
    if dtype is DType.U8:
        raise InvalidArgument("u8 objects are bytes with no element type: they convert to and from no values")
    return dtype


def encode_segments(x: torch.Tensor, dtype: DType | str) -> torch.Tensor:
    """Values [..., segment_elements] -> the store's bytes for `dtype`, uint8 [..., segment_bytes].

    FP8 objects carry no scales in their layout, so they are a saturating cast (scale 1);
    MXFP8 carries its own. A writer that wants scaled FP8 keeps the scale in its metadata.
    """
    dtype = _convertible(dtype)
    if dtype is DType.MXFP8:
        return pack_mxfp8(quantize_mxfp8(x))
    target = getattr(torch, dtype.torch_name)
    if dtype in _FORMATS:
        return _encode(x.float(), _FORMATS[dtype]).view(torch.uint8)
    return x.to(target).contiguous().view(torch.uint8)


def decode_segments(
    raw: torch.Tensor, dtype: DType | str, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The reader-side conversion behind get(accept=[...]): store bytes uint8 [..., segment_bytes]
    of a `dtype` object -> values [..., segment_elements] in `out_dtype` (a new tensor)."""
    dtype = _convertible(dtype)
    if dtype is DType.MXFP8:
        return dequantize_mxfp8(unpack_mxfp8(raw), out_dtype)
    if raw.dtype != torch.uint8 or raw.dim() == 0 or raw.shape[-1] % dtype.element_bytes:
        raise InvalidArgument(f"{dtype.value} segment bytes must be uint8 [..., k * {dtype.element_bytes}]")
    return raw.contiguous().view(getattr(torch, dtype.torch_name)).to(out_dtype)
