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

vLLM (and torch) are imported only when vLLM asks this module for `KVStoreConnector`.
Hybrid models (several KV cache groups) are not supported yet: the connector does not
declare SupportsHMA, so vLLM turns its hybrid KV cache manager off or refuses such models.
"""

from __future__ import annotations

import logging

from kvstore.identity import StateDescriptor
from adapters.common import SafeStore, StoreConfig, lazy_classes
from adapters.vllm_plan import LoadSpec, RequestPlan, SaveSpec, plan_request, request_extra_keys

log = logging.getLogger("kvstore.adapters.vllm")
DEFAULT_CHUNK_TOKENS = 256

_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def chunk_tokens_for(block_size: int, wanted: int | None) -> int:
    if wanted is None:
        return -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
    if wanted <= 0 or wanted % block_size:
        raise ValueError(f"kvstore: chunk_tokens must be a positive multiple of the block size {block_size}, "
                         f"got {wanted}")
    return wanted


def describe(vllm_config, kv_cache_config, chunk_tokens: int, namespace: str, revision: str | None):
    """The descriptor of this engine's chunk objects and the extra key naming the paged
    cache's inner layout (a reader with another layout must miss, not misread)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvstore: {len(groups)} KV cache groups (a hybrid model); this connector stores "
                         "one full-attention group: set disable_hybrid_kv_cache_manager or drop the connector")
    spec = groups[0].kv_cache_spec
    layers = len(groups[0].layer_names)
    dtype = _DTYPES.get(str(spec.dtype).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"kvstore: KV cache dtype {spec.dtype} is not one kvstore stores")
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if getattr(model, "use_mla", False):
        layout = "raw(bytes=0)"
        kind = "mla_latent"
    else:
        layout = (f"paged(order=layer_first,layers={layers},block={spec.block_size},"
                  f"kv_heads={spec.num_kv_heads},head_dim={spec.head_size})")
        kind = "kv"
    # One model replica's ranks (TP x PP x prefill-context): each holds other heads or other
    # layers, so each stores its own shard. (Data-parallel replicas share state.) The
    # scheduler, rank 0, looks up shard 0; a rank whose shard is missing reports load errors.
    replica = max(1, parallel.tensor_parallel_size * parallel.pipeline_parallel_size
                  * getattr(parallel, "prefill_context_parallel_size", 1))
    shard = f"{parallel.rank % replica}/{replica}"
    desc = StateDescriptor(namespace, model.model, revision or model.revision or "main", kind=kind, dtype=dtype,
                           layout=layout, shard=shard, chunk_tokens=chunk_tokens)
    inner = getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default"
    return desc, f"vllm-kv-layout:{inner}"


def _build_classes(name: str) -> dict | None:
    """vLLM's factory does getattr(module, "KVStoreConnector"): build the classes then."""
    if name not in ("KVStoreConnector", "KVStoreMetadata"):
        return None
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class KVStoreMetadata(KVConnectorMetadata):
        """What one step asks of the workers: chunks to load and chunks to save."""

        def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec]):
            self.loads = loads
            self.saves = saves

    class KVStoreConnector(KVConnectorBase_V1):
        """See the module docstring."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
            self.store = SafeStore(StoreConfig.from_mapping(extra))
            self.block_size = vllm_config.cache_config.block_size
            self.chunk_tokens = chunk_tokens_for(self.block_size, extra.get("chunk_tokens"))
            self.desc, self.layout_key = describe(vllm_config, kv_cache_config, self.chunk_tokens,
                                                  self.store.config.namespace, extra.get("model_revision"))
            self.num_blocks = kv_cache_config.num_blocks
            # scheduler side
            self._plans: dict[str, RequestPlan] = {}
            # worker side
            self._layers: list = []  # the paged cache tensors, in registration order
            self._block_dim = 1
            self._load_errors: set[int] = set()
            self.num_loaded_chunks = 0
            self.num_saved_chunks = 0
            log.info("kvstore connector (%s): %s, %d-token chunks", role.name, self.desc.layout, self.chunk_tokens)

        # --- scheduler role --------------------------------------------------------------

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            try:
                plan = self._plan(request)
                hits = self.store.prefix_hits(plan.ids)
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
                extras = request_extra_keys(getattr(request, "cache_salt", None),
                                            getattr(lora, "lora_name", None)) + [self.layout_key]
                plan = plan_request(request.request_id, list(request.prompt_token_ids or ()), self.desc,
                                    self.block_size, extras, mm)
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
                for new in scheduler_output.scheduled_new_reqs:
                    plan = self._plans.get(new.req_id)
                    if plan is None:
                        continue
                    plan.block_ids = list(new.block_ids[0])
                    loads += plan.loads()
                    after = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                    saves += plan.saves(after)
                cached = scheduler_output.scheduled_cached_reqs
                for i, req_id in enumerate(cached.req_ids):
                    plan = self._plans.get(req_id)
                    if plan is None:
                        continue
                    new_ids = cached.new_block_ids[i]
                    if req_id in cached.resumed_req_ids:
                        plan.block_ids = list(new_ids[0]) if new_ids is not None else []
                    elif new_ids is not None:
                        plan.block_ids += new_ids[0]
                    loads += plan.loads()
                    after = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
                    saves += plan.saves(after)
            except Exception:
                log.exception("kvstore: building the step's metadata failed; this step loads and saves nothing")
                loads, saves = [], []
            return KVStoreMetadata(loads, saves)

        def request_finished(self, request, block_ids):
            self._plans.pop(request.request_id, None)
            return False, None  # saves are synchronous: the blocks are free to go

        # --- worker role -----------------------------------------------------------------------

        def register_kv_caches(self, kv_caches: dict):
            self._layers = list(kv_caches.values())
            first = self._layers[0]
            # vLLM's paged caches are (2, num_blocks, ...) or (num_blocks, ...) (MLA).
            self._block_dim = 1 if first.dim() > 1 and first.shape[1] == self.num_blocks else 0
            if first.shape[self._block_dim] != self.num_blocks:
                raise ValueError(f"kvstore: no dimension of size num_blocks={self.num_blocks} in the KV cache "
                                 f"of shape {tuple(first.shape)}")
            per_block = first.select(self._block_dim, 0).numel() * first.element_size()
            expected = self.desc.object_bytes
            actual = per_block * len(self._layers) * (self.chunk_tokens // self.block_size)
            if expected and expected != actual:
                raise ValueError(f"kvstore: the KV cache holds {actual} bytes per chunk, its descriptor "
                                 f"{self.desc.layout} says {expected}")

        def _chunk_tensor(self, nblocks: int):
            first = self._layers[0]
            block_shape = first.select(self._block_dim, 0).shape
            return torch.empty((len(self._layers), nblocks, *block_shape), dtype=first.dtype)

        def start_load_kv(self, forward_context, **kwargs):
            """Every chunk of the step in one pipelined get, then each into its blocks."""
            loads = self._get_connector_metadata().loads
            if not loads:
                return
            chunks = [self._chunk_tensor(self.chunk_tokens // self.block_size) for _ in loads]
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
            for layer, cache in enumerate(self._layers):
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
            items = []
            for spec in meta.saves:
                try:
                    index = torch.tensor(spec.block_ids)
                    chunk = torch.stack([cache.index_select(self._block_dim, index.to(cache.device))
                                         .movedim(self._block_dim, 0).cpu() for cache in self._layers])
                    items.append((spec.object_id, chunk.contiguous().view(-1).view(torch.uint8).numpy()))
                except Exception:
                    log.exception("kvstore: reading chunk %s out of the KV cache failed", spec.object_id)
            if items:
                self.num_saved_chunks += sum(self.store.put_many(items, self.desc))

        def get_block_ids_with_load_errors(self) -> set[int]:
            errors, self._load_errors = self._load_errors, set()
            return errors

        def shutdown(self):
            self.store.close()

    return {"KVStoreConnector": KVStoreConnector, "KVStoreMetadata": KVStoreMetadata}


__getattr__ = lazy_classes(globals(), _build_classes)
