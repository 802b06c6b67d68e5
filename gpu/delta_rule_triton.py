"""Triton kernel for `gpu.delta_rule`: a fused recurrent gated delta rule.

Grid: (batch * heads, d_v / BLOCK_V). Rows of S (one per value channel) evolve independently
(S' k and the update act row by row), so a program keeps a [BLOCK_V, d_k] slice of the state in
registers for all T steps and writes it back once. Decode is T = 1; prefill runs the same
kernel over the whole sequence (a chunked-parallel form would be faster for long prefill; the
store only needs the state at chunk boundaries, which this produces exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstore.gpu.delta_rule import check_shapes

BLOCK_V = 32  # value rows per program: [32, 128] fp32 = 16 KiB of state in registers


@triton.jit
def _delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, s_in_ptr, s_out_ptr, o_ptr, T, H,
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    GATE_PER_KEY: tl.constexpr,
):
    bh = tl.program_id(0)
    batch = bh // H
    head = bh % H
    rk = tl.arange(0, BK)
    rv = tl.program_id(1) * BV + tl.arange(0, BV)
    kmask = rk < DK
    vmask = rv < DV
    smask = vmask[:, None] & kmask[None, :]
    s_off = bh.to(tl.int64) * DV * DK + rv[:, None] * DK + rk[None, :]
    s = tl.load(s_in_ptr + s_off, mask=smask, other=0.0)
    for t in range(T):
        row = (batch.to(tl.int64) * T + t) * H + head  # index of (batch, t, head)
        k = tl.load(k_ptr + row * DK + rk, mask=kmask, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + row * DK + rk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * DV + rv, mask=vmask, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + row).to(tl.float32)
        if GATE_PER_KEY:
            alpha = tl.load(a_ptr + row * DK + rk, mask=kmask, other=0.0).to(tl.float32)
            s = s * alpha[None, :]
        else:
            s = s * tl.load(a_ptr + row).to(tl.float32)
        pred = tl.sum(s * k[None, :], axis=1)
        s = s + (beta * (v - pred))[:, None] * k[None, :]
        o = tl.sum(s * q[None, :], axis=1)
        tl.store(o_ptr + row * DV + rv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_out_ptr + s_off, s, mask=smask)


def delta_rule_chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `gpu.delta_rule.delta_rule_chunk` (state not modified)."""
    check_shapes(state, q, k, v, alpha, beta)
    b, h, dv, dk = state.shape
    t = q.shape[1]
    out_state = torch.empty_like(state, memory_format=torch.contiguous_format)
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bv = min(BLOCK_V, triton.next_power_of_2(dv))
    if b * h == 0:
        return o, out_state
    _delta_rule_kernel[(b * h, triton.cdiv(dv, bv))](
        q.contiguous(), k.contiguous(), v.contiguous(), alpha.contiguous(), beta.contiguous(),
        state.contiguous(), out_state, o, t, h,
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv, GATE_PER_KEY=alpha.dim() == 4,
    )
    return o, out_state


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `gpu.delta_rule.delta_rule_step`."""
    o, s = delta_rule_chunk(state, q[:, None], k[:, None], v[:, None], alpha[:, None], beta[:, None])
    return o[:, 0], s
