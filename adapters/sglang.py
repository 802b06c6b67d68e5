"""kvstore as SGLang's HiCache storage backend (SGLang 0.5.23), loaded by SGLang's own factory
(`StorageBackendFactory`, backend "dynamic"):

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
            "module_path": "kvstore.adapters.sglang", "class_name": "KVStoreHiCacheStorage",
            "interface_v1": 1, "socket_path": "/run/kvstore/kvstore.sock"}'

With `interface_v1` SGLang calls `batch_set_v1` / `batch_get_v1` with page hashes and host
pool indices: each page's parts move straight between the host pool's memory and the store
(see adapters.sglang_pages). `batch_exists` is one lookup of every part of every page and
answers how many leading pages are held whole. Without `interface_v1` SGLang copies each page
into a flat tensor and calls the older `batch_set` / `batch_get` / `set` / `get` / `exists`;
those store one object per flat page, apart from the v1 parts (the two modes share nothing).

Hybrid models (SGLang's v2 interface, adapters.sglang_v2): KV stays on the path above;
`register_mem_host_pool_v2` gives the MAMBA, SWA and DSA INDEXER pools their own page
plans, and `batch_exists_v2` / `batch_get_v2` / `batch_set_v2` carry them, each page of
each such pool one store group (all or nothing). A page's KV and its extra pools are not
one group (SGLang writes them in separate calls, the extra pools first); a prefix is a hit
only when its KV and every pool's groups are held. Any other pool (DeepSeek V4's, draft
pools) is refused when it is registered: the attach fails with a message naming it.

Heterogeneous TP (`tp_lcm_size` in the extra config: SGLang then splits the heads of MHA
pages in its page_head layout): a rank of TP size T stores each page as the tp_lcm_size/T
head slices it holds, each under the ids a rank of TP size tp_lcm_size gives its own page
(adapters.sglang_pages.plan_for), so ranks of any TP size that divides tp_lcm_size (all in
page_head) read each other's pages. Only the KV pool is split (as in SGLang's Mooncake
backend): the extra pools of hybrid models stay per TP size. Needs `interface_v1`.

KV events: every KV page object is put with a route naming the page as SGLang's own KV
events do (mem_cache/events.py `KVCacheEventRecorder.record_store`): `hash_str_to_int64` of
its page hash, the key SGLang passes (the first 16 hex digits as a signed 64-bit integer),
block_size the page's tokens, and the page before it as parent (SGLang passes a call's keys
as one chain after `prefix_keys`; a call's first page has none without them). No token ids: a
storage backend is not given them. That is SGLang's event hash for a request without a
namespace (no LoRA `extra_key`, no `cache_salt`); with one, SGLang's event chain is seeded
and namespaced otherwise than its storage chain, from what a storage backend is never
given (the tokens, the namespace), so those pages are named by the storage chain's hash
and a router must match on that. The extra pools of hybrid models (Mamba, SWA, indexer)
are put without one: SGLang's events name KV pages only.

No connection is made in the constructor, and no data-path call raises: a daemon that is
down, restarted, slow or full is a miss or a failed write (`adapters.common.SafeStore`), so
SGLang recomputes. Extra config keys besides SGLang's own: `socket_path` (default
$KVSTORE_SOCKET, then the daemon's default), `namespace`, `timeout_s`, `retry_after_s`,
`model_revision` (default "main"), `model` (only when SGLang passes no model name),
`kv_cache_dtype` (only for pools that keep fp8 as bytes).

SGLang (and torch) are imported only when SGLang's factory asks this module for
`KVStoreHiCacheStorage`.
"""

from __future__ import annotations

import logging

from kvstore.route import Route
from kvstore.adapters.common import SafeStore, StoreConfig, lazy_classes
from kvstore.adapters.sglang_pages import PagePlan, plan_for, sidecar_plan

log = logging.getLogger("kvstore.adapters.sglang")


def _build_classes(name: str) -> dict | None:
    """SGLang's factory does getattr(module, "KVStoreHiCacheStorage"): build the class then."""
    return {name: _build_class()} if name == "KVStoreHiCacheStorage" else None


def _build_class():
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolName, PoolTransferResult
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    from kvstore.adapters.sglang_v2 import SidecarPools

    class KVStoreHiCacheStorage(HiCacheStorage):
        """See the module docstring. SGLang calls it from its prefetch and backup threads at
        once: the store handle is thread-safe, and nothing else here changes after the
        pools are registered."""

        def __init__(self, storage_config, kwargs=None):
            extra = dict(storage_config.extra_config or {})
            self.interface_v1 = bool(extra.get("interface_v1", 0))
            # SGLang sets should_split_heads for MHA in page_head with tp_lcm_size > tp_size.
            self.split_factor = storage_config.tp_lcm_size // storage_config.tp_size \
                if storage_config.should_split_heads else 1
            if self.split_factor > 1 and not self.interface_v1:
                raise ValueError('kvstore: "tp_lcm_size" (heterogeneous-TP head splitting) needs "interface_v1": 1 '
                                 "in --hicache-storage-backend-extra-config")
            self.storage_config = storage_config
            self.extra = extra
            self.store = SafeStore(StoreConfig.from_mapping(extra))
            self.mem_pool_host = None
            self.plan: PagePlan | None = None
            self.sidecars = SidecarPools(self.store)
            self.num_errors = 0
            if not self.interface_v1:
                log.warning('kvstore: "interface_v1" is not set: SGLang copies every page through a flat '
                            'tensor; add "interface_v1": 1 to the extra config for direct page moves')

        def register_mem_pool_host(self, mem_pool_host):
            """Raises ValueError when the pool cannot be described (the attach then fails)."""
            super().register_mem_pool_host(mem_pool_host)
            self.plan = plan_for(mem_pool_host, self.storage_config, self.store.config.namespace, self.extra,
                                 split_factor=self.split_factor)
            log.info("kvstore HiCache backend: %s, %d part(s) per page of %d tokens (%s)", self.plan.engine,
                     self.plan.num_parts, self.plan.page_tokens, self.plan.part_descs[0])

        def register_mem_host_pool_v2(self, host_pool, host_pool_name):
            """KV stays on the v1 / older path (register_mem_pool_host); a hybrid model's
            MAMBA, SWA and INDEXER pools get their own page plans (adapters.sglang_v2).
            Raises ValueError for any other pool, or one that cannot be described."""
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            if host_pool_name == PoolName.KV:
                return
            if self.plan is None:
                raise ValueError(f"kvstore: SGLang registered its {host_pool_name} pool before the KV pool")
            plan = sidecar_plan(host_pool, host_pool_name, self.storage_config, self.store.config.namespace,
                                self.extra, self.plan.page_tokens)
            self.sidecars.register(host_pool_name, host_pool, plan)
            log.info("kvstore HiCache backend: %s pool, %d part(s) per page (%s)", host_pool_name,
                     plan.num_parts, ", ".join(f"{d.kind.value} {d.dtype.value}" for d in plan.part_descs))

        # --- v2: hybrid models' extra pools (adapters.sglang_v2) ----------------------------

        def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
            """The prefixes every pool can restore (a PoolTransferResult), from one KV
            lookup and one group lookup."""
            return self._guard("batch_exists_v2", PoolTransferResult(0, {}, []), self._exists_v2, keys,
                               pool_transfers)

        def batch_get_v2(self, transfers, extra_info=None) -> dict:
            """Per transfer's pool, which pages were read whole into its host indices."""
            return self._guard("batch_get_v2", _failed(transfers), self.sidecars.get, transfers)

        def batch_set_v2(self, transfers, extra_info=None) -> dict:
            """Per transfer's pool, which pages the store now holds whole."""
            return self._guard("batch_set_v2", _failed(transfers), self.sidecars.set, transfers)

        def _exists_v2(self, keys, transfers):
            return self.sidecars.exists(keys, transfers, self._leading_pages(keys))

        # --- v1: pages straight from and into the host pool ---------------------------------

        def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
            """Store each page's parts; per page, True when the store holds all of them."""
            return self._guard("batch_set_v1", [False] * len(keys), self._set_pages, keys, host_indices,
                               getattr(extra_info, "prefix_keys", None))

        def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
            """Load pages into the host pool; SGLang uses the leading run of True, so the
            first page that misses ends the batch (later pages report False)."""
            return self._guard("batch_get_v1", [False] * len(keys), self._get_pages, keys, host_indices)

        def batch_exists(self, keys, extra_info=None) -> int:
            """How many leading pages the store holds whole, from one lookup."""
            return self._guard("batch_exists", 0, self._leading_pages, keys)

        def _parts(self, keys, host_indices):
            """Per page: (object ids, views of the pool's memory) of its parts."""
            pool = self.mem_pool_host
            meta = pool.get_split_heads_page_buffer_meta(host_indices, self.split_factor) if self.split_factor > 1 \
                else pool.get_page_buffer_meta(host_indices)
            views = self.plan.views(len(keys), *meta)
            return [(self.plan.part_ids(key), page) for key, page in zip(keys, views)]

        def _routes(self, keys, prefix_keys=None) -> list:
            """Per page, SGLang's name for it in its KV events (mem_cache/events.py): the event
            hash of its page hash string (hash_str_to_int64), and its parent's: the key
            before it (SGLang: prefix_keys + keys is one contiguous chain), None where the
            call does not say (no prefix_keys) or the chain starts. None for a key that is no
            page hash."""
            routes = []
            for key, parent in zip(keys, [(prefix_keys or [None])[-1], *keys[:-1]]):
                try:
                    routes.append(Route(block_hashes=[hash_str_to_int64(key)], block_size=self.plan.page_tokens,
                                        parent_block_hash=None if parent is None else hash_str_to_int64(parent)).pack())
                except (TypeError, ValueError):
                    routes.append(None)
            return routes

        def _set_pages(self, keys, host_indices, prefix_keys=None):
            pages = self._parts(keys, host_indices)
            routes = self._routes(keys, prefix_keys)  # every part of a page: the page's name
            held = [True] * len(pages)
            for desc, part_indices in self.plan.groups:
                items = [(ids[j], views[j]) for ids, views in pages for j in part_indices]
                stored = self.store.put_many(items, desc, [route for route in routes for _ in part_indices])
                for k, ok in enumerate(stored):
                    held[k // len(part_indices)] &= ok
            return held

        def _get_pages(self, keys, host_indices):
            """Every part of every page in one pipelined call; the leading run of whole pages."""
            pages = self._parts(keys, host_indices)
            got = self.store.get_many_into([(oid, view) for ids, views in pages for oid, view in zip(ids, views)])
            whole = self.plan.leading_pages(got, self.plan.num_parts)
            return [i < whole for i in range(len(keys))]

        def _leading_pages(self, keys):
            if self.interface_v1:
                ids = [oid for key in keys for oid in self.plan.part_ids(key)]
                return self.plan.leading_pages(self.store.contains(ids), self.plan.num_parts)
            return self.plan.leading_pages(self.store.contains([self.plan.page_id(k) for k in keys]), 1)

        # --- the older interface: whole flat pages, copied by SGLang ------------------------

        def get(self, key, target_location=None, target_sizes=None):
            """The page read into `target_location` (a flat page tensor; a new one if None),
            or None on a miss."""
            return self._guard("get", None, self._get_flat, key, target_location)

        def batch_get(self, keys, target_locations=None, target_sizes=None):
            """Pages or None, as `get`; after the first miss the rest are None (SGLang stops there)."""
            locations = list(target_locations or [None] * len(keys))
            pages = [None] * len(keys)
            for i, (key, location) in enumerate(zip(keys, locations)):
                pages[i] = self.get(key, location)
                if pages[i] is None:
                    break
            return pages

        def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
            return self.batch_set([key], [value])

        def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
            """Store flat pages (CPU tensors); True when the store holds all of them."""
            return self._guard("batch_set", False, self._set_flat, keys, values)

        def exists(self, key) -> bool:
            return self.batch_exists([key]) == 1

        def _get_flat(self, key, target_location):
            out = self.mem_pool_host.get_dummy_flat_data_page() if target_location is None else target_location
            return out if self.store.get_into(self.plan.page_id(key), out) else None

        def _set_flat(self, keys, values):
            if values is None or len(values) != len(keys) or any(v is None for v in values):
                return False
            items = [(self.plan.page_id(key), value) for key, value in zip(keys, values)]
            return all(self.store.put_many(items, self.plan.page_desc, self._routes(keys)))

        # --- the rest ---------------------------------------------------------------------

        def _guard(self, op: str, on_error, fn, *args):
            """fn(*args), or `on_error` if it raised: nothing reaches SGLang's threads. The
            store's own failures never raise (SafeStore); this catches what is left, such as
            a pool answering with other page sizes than at registration."""
            if self.plan is None:
                return on_error
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - the data path must not raise
                self.num_errors += 1
                log.warning("kvstore %s failed, answering a miss: %s: %s", op, type(exc).__name__, exc,
                            exc_info=self.num_errors == 1)
                return on_error

        def stats(self) -> dict:
            return {**self.store.stats(), "num_errors": self.num_errors}

        def close(self) -> None:
            self.store.close()

    def _failed(transfers) -> dict:
        return {t.name: [False] * len(t.keys or ()) for t in transfers or ()}

    KVStoreHiCacheStorage.__qualname__ = "KVStoreHiCacheStorage"
    return KVStoreHiCacheStorage


__getattr__ = lazy_classes(globals(), _build_classes)
