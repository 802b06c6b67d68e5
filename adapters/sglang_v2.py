"""SGLang's HiCache v2 interface (SGLang 0.5.23): the extra host pools of hybrid models.

A hybrid model's HybridCacheController registers, besides the KV pool, one host pool per
kind of extra state and moves them with `batch_exists_v2` / `batch_get_v2` /
`batch_set_v2`, one `PoolTransfer` per pool. KV itself stays on the v1 (or older flat)
path; kvstore carries these extra pools (their page plans: adapters/sglang_pages.py):

- MAMBA: one state per radix node, under the node's last page hash, in one host slot:
  its temporal (SSM) state and each conv state, one object each, keyed per TP rank.
- SWA: the sliding window's pages, another MHA (or MLA) pool of the KV page size.
- INDEXER: the DSA indexer's keys, one object per KV page, on KV's indices.
Any other pool (DeepSeek V4's, draft pools) is refused at registration.

What is atomic. Each page of each extra pool (a Mamba state's temporal and conv objects,
an SWA page's K and V, an indexer page) is one store group: committed, found and read
whole or not at all. A page's KV objects are not in that group, and the pools of one page
are not one group, because:
- SGLang's backup writes a node's extra pools (`batch_set_v2`) *before* its KV
  (`batch_set_v1`, 128-page batches), in separate calls, and a Mamba or SWA transfer
  carries no KV host indices: no single call holds both. So a Mamba state can be stored
  while its KV is not (yet, or ever, if the KV write fails).
- Which pools hold a page depends on where the page sat in the node written (Mamba: the
  node's last page only; SWA: its last window pages), and a group is named by its exact
  members, so a reader could not name a group of several pools. Mamba objects are also per
  TP rank while an MLA model's indexer and SWA pages are shared by all ranks and written
  only by the storage writer rank.
What holds instead: `batch_exists_v2` counts a prefix of P pages restorable only when the
KV objects of all P pages are held (one lookup, as `batch_exists`) and every pool's groups
that its hit policy needs are complete: ALL_PAGES (indexer) every page before P,
TRAILING_PAGES (Mamba: 1, SWA: `len(transfer.keys)` pages) the last ones before P. A page
missing in one pool is therefore a miss for the whole prefix. Between that answer and the
reads, a group can still leave the store; `batch_get_v2` then reports its page False and
SGLang drops the whole prefetch of its Mamba / SWA pools (it requires every one).

Semantics follow SGLang's own backends (HiCacheFile, Mooncake): transfers' keys in
`batch_exists_v2` are placeholders (only their number, a TRAILING pool's window, counts) and
pools are tested against the KV keys; results are keyed by `transfer.name`, one bool per
key, and only their leading run of True counts (a page after a pool's first failed one is
reported False). A transfer's page groups are read in one round trip and written in two (batched
get_group / commit_group requests).

Never raises into SGLang: the backend calls these through its guard, and a daemon that is
down is a miss or a failed write (adapters.common.SafeStore). SGLang's types are imported
where they are used: importing this module needs neither SGLang nor torch.
"""

from __future__ import annotations

from kvstore.adapters.common import SafeStore
from kvstore.adapters.sglang_pages import PagePlan


def _leading(done: list[bool]) -> list[bool]:
    """A pool's pages as SGLang counts them: only the leading run of True (a page after the
    first failed one is reported False, even where it was read or stored)."""
    run = next((i for i, ok in enumerate(done) if not ok), len(done))
    return [True] * run + [False] * (len(done) - run)


def restorable_prefixes(policy, window: int, present: list[bool]) -> set[int]:
    """The prefix lengths (in pages, 1..len(present)) one pool can restore, given which of
    the KV hit's pages it holds: ALL_PAGES needs every page before the prefix's end,
    TRAILING_PAGES only the last `window` of them."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy

    if policy == PoolHitPolicy.ALL_PAGES:
        boundary = next((i for i, ok in enumerate(present) if not ok), len(present))
        return set(range(1, boundary + 1))
    if policy == PoolHitPolicy.TRAILING_PAGES:
        return {end for end in range(1, len(present) + 1) if all(present[max(0, end - window):end])}
    raise ValueError(f"kvstore: hit policy {policy} is not supported")


class SidecarPools:
    """The extra host pools of one backend, by PoolName value, and their page plans.
    Registered while SGLang attaches the backend (a sidecar added later arrives the same
    way); read from SGLang's prefetch and backup threads at once."""

    def __init__(self, store: SafeStore):
        self.store = store
        self._pools: dict[str, tuple[object, PagePlan]] = {}

    def register(self, name, pool, plan: PagePlan) -> None:
        self._pools[str(name)] = (pool, plan)

    def plan(self, name) -> PagePlan:
        """The page plan of registered pool `name` (KeyError if none)."""
        return self._pools[str(name)][1]

    def exists(self, keys: list[str], transfers, kv_pages: int) -> PoolTransferResult:
        """SGLang's batch_exists_v2 once the leading `kv_pages` of `keys` are known to have
        their KV: every pool's groups of those pages in one lookup."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        transfers = list(transfers or ())
        if not restorable or not transfers:
            return PoolTransferResult(kv_pages, hits, restorable)
        plans = [self.plan(t.name) for t in transfers]
        found = self.store.lookup_groups([plan.members(key) for plan in plans for key in keys[:kv_pages]])
        for i, transfer in enumerate(transfers):
            if not restorable:  # as SGLang's backends: a pool after the prefix is gone gets no verdict
                break
            window = max(1, len(transfer.keys or ()))
            prefixes = restorable_prefixes(transfer.hit_policy, window, found[i * kv_pages:(i + 1) * kv_pages])
            if prefixes:
                hits[transfer.name] = max(prefixes)
            restorable = [p for p in restorable if p in prefixes]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def get(self, transfers) -> dict:
        """SGLang's batch_get_v2: each key's page read whole into the transfer's host
        indices, or not at all; after a pool's first miss its later pages are False."""
        results = {}
        for transfer in transfers:
            plan, pages = self._pages(transfer)
            results[transfer.name] = _leading(self.store.get_groups_into([(plan.members(key), views)
                                                                          for key, views in pages]))
        return results

    def set(self, transfers) -> dict:
        """SGLang's batch_set_v2: each key's page stored as one group; a page the store
        holds already is not copied again. After a pool's first failure its later pages are
        False."""
        results = {}
        for transfer in transfers:
            plan, pages = self._pages(transfer)
            results[transfer.name] = _leading(self.store.put_groups(
                [[(oid, view, desc) for oid, view, desc in zip(plan.part_ids(key), views, plan.part_descs)]
                 for key, views in pages]))
        return results

    def _pages(self, transfer) -> tuple[PagePlan, list]:
        """(plan, [(key, views of its parts in the host pool)]) of a transfer. Raises
        KeyError for a pool never registered, ValueError when the host indices are not one
        page (`pool.page_size` indices) per key."""
        pool, plan = self._pools[str(transfer.name)]
        keys, indices = list(transfer.keys or ()), transfer.host_indices
        if indices is None or indices.numel() != len(keys) * pool.page_size:
            raise ValueError(f"{transfer.name}: {len(keys)} keys but "
                             f"{0 if indices is None else indices.numel()} host indices "
                             f"(expected {pool.page_size} per key)")
        views = plan.views(len(keys), *pool.get_page_buffer_meta(indices)) if keys else []
        return plan, list(zip(keys, views))
