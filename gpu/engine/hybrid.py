"""A small hybrid model: attention layers and gated delta-rule (Gated DeltaNet) layers.

No small real hybrid model is available offline, so the weights are seeded random; what
matters here is the state it keeps. Attention layers keep paged KV, like the Llama engine;
delta layers keep an fp32 recurrent state S [heads, d_v, d_k] per layer (`gpu.delta_rule`),
which summarises the whole prefix and cannot be rebuilt from a suffix. The forward pass cuts
each delta layer's scan at the requested chunk boundaries and returns the state there: those
snapshots are what the store keeps as `recurrent` objects, one per chunk boundary, so a prefix
hit needs the KV chunks of the attention layers plus the one snapshot at the hit boundary.

Layer i: x += mixer(rms_norm(x)); x += SwiGLU(rms_norm(x)). The attention mixer is Llama's
(RoPE, GQA). The delta mixer: q, k L2-normalised, v linear,
alpha = sigmoid(a + bias_h) with per-head biases from 3 to 8 (memories of ~20 to thousands of
tokens, so a wrong snapshot shows in the output), beta = sigmoid(b). The output head is untied
(with a tied one a random model repeats its input token). Everything runs in float32.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstore.gpu.delta_rule import delta_rule_chunk
from kvstore.errors import InvalidArgument

from .kv_cache import PagedKVCache
from .model import rms_norm, rotate_half

ATTENTION, DELTA = "attention", "delta"


@dataclass(frozen=True, slots=True)
class HybridConfig:
    vocab_size: int = 8192
    hidden_size: int = 128
    intermediate_size: int = 256
    pattern: tuple = (ATTENTION, DELTA, ATTENTION, DELTA)
    num_heads: int = 4  # query heads of attention layers, and heads of delta layers
    num_kv_heads: int = 2
    head_dim: int = 32  # also d_k = d_v of the delta layers
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", tuple(self.pattern))
        if not self.pattern or set(self.pattern) - {ATTENTION, DELTA}:
            raise InvalidArgument(f"pattern lists '{ATTENTION}' and '{DELTA}' layers, got {self.pattern}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise InvalidArgument(f"HybridConfig.{name} must be a positive integer")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise InvalidArgument("num_heads must be a multiple of num_kv_heads, head_dim even")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.pattern) if kind == ATTENTION)

    @property
    def delta_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.pattern) if kind == DELTA)

    @property
    def name(self) -> str:
        return "kvstore/tiny-hybrid-gdn"

    @property
    def revision(self) -> str:
        """Seeded weights are a function of the config: its digest names them."""
        return f"seed{self.seed}-" + hashlib.blake2b(repr(self).encode(), digest_size=6).hexdigest()


def init_weights(c: HybridConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(c.seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)

    hd, w = c.num_heads * c.head_dim, {"embed": torch.randn(c.vocab_size, c.hidden_size, generator=g)}
    for i, kind in enumerate(c.pattern):
        p = f"layers.{i}."
        kv = c.num_kv_heads * c.head_dim if kind == ATTENTION else hd
        w[p + "q_proj"], w[p + "k_proj"], w[p + "v_proj"] = (
            linear(hd, c.hidden_size), linear(kv, c.hidden_size), linear(kv, c.hidden_size))
        w[p + "o_proj"] = linear(c.hidden_size, hd)
        if kind == DELTA:
            w[p + "a_proj"] = linear(c.num_heads, c.hidden_size)
            # per-head decay sigmoid(3) ~ 0.95 .. sigmoid(8) ~ 0.9997: short and long memories
            w[p + "a_bias"] = torch.linspace(3.0, 8.0, c.num_heads)
            w[p + "b_proj"] = linear(c.num_heads, c.hidden_size)
        w[p + "gate_proj"] = linear(c.intermediate_size, c.hidden_size)
        w[p + "up_proj"] = linear(c.intermediate_size, c.hidden_size)
        w[p + "down_proj"] = linear(c.hidden_size, c.intermediate_size)
        w[p + "input_norm"] = torch.ones(c.hidden_size)
        w[p + "post_norm"] = torch.ones(c.hidden_size)
    w["norm"] = torch.ones(c.hidden_size)
    w["lm_head"] = torch.randn(c.vocab_size, c.hidden_size, generator=g)
    return w


class HybridModel:
    """Weights plus the forward pass of one sequence segment; state is passed in and out."""

    def __init__(self, config: HybridConfig = HybridConfig()):
        self.config = config
        self.w = init_weights(config)
        half = config.head_dim // 2
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
        emb = torch.arange(config.max_position, dtype=torch.float32)[:, None] * inv_freq
        emb = torch.cat((emb, emb), dim=-1)
        self._cos, self._sin = emb.cos(), emb.sin()

    def initial_state(self) -> torch.Tensor:
        c = self.config
        return torch.zeros(len(c.delta_layers), c.num_heads, c.head_dim, c.head_dim)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], start: int, cache: PagedKVCache, seq_id: int,
                state: torch.Tensor, boundaries=()) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Compute tokens [start, start + len(token_ids)) of seq_id, whose earlier KV is in
        `cache` (one layer per attention layer) and whose recurrent state after `start` is
        `state` [delta layers, heads, d_v, d_k]. Returns (logits [vocab] of the last token,
        the new state, {b: state after token b - 1} for each b in boundaries inside
        (start, end]). `state` is not modified."""
        c, w = self.config, self.w
        end = start + len(token_ids)
        if end > c.max_position:
            raise InvalidArgument(f"position {end} beyond the context length {c.max_position}")
        cuts = sorted(b for b in set(boundaries) if start < b <= end)
        positions = torch.arange(start, end)
        cos, sin = self._cos[positions][:, None], self._sin[positions][:, None]
        slots = cache.slots(seq_id, 0, end)
        mask = torch.arange(end)[None, :] <= positions[:, None]
        x = w["embed"][torch.tensor(token_ids)]
        new_state, snaps = state.clone(), {b: [] for b in cuts}
        for i, kind in enumerate(c.pattern):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "input_norm"], c.rms_norm_eps)
            q = F.linear(h, w[p + "q_proj"]).view(len(token_ids), c.num_heads, c.head_dim)
            k = F.linear(h, w[p + "k_proj"]).view(len(token_ids), -1, c.head_dim)
            v = F.linear(h, w[p + "v_proj"]).view(len(token_ids), -1, c.head_dim)
            if kind == ATTENTION:
                k_flat, v_flat = cache.layer(c.attention_layers.index(i))
                k_flat[slots[start:]] = k * cos + rotate_half(k) * sin
                v_flat[slots[start:]] = v
                q = (q * cos + rotate_half(q) * sin).transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k_flat[slots].transpose(0, 1), v_flat[slots].transpose(0, 1),
                                                     attn_mask=mask, enable_gqa=True).transpose(0, 1)
            else:
                d = c.delta_layers.index(i)
                q = F.normalize(q, dim=-1)
                k = F.normalize(k, dim=-1)
                alpha = torch.sigmoid(F.linear(h, w[p + "a_proj"]) + w[p + "a_bias"])
                beta = torch.sigmoid(F.linear(h, w[p + "b_proj"]))
                s, outs = new_state[d][None], []
                for lo, hi in zip([start] + cuts, cuts + [end]):
                    if hi > lo:
                        span = slice(lo - start, hi - start)
                        o, s = delta_rule_chunk(s, q[None, span], k[None, span], v[None, span],
                                                alpha[None, span], beta[None, span])
                        outs.append(o[0])
                        if hi in snaps:
                            snaps[hi].append(s[0])
                new_state[d] = s[0]
                out = torch.cat(outs)
            x = x + F.linear(out.reshape(len(token_ids), -1), w[p + "o_proj"])
            h = rms_norm(x, w[p + "post_norm"], c.rms_norm_eps)
            x = x + F.linear(F.silu(F.linear(h, w[p + "gate_proj"])) * F.linear(h, w[p + "up_proj"]),
                             w[p + "down_proj"])
        logits = F.linear(rms_norm(x[-1], w["norm"], c.rms_norm_eps), w["lm_head"])
        return logits, new_state, {b: torch.stack(v) for b, v in snaps.items()}
