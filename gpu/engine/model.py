"""Llama forward pass in plain torch: RMSNorm, RoPE (rotate-half), GQA attention, SwiGLU.

Two entry points share every layer: `forward` attends over the paged KV cache (writing the new
tokens' K/V first, then gathering each sequence's context), `forward_nocache` attends within
one sequence with no cache at all. The second is the specification the first is tested against.
Numerics follow transformers' LlamaForCausalLM: norms and RoPE tables in float32, matmuls in the
model dtype, logits in float32.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .gguf_loader import ModelConfig
from .kv_cache import PagedKVCache

# (layer, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> attention output [T, H, D]
Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights plus the forward pass. Stateless between calls: the KV cache is passed in."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        self.config = config
        self.w = weights
        self.dtype = weights["embed"].dtype
        self.device = weights["embed"].device
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
        freqs = torch.arange(config.max_position, dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.device, self.dtype)   # [max_position, head_dim]
        self._sin = emb.sin().to(self.device, self.dtype)

    # -- entry points -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: StepBatch, cache: PagedKVCache,
                queries: list | None = None) -> torch.Tensor:
        """Compute the batch's tokens against the cache; returns logits [B, vocab] (float32)
        of each segment's last token. Writes the new tokens' K/V into the cache. With
        `queries`, appends each layer's query of each segment's last token ([B, heads, dim],
        RoPE applied)."""

        def paged_attention(layer, q, k, v):
            if queries is not None:
                queries.append(q[batch.last_index])
            k_flat, v_flat = cache.layer(layer)
            k_flat[batch.write_slots] = k
            v_flat[batch.write_slots] = v
            # [B, Q, H, D] against [B, L, KVH, D] -> heads first for SDPA
            qb = q[batch.query_index].transpose(1, 2)
            kb = k_flat[batch.context_slots].transpose(1, 2)
            vb = v_flat[batch.context_slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=batch.attn_mask,
                                                 enable_gqa=True)
            return out.transpose(1, 2)[batch.query_valid]

        hidden = self._layers(batch.token_ids, batch.positions, paged_attention)
        return self.logits(hidden[batch.last_index])

    @torch.inference_mode()
    def forward_nocache(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [T, vocab] (float32) at every position of one sequence, with no cache."""

        def causal_attention(layer, q, k, v):
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                 v.transpose(0, 1), is_causal=True,
                                                 enable_gqa=True)
            return out.transpose(0, 1)

        ids = torch.tensor(token_ids, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        return self.logits(self._layers(ids, positions, causal_attention))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.w["lm_head"]).float()

    # -- layers ---------------------------------------------------------------------------

    def _layers(self, token_ids: torch.Tensor, positions: torch.Tensor,
                attention: Attention) -> torch.Tensor:
        c, w = self.config, self.w
        if int(positions.max()) >= c.max_position:
            raise ValueError(f"position {int(positions.max())} beyond the model's context "
                             f"length {c.max_position}")
        cos, sin = self._cos[positions][:, None, :], self._sin[positions][:, None, :]
        x = w["embed"][token_ids]
        for i in range(c.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_norm"], c.rms_norm_eps)
            q = F.linear(h, w[p + "q_proj"]).view(-1, c.num_heads, c.head_dim)
            k = F.linear(h, w[p + "k_proj"]).view(-1, c.num_kv_heads, c.head_dim)
            v = F.linear(h, w[p + "v_proj"]).view(-1, c.num_kv_heads, c.head_dim)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attn = attention(i, q, k, v).reshape(-1, c.num_heads * c.head_dim)
            x = x + F.linear(attn, w[p + "o_proj"])
            h = rms_norm(x, w[p + "post_attn_norm"], c.rms_norm_eps)
            gate_up = F.silu(F.linear(h, w[p + "gate_proj"])) * F.linear(h, w[p + "up_proj"])
            x = x + F.linear(gate_up, w[p + "down_proj"])
        return rms_norm(x, w["norm"], c.rms_norm_eps)
