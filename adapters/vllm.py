"""kvstore as vLLM's KV connector (vLLM 0.33), loaded by vLLM's own factory:

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket_path": "/run/kvstore/kvstore.sock"}}'

Scheduler role: one batched lookup per new request (`get_num_new_matched_tokens`), the
tokens the store holds beyond vLLM's local prefix cache (always leaving one prompt token to
compute), and per step a `KVStoreMetadata` carrying block ids and object ids to the workers.
Worker role: `start_load_kv` copies stored chunks into the paged cache before the forward
(synchronous loads), `wait_for_save` copies newly completed prompt chunks out of it and puts
them. A chunk that fails to load is reported by `get_block_ids_with_load_errors`, so with
`kv_load_failure_policy = "recompute"` vLLM recomputes exactly those blocks.

The serving path never raises: a daemon that is down or slow is a miss, counted and logged
(`adapters.common.SafeStore`). Extra config keys: `socket_path`, `namespace`, `timeout_s`,
`retry_after_s`, `chunk_tokens` (a multiple of the block size; default: the smallest one
>= 256), `model_revision`.

Hybrid models: the connector declares `SupportsHMA`, so vLLM keeps its hybrid KV cache
manager on. Each attention group (full attention, sliding window) stores its own chunk
objects; a lookup hits the chunks every group holds; a sliding-window group loads only the
blocks vLLM keeps inside its window (`adapters.vllm_plan`). Mamba groups (recurrent state)
are refused with an error that points to the secondary tier (`adapters.vllm_tier`), where
vLLM's own offloading keeps recurrent state.

vLLM (and torch) are imported only when vLLM asks this module for `KVStoreConnector`.
"""

from __future__ import annotations

import logging

from kvstore.identity import StateDescriptor
from adapters.common import SafeStore, StoreConfig, lazy_classes
from adapters.vllm_plan import LoadSpec, RequestPlan, SaveSpec, plan_request, request_extra_keys

log = logging.getLogger("kvstore.adapters.vllm")
DEFAULT_CHUNK_TOKENS = 256
STAGED_CHUNKS = 32  # pinned staging chunks kept per KV cache group when the cache is on a GPU

_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def chunk_tokens_for(block_size: int, wanted: int | None) -> int:
    if wanted is None:
        return -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if wanted <= 0 or wanted % block_size:
        raise ValueError(f"kvstore: chunk_tokens must be a positive multiple of the block size {block_size}, "
                         f"got {wanted}")
    return wanted


def _spec_kind(spec) -> str:
    """"full" or "sliding"; anything else (Mamba's recurrent state) this connector does not store."""
    name = type(spec).__name__
    if "SlidingWindow" in name:
        return "sliding"
    if "Mamba" in name or not hasattr(spec, "num_kv_heads"):
        raise ValueError(f"kvstore: the KV connector stores attention KV only, not {name} (a hybrid SSM model): "
                         "use kvstore as vLLM's secondary offloading tier (adapters.vllm_tier), which keeps "
                         "recurrent state, or drop the connector")
    return "full"


def describe(vllm_config, kv_cache_config, chunk_tokens: int, namespace: str, revision: str | None):
    """Per KV cache group: the descriptor of its chunk objects and its own extra keys (the
    paged cache's inner layout, so a reader with another layout misses instead of misreading;
    and, in a hybrid model, the group's place and kind, so two groups never share an id)."""
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    # One model replica's ranks (TP x PP x prefill-context): each holds other heads or other
    # layers, so each stores its own shard. (Data-parallel replicas share state.) The
    # scheduler, rank 0, looks up shard 0; a rank whose shard is missing reports load errors.
    replica = max(1, parallel.tensor_parallel_size * parallel.pipeline_parallel_size
                  * getattr(parallel, "prefill_context_parallel_size", 1))
    shard = f"{parallel.rank % replica}/{replica}"
    inner = getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default"
    described = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        kind_of_group = _spec_kind(spec)
        dtype = _DTYPES.get(str(spec.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"kvstore: KV cache dtype {spec.dtype} is not one kvstore stores")
        if getattr(model, "use_mla", False):
            layout, kind = "raw(bytes=0)", "mla_latent"
        else:
            layout = (f"paged(order=layer_first,layers={len(group.layer_names)},block={spec.block_size},"
                      f"kv_heads={spec.num_kv_heads},head_dim={spec.head_size})")
            kind = "kv"
        desc = StateDescriptor(namespace, model.model, revision or model.revision or "main", kind=kind,
                               dtype=dtype, layout=layout, shard=shard, chunk_tokens=chunk_tokens)
        own = [f"vllm-kv-layout:{inner}"]
        if len(groups) > 1:
            window = getattr(spec, "sliding_window", None)
            own.append(f"vllm-group:{index}/{len(groups)}:{kind_of_group}" + (f":{window}" if window else ""))
        described.append((desc, own, kind_of_group))
    return described


def _build_classes(name: str) -> dict | None:
    """vLLM's factory does getattr(module, "KVStoreConnector"): build the classes then."""
    if name not in ("KVStoreConnector", "KVStoreMetadata"):
        return None
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                      SupportsHMA)

    class KVStoreMetadata(KVConnectorMetadata):
        """What one step asks of the workers: chunks to load and chunks to save."""

        def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec]):
            self.loads = loads
            self.saves = saves

    class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
        """See the module docstring."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            self.store = SafeStore(StoreConfig.from_mapping(extra))
            sizes = {group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups}
            if len(sizes) != 1:
                raise ValueError(f"kvstore: the KV cache groups have different block sizes {sorted(sizes)}; "
                                 "the connector needs one")
            self.block_size = sizes.pop()
            self.chunk_tokens = chunk_tokens_for(self.block_size, extra.get("chunk_tokens"))
            self.groups = describe(vllm_config, kv_cache_config, self.chunk_tokens, self.store.config.namespace,
                                   extra.get("model_revision"))
            self._sliding = [g for g, (_, _, kind) in enumerate(self.groups) if kind == "sliding"]
            self._layer_names = [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]
            self.num_blocks = kv_cache_config.num_blocks
            # scheduler side
            self._plans: dict[str, RequestPlan] = {}
            self.num_unsaved_chunks = 0  # chunks a sliding window had moved past before they were done
            # worker side
            self._layers: list[list] = []  # per group, its paged cache tensors
            self._pinned: dict[int, list] = {}  # per group, pinned staging chunks (CUDA caches)
            self._block_dim = 1
            self._load_errors: set[int] = set()
            self.num_loaded_chunks = 0
            self.num_saved_chunks = 0
            log.info("kvstore connector (%s): %s, %d-token chunks", role.name,
                     "; ".join(f"{desc.layout} ({kind})" for desc, _, kind in self.groups), self.chunk_tokens)

        # --- scheduler role --------------------------------------------------------------

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            try:
                plan = self._plan(request)
                hits = plan.hits_of(self.store.contains(plan.lookup_ids))
                return plan.matched_tokens(hits, num_computed_tokens), False
            except Exception:  # never into the engine: a miss
                log.exception("kvstore lookup failed for %s; recomputing", request.request_id)
                return 0, False

        def _plan(self, request) -> RequestPlan:
            plan = self._plans.get(request.request_id)
            if plan is None:
                lora = getattr(request, "lora_request", None)
                mm = [(f.mm_position.offset, f.mm_position.length, f.identifier)
                      for f in (getattr(request, "mm_features", None) or ())]
                extras = request_extra_keys(getattr(request, "cache_salt", None), getattr(lora, "lora_name", None))
                plan = plan_request(request.request_id, list(request.prompt_token_ids or ()),
                                    [(desc, own) for desc, own, _ in self.groups], self.block_size, extras, mm)
                self._plans[request.request_id] = plan
            return plan

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            plan = self._plans.get(request.request_id)
            if plan is not None and num_external_tokens > 0:
                plan.num_load_tokens = num_external_tokens
                plan.load_pending = True

        def build_connector_meta(self, scheduler_output):
            loads: list[LoadSpec] = []
            saves: list[SaveSpec] = []
            try:
                cached = scheduler_output.scheduled_cached_reqs
                if self._sliding:  # blocks handed out this step are stale wherever a plan still holds them
                    reused = {block for new in scheduler_output.scheduled_new_reqs for ids in new.block_ids
                              for block in ids}
                    reused.update(block for ids in cached.new_block_ids if ids is not None
                                  for group in ids for block in group)
                    reused.update(copy.dst_block_id for copy in getattr(scheduler_output, "kv_cache_block_copies",
                                                                          None) or ())
                    for plan in self._plans.values():
                        plan.forget_reused(reused, self._sliding)
                steps = [(new.req_id, new.block_ids, True, new.num_computed_tokens)
                         for new in scheduler_output.scheduled_new_reqs]
                steps += [(req_id, cached.new_block_ids[i], req_id in cached.resumed_req_ids,
                           cached.num_computed_tokens[i]) for i, req_id in enumerate(cached.req_ids)]
                for req_id, block_ids, replace, computed in steps:
                    plan = self._plans.get(req_id)
                    if plan is None:
                        continue
                    if block_ids is not None or replace:
                        plan.set_blocks(block_ids or [[] for _ in self.groups], replace)
                    loads += plan.loads()
                    unsaved = plan.num_unsaved_chunks
                    saves += plan.saves(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
                    self.num_unsaved_chunks += plan.num_unsaved_chunks - unsaved
            except Exception:
                log.exception("kvstore: building the step's metadata failed; this step loads and saves nothing")
                loads, saves = [], []
            return KVStoreMetadata(loads, saves)

        def request_finished(self, request, block_ids):
            self._plans.pop(request.request_id, None)
            return False, None  # saves are synchronous: the blocks are free to go

        def request_finished_all_groups(self, request, block_ids):
            return self.request_finished(request, block_ids)

        # --- worker role -----------------------------------------------------------------------

        def register_kv_caches(self, kv_caches: dict):
            missing = [name for names in self._layer_names for name in names if name not in kv_caches]
            if missing:
                raise ValueError(f"kvstore: vLLM registered no KV cache for layers {missing[:4]}")
            self._layers = [[kv_caches[name] for name in names] for names in self._layer_names]
            first = self._layers[0][0]
            # vLLM's paged caches are (2, num_blocks, ...) or (num_blocks, ...) (MLA).
            self._block_dim = 1 if first.dim() > 1 and first.shape[1] == self.num_blocks else 0
            for (desc, _, _), layers in zip(self.groups, self._layers):
                if layers[0].shape[self._block_dim] != self.num_blocks:
                    raise ValueError(f"kvstore: no dimension of size num_blocks={self.num_blocks} in the KV cache "
                                     f"of shape {tuple(layers[0].shape)}")
                per_block = layers[0].select(self._block_dim, 0).numel() * layers[0].element_size()
                actual = per_block * len(layers) * (self.chunk_tokens // self.block_size)
                if desc.object_bytes and desc.object_bytes != actual:
                    raise ValueError(f"kvstore: the KV cache holds {actual} bytes per chunk, its descriptor "
                                     f"{desc.layout} says {desc.object_bytes}")

        def _staging(self, specs) -> list:
            """One host tensor per chunk of `specs`, each the shape of its group's chunk. Where
            the cache is on a GPU they are pinned (copies by DMA) and kept for the next steps,
            up to STAGED_CHUNKS per group; beyond that, and on CPU, they are made per step."""
            taken: dict[int, int] = {}
            out = []
            for spec in specs:
                first = self._layers[spec.group][0]
                shape = (len(self._layers[spec.group]), self.chunk_tokens // self.block_size,
                         *first.select(self._block_dim, 0).shape)
                if not first.is_cuda:
                    out.append(torch.empty(shape, dtype=first.dtype))
                    continue
                pool = self._pinned.setdefault(spec.group, [])
                index = taken[spec.group] = taken.get(spec.group, -1) + 1
                if index < len(pool):
                    out.append(pool[index])
                elif index < STAGED_CHUNKS:
                    pool.append(torch.empty(shape, dtype=first.dtype, pin_memory=True))
                    out.append(pool[index])
                else:
                    out.append(torch.empty(shape, dtype=first.dtype))
            return out

        def start_load_kv(self, forward_context, **kwargs):
            """Every chunk of the step in one pipelined get, then each into its blocks."""
            loads = self._get_connector_metadata().loads
            if not loads:
                return
            chunks = self._staging(loads)
            got = self.store.get_many_into([(spec.object_id, chunk.view(-1).view(torch.uint8).numpy())
                                            for spec, chunk in zip(loads, chunks)])
            for spec, chunk, ok in zip(loads, chunks, got):
                try:
                    if ok:
                        self._scatter(spec, chunk)
                        continue
                except Exception:
                    log.exception("kvstore: loading chunk %s failed; vLLM recomputes it", spec.object_id)
                self._load_errors.update(block for _, block in spec.blocks)

        def _scatter(self, spec: LoadSpec, chunk) -> None:
            inside = torch.tensor([i for i, _ in spec.blocks])
            dest = torch.tensor([b for _, b in spec.blocks])
            for layer, cache in enumerate(self._layers[spec.group]):
                picked = chunk[layer].index_select(0, inside).to(cache.device)
                cache.index_copy_(self._block_dim, dest.to(cache.device), picked.movedim(0, self._block_dim))
            self.num_loaded_chunks += 1

        def wait_for_layer_load(self, layer_name: str):
            return  # loads are synchronous: complete when start_load_kv returns

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return  # chunks are saved whole, once every layer ran (wait_for_save)

        def wait_for_save(self):
            if not self.has_connector_metadata():
                return
            meta = self._get_connector_metadata()
            per_group: dict[int, list] = {}
            for spec, chunk in zip(meta.saves, self._staging(meta.saves)):
                try:
                    for layer, cache in enumerate(self._layers[spec.group]):
                        index = torch.tensor(spec.block_ids, device=cache.device)
                        chunk[layer].copy_(cache.index_select(self._block_dim, index).movedim(self._block_dim, 0))
                    per_group.setdefault(spec.group, []).append((spec.object_id, chunk.view(-1).view(torch.uint8).numpy()))
                except Exception:
                    log.exception("kvstore: reading chunk %s out of the KV cache failed", spec.object_id)
            for group, items in per_group.items():
                self.num_saved_chunks += sum(self.store.put_many(items, self.groups[group][0]))

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors, self._load_errors = self._load_errors, set()
            return errors

        def shutdown(self):
            self.store.close()

    return {"KVStoreConnector": KVStoreConnector, "KVStoreMetadata": KVStoreMetadata}


__getattr__ = lazy_classes(globals(), _build_classes)
