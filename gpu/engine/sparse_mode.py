"""Quest-style sparse decode on the real model, with pages fetched from the store by selection.

On one request:

1. Dense prefill of the prompt, in chunk-aligned pieces (`chunked.prefill`, the one chunk
   computation every path of the engine shares, so chunks stored by `StoreEngine` are the
   bytes this prefill computes), keeping each layer's K/V and the last token's query. Its
   full chunks go to the store; the simulated device then forgets them. The first token
   comes from the dense logits.
2. Each decode step, each layer: every full page is scored against its min/max key summary and
   the top-k pages are selected (`gpu.sparse`); attention covers those pages plus the current
   partial page. A selected page of a stored chunk must be resident on the device (an LRU of
   `resident_pages` per layer); a missing one is fetched while the step waits (stall), by a
   ranged read of its chunk object. Pages after the last stored chunk (the prompt's partial
   chunk and the generated tokens) are local and always resident.
3. Warm start: the prefill's last query makes the first selection, prefetched before step 1;
   after each step its selection stays resident, plus the `prefetch_extra` next-best pages by
   that step's scores.

Measured per run: prefetch recall (selected stored pages already resident when the step ran),
bytes moved per step (stall + prefetch) against full prefetch (every stored page of every
layer, what a store that restores the whole cache moves), stall time per step, and agreement
with dense attention (`dense_agreement`). With every page resident (`ResidentPages`) the
same decode is the reference: store prefetch must not change a token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstore.gpu.sparse import score_pages, select_top_k
from kvstore.errors import InvalidArgument
from kvstore.identity import DEFAULT_CHUNK_TOKENS

from . import chunked
from .model import LlamaModel
from .sparse_pages import ResidentPages


@dataclass(frozen=True, slots=True)
class SparseConfig:
    top_k: int  # full pages attended per layer per step (the partial page comes on top)
    resident_pages: int  # per layer: fetched pages the simulated device keeps
    prefetch_extra: int = 0  # after a step, also fetch this many next-best pages per layer

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.prefetch_extra < 0 or self.resident_pages < self.top_k + self.prefetch_extra:
            raise InvalidArgument("SparseConfig needs top_k >= 1, prefetch_extra >= 0 and "
                                  "resident_pages >= top_k + prefetch_extra")


@dataclass(frozen=True, slots=True)
class Prefill:
    kv: torch.Tensor  # [layers, 2, prompt tokens, kv_heads, head_dim]
    last_q: torch.Tensor  # [layers, heads, head_dim], RoPE applied
    first_token: int


@dataclass(frozen=True, slots=True)
class SparseRun:
    token_ids: list[int]  # generated; the first from the dense prefill
    num_steps: int  # sparse decode steps (len(token_ids) - 1)
    recall: float
    bytes_per_step: float  # fetched while stalled + prefetched, per step
    full_bytes_per_step: float  # every stored page of every layer
    selected_bytes_per_step: float  # the selected stored pages (no warm start)
    stall_s_per_step: float
    prefetch_s_per_step: float
    num_fallbacks: int  # store failures that made the source recompute the prompt's KV


class SparseDecoder:
    def __init__(self, model: LlamaModel, config: SparseConfig, page_tokens: int = 16,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        if chunk_tokens % page_tokens:
            raise InvalidArgument("chunk_tokens must be a multiple of page_tokens")
        self.model, self.config = model, config
        self.page_tokens, self.chunk_tokens = page_tokens, chunk_tokens

    def prefill(self, prompt: list[int]) -> Prefill:
        done = chunked.prefill(self.model, prompt, self.chunk_tokens, self.page_tokens)
        return Prefill(done.kv, done.last_q, int(done.logits.argmax()))

    @torch.inference_mode()
    def decode(self, prompt: list[int], prefill: Prefill, source, max_new_tokens: int) -> SparseRun:
        c, pt, cfg, dev = self.model.config, self.page_tokens, self.config, self.model.device
        num_layers, t0 = c.num_layers, len(prompt)
        stored = (t0 // self.chunk_tokens) * (self.chunk_tokens // pt)  # pages in stored chunks
        local_start = stored * pt
        shape = (num_layers, t0 + max_new_tokens - local_start, c.num_kv_heads, c.head_dim)
        tail = [prefill.kv.new_zeros(shape), prefill.kv.new_zeros(shape)]  # local K, V
        for i in (0, 1):
            tail[i][:, :t0 - local_start] = prefill.kv[:, i, local_start:]
        summaries = torch.zeros(num_layers, (t0 + max_new_tokens) // pt + 1, 2, c.num_kv_heads, c.head_dim,
                                device=dev)
        pages = prefill.kv[:, 0, :t0 // pt * pt].unflatten(1, (t0 // pt, pt)).float()
        summaries[:, :t0 // pt] = torch.stack([pages.amin(2), pages.amax(2)], dim=2)
        budget = cfg.resident_pages if not source.all_resident else stored
        resident = [OrderedDict() for _ in range(num_layers)]
        if source.all_resident:
            for layer in range(num_layers):
                resident[layer].update(zip(range(stored), source.fetch(layer, list(range(stored)))))
        m = {"selected": 0, "hits": 0, "bytes": 0, "stall_s": 0.0, "prefetch_s": 0.0}
        prev, scores = [None] * num_layers, [None] * num_layers

        def fetch(layer: int, wanted, keep, timer: str) -> None:
            missing = [p for p in wanted if p < stored and p not in resident[layer]]
            if missing:
                started = time.perf_counter()
                resident[layer].update(zip(missing, source.fetch(layer, missing).to(dev)))
                m[timer] += time.perf_counter() - started
                m["bytes"] += len(missing) * source.page_bytes
            for p in keep:
                if p in resident[layer]:
                    resident[layer].move_to_end(p)
            while len(resident[layer]) > budget:  # least recently used first; kept pages are last
                resident[layer].popitem(last=False)

        def select(layer: int, q: torch.Tensor, num_full: int, step: int):
            cu = torch.tensor([0, num_full], device=dev)
            s = score_pages(q[None].float(), summaries[layer, :num_full], torch.arange(num_full, device=dev), cu)
            scores[layer] = s
            sel = select_top_k(s, cu, cfg.top_k, layer=layer, step=step, previous=[prev[layer]])[0]
            prev[layer] = sel
            return sel

        def prefetch_next() -> None:
            for layer in range(num_layers):
                best = scores[layer].topk(min(cfg.top_k + cfg.prefetch_extra, scores[layer].numel())).indices
                fetch(layer, sorted(best.tolist()), prev[layer].page_ids, "prefetch_s")

        for layer in range(num_layers):  # warm start from the prefill's last query
            select(layer, prefill.last_q[layer], (t0 - 1) // pt, 0)
        prefetch_next()
        tokens = [prefill.first_token]
        for step in range(1, max_new_tokens):
            pos = t0 + step - 1

            def attention(layer, q, k, v):
                tail[0][layer, pos - local_start], tail[1][layer, pos - local_start] = k[0], v[0]
                sel = select(layer, q[0], pos // pt, step)
                chosen = [p for p in sel.page_ids if p < stored]
                m["selected"] += len(chosen)
                m["hits"] += sum(p in resident[layer] for p in chosen)
                fetch(layer, chosen, chosen, "stall_s")
                ks, vs = [], []
                for p in sel.page_ids:
                    if p < stored:
                        ks.append(resident[layer][p][0]), vs.append(resident[layer][p][1])
                    else:
                        span = slice(p * pt - local_start, (p + 1) * pt - local_start)
                        ks.append(tail[0][layer, span]), vs.append(tail[1][layer, span])
                span = slice(pos // pt * pt - local_start, pos + 1 - local_start)
                key, value = torch.cat(ks + [tail[0][layer, span]]), torch.cat(vs + [tail[1][layer, span]])
                out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], key.transpose(0, 1)[None],
                                                     value.transpose(0, 1)[None], enable_gqa=True)
                return out[0].transpose(0, 1)

            hidden = self.model._layers(torch.tensor([tokens[-1]], device=self.model.device),
                                        torch.tensor([pos], device=self.model.device), attention)
            tokens.append(int(self.model.logits(hidden[-1]).argmax()))
            if (pos + 1) % pt == 0:  # the page filled: it gets a summary and becomes selectable
                full = tail[0][:, pos + 1 - pt - local_start:pos + 1 - local_start].float()
                summaries[:, pos // pt] = torch.stack([full.amin(1), full.amax(1)], dim=1)
            if step < max_new_tokens - 1:
                prefetch_next()
        steps = max(1, max_new_tokens - 1)
        return SparseRun(tokens, max_new_tokens - 1, m["hits"] / max(1, m["selected"]),
                         m["bytes"] / steps, stored * num_layers * source.page_bytes,
                         m["selected"] * source.page_bytes / steps, m["stall_s"] / steps,
                         m["prefetch_s"] / steps, getattr(source, "num_fallbacks", 0))

    def run(self, prompt: list[int], max_new_tokens: int, connector=None, codec=None,
            request_id=0, reader=None) -> SparseRun:
        """Prefill, save the prompt's chunks through `connector` (whose first codec must read
        `codec.engine.kv`: see `PrefillKV`), and decode from the store, reading pages through
        `reader` if given (another node's connector: a decode node) else `connector`; without
        a connector, decode with every page resident (the reference)."""
        prefill = self.prefill(prompt)
        if connector is None:
            return self.decode(prompt, prefill, ResidentPages(prefill.kv, self.page_tokens), max_new_tokens)
        from .sparse_pages import StorePages
        codec.engine.kv = prefill.kv
        connector.save_kv(request_id, prompt, len(prompt))
        connector.wait_for_save()
        reader = reader or connector
        source = StorePages(reader, codec, request_id, prompt, lambda: self.prefill(prompt).kv)
        try:
            return self.decode(prompt, prefill, source, max_new_tokens)
        finally:
            codec.engine.kv = None  # the device forgets the prompt
            for conn in {id(c): c for c in (connector, reader)}.values():
                conn.request_finished(request_id, prompt, 0)


class PrefillKV:
    """What a connector's codec exports from during `SparseDecoder.run`: the prefill's KV."""

    kv: torch.Tensor | None = None

    def export_kv(self, request_id, start: int, end: int) -> torch.Tensor:
        return self.kv[:, :, start:end]


def connect(model: LlamaModel, store, page_tokens: int = 16):
    """(connector, codec) for `SparseDecoder.run` with a `store_engine.StoreConfig`."""
    from .store_codecs import PagedKVCodec
    from .store_engine import kv_descriptor, make_connector
    codec = PagedKVCodec(PrefillKV(), kv_descriptor(model.config, page_tokens, store), model.dtype)
    return make_connector(store, [codec], model.dtype, lambda tokens: tokens / 500.0), codec


@torch.inference_mode()
def dense_agreement(model: LlamaModel, prompt: list[int], tokens: list[int]) -> float:
    """Teacher-forced: the fraction of sparse steps whose token dense attention also picks."""
    if len(tokens) < 2:
        return 1.0
    logits = model.forward_nocache(prompt + tokens[:-1])[len(prompt):]
    return float((logits.argmax(-1).cpu() == torch.tensor(tokens[1:])).float().mean())
