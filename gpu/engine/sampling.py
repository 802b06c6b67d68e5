"""Next-token choice: greedy, or temperature / top-k / top-p sampling from a seeded generator.

Each sequence owns its own `torch.Generator` (CPU), so a seeded sequence draws the same tokens
whether it runs alone or batched with others, on CPU or CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0      # 0: greedy (argmax)
    top_p: float = 1.0            # keep the smallest set of tokens whose probability >= top_p
    top_k: int = 0                # 0: no top-k cut
    seed: int | None = None       # None with temperature > 0: torch's global RNG

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator | None:
        if self.greedy or self.seed is None:
            return None
        return torch.Generator(device="cpu").manual_seed(self.seed)


GREEDY = SamplingParams()


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> int:
    """One token id from logits [vocab] (float32)."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float().cpu() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # drop a token when the tokens ranked above it already reach top_p (the first stays)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
