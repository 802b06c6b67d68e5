"""kvstore as a secondary tier of vLLM's CPU KV offloading (vLLM 0.33 `kv_offload/tiering`).

vLLM keeps the GPU copies, the CPU (primary) tier, async jobs, preemption and hybrid models;
this tier stores and loads the primary tier's chunks (pure bytes) in the kvstore daemon:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 4000000000,
          "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                               "module_path": "adapters.vllm_tier",
                               "socket_path": "/run/kvstore/kvstore.sock"}]}}'

An `OffloadKey` (vLLM's block hash + KV cache group) becomes an object id under a full
descriptor (model, revision, dtype, `raw(bytes=<chunk bytes>)`), so another model's or
another chunk geometry's chunks are other objects. vLLM's block hashes are seeded per process
unless PYTHONHASHSEED is set: set it (the same on every instance) for hits across restarts
and instances.

Lookups are batched: vLLM's own AsyncLookupManager collects a step's keys and this tier
answers them with one daemon lookup per 4,096 keys in its background thread (RETRY until
then). Stores and loads run in one I/O thread; every method the scheduler calls returns at
once. A daemon that is down or slow is a miss, a failed store or a failed load (with the keys
that did load), never an exception in the scheduler.

Extra tier config keys: socket_path, namespace, timeout_s, retry_after_s; model,
model_revision and dtype (default: vLLM's model config and KV cache dtype).
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvstore.dtypes import DType
from kvstore.identity import StateDescriptor
from adapters.common import SafeStore, StoreConfig, engine_object_id, lazy_classes

log = logging.getLogger("kvstore.adapters.vllm_tier")

_DTYPES = {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32", "float": "fp32",
           "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
           "float8_e5m2": "fp8_e5m2"}


def chunk_descriptor(offloading_spec, chunk_bytes: int, namespace: str, model=None, model_revision=None,
                     dtype=None) -> StateDescriptor:
    """The descriptor of this tier's chunks: explicit settings first, else vLLM's config."""
    vllm_config = getattr(offloading_spec, "vllm_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    def text(value):  # only what vLLM's config really says (a spec without one has none)
        return value if isinstance(value, str) else None

    if model is None:
        model = text(getattr(model_config, "model", None))
    if model_revision is None:
        model_revision = text(getattr(model_config, "revision", None)) or "main"
    if dtype is None:
        cache_dtype = text(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", None)) or "auto"
        dtype = str(getattr(model_config, "dtype", "")) if cache_dtype == "auto" else cache_dtype
    dtype = _DTYPES.get(str(dtype).removeprefix("torch."), dtype)
    if not isinstance(model, str) or not isinstance(model_revision, str):
        raise ValueError("kvstore tier: cannot tell the model from vLLM's config; set 'model' (and "
                         "'model_revision') in the tier's config")
    # raw(bytes=N) counts elements of the dtype; a chunk that is no whole number of them
    # (it cannot be, for vLLM's caches) would take "any size".
    dtype = DType.parse(dtype)
    elements = chunk_bytes // dtype.element_bytes if chunk_bytes % dtype.element_bytes == 0 else 0
    return StateDescriptor(namespace, model, model_revision, kind="kv", dtype=dtype,
                           layout=f"raw(bytes={elements})")


def _build_classes(name: str) -> dict | None:
    """vLLM's tier factory does getattr(module, "KVStoreSecondaryTier"): build it then."""
    return {name: _build_tier_class()} if name == "KVStoreSecondaryTier" else None


def _build_tier_class():
    from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
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
            flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B" \
                else primary_kv_view
            self._chunks = np.frombuffer(flat, dtype=np.uint8).reshape(-1, self.block_size_bytes)
            self._lookups = _BatchedLookups(tier_type, self._ids, self.store)
            self._io = ThreadPoolExecutor(1, thread_name_prefix="kvstore-tier-io")
            self._finished: queue.SimpleQueue = queue.SimpleQueue()
            self._pending = 0
            self._pending_lock = threading.Lock()
            self._idle = threading.Condition(self._pending_lock)
            log.info("kvstore secondary tier: %d-byte chunks of %s", self.block_size_bytes, self.desc.model)

        def _ids(self, keys):
            return [engine_object_id(self.desc, "vllm-offload", bytes(k)) for k in keys]

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
            ids = self._ids(job.keys)
            held = self.store.contains(ids)
            items = [(oid, self._chunks[int(chunk)]) for oid, chunk, ok in zip(ids, job.chunk_ids, held) if not ok]
            stored = self.store.put_many(items, self.desc)
            return JobResult(job_id=job.job_id, success=all(stored),
                             transfer_bytes=sum(ok for ok in stored) * self.block_size_bytes)

        def submit_load(self, job_metadata) -> None:
            self._submit(self._load_job, job_metadata)

        def _load_job(self, job):
            keys = list(job.keys)
            got = self.store.get_many_into([(oid, self._chunks[int(chunk)])
                                            for oid, chunk in zip(self._ids(keys), job.chunk_ids)])
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
            self._io.shutdown(wait=True)
            self._lookups.shutdown()
            self.store.close()

    return KVStoreSecondaryTier


__getattr__ = lazy_classes(globals(), _build_classes)
