"""kvstore as vLLM's KV connector (vLLM 0.33), loaded by vLLM's own factory:

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.adapters.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket_path": "/run/kvstore/kvstore.sock"}}'

Scheduler role: one batched lookup per new request (`get_num_new_matched_tokens`), the
tokens the store holds beyond vLLM's local prefix cache (always leaving one prompt token to
compute), and per step a `KVStoreMetadata` carrying block ids and object ids to the workers,
and with each chunk to save its route: vLLM's own block hashes of the chunk, so the daemon's
KV events name its blocks as vLLM's events do (`adapters.vllm_routes`).
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
blocks vLLM keeps inside its window (`adapters.vllm_plan`). Mamba groups (recurrent state of
Mamba / linear-attention layers) need vLLM's `mamba_cache_mode = "align"` (any other mode is
refused at start, naming the setting, as vLLM's own Mooncake connector does): the state at a
chunk boundary is its own object (kind recurrent, layout `mamba(layers, states)` naming
each state's shape and dtype), stored with that chunk's attention objects as one store group
(kvstore/groups.py) and hit and read with them whole, or not at all. With more than one KV
cache group, loads are reported asynchronously (`get_transfer_results`): a load that fails
is a failed receive and vLLM recomputes the request, the only failure path vLLM 0.33 offers
models with several groups (it refuses block-level load errors for them).

vLLM (and torch) are imported only when vLLM asks this module for `KVStoreConnector`.
"""

from __future__ import annotations

import logging
import dataclasses

from kvstore.identity import StateDescriptor
from kvstore.adapters.common import SafeStore, StoreConfig, lazy_classes
from kvstore.adapters.vllm_plan import LoadSpec, RequestPlan, SaveSpec, plan_request, request_extra_keys

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


def _spec_kind(spec, index: int) -> str:
    """"full", "sliding" or "mamba"; anything else this connector does not store."""
    name = type(spec).__name__
    if "Mamba" in name:
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise ValueError(f"kvstore: the KV connector does not support: group {index}: mamba_cache_mode={mode!r} "
                             "!= 'align'. Run vLLM with --mamba-cache-mode align (prefix caching on), or use kvstore "
                             "as vLLM's secondary offloading tier (adapters.vllm_tier)")
        return "mamba"
    if "SlidingWindow" in name:
        return "sliding"
    if "Cross" in name or not hasattr(spec, "num_kv_heads"):
        raise ValueError(f"kvstore: the KV connector does not support: group {index}: {name}")
    return "full"


_STATE_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8_e4m3",
                 "float8_e5m2": "fp8_e5m2", "int8": "int8", "uint8": "uint8"}


def mamba_layout(spec, num_layers: int) -> tuple[str, str]:
    """(layout, dtype) of a Mamba group's state objects: every state of every layer, in the
    order vLLM keeps them (conv, then SSM), and the descriptor's dtype: the last state's
    (the SSM state: fp32 where vLLM keeps it so)."""
    states = []
    for shape, dtype in zip(spec.shapes, spec.dtypes):
        name = _STATE_DTYPES.get(str(dtype).removeprefix("torch."))
        if name is None:
            raise ValueError(f"kvstore: Mamba state dtype {dtype} is not one kvstore stores")
        states.append(f"{'x'.join(map(str, shape))}:{name}")
    descriptor_dtype = next((_DTYPES[str(d).removeprefix("torch.")] for d in reversed(spec.dtypes)
                             if str(d).removeprefix("torch.") in _DTYPES), "fp32")
    return f"mamba(layers={num_layers},states={'+'.join(states)})", descriptor_dtype


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
        kind_of_group = _spec_kind(spec, index)
        dtype = _DTYPES.get(str(getattr(spec, "dtype", "")).removeprefix("torch."))
        if kind_of_group == "mamba":
            (layout, dtype), kind = mamba_layout(spec, len(group.layer_names)), "recurrent"
        elif dtype is None:
            raise ValueError(f"kvstore: KV cache dtype {spec.dtype} is not one kvstore stores")
        elif getattr(model, "use_mla", False):
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
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                      SupportsHMA)

    from kvstore.adapters.vllm_routes import RouteNamer
    from kvstore.adapters.vllm_worker import WorkerIO

    class KVStoreMetadata(KVConnectorMetadata):
        """What one step asks of the workers: chunks to load and chunks to save."""

        def __init__(self, loads: list[LoadSpec], saves: list[SaveSpec]):
            self.loads = loads
            self.saves = saves

    class KVStoreConnector(WorkerIO, KVConnectorBase_V1, SupportsHMA):
        """See the module docstring; the worker role is adapters.vllm_worker.WorkerIO."""

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
            self._mamba = [g for g, (_, _, kind) in enumerate(self.groups) if kind == "mamba"]
            self._attention = [g for g, (_, _, kind) in enumerate(self.groups) if kind != "mamba"]
            if not self._attention:
                raise ValueError("kvstore: the KV connector needs at least one attention KV cache group")
            # vLLM takes block-level load errors only from single-group models: the others load
            # "asynchronously" (the request waits a step) and a failure fails the whole receive.
            self._load_async = len(self.groups) > 1
            self._layer_names = [list(group.layer_names) for group in kv_cache_config.kv_cache_groups]
            self.num_blocks = kv_cache_config.num_blocks
            # scheduler side
            self._plans: dict[str, RequestPlan] = {}
            self._requests: dict = {}  # request id -> vLLM's Request, for its block hashes (routes)
            self.routes = RouteNamer(kv_cache_config, self.chunk_tokens,
                                     getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
            self.num_unsaved_chunks = 0  # chunks a sliding window had moved past before they were done
            # worker side
            self._layers: list[list] = []  # per group, its paged cache tensors
            self._pinned: dict[int, list] = {}  # per group, pinned staging chunks (CUDA caches)
            self._block_dim = 1
            self._load_errors: set[int] = set()
            self._received: set[str] = set()  # requests whose (async) load ran
            self._failed: set[str] = set()  # ... and failed: vLLM recomputes them
            self.num_loaded_chunks = 0
            self.num_loaded_states = 0
            self.num_saved_chunks = 0
            self.num_saved_groups = 0  # store groups put: a chunk's attention objects with the states at its end
            log.info("kvstore connector (%s): %s, %d-token chunks", role.name,
                     "; ".join(f"{desc.layout} ({kind})" for desc, _, kind in self.groups), self.chunk_tokens)

        # --- scheduler role --------------------------------------------------------------

        def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
            try:
                plan = self._plan(request)
                hits = plan.hits_of(self.store.contains(plan.lookup_ids))
                if self._mamba:  # the hit ends where a chunk's store group (KV and state) is whole
                    ks = plan.state_candidates(hits, num_computed_tokens)
                    complete = self.store.lookup_groups([plan.state_members(k) for k in ks])
                    hits = max((k for k, ok in zip(ks, complete) if ok), default=0)
                matched = plan.matched_tokens(hits, num_computed_tokens, exact=bool(self._mamba))
                return matched, self._load_async and matched > 0
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
                self._requests[request.request_id] = request
            return plan

        def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
            plan = self._plans.get(request.request_id)
            if plan is not None and num_external_tokens > 0:
                plan.num_load_tokens = num_external_tokens
                plan.load_pending = True
                tables = blocks.get_block_ids()
                plan.set_blocks(tables, True)  # an async load runs before the request is scheduled
                plan.set_state_blocks(tables)

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
                state = getattr(scheduler_output, "kv_connector_block_state", None)
                offers = state.boundary_state_offloads if state is not None else {}
                for req_id, block_ids, replace, computed in steps:
                    plan = self._plans.get(req_id)
                    if plan is None:
                        continue
                    if block_ids is not None or replace:
                        plan.set_blocks(block_ids or [[] for _ in self.groups], replace)
                    loads += plan.loads()
                    unsaved = plan.num_unsaved_chunks
                    saves += self._named(plan.saves(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0),
                                                    offers.get(req_id, ())))
                    self.num_unsaved_chunks += plan.num_unsaved_chunks - unsaved
                for plan in self._plans.values():  # async loads: the request is not scheduled yet
                    loads += plan.loads()
            except Exception:
                log.exception("kvstore: building the step's metadata failed; this step loads and saves nothing")
                loads, saves = [], []
            return KVStoreMetadata(loads, saves)

        def _named(self, specs: list[SaveSpec]) -> list[SaveSpec]:
            """The saves with their routes: vLLM's own names for the blocks each object holds,
            which the daemon's KV events publish (adapters.vllm_routes)."""
            return [dataclasses.replace(spec, route=self.routes.route_of(self._requests[spec.request_id], spec.group,
                                                                         spec.chunk))
                    for spec in specs]

        def request_finished(self, request, block_ids):
            self._plans.pop(request.request_id, None)
            self._requests.pop(request.request_id, None)
            return False, None  # saves are synchronous: the blocks are free to go

        def request_finished_all_groups(self, request, block_ids):
            return self.request_finished(request, block_ids)

        def shutdown(self):
            self.store.close()

    return {"KVStoreConnector": KVStoreConnector, "KVStoreMetadata": KVStoreMetadata}


__getattr__ = lazy_classes(globals(), _build_classes)
