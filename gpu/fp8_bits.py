"""FP8 encode/decode as integer bit operations inside Triton kernels.

Why not `x.to(tl.float8e4nv)`: the interpreter's conversion neither rounds to nearest even nor
saturates, and hardware casts differ by architecture. Integer arithmetic gives the same bits
everywhere, matches torch's round-to-nearest-even cast, and costs nothing in a kernel that is
bound by memory bandwidth. Imports triton: load this module only from `*_triton` modules.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rne_shift(v, s):
    """round(v / 2^s), ties to even, for int32 v >= 0 and 1 <= s <= 31."""
    q = v >> s
    rem = v - (q << s)
    half = 1 << (s - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def encode_fp8(y, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr):
    """fp32 -> FP8 code (uint8): nearest even, saturating (inf too), NaN -> 0x7F, sign kept."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23) - 127
    # normal range: drop mantissa bits; a carry ripples into the exponent as it should
    normal = rne_shift(mag, 23 - MANT) - ((127 - BIAS) << MANT)
    # subnormal range: code = round(|y| / 2^(1 - BIAS - MANT)) from the 24-bit significand
    shift = tl.minimum(tl.maximum(24 - BIAS - MANT - exp, 1), 31)
    sub = rne_shift((mag & 0x7FFFFF) | 0x800000, shift)
    code = tl.where(exp >= 1 - BIAS, normal, sub)
    code = tl.minimum(code, MAX_CODE)
    code = tl.where(y != y, 0x7F, code)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def decode_fp8(c, MANT: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, E4M3FN: tl.constexpr):
    """FP8 code (uint8) -> fp32, exact."""
    c = c.to(tl.int32)
    sign = (c >> 7) & 1
    e = (c >> MANT) & ((1 << (7 - MANT)) - 1)
    m = c & ((1 << MANT) - 1)
    normal = (((e - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * SUB_STEP, normal)
    if E4M3FN:
        val = tl.where((c & 0x7F) == 0x7F, float("nan"), val)
    else:
        top = e == (1 << (7 - MANT)) - 1
        val = tl.where(top, tl.where(m == 0, float("inf"), float("nan")), val)
    return tl.where(sign == 1, -val, val)


@triton.jit
def pow2_from_e8m0(b):
    """e8m0 byte (int32) -> 2^(b - 127) as fp32 factor; byte 255 -> NaN.

    Byte 0 (2^-127) is a subnormal; build it as 2^-126 * 0.5 at the use site so no flush-to-zero
    constant appears. Returns (factor, extra_half) where value = factor * extra_half.
    """
    factor = (tl.maximum(b, 1) << 23).to(tl.float32, bitcast=True)
    factor = tl.where(b == 255, float("nan"), factor)
    half = tl.where(b == 0, 0.5, 1.0)
    return factor, half
