"""kvstore as a secondary tier of vLLM's CPU KV offloading (vLLM 0.33 `kv_offload/tiering`).

vLLM keeps the GPU copies, the CPU (primary) tier, async jobs, preemption and hybrid models;
this tier stores and loads the primary tier's chunks (pure bytes) in the kvstore daemon.
vLLM reads `secondary_tiers` only with `"spec_name": "TieringOffloadingSpec"`:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
          "cpu_bytes_to_use": 4000000000,
          "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                               "module_path": "kvstore.adapters.vllm_tier",
                               "socket_path": "/run/kvstore/kvstore.sock"}]}}'

An `OffloadKey` (vLLM's block hash + KV cache group index) becomes an object id under a full
descriptor (model, revision, dtype, `raw(bytes=<chunk bytes>)`) and the chunk geometry
(`chunk_geometry`: vLLM's cache groups, chunking and parallel layout), so another group's,
model's or layout's chunks are other objects. vLLM's block hashes are seeded per process
unless PYTHONHASHSEED is set: set it (the same on every instance) for hits across restarts
and instances.

Hybrid models: vLLM's OffloadingConnector offloads every prefix-cacheable group, Mamba
("align" mode) included: a Mamba group's chunk is the recurrent state vLLM hands over at a
block boundary, keyed by the prefix hash there and the group index, the same size as every
other chunk. This tier stores and loads it like any chunk; vLLM counts a hit only where the
state and every attention chunk before it are found.

Lookups are batched: vLLM's own AsyncLookupManager collects a step's keys and this tier
answers them with one daemon lookup per 4,096 keys in its background thread (RETRY until
then). Stores and loads run in one I/O thread; every method the scheduler calls returns at
once. A daemon that is down or slow is a miss, a failed store or a failed load (with the keys
that did load), never an exception in the scheduler.

KV events: an OffloadKey's block hash is vLLM's hash of the chunk's last block (request.
block_hashes at the chunk's end, chained over the whole prefix): the hash vLLM's own
BlockStored names that block by in that group. Each chunk is put with the route
[that hash] (maybe_convert_block_hash), the group index and the group's tokens per block, so
the daemon's events name it as vLLM's offloading connector names a secondary tier's chunk
(offloading/events.py, its placeholder payload). The chunk's other block hashes, its parent
and its tokens never reach a tier: the router sees the chunk's last block only.

Extra tier config keys: socket_path, namespace, timeout_s, retry_after_s; model and dtype
(default: the model name and KV cache dtype in vLLM's OffloadingConfig) and model_revision
(default "main": vLLM does not tell a tier the revision).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.dtypes import DType
from kvstore.identity import StateDescriptor
from kvstore.route import Route
from kvstore.adapters.common import SafeStore, StoreConfig, engine_object_id, lazy_classes

log = logging.getLogger("kvstore.adapters.vllm_tier")

_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
           "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "float8_e5m2": "fp8_e5m2"}


def _offloading_config(offloading_spec):
    """vLLM's OffloadingConfig of the spec, or None (a stand-in spec has none)."""
    config = getattr(offloading_spec, "config", None)
    if config is None:  # no spec: vLLM need not be installed
        return None
    from vllm.v1.kv_offload.config import OffloadingConfig

    return config if isinstance(config, OffloadingConfig) else None


def chunk_descriptor(offloading_spec, chunk_bytes: int, namespace: str, model=None, model_revision=None,
                     dtype=None) -> StateDescriptor:
    """The descriptor of this tier's chunks: explicit settings first, else what vLLM's
    OffloadingConfig says (model name, KV cache dtype). vLLM gives a tier no revision: "main"
    unless `model_revision` is set."""
    config = _offloading_config(offloading_spec)
    if model is None and config is not None:
        model = config.model.name
    if dtype is None and config is not None:
        dtype = config.model.dtype
    if not isinstance(model, str) or not model or dtype is None:
        raise ValueError("kvstore tier: cannot tell the model or its KV cache dtype from vLLM's config; set "
                         "'model' and 'dtype' in the tier's config")
    dtype = _DTYPES.get(str(dtype).removeprefix("torch."), dtype)
    # raw(bytes=N) counts elements of the dtype; a chunk that is no whole number of them
    # (it cannot be, for vLLM's caches) would take "any size".
    dtype = DType.parse(dtype)
    elements = chunk_bytes // dtype.element_bytes if chunk_bytes % dtype.element_bytes == 0 else 0
    return StateDescriptor(namespace, model, model_revision or "main", kind="kv", dtype=dtype,
                           layout=f"raw(bytes={elements})")


def chunk_geometry(offloading_spec) -> str:
    """What places the bytes inside a chunk, beyond its size (vLLM's FileMapper keys its
    folders by the same facts): every offloaded cache group (index, tokens per block, layer
    names, window), blocks per chunk, tokens per hash, the parallel layout (one chunk holds
    every worker's pages) and the host layout. Folded into every object id, so a chunk is only
    ever read back by an engine that places its bytes the same way: a Mamba group's chunk
    holds each Mamba layer's state where vLLM's worker put it, an attention group's chunk each
    layer's KV. "" for a stand-in spec without an OffloadingConfig."""
    config = _offloading_config(offloading_spec)
    if config is None:
        return ""
    parallel = config.parallel
    facts = {
        "groups": [[g.group_id, g.tokens_per_block, list(g.layer_names), g.sliding_window_size_in_chunks]
                   for g in config.groups],
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "blocks_per_chunk": config.cache.blocks_per_chunk, "tokens_per_hash": config.cache.tokens_per_hash,
        "parallel": [parallel.world_size, parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "host_layout": [config.replicated_layout, config.canonical_layout, config.kv_cache_layout],
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]


def _build_classes(name: str) -> dict | None:
    """vLLM's tier factory does getattr(module, "KVStoreSecondaryTier"): build it then."""
    return {name: _build_tier_class()} if name == "KVStoreSecondaryTier" else None


def _build_tier_class():
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    from vllm.v1.kv_offload.base import (LookupResult, Medium, RequestOffloadingContext, get_offload_block_hash,
                                         get_offload_group_idx)
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager

    class _BatchedLookups(AsyncLookupManager):
        def __init__(self, tier_type: str, ids_of, store: SafeStore):
            self._ids_of = ids_of
            self._store = store
            super().__init__(tier_type)

        def batch_lookup(self, keys, req_context):
            return self._store.contains(self._ids_of(keys))

    class KVStoreSecondaryTier(SecondaryTierManager):
        """See the module docstring. Scheduler-side calls never block on the daemon."""

        medium = Medium.CPU

        def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                     backpressure_detector=None, socket_path=None, namespace="default", timeout_s=5.0,
                     retry_after_s=2.0, model=None, model_revision=None, dtype=None, locality=None):
            super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                             tier_type=tier_type, backpressure_detector=backpressure_detector)
            self.store = SafeStore(StoreConfig(socket_path, namespace, float(timeout_s), float(retry_after_s)))
            self.desc = chunk_descriptor(offloading_spec, self.block_size_bytes, namespace, model, model_revision,
                                         dtype)
            geometry = chunk_geometry(offloading_spec)
            self._engine_key = f"vllm-offload/{geometry}" if geometry else "vllm-offload"
            self._flat = primary_kv_view.cast("B")  # released at shutdown, so vLLM can unmap its CPU tier
            self._chunks = np.frombuffer(self._flat, dtype=np.uint8).reshape(-1, self.block_size_bytes)
            self._lookups = _BatchedLookups(tier_type, self.object_ids, self.store)
            config = _offloading_config(offloading_spec)
            self._tokens_per_block = {g.group_id: g.tokens_per_block for g in config.groups} if config else {}
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-tier-io")
            self._finished: queue.SimpleQueue = queue.SimpleQueue()
            self._pending = 0
            self._pending_lock = threading.Lock()
            self._idle = threading.Condition(self._pending_lock)
            log.info("kvstore secondary tier: %d-byte chunks of %s", self.block_size_bytes, self.desc.model)

        def object_ids(self, keys) -> list:
            """The store's object ids of vLLM's OffloadKeys (block hash + group index, both
            hashed in whole), under this tier's descriptor and chunk geometry."""
            return [engine_object_id(self.desc, self._engine_key, bytes(k)) for k in keys]

        def route(self, key) -> Route | None:
            """vLLM's name for a chunk in KV events (see the module docstring); None for a key
            that is no OffloadKey (the chunk is then published by its object id)."""
            block_hash, group = get_offload_block_hash(key), get_offload_group_idx(key)
            if not block_hash:
                return None
            return Route(block_hashes=[maybe_convert_block_hash(bytes(block_hash))], group_idx=group,
                         block_size=self._tokens_per_block.get(group))

        # --- lookups (batched, in vLLM's lookup thread) ------------------------------------

        def lookup(self, key, req_context):
            found = self._lookups.lookup(key, req_context)
            if found is None:
                return LookupResult.RETRY
            return LookupResult.HIT if found else LookupResult.MISS

        def on_schedule_end(self, context) -> None:
            self._lookups.flush()

        def on_new_request(self, req_context):
            return RequestOffloadingContext()

        def on_request_finished(self, req_context) -> None:
            self._lookups.cleanup(req_context.req_id)

        # --- stores and loads (in this tier's I/O thread) --------------------------------------

        def _submit(self, fn, job) -> None:
            with self._pending_lock:
                self._pending += 1
            self._io.submit(self._run, fn, job)

        def _run(self, fn, job) -> None:
            try:
                result = fn(job)
            except Exception:  # never lose a job: vLLM waits for every result
                log.exception("kvstore tier: job %d failed", job.job_id)
                result = JobResult(job_id=job.job_id, success=False)
            missing = ()
            if job.is_promotion and not result.success:  # these keys are gone from the store
                missing = set(job.keys) - set(result.successful_keys or ())
            self._finished.put((result, missing))
            with self._pending_lock:
                self._pending -= 1
                self._idle.notify_all()

        def submit_store(self, job_metadata) -> None:
            self._submit(self._store_job, job_metadata)

        def _store_job(self, job):
            ids = self.object_ids(job.keys)
            held = self.store.contains(ids)
            missing = [(oid, chunk, key) for oid, chunk, key, ok in zip(ids, job.chunk_ids, job.keys, held) if not ok]
            stored = self.store.put_many([(oid, self._chunks[int(chunk)]) for oid, chunk, _ in missing], self.desc,
                                         [self.route(key) for _, _, key in missing])
            return JobResult(job_id=job.job_id, success=all(stored),
                             transfer_bytes=sum(ok for ok in stored) * self.block_size_bytes)

        def submit_load(self, job_metadata) -> None:
            self._submit(self._load_job, job_metadata)

        def _load_job(self, job):
            keys = list(job.keys)
            got = self.store.get_many_into([(oid, self._chunks[int(chunk)])
                                            for oid, chunk in zip(self.object_ids(keys), job.chunk_ids)])
            loaded = [key for key, ok in zip(keys, got) if ok]
            if len(loaded) == len(keys):
                return JobResult(job_id=job.job_id, success=True,
                                 transfer_bytes=len(keys) * self.block_size_bytes)
            return JobResult(job_id=job.job_id, success=False, successful_keys=loaded,
                             transfer_bytes=len(loaded) * self.block_size_bytes)

        def get_finished_jobs(self):
            """Called under vLLM's manager lock: the lookup state may be updated here."""
            done = []
            while True:
                try:
                    result, missing = self._finished.get_nowait()
                except queue.Empty:
                    return done
                if missing:  # a later lookup must not promise them again
                    self._lookups.mark_miss(missing)
                done.append(result)

        def has_pending_work(self) -> bool:
            with self._pending_lock:
                return self._pending > 0

        def drain_jobs(self) -> None:
            with self._pending_lock:
                self._idle.wait_for(lambda: self._pending == 0)

        def shutdown(self) -> None:
            """vLLM shuts its secondary tiers down before the CPU tier, which then unmaps its
            shared region: nothing of this tier may still hold a view of it."""
            self._io.shutdown(wait=True)
            self._lookups.shutdown()
            self.store.close()
            self._chunks = None
            self._flat.release()

    return KVStoreSecondaryTier


__getattr__ = lazy_classes(globals(), _build_classes)
