"""Triton kernels for `gpu.formats`: same functions, same results, one launch each.

Inputs are flattened (made contiguous if they are not) and cut into groups: a scale block
(32 for MXFP8, `block` for per-block FP8) or, per tensor, 1024 elements sharing one scale.
Each program handles `GROUPS_PER_PROG` groups. Results equal the reference bit for bit: scale
divisions use `div_rn` (IEEE round-to-nearest, as torch does; Triton's `/` is approximate on
NVIDIA GPUs), MXFP8 only multiplies by powers of two. One exception: the interpreter truncates
fp32 -> bf16 stores where hardware rounds, so FP8-with-fp32-scale dequantization to bf16 can be
one bf16 ulp off under the interpreter (MXFP8 products are exact in bf16 and never are).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.gpu.formats import (
    E4M3,
    Fp8Format,
    Fp8Tensor,
    MxTensor,
    amax_scale,
    check_blocked,
    finite_amax,
    fp8_format,
)
from kvstore.gpu.fp8_bits import decode_fp8, encode_fp8, pow2_from_e8m0
from kvstore.dtypes import MX_BLOCK, DType
from kvstore.errors import InvalidArgument

SCALE_GIVEN, SCALE_AMAX, SCALE_MX = 0, 1, 2
PER_TENSOR_GROUP = 1024  # elements per program-row when one scale covers the whole tensor
TARGET_ELEMENTS = 4096  # elements per program: enough bytes in flight per SM, few registers


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, n_elements, n_groups, scale_stride,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, SCALE_MODE: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, FMAX: tl.constexpr,
    EMAX: tl.constexpr,
):
    g = tl.program_id(0) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    gmask = g < n_groups
    offs = g.to(tl.int64)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE_MODE == 0:
        s = tl.load(s_ptr + g * scale_stride, mask=gmask, other=1.0)
        y = tl.math.div_rn(x, s[:, None])
    else:
        finite = tl.abs(x) < float("inf")
        amax = tl.max(tl.where(finite, tl.abs(x), 0.0), axis=1)
        if SCALE_MODE == 1:
            s = tl.maximum(tl.math.div_rn(amax, FMAX), 1.1754943508222875e-38)
            tl.store(s_ptr + g, s, mask=gmask)
            y = tl.math.div_rn(x, s[:, None])
        else:
            e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX
            e = tl.minimum(tl.maximum(e, -127), 127)
            tl.store(s_ptr + g, (e + 127).to(tl.uint8), mask=gmask)
            inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
            y = x * inv[:, None]
    tl.store(q_ptr + offs, encode_fp8(y, MANT, BIAS, MAX_CODE), mask=mask)


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, n_elements, n_groups, scale_stride,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, SCALE_MODE: tl.constexpr,
    MANT: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, E4M3FN: tl.constexpr,
):
    g = tl.program_id(0) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    gmask = g < n_groups
    offs = g.to(tl.int64)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < n_elements
    c = tl.load(q_ptr + offs, mask=mask, other=0)
    val = decode_fp8(c, MANT, BIAS, SUB_STEP, E4M3FN)
    if SCALE_MODE == 2:
        b = tl.load(s_ptr + g, mask=gmask, other=127).to(tl.int32)
        factor, half = pow2_from_e8m0(b)
        out = val * factor[:, None] * half[:, None]
    else:
        s = tl.load(s_ptr + g * scale_stride, mask=gmask, other=1.0)
        out = val * s[:, None]
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _groups_per_prog(group: int, n_groups: int) -> int:
    return max(1, min(TARGET_ELEMENTS // group, triton.next_power_of_2(max(n_groups, 1))))


def _launch_quantize(x, q_bytes, scale, group, n_groups, mode, stride, fmt: Fp8Format) -> None:
    if x.numel() == 0:
        return
    gpp = _groups_per_prog(group, n_groups)
    _quantize_kernel[(triton.cdiv(n_groups, gpp),)](
        x, q_bytes, scale, x.numel(), n_groups, stride,
        GROUP=group, GROUPS_PER_PROG=gpp, SCALE_MODE=mode,
        MANT=fmt.mantissa_bits, BIAS=fmt.bias, MAX_CODE=fmt.max_code, FMAX=fmt.max_finite,
        EMAX=fmt.emax,
    )


def _launch_dequantize(q_bytes, scale, out, group, n_groups, mode, stride, fmt: Fp8Format) -> None:
    if out.numel() == 0:
        return
    gpp = _groups_per_prog(group, n_groups)
    _dequantize_kernel[(triton.cdiv(n_groups, gpp),)](
        q_bytes, scale, out, out.numel(), n_groups, stride,
        GROUP=group, GROUPS_PER_PROG=gpp, SCALE_MODE=mode,
        MANT=fmt.mantissa_bits, BIAS=fmt.bias, SUB_STEP=fmt.subnormal_step,
        E4M3FN=fmt is E4M3,
    )


def quantize_fp8(
    x: torch.Tensor,
    dtype: DType | str = DType.FP8_E4M3,
    block: int | None = None,
    scale: torch.Tensor | None = None,
) -> Fp8Tensor:
    """Triton twin of `gpu.formats.quantize_fp8` (per-tensor amax is a torch reduction)."""
    fmt = fp8_format(dtype)
    x = x.contiguous()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if block is None:
        if scale is None:
            scale = amax_scale(finite_amax(x.float()), fmt)
        scale = scale.to(x.device, torch.float32).reshape(()).contiguous()
        n_groups = triton.cdiv(x.numel(), PER_TENSOR_GROUP)
        _launch_quantize(x, data, scale, PER_TENSOR_GROUP, n_groups, SCALE_GIVEN, 0, fmt)
    else:
        _check_block(x, block)
        shape = (*x.shape[:-1], x.shape[-1] // block)
        n_groups = x.numel() // block
        if scale is None:
            scale = torch.empty(shape, dtype=torch.float32, device=x.device)
            _launch_quantize(x, data, scale, block, n_groups, SCALE_AMAX, 1, fmt)
        else:
            scale = scale.to(x.device, torch.float32).reshape(shape).contiguous()
            _launch_quantize(x, data, scale, block, n_groups, SCALE_GIVEN, 1, fmt)
    return Fp8Tensor(data.view(fmt.torch_dtype), scale, block)


def dequantize_fp8(q: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton twin of `gpu.formats.dequantize_fp8`."""
    fmt = _format_of(q.data)
    data = q.data.contiguous().view(torch.uint8)
    out = torch.empty(q.data.shape, dtype=out_dtype, device=q.data.device)
    scale = q.scale.float().contiguous()
    if q.block is None:
        n_groups = triton.cdiv(out.numel(), PER_TENSOR_GROUP)
        _launch_dequantize(data, scale, out, PER_TENSOR_GROUP, n_groups, SCALE_GIVEN, 0, fmt)
    else:
        _check_block(q.data, q.block)
        n_groups = out.numel() // q.block
        _launch_dequantize(data, scale, out, q.block, n_groups, SCALE_GIVEN, 1, fmt)
    return out


def quantize_mxfp8(x: torch.Tensor) -> MxTensor:
    """Triton twin of `gpu.formats.quantize_mxfp8`."""
    check_blocked(x, MX_BLOCK, "mxfp8")
    x = x.contiguous()
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scales = torch.empty((*x.shape[:-1], x.shape[-1] // MX_BLOCK), dtype=torch.uint8, device=x.device)
    _launch_quantize(x, data, scales, MX_BLOCK, scales.numel(), SCALE_MX, 1, E4M3)
    return MxTensor(data.view(torch.float8_e4m3fn), scales)


def dequantize_mxfp8(mx: MxTensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Triton twin of `gpu.formats.dequantize_mxfp8`."""
    check_blocked(mx.elements, MX_BLOCK, "mxfp8")
    data = mx.elements.contiguous().view(torch.uint8)
    scales = mx.scales.contiguous()
    out = torch.empty(mx.elements.shape, dtype=out_dtype, device=mx.elements.device)
    _launch_dequantize(data, scales, out, MX_BLOCK, scales.numel(), SCALE_MX, 1, E4M3)
    return out


def _check_block(x: torch.Tensor, block: int) -> None:
    check_blocked(x, block, f"per-block fp8 (block={block})")
    if block & (block - 1):
        raise InvalidArgument(f"the per-block fp8 kernels need a power-of-two block, got {block}")


def _format_of(data: torch.Tensor) -> Fp8Format:
    for dtype in (DType.FP8_E4M3, DType.FP8_E5M2):
        fmt = fp8_format(dtype)
        if data.dtype == fmt.torch_dtype:
            return fmt
    raise InvalidArgument(f"expected float8_e4m3fn or float8_e5m2 elements, got {data.dtype}")

