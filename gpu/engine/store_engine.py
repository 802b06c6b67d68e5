"""The reference engine wired to a kvstore daemon through `gpu.engine.connector.KVConnector`.

`StoreEngine` is an `Engine` whose requests first ask the store for their prompt's prefix:
`add_request` looks the chunks up and loads the part that is faster to load than to recompute
(so TTFT includes the lookup and the load), every `step` saves the full chunks it completed,
and `release` saves the rest. Any store failure leaves the request to plain recompute, so the
tokens are those of a plain `Engine`.

Object identity: model `HuggingFaceTB/SmolLM2-135M-Instruct` (or the GGUF's name), revision a
digest of the GGUF file, and the engine's compute dtype as a chain extra key: KV computed in
float32 and in bfloat16 differ, and a reader that wants identical tokens must not mix them.

Every chunk it stores is the one chunk computation of `chunked` (the chunk's tokens in one
forward, alone, after the chunks before it): prompt chunks come so from the chunk-aligned,
batch-invariant prefill; a chunk completed while decoding (its KV was computed a token at a
time) is recomputed so before it is saved (`export_kv`), which costs one chunk of prefill per
chunk decoded. The sparse decoder and every other reader of these objects compute the same
bytes themselves, so a hit never changes a token.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvstore.errors import InvalidArgument
from kvstore.identity import DEFAULT_CHUNK_TOKENS, StateDescriptor

from . import chunked
from .connector import ConnectorConfig, KVConnector, MatchResult
from .engine import Engine, EngineConfig
from .gguf_loader import DEFAULT_MODEL_FILE, ModelConfig, default_model_path, load_gguf
from .model import LlamaModel
from .sampling import GREEDY, SamplingParams
from .store_codecs import PagedKVCodec, paged_layout
from .tokenizer import Tokenizer

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Prefill rate assumed until the engine has measured its own (bf16 on 2 CPU cores: ~600).
DEFAULT_PREFILL_TOKENS_PER_S = 500.0
_DIGEST_BYTES = 8 << 20


@functools.lru_cache(maxsize=8)
def model_revision(path: str) -> str:
    """A content digest of the GGUF: its size and the BLAKE2b of its first 8 MiB (header,
    metadata and the first tensors). Cheap enough to take at every start."""
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(_DIGEST_BYTES)
    digest = hashlib.blake2b(head + p.stat().st_size.to_bytes(8, "little"), digest_size=8)
    return f"gguf-{digest.hexdigest()}"


@functools.lru_cache(maxsize=4)
def shared_weights(dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[LlamaModel, Tokenizer]:
    """SmolLM2 loaded once per process per dtype (bf16 is cast from one float32 load)."""
    if dtype == torch.float32:
        loaded = load_gguf(None, torch.float32, device)
        return LlamaModel(loaded.config, loaded.weights), Tokenizer(loaded.tokenizer)
    base, tokenizer = shared_weights(torch.float32, device)
    return LlamaModel(base.config, {k: v.to(dtype) for k, v in base.w.items()}), tokenizer


@dataclass(frozen=True, slots=True)
class StoreConfig:
    socket_path: str | None = None  # None: $KVSTORE_SOCKET or the default path
    namespace: str = "default"
    dtype: str = "bf16"  # storage dtype: bf16, fp16, fp32 (lossless from float32), fp8_e4m3, mxfp8
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    model_id: str | None = None  # None: SmolLM2's hub id for the default GGUF, else its name
    model_revision: str | None = None  # None: a digest of the GGUF file
    model_path: str | None = None  # the GGUF the weights came from (None: the default)
    prefill_tokens_per_s: float | None = None  # None: measured by the engine
    # Save chunks completed while decoding. Their KV was computed one token at a time, which
    # differs in the last bits from a prefill of the chunk, so each is recomputed as one
    # chunk (`chunked.prefill`) before it is saved: one chunk of prefill per chunk decoded.
    save_decode: bool = True
    connector: ConnectorConfig = ConnectorConfig()


class StoreEngine(Engine):
    """An Engine with a store. Its prefill is chunk-aligned (`EngineConfig.prefill_align` =
    chunk_tokens unless set) and the chunk holding a prompt's last token is always computed:
    a plain `Engine(config=store_engine.config)` then computes every prompt chunk in the same
    pieces, and a request that prefills alone gets the same tokens with the store or without."""

    def __init__(self, store: StoreConfig = StoreConfig(), dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", config: EngineConfig = EngineConfig(), *,
                 model: LlamaModel | None = None, tokenizer: Tokenizer | None = None):
        if not config.prefill_align:
            config = replace(config, prefill_align=store.chunk_tokens,
                             max_prefill_tokens=max(config.max_prefill_tokens, store.chunk_tokens))
        super().__init__(store.model_path, dtype, device, config, model=model, tokenizer=tokenizer)
        if store.chunk_tokens % config.page_tokens or store.chunk_tokens != config.prefill_align:
            raise InvalidArgument(f"chunk_tokens {store.chunk_tokens} must be a multiple of the "
                                  f"page size {config.page_tokens} and equal prefill_align "
                                  f"({config.prefill_align}): a chunk is computed in one piece")
        self.store = store
        self.descriptor = kv_descriptor(self.model_config, config.page_tokens, store)
        self.codec = PagedKVCodec(self, self.descriptor, self.model.dtype)
        self.connector = make_connector(store, [self.codec], self.model.dtype, self.estimate_prefill_s)
        self.matches: dict[int, MatchResult] = {}  # seq_id -> what its lookup decided (kept)
        self.num_decode_recomputed = 0  # chunks completed while decoding, recomputed to save
        self._recomputed: dict[int, torch.Tensor] = {}  # seq_id -> KV of those chunks, in order

    def estimate_prefill_s(self, num_tokens: int) -> float:
        rate = self.store.prefill_tokens_per_s or self.stats.prefill_tokens_per_s(DEFAULT_PREFILL_TOKENS_PER_S)
        return num_tokens / rate

    def add_request(self, prompt_ids: list[int], max_new_tokens: int = 16,
                    sampling: SamplingParams = GREEDY, ignore_eos: bool = False) -> int:
        """Engine.add_request, then one lookup and (when it pays) the load of the prefix."""
        seq_id = super().add_request(prompt_ids, max_new_tokens, sampling, ignore_eos)
        match = self.connector.get_num_new_matched_tokens(seq_id, prompt_ids)
        if match.num_tokens:
            self.connector.start_load_kv(seq_id)
        self.matches[seq_id] = self.connector.match(seq_id)
        return seq_id

    def step(self):
        outputs = super().step()
        for seq in self._seqs.values():
            self.connector.save_kv(seq.seq_id, seq.token_ids, self._savable(seq))
        self.connector.wait_for_save()
        return outputs

    def release(self, seq_id: int):
        seq = self.sequence(seq_id)
        try:
            self.connector.request_finished(seq_id, seq.token_ids, self._savable(seq))
        finally:
            self._recomputed.pop(seq_id, None)
        return super().release(seq_id)

    def export_kv(self, seq_id: int, start_token: int, end_token: int) -> torch.Tensor:
        """Engine.export_kv, except that a chunk past the prompt's full chunks (completed
        while decoding) comes as the one chunk computation gives it, not as decoded."""
        seq = self.sequence(seq_id)
        C = self.store.chunk_tokens
        prompt_end = seq.num_prompt_tokens // C * C  # full prompt chunks: prefilled canonically
        if end_token <= prompt_end or start_token % C or end_token - start_token != C \
                or end_token > seq.num_computed:
            return super().export_kv(seq_id, start_token, end_token)
        done = self._recomputed.get(seq_id)
        have = prompt_end + (0 if done is None else done.shape[2])
        if have < end_token:
            context = self.cache.read(seq_id, 0, prompt_end)
            if done is not None:
                context = torch.cat([context, done], dim=2)
            more = chunked.prefill(self.model, seq.token_ids[:end_token], C,
                                   self.config.page_tokens, context).kv
            self.num_decode_recomputed += more.shape[2] // C
            done = more if done is None else torch.cat([done, more], dim=2)
            self._recomputed[seq_id] = done
        return done[:, :, start_token - prompt_end:end_token - prompt_end].clone()

    def _savable(self, seq) -> int:
        return seq.num_computed if self.store.save_decode else min(seq.num_computed, seq.num_prompt_tokens)

    def close(self) -> None:
        self.connector.close()


def make_connector(store: StoreConfig, codecs: list, compute_dtype: torch.dtype, prefill_s) -> KVConnector:
    """A connector whose chain carries the compute dtype as an extra key (see the top), and
    that leaves the chunk of a prompt's last token to the (chunk-aligned) prefill."""
    compute = str(compute_dtype).removeprefix("torch.")
    config = replace(store.connector, extra_keys=(f"compute={compute}", *store.connector.extra_keys),
                     load_last_chunk=False)
    return KVConnector(store.socket_path, codecs, prefill_s, config)


def kv_descriptor(c: ModelConfig, page_tokens: int, store: StoreConfig) -> StateDescriptor:
    """The descriptor of SmolLM2 (or another GGUF Llama) KV chunk objects."""
    path = store.model_path or str(default_model_path())
    model_id = store.model_id or (DEFAULT_MODEL_ID if Path(path).name == DEFAULT_MODEL_FILE else c.name)
    return StateDescriptor(
        namespace=store.namespace, model=model_id,
        model_revision=store.model_revision or model_revision(path),
        kind="kv", dtype=store.dtype,
        layout=paged_layout(c.num_layers, page_tokens, c.num_kv_heads, c.head_dim),
        chunk_tokens=store.chunk_tokens)
