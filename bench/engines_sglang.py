"""bench/engines.py's SGLang part (run in SGLang's environment): HiCache pages stored and
loaded per second through adapters/sglang.py, against a memcpy of the same bytes.

The backend is made as SGLang's cache controller makes it (StorageBackendFactory, backend
"dynamic", interface_v1) over SGLang's own MHATokenToKVPoolHost on CPU, with a model's
geometry: 24 layers, pages of 64 tokens, 8 KV heads x 128, bf16 (6 MiB a page).

    sglang batch_set_v1 [layer_first]   a batch of pages from the host pool into the store
    sglang batch_get_v1 [layer_first]   the same pages back into other host pool pages
    baseline (memcpy)                   np.copyto of the same page parts (one per K / V in
                                        page_first, one per layer and K / V in layer_first)
                                        into / out of one staging buffer

Each timed set stores fresh page keys (a put of a held id copies nothing); what a case stored
is deleted after it, so the rounds fit the bench daemon's 1 GiB arena. The pages the last get
wrote are checked bit-exact against their sources before a row counts.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from bench.common import Row
from bench.engines import _timed

LAYERS, PAGE, HEADS, HEAD_DIM = 24, 64, 8, 128
HELPERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "adapters", "sglang")


def bench(socket_path: str, quick: bool, suite: str) -> list[Row]:
    pages, reps = (8, 3) if quick else (16, 5)
    rows = []
    for layout, label in (("page_first", ""), ("layer_first", " layer_first")):
        rows += _bench_layout(socket_path, layout, label, pages, reps, suite)
    return rows


def _bench_layout(socket_path: str, layout: str, label: str, pages: int, reps: int, suite: str) -> list[Row]:
    if HELPERS not in sys.path:
        sys.path.insert(0, HELPERS)
    import torch
    from sglang_helpers import create_backend, make_pool, page_bytes, page_keys, token_indices

    from kvstore.adapters.sglang_pages import host_view

    # the host pool holds 2 x device_tokens (+ a padding page): sources, then targets
    pool = make_pool("mha", layout, layers=LAYERS, page=PAGE, heads=HEADS, head_dim=HEAD_DIM,
                     device_tokens=pages * PAGE)
    backend = create_backend(pool, "mha", socket_path, timeout_s=60)
    source, target = list(range(pages)), list(range(pages, 2 * pages))
    src_idx, dst_idx = token_indices(source, PAGE), token_indices(target, PAGE)
    seeds = iter(range(1 << 30))
    stored = []

    def set_once():
        keys = page_keys(pages, seed=next(seeds))
        if backend.batch_set_v1(keys, src_idx) != [True] * pages:
            raise RuntimeError(f"bench: an sglang {layout} page store failed")
        stored.append(keys)
        return keys

    def views(indices):
        ptrs, sizes = pool.get_page_buffer_meta(indices)
        return [host_view(p, n) for p, n in zip(ptrs, sizes)]

    src_views, dst_views = views(src_idx), views(dst_idx)
    staging = np.empty(sum(v.nbytes for v in src_views), np.uint8)
    slots, at = [], 0
    for v in src_views:
        slots.append(staging[at:at + v.nbytes])
        at += v.nbytes

    def plain_set():
        for slot, view in zip(slots, src_views):
            np.copyto(slot, view)

    def plain_get():
        for slot, view in zip(slots, dst_views):
            np.copyto(view, slot)

    ours = _timed(set_once, reps)
    base = _timed(plain_set, reps)
    rows = [Row(suite, f"sglang batch_set_v1{label}", "throughput", "pages/s", pages / ours, "memcpy", pages / base)]
    _forget(backend, stored)
    keys = set_once()

    def get_once():
        if backend.batch_get_v1(keys, dst_idx) != [True] * pages:
            raise RuntimeError(f"bench: an sglang {layout} page load missed")

    ours = _timed(get_once, reps)
    base = _timed(plain_get, reps)
    rows.append(Row(suite, f"sglang batch_get_v1{label}", "throughput", "pages/s", pages / ours, "memcpy",
                    pages / base))
    for view in dst_views:  # the baseline wrote the right bytes too: blank them, load once more
        view.fill(0)
    get_once()
    for s, t in zip(source, target):  # the bench's loads must be right to count
        if not torch.equal(page_bytes(pool, t), page_bytes(pool, s)):
            raise RuntimeError(f"bench: sglang {layout} page {s} loaded wrong")
    if backend.stats()["num_failures"] or backend.num_errors:
        raise RuntimeError(f"bench: sglang {layout} backend counted failures: {backend.stats()}")
    _forget(backend, stored)
    backend.close()
    return rows


def _forget(backend, stored: list) -> None:
    """Delete every page part the rounds stored, so the next case starts with an empty arena."""
    ids = [oid for keys in stored for key in keys for oid in backend.plan.part_ids(key)]
    backend.store.delete(ids)
    stored.clear()
