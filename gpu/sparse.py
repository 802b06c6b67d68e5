"""Quest-style sparse page selection (reference), and the selection metadata it produces.

1. Summaries. When a page fills, keep per layer, page, kv head and channel the min and max of
   its keys: `summaries` [layers, pages, 2, kv_heads, head_dim] fp32 ([:, :, 0] min, [:, :, 1]
   max), indexed by the engine's page id. Partial pages have no summary; the engine always
   attends to its current page and leaves it out of scoring.
2. Scores. For a query q and a page, sum over query heads h and channels c of
   max(q[h,c] * min[g(h),c], q[h,c] * max[g(h),c]), g(h) = h // (q_heads / kv_heads) (GQA):
   an upper bound of q.k over the page's keys, summed over the heads that share the page.
   Requests are ragged (varlen): `page_table` is the concatenation of each request's page ids in
   sequence order, `cu_pages` [requests + 1] the offsets into it.
3. Top-k. Per request, the `top_k` pages with the highest scores (all of them when it has fewer;
   NaN scores rank last). A `Selection` names pages by their *position* in the request's
   sequence (page index i covers tokens [i * page_tokens, (i + 1) * page_tokens)), which is what
   the client maps to (chunk, layer, block) ranged reads. Warm start: given the previous step's
   selection for the same (request, layer), `new_page_ids` are the selected pages it lacked:
   the prefetch set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvstore.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Selection:
    """Pages one request attends to at one layer in one decode step.

    page_ids: ascending page indices within the request's sequence.
    new_page_ids: the subset absent from the previous step's selection (all of page_ids
    without a previous selection): what must be prefetched.
    """

    request: int
    layer: int
    step: int
    page_ids: tuple[int, ...]
    new_page_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("request", "layer", "step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"Selection.{name} must be an integer >= 0, got {value!r}")
        if any(b <= a for a, b in zip(self.page_ids, self.page_ids[1:])) or any(p < 0 for p in self.page_ids):
            raise InvalidArgument(f"Selection.page_ids must be ascending, distinct, >= 0: {self.page_ids}")
        if not set(self.new_page_ids) <= set(self.page_ids):
            raise InvalidArgument("Selection.new_page_ids must be a subset of page_ids")

    def chunk_blocks(self, blocks_per_chunk: int, only_new: bool = True) -> dict[int, list[tuple[int, int]]]:
        """{chunk index: [(layer, block), ...]} to read; feed each list to `Layout.ranges`."""
        if blocks_per_chunk <= 0:
            raise InvalidArgument(f"blocks_per_chunk must be > 0, got {blocks_per_chunk}")
        out: dict[int, list[tuple[int, int]]] = {}
        for page in self.new_page_ids if only_new else self.page_ids:
            out.setdefault(page // blocks_per_chunk, []).append((self.layer, page % blocks_per_chunk))
        return out


def check_ragged(page_table: torch.Tensor, cu_pages: torch.Tensor, num_requests: int) -> None:
    if cu_pages.dim() != 1 or cu_pages.numel() != num_requests + 1:
        raise InvalidArgument(f"cu_pages must have {num_requests + 1} offsets, got {tuple(cu_pages.shape)}")
    if page_table.dim() != 1 or int(cu_pages[-1]) != page_table.numel() or int(cu_pages[0]) != 0:
        raise InvalidArgument("cu_pages must start at 0 and end at len(page_table)")
    if bool((cu_pages[1:] < cu_pages[:-1]).any()):
        raise InvalidArgument("cu_pages must be non-decreasing")


def page_summaries(k_cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """Min/max keys of full pages: k_cache [layers, pages, page_tokens, kv_heads, head_dim],
    page_ids [n] -> new fp32 [layers, n, 2, kv_heads, head_dim]. Store them with
    `summaries[:, page_ids] = ...` (or call `update_summaries`)."""
    keys = k_cache[:, page_ids.long()].float()  # [L, n, T, H, D]
    return torch.stack([keys.amin(dim=2), keys.amax(dim=2)], dim=2)


def update_summaries(k_cache: torch.Tensor, summaries: torch.Tensor, page_ids: torch.Tensor) -> None:
    """Write the summaries of the pages in `page_ids` (pages that just filled) in place."""
    summaries[:, page_ids.long()] = page_summaries(k_cache, page_ids)


def score_pages(queries: torch.Tensor, summaries: torch.Tensor, page_table: torch.Tensor,
                cu_pages: torch.Tensor) -> torch.Tensor:
    """Scores [total pages] fp32 for one layer: queries [requests, q_heads, head_dim],
    summaries [pages, 2, kv_heads, head_dim] (one layer of the summary tensor)."""
    check_ragged(page_table, cu_pages, queries.shape[0])
    q_heads, kv_heads = queries.shape[1], summaries.shape[2]
    if q_heads % kv_heads:
        raise InvalidArgument(f"{q_heads} query heads do not group over {kv_heads} kv heads")
    counts = (cu_pages[1:] - cu_pages[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(queries.shape[0], device=queries.device), counts)
    q = queries.float()[owner]  # [P, QH, D]
    s = summaries[page_table.long()].repeat_interleave(q_heads // kv_heads, dim=2)  # [P, 2, QH, D]
    return torch.maximum(q * s[:, 0], q * s[:, 1]).sum(dim=(1, 2))


def select_top_k(
    scores: torch.Tensor,
    cu_pages: torch.Tensor,
    top_k: int,
    *,
    layer: int,
    step: int,
    requests: Sequence[int] | None = None,
    previous: Sequence[Selection | None] | None = None,
) -> list[Selection]:
    """Top-k pages per request from ragged scores; one torch.topk over a padded [R, max] view.

    requests: the request ids (default 0..R-1). previous: per request, the Selection of an
    earlier step for the same request and layer (or None), for warm start.
    """
    if top_k <= 0:
        raise InvalidArgument(f"top_k must be > 0, got {top_k}")
    num = cu_pages.numel() - 1
    requests = list(range(num)) if requests is None else list(requests)
    previous = [None] * num if previous is None else list(previous)
    if len(requests) != num or len(previous) != num:
        raise InvalidArgument(f"requests and previous must have one entry per request ({num})")
    counts = (cu_pages[1:] - cu_pages[:-1]).long()
    width = int(counts.max()) if num else 0
    padded = torch.full((num, max(width, 1)), float("-inf"), device=scores.device)
    row = torch.repeat_interleave(torch.arange(num, device=scores.device), counts)
    col = torch.arange(scores.numel(), device=scores.device) - cu_pages.long()[row]
    # NaN (and -inf) pages rank after every real score but before the padding
    lowest = torch.finfo(torch.float32).min
    padded[row, col] = torch.nan_to_num(scores.float(), nan=lowest, neginf=lowest)
    k = min(top_k, max(width, 1))
    order = padded.topk(k, dim=1).indices
    keep = order < counts[:, None]
    chosen = [sorted(order[i][keep[i]].tolist()) for i in range(num)]
    out = []
    for i, pages in enumerate(chosen):
        prev = previous[i]
        if prev is not None and (prev.request != requests[i] or prev.layer != layer or prev.step >= step):
            raise InvalidArgument(f"previous selection {prev} is not an earlier step of request "
                                  f"{requests[i]} at layer {layer}")
        old = set(prev.page_ids) if prev is not None else set()
        out.append(Selection(requests[i], layer, step, tuple(pages), tuple(p for p in pages if p not in old)))
    return out
