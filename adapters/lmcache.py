"""kvstore as an LMCache remote-storage plug-in (a `RemoteConnector`, LMCache 0.5.x).

LMCache's config turns it on (plug-in name `kvstore`; any name works if the keys follow it):

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.adapters.lmcache
      remote_storage_plugin.kvstore.class_name: KVStoreConnector
      remote_storage_plugin.kvstore.socket_path: /run/kvstore.sock   # else $KVSTORE_SOCKET
      # optional: .namespace, .model_revision (default "main"), .timeout_s, .retry_after_s

LMCache's `CreateConnector` imports `module_path` and takes `class_name` from it. The class is
built on that first access (the module's `__getattr__`): importing this module needs neither
LMCache nor torch.

One LMCache chunk (a MemoryObj) is two objects, stored and checked together: its bytes exactly
as LMCache holds them, and LMCache's own `RemoteMetadata` header (length, shapes, dtypes, memory
format) from which a get allocates the right MemoryObj before copying the bytes in. Two objects,
not header + bytes in one: the client copies one contiguous buffer per object, so one object
would cost a second copy of every chunk. Their ids come from `key.to_string()` (model, world
size, worker, chunk hash, dtype, tags) under a descriptor with the key's model, shard
worker_id/world_size, dtype, kind (kv or mla_latent) and layout raw: LMCache's chunk order (K
of every layer, then V) is none of kvstore's layouts, so the store keeps the bytes opaque and the
memory format travels in the header.

Threads: LMCache runs the async methods on its own event loop and calls `exists_sync`,
`remove_sync` and `batched_contains` from its worker threads. The store handle (`SafeStore`) is
blocking and thread-safe: async methods run it on a small thread pool and only await it, so
LMCache's loop never waits on the daemon; the sync methods call it directly.

Buffers: put reads the MemoryObj only during the call and takes its own reference while the copy
runs (LMCache's wrapper drops the caller's reference when put returns or is cancelled); the
caller's reference is never released here. A MemoryObj from get carries one reference, the
caller's; a get cancelled mid-copy releases what it allocated.

KV events: both objects of a chunk are put with a route naming it as LMCache's own KV events
do (`LMCacheEngine.store` -> CacheStoreEvent, published by vLLM's LMCacheConnectorV1): its
chunk hash (LMCache's, not vLLM's block hashes), with the chunk's tokens as block_size. A
router that reads LMCache's events matches it; one that reads vLLM's does not, since LMCache
hands a remote connector no vLLM block hashes, no parent chunk and no tokens.

Never raises on the data path: a daemon that is down, restarted or slow is a miss (exists False,
get None) and a put is a no-op; both are counted (`stats()`) and logged once per outage.

Hybrid models (Mamba / linear-attention state): a `RemoteConnector` chunk is attention KV only,
so this connector never carries recurrent state. LMCache's in-process engine, which drives
remote connectors, has no notion of it either (its kernel groups are built without engine
group infos, so none is marked `recurrent_state`), and vLLM does not start a Mamba hybrid with
`LMCacheConnectorV1` (not `SupportsHMA`). The connector cannot see the model's config; what it
can see is LMCache's `metadata.kv_layer_groups_manager`: if any kernel group there holds
recurrent state, creation raises (`HybridStateUnsupported`), and if that shows only later,
every chunk is refused (a counted miss, logged once as an error): KV of a hybrid model is
never stored without its state. For a hybrid model use kvstore from vLLM directly
(adapters.vllm); LMCache carries hybrid state only in its multi-process mode, through L2
adapters, and kvstore has none.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from kvstore.adapters.common import SafeStore, StoreConfig, engine_object_id, lazy_classes
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.identity import Kind, ObjectId, Shard, StateDescriptor
from kvstore.layout import Layout
from kvstore.route import Route

_log = logging.getLogger("kvstore.lmcache")

CLASS_NAME = "KVStoreConnector"
ENGINE = "lmcache"
DEFAULT_MODEL_REVISION = "main"
# Store calls share one connection (SafeStore's lock); a few threads let one chunk's
# allocation and header work overlap another chunk's round trip.
IO_THREADS = 4
# LMCache key dtypes that are kvstore dtypes; a key of another dtype is never stored (a miss).
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
           "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2"}
_OPAQUE = Layout.make("raw")  # bytes=0: any size; partial chunks are shorter than full ones
_HYBRID_ADVICE = ("for this model use kvstore from vLLM directly, without LMCache (adapters.vllm; the README's "
                  "vLLM section says which hybrid layouts it carries)")


class HybridStateUnsupported(InvalidArgument):
    """LMCache shows a model with recurrent state, which a RemoteConnector chunk cannot carry."""


def hybrid_refusal(metadata) -> str | None:
    """Why LMCache's metadata shows a model this connector must not store (its kernel groups
    name recurrent Mamba / linear-attention state), or None. Read from LMCache's own
    `kv_layer_groups_manager`, which its GPU connector sets on the first transfer."""
    groups = getattr(getattr(metadata, "kv_layer_groups_manager", None), "kernel_groups", None) or []
    recurrent = [i for i, group in enumerate(groups) if getattr(group, "recurrent_state", False)]
    if not recurrent:
        return None
    return (f"the kvstore LMCache RemoteConnector cannot carry hybrid state: LMCache's kernel groups {recurrent} "
            f"(of {len(groups)}) hold recurrent state, and a RemoteConnector chunk is KV only, so a hit would "
            f"restore attention KV without its state; {_HYBRID_ADVICE}")


def _build_classes(name: str) -> dict | None:
    """`KVStoreConnector`, built (LMCache imported) when LMCache's plug-in loader asks for it."""
    if name != CLASS_NAME:
        return None
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    class KVStoreConnector(_Connector, RemoteConnector):
        __doc__ = _Connector.__doc__

    KVStoreConnector.__qualname__ = CLASS_NAME
    return {name: KVStoreConnector}


class _Connector:
    """kvstore behind LMCache's `RemoteConnector` interface (see the module docstring).

    Created by LMCache's `DynamicConnectorAdapter` as (loop, local_cpu_backend, config); the
    metadata comes from the local CPU backend, the plug-in name from the config entry that
    names this class. Each method is sync or async exactly as `RemoteConnector` declares it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, metadata=None,
                 plugin_name: str | None = None):
        metadata = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if metadata is None:
            raise InvalidArgument("the kvstore LMCache connector needs LMCache's metadata: create it in a worker "
                                  "(a local CPU backend with max_local_cpu_size > 0)")
        reason = hybrid_refusal(metadata)
        if reason is not None:
            raise HybridStateUnsupported(reason)
        super().__init__(config, metadata)
        self.metadata = metadata
        self.plugin_name = plugin_name or _plugin_name(config)
        prefix = f"remote_storage_plugin.{self.plugin_name}."
        extra = config.extra_config or {}
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.store = SafeStore(_store_config(extra, prefix))
        self.model_revision = str(extra.get(prefix + "model_revision", DEFAULT_MODEL_REVISION))
        self.kind = Kind.MLA_LATENT if metadata.use_mla else Kind.KV
        self.chunk_tokens = int(metadata.chunk_size)
        # check the settings once, here, rather than as a miss on every key
        StateDescriptor(self.store.config.namespace, "probe", self.model_revision, chunk_tokens=self.chunk_tokens)
        # the header object's size is in its id: another LMCache layout (more KV groups) never
        # meets a header of another size
        self._meta_engine = f"{ENGINE}.meta/{self.remote_metadata_bytes}"
        self._executor = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvstore-lmcache")
        self._descriptors: dict[tuple, StateDescriptor | None] = {}
        self._closed = False
        self._logged: set[str] = set()
        self.num_refused = 0  # chunks refused here, not by the store (see _refuse)
        self.num_no_memory = 0  # gets that found the chunk but LMCache had no memory for it

    # --- ids --------------------------------------------------------------------

    def _ids(self, key) -> tuple[ObjectId, ObjectId, StateDescriptor] | None:
        """(data id, header id, descriptor) of an LMCache key; None for a key kvstore cannot
        describe (an unsupported dtype, worker_id outside world_size) and for every key once
        LMCache's metadata shows a hybrid model (see `hybrid_refusal`)."""
        hybrid = hybrid_refusal(self.metadata)
        if hybrid is not None:
            self._refuse(hybrid, logging.ERROR)
            return None
        desc = self._descriptor(key)
        if desc is None:
            return None
        name = key.to_string()
        return engine_object_id(desc, ENGINE, name), engine_object_id(desc, self._meta_engine, name), desc

    def _descriptor(self, key) -> StateDescriptor | None:
        spec = (key.model_name, key.world_size, key.worker_id, str(key.dtype))
        if spec in self._descriptors:
            return self._descriptors[spec]
        desc = None
        dtype = _DTYPES.get(str(key.dtype))
        if dtype is None:
            self._refuse(f"LMCache keys of dtype {key.dtype} are not stored (kvstore dtypes: {', '.join(_DTYPES)})")
        else:
            try:
                desc = StateDescriptor(self.store.config.namespace, key.model_name, self.model_revision,
                                       kind=self.kind, dtype=dtype, layout=_OPAQUE,
                                       shard=Shard(key.worker_id, key.world_size), chunk_tokens=self.chunk_tokens)
            except KVStoreError as exc:
                self._refuse(f"LMCache key {key.to_string()!r} is not stored: {exc}")
        self._descriptors[spec] = desc  # one entry per model/rank/dtype: a handful
        return desc

    def _refuse(self, why: str, level: int = logging.WARNING) -> None:
        """Count a chunk this connector cannot store or load; log each reason once."""
        self.num_refused += 1
        if why not in self._logged:
            self._logged.add(why)
            _log.log(level, "%s", why)

    # --- blocking work (LMCache's threads, or the I/O threads for the async methods) ----

    def _found(self, keys) -> list[bool]:
        """Per key: the store holds both its objects (one lookup for all)."""
        ids = [self._ids(key) for key in keys]
        found = iter(self.store.contains([oid for item in ids if item is not None for oid in item[:2]]))
        return [item is not None and all([next(found), next(found)]) for item in ids]

    def _leading(self, keys) -> int:
        found = self._found(keys)
        return next((i for i, ok in enumerate(found) if not ok), len(found))

    def _put_blocking(self, keys, memory_objs) -> int:
        """Store the chunks (one put_many per descriptor), then drop the references `put` took."""
        try:
            groups: dict[StateDescriptor, list] = {}
            routes: dict[StateDescriptor, list] = {}
            for key, memory_obj in zip(keys, memory_objs):
                item = self._put_items(key, memory_obj)
                if item is not None:
                    groups.setdefault(item[0], []).extend(item[1])
                    routes.setdefault(item[0], []).extend([_route(key, memory_obj)] * len(item[1]))
            return sum(all(self.store.put_many(items, desc, routes[desc])) for desc, items in groups.items())
        finally:
            for memory_obj in memory_objs:
                memory_obj.ref_count_down()

    def _put_items(self, key, memory_obj):
        ids = self._ids(key)
        if ids is None:
            return None
        data_id, meta_id, desc = ids
        from lmcache.v1.protocol import RemoteMetadata
        try:
            data = memory_obj.byte_array
            header = RemoteMetadata(len(data), memory_obj.get_shapes(), memory_obj.get_dtypes(),
                                    memory_obj.get_memory_format()).serialize()
        except Exception as exc:  # a MemoryObj LMCache's own header cannot describe
            self._refuse(f"an LMCache chunk is not stored: its header cannot be written ({type(exc).__name__}: {exc})")
            return None
        return desc, [(data_id, data), (meta_id, header)]

    def _get_many_blocking(self, keys) -> list:
        """Per key a MemoryObj from the local CPU backend holding the chunk, or None: the
        headers of all keys in one get_many_into, then the data of the hits in another."""
        ids = [self._ids(key) for key in keys]
        asked = [i for i, item in enumerate(ids) if item is not None]
        headers = {i: bytearray(self.remote_metadata_bytes) for i in asked}
        got = self.store.get_many_into([(ids[i][1], headers[i]) for i in asked])
        from lmcache.v1.protocol import RemoteMetadata
        out: list = [None] * len(keys)
        for i, found in zip(asked, got):
            if not found:
                continue
            try:
                meta = RemoteMetadata.deserialize(bytes(headers[i]))
                # no busy loop: waiting here for memory that puts queued behind us would free is
                # a deadlock; without memory the chunk is a miss and LMCache recomputes it
                memory_obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt, busy_loop=False)
            except Exception as exc:
                self._refuse(f"an LMCache chunk is not loaded: {type(exc).__name__}: {exc}")
                continue
            if memory_obj is None:
                self.num_no_memory += 1
                continue
            if len(memory_obj.byte_array) != meta.length:
                memory_obj.ref_count_down()
                continue
            out[i] = memory_obj
        loading = [i for i, memory_obj in enumerate(out) if memory_obj is not None]
        try:
            loaded = self.store.get_many_into([(ids[i][0], out[i].byte_array) for i in loading])
        except Exception as exc:
            self._refuse(f"LMCache chunks are not loaded: {type(exc).__name__}: {exc}")
            loaded = [False] * len(loading)
        for i, ok in zip(loading, loaded):
            if not ok:
                out[i].ref_count_down()
                out[i] = None
        return out

    def _submit(self, fn, *args) -> Future | None:
        """fn(*args) on the I/O threads; None once closed."""
        try:
            return self._executor.submit(fn, *args)
        except RuntimeError:  # shut down
            return None

    async def _await(self, job: Future, on_abandoned=None):
        """Wait for `job` without letting a cancellation stop it (it may own references); a
        caller that gives up hands the job's result to `on_abandoned`."""
        try:
            return await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            if on_abandoned is not None:
                job.add_done_callback(
                    lambda done: None if done.cancelled() or done.exception() else on_abandoned(done.result()))
            raise

    # --- RemoteConnector: sync methods --------------------------------------------

    def exists_sync(self, key) -> bool:
        return self._found([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys) -> int:
        """How many leading keys the store holds (one lookup)."""
        return self._leading(keys)

    def remove_sync(self, key) -> bool:
        ids = self._ids(key)
        return ids is not None and self.store.delete(list(ids[:2])) > 0

    def support_batched_put(self) -> bool:
        return True

    def support_batched_async_contains(self) -> bool:
        return True

    def stats(self) -> dict:
        """The store's counters (hits and misses count objects: two per chunk) and this connector's."""
        return {**self.store.stats(), "num_refused": self.num_refused, "num_no_memory": self.num_no_memory}

    # --- RemoteConnector: async methods (LMCache's loop) --------------------------

    async def exists(self, key) -> bool:
        job = self._submit(self.exists_sync, key)
        return False if job is None else await self._await(job)

    async def batched_async_contains(self, lookup_id: str, keys, pin: bool = False) -> int:
        """Leading keys held, in one lookup. `pin` is not honoured: a chunk evicted before
        its get is a miss there, and LMCache recomputes it."""
        job = self._submit(self._leading, keys)
        return 0 if job is None else await self._await(job)

    async def get(self, key):
        return (await self.batched_get([key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys) -> list:
        """Per key its MemoryObj or None, in two round trips for all of them."""
        job = self._submit(self._get_many_blocking, list(keys))
        if job is None:
            return [None] * len(keys)
        return await self._await(job, on_abandoned=_release_all)

    async def batched_get_non_blocking(self, lookup_id: str, keys) -> list:
        """The leading chunks found, in order; those found after the first miss are released."""
        got = await self.batched_get(keys)
        leading = next((i for i, memory_obj in enumerate(got) if memory_obj is None), len(got))
        _release_all(got[leading:])
        return got[:leading]

    async def put(self, key, memory_obj) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys, memory_objs) -> None:
        for memory_obj in memory_objs:
            memory_obj.ref_count_up()  # ours until the copy ends, even if the caller is cancelled
        job = self._submit(self._put_blocking, list(keys), list(memory_objs))
        if job is None:
            for memory_obj in memory_objs:
                memory_obj.ref_count_down()
            return
        await self._await(job)

    async def list(self) -> list[str]:
        """Always empty: object ids are one-way hashes of LMCache's keys."""
        return []

    async def close(self) -> None:
        """Finish the copies in flight, then drop the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        self.store.close()


def _route(key, memory_obj) -> bytes | None:
    """LMCache's name for the chunk in its own KV events (cache_engine.py, CacheStoreEvent):
    its chunk hash, one block of the chunk's tokens. None where the hash is no 64-bit
    integer. A put does not say which chunk came before, nor its tokens."""
    try:
        return Route(block_hashes=[key.chunk_hash], block_size=memory_obj.get_num_tokens() or None).pack()
    except Exception:  # noqa: BLE001 - a name is no reason to lose the chunk: it is published by its id
        return None


def _release_all(memory_objs) -> None:
    for memory_obj in memory_objs:
        if memory_obj is not None:
            memory_obj.ref_count_down()


def _plugin_name(config) -> str:
    """Which entry of `remote_storage_plugins` loads this class (LMCache's loader does not say)."""
    extra = config.extra_config or {}
    ours = [name for name in config.remote_storage_plugins or []
            if extra.get(f"remote_storage_plugin.{name}.module_path") == __name__
            and extra.get(f"remote_storage_plugin.{name}.class_name") == CLASS_NAME]
    if len(ours) != 1:
        raise InvalidArgument(
            f"LMCache config: exactly one entry of remote_storage_plugins must load the kvstore connector "
            f"(extra_config remote_storage_plugin.<name>.module_path = {__name__}, .class_name = {CLASS_NAME}); "
            f"found {ours or 'none'}")
    return ours[0]


def _store_config(extra: dict, prefix: str) -> StoreConfig:
    for name in ("timeout_s", "retry_after_s"):
        value = extra.get(prefix + name)
        try:
            if value is not None and float(value) <= 0:
                raise ValueError
        except (TypeError, ValueError):
            raise InvalidArgument(f"LMCache extra_config {prefix}{name} must be a positive number of seconds, "
                                  f"got {value!r}") from None
    return StoreConfig.from_mapping(extra, prefix)


__getattr__ = lazy_classes(globals(), _build_classes)
