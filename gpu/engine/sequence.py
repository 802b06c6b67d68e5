"""One request's tokens and progress, as the engine's step loop sees it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutable; owned by the engine. `num_computed` tokens have their K/V in the cache.

    token_ids holds the prompt followed by the generated tokens. The newest generated token
    is not computed yet (its K/V is written by the next decode step), so while the sequence
    runs, num_computed == len(token_ids) - 1 after its prefill has finished.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None = None
    num_computed: int = 0
    finish_reason: str | None = None     # "stop" (a stop token) or "length"
    ttft_s: float | None = None          # from add_request to the first generated token
    created_s: float = 0.0               # time.perf_counter() at add_request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def in_prefill(self) -> bool:
        return self.num_generated == 0 and not self.finished

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
        elif self.num_generated >= self.max_new_tokens:
            self.finish_reason = "length"
