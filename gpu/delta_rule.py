"""Gated delta rule: the recurrent update of Gated DeltaNet and Kimi Delta Attention (reference).

State convention: S is fp32 [batch, heads, d_v, d_k] (rows index values, columns keys), so
o = S q and the recurrence reads

    S_t = S_{t-1} G_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,      o_t = S_t q_t

with G_t = alpha_t I (Gated DeltaNet: `alpha` [..., heads]) or G_t = diag(alpha_t) (KDA: a
per-key-channel gate, `alpha` [..., heads, d_k]). Computed as S' = S_{t-1} G_t,
S_t = S' + beta_t (v_t - S' k_t) k_t^T. The output uses the updated state. Libraries that keep
the state as [d_k, d_v] (flash-linear-attention) hold S^T: transpose at the boundary.
q/k normalisation and the 1/sqrt(d_k) scale are the caller's (the model's) business.

The recurrent state is what the store keeps as a `recurrent` object per chunk boundary
(layout `recurrent(layers, heads, k_dim, v_dim)`); it stays fp32 because errors compound.
"""

from __future__ import annotations

import torch

from kvstore.errors import InvalidArgument


def check_shapes(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 alpha: torch.Tensor, beta: torch.Tensor) -> None:
    """Sequence form: state [B, H, V, K]; q, k [B, T, H, K]; v [B, T, H, V];
    alpha [B, T, H] or [B, T, H, K]; beta [B, T, H]."""
    if state.dim() != 4 or state.dtype != torch.float32:
        raise InvalidArgument(
            f"state must be fp32 [batch, heads, d_v, d_k], got {state.dtype} {list(state.shape)}"
        )
    b, h, dv, dk = state.shape
    t = q.shape[1] if q.dim() == 4 else -1
    for name, tensor, shape in (("q", q, (b, t, h, dk)), ("k", k, (b, t, h, dk)),
                                ("v", v, (b, t, h, dv)), ("beta", beta, (b, t, h))):
        if tuple(tensor.shape) != shape:
            raise InvalidArgument(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
    if tuple(alpha.shape) not in ((b, t, h), (b, t, h, dk)):
        raise InvalidArgument(
            f"alpha must be [{b}, {t}, {h}] or [{b}, {t}, {h}, {dk}], got {list(alpha.shape)}"
        )


def _step(s: torch.Tensor, q, k, v, alpha, beta) -> tuple[torch.Tensor, torch.Tensor]:
    gate = alpha[..., None, None] if alpha.dim() == 2 else alpha[..., None, :]
    s = s * gate
    pred = torch.einsum("bhvk,bhk->bhv", s, k)
    s = s + beta[..., None, None] * (v - pred)[..., None] * k[..., None, :]
    return torch.einsum("bhvk,bhk->bhv", s, q), s


def delta_rule_chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run T steps. Returns (o [B, T, H, V] in v's dtype, new state); `state` is not modified."""
    check_shapes(state, q, k, v, alpha, beta)
    s = state.clone()
    outs = []
    for t in range(q.shape[1]):
        o, s = _step(s, q[:, t].float(), k[:, t].float(), v[:, t].float(),
                     alpha[:, t].float(), beta[:, t].float())
        outs.append(o)
    o = torch.stack(outs, dim=1) if outs else v.new_empty(v.shape).float()
    return o.to(v.dtype), s


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    alpha: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step: q, k [B, H, K]; v [B, H, V]; alpha [B, H] or [B, H, K]; beta [B, H].
    Returns (o [B, H, V], new state)."""
    o, s = delta_rule_chunk(state, q[:, None], k[:, None], v[:, None], alpha[:, None], beta[:, None])
    return o[:, 0], s
