"""kvstore as an L2 adapter of LMCache's multiprocess (MP) mode (LMCache 0.5.x).

LMCache's MP mode runs one `lmcache server` per node: engines hand it their KV cache, it keeps
chunks in its own L1 (host memory) and stores, looks up and loads them through L2 adapters.
This is one, loaded through LMCache's `plugin` adapter type:

    lmcache server ... --l2-adapter '{"type": "plugin",
        "module_path": "kvstore.adapters.lmcache_mp", "class_name": "KVStoreL2Adapter",
        "adapter_params": {"socket_path": "/run/kvstore/kvstore.sock"}}'

adapter_params (all optional): socket_path (else $KVSTORE_SOCKET, then the daemon's default),
namespace ("default": the daemon makes and prefaults its arena at start, as it does for every
namespace in [host] namespaces; another namespace's first store waits for its arena, seconds for
a large one, and may time out once), model_revision ("main"), timeout_s (5), retry_after_s (2), io_threads
(4: connections to the daemon, one per worker thread), lock_ttl_s (60: how long a lookup's lock
holds at most), group_kinds ({}: object group id -> kind, e.g. {"1": "recurrent"}).
`KVStoreL2AdapterConfig.help()` says the same. Importing this module needs neither LMCache nor
torch: LMCache's loader builds the classes on first access.

Identity. LMCache names an object by an `ObjectKey` (chunk hash, model name, kv rank, object
group id, cache salt); a lookup carries nothing else, so the object id is a function of the
whole key under (namespace, model, model_revision), and the cache salt keeps tenants apart. The
object is stored under the descriptor its buffer describes: the model, the kind of its group,
its dtype (the MemoryObj's; `u8` where LMCache holds bytes, as its benchmark and vLLM's raw
Mamba pages do, or where the object mixes dtypes) and layout raw. A load expects the
descriptor its own buffer describes and the buffer's exact size: an object stored as anything
else is a miss, never copied in. Every copy in and out is checked against the object's
checksum on the store's usual terms.

Hybrid models. LMCache's MP server stores Mamba/GDN state pages (vLLM `align` mode) as object
groups of their own, through the same L2 calls, so this adapter carries them: all groups of a
chunk are separate objects. What LMCache withholds: a group's kind ("attention", "recurrent",
"aux") is derived inside the server and never reaches an L2 adapter (`AttnWindowDesc.group_kinds`
stays server-side; a lookup's `group_layout_descs` carry shapes and dtypes only), so the
descriptor says `kv` unless `group_kinds` names the group. Whether a prefix hit needs every
group is the server's rule (its prefetch asks for all groups and takes the common prefix).

Locks. A lookup pins the objects it found for at most lock_ttl_s, in the lookup's own round
trip, so the daemon does not evict them before LMCache loads them; an unlock unpins an object
once no lookup of this adapter holds it. A lock is a wish, not a promise (an object evicted
between the lookup and its pin, or a lookup racing another's unlock): LMCache's contract lets
a load miss, and a missed load is recomputed.

Lookups queued while one is answered go to the daemon together in the next round trip (LMCache
submits a prefetch's or a round's lookups at once); stores and loads run on the io_threads, one
daemon connection each. The id of each ObjectKey is kept (up to ID_CACHE_KEYS keys): LMCache
stores, looks up and loads the same keys.

Never raises on the data path: a daemon that is down, restarted or slow (past timeout_s) is a
miss, a store that fails is a failed task (`L2StoreResult` -1), all counted in
`report_status()`. Capacity and eviction are the daemon's (its host tier, NVMe, peers), so the
adapter declares no capacity of its own to LMCache's L2 eviction.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

from kvstore.adapters.common import SafeStore, StoreConfig, engine_ids, lazy_classes
from kvstore.dtypes import DType
from kvstore.errors import InvalidArgument
from kvstore.identity import Kind, ObjectId, StateDescriptor

_log = logging.getLogger("kvstore.lmcache_mp")

CLASS_NAME = "KVStoreL2Adapter"
CONFIG_CLASS_NAME = CLASS_NAME + "Config"
ENGINE = "lmcache-mp"
ID_CACHE_KEYS = 1 << 16  # ObjectKeys whose ids the adapter keeps (about 30 MiB at most)
# torch dtypes that are kvstore dtypes; any other (uint8, int8) or a mix is stored as u8
_DTYPES = {"torch.bfloat16": DType.BF16, "torch.float16": DType.FP16, "torch.float32": DType.FP32,
           "torch.float8_e4m3fn": DType.FP8_E4M3, "torch.float8_e5m2": DType.FP8_E5M2}
_DEFAULTS = {"socket_path": None, "namespace": "default", "model_revision": "main", "timeout_s": 5.0,
             "retry_after_s": 2.0, "io_threads": 4, "lock_ttl_s": 60.0, "group_kinds": {}}
_HELP = """kvstore L2 adapter config fields (adapter_params), all optional:
- socket_path (str): the kvstore daemon's socket (default $KVSTORE_SOCKET, then the daemon's default)
- namespace (str): kvstore namespace of LMCache's objects (default "default"; list another in
  the daemon's [host] namespaces so its arena is made at start)
- model_revision (str): model revision in every object's identity (default "main")
- timeout_s (float > 0): a daemon slower than this is a miss (default 5)
- retry_after_s (float > 0): after a failure, skip the daemon this long (default 2)
- io_threads (int 1-64): worker threads, one daemon connection each (default 4)
- lock_ttl_s (float >= 0): a lookup pins what it found this long at most; 0: no pins (default 60)
- group_kinds (dict): object group id -> kvstore kind (kv, mla_latent, recurrent, conv, indexer);
  groups not named are kv (LMCache does not tell L2 adapters a group's kind)

Example: {"type": "plugin", "module_path": "kvstore.adapters.lmcache_mp",
 "class_name": "KVStoreL2Adapter", "adapter_params": {"socket_path": "/run/kvstore/kvstore.sock"}}"""


def parse_params(params: dict) -> dict:
    """adapter_params with defaults filled in and every value checked (ValueError naming the
    field, as LMCache's own adapter configs raise)."""
    if not isinstance(params, dict):
        raise ValueError(f"kvstore L2 adapter: adapter_params must be a dict, got {type(params).__name__}")
    unknown = sorted(set(params) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"kvstore L2 adapter: unknown adapter_params {unknown}; known: {sorted(_DEFAULTS)}")
    out = {**_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    if out["socket_path"] is None:
        out["socket_path"] = os.environ.get("KVSTORE_SOCKET")
    for name in ("socket_path", "namespace", "model_revision"):
        value = out[name]
        if value is not None and (not isinstance(value, str) or not value):
            raise ValueError(f"kvstore L2 adapter: {name} must be a non-empty string, got {value!r}")
    for name, low in (("timeout_s", 0.0), ("retry_after_s", 0.0), ("lock_ttl_s", None)):
        value = out[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                value > 0 if low is not None else value >= 0) or value > 86400:
            raise ValueError(f"kvstore L2 adapter: {name} must be a number of seconds "
                             f"{'> 0' if low is not None else '>= 0'} and at most 86400, got {value!r}")
        out[name] = float(value)
    threads = out["io_threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ValueError(f"kvstore L2 adapter: io_threads must be an integer from 1 to 64, got {threads!r}")
    kinds = out["group_kinds"]
    if not isinstance(kinds, dict):
        raise ValueError(f"kvstore L2 adapter: group_kinds must be a dict of group id -> kind, got {kinds!r}")
    parsed = {}
    for group, kind in kinds.items():
        try:
            group_id = int(group)
            if group_id < 0 or str(group_id) != str(group).strip():
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"kvstore L2 adapter: group_kinds keys must be object group ids (integers >= 0), "
                             f"got {group!r}") from None
        try:
            parsed[group_id] = Kind.parse(kind)
        except InvalidArgument as exc:
            raise ValueError(f"kvstore L2 adapter: group_kinds[{group!r}]: {exc}") from None
        if parsed[group_id] is Kind.GROUP:
            raise ValueError(f"kvstore L2 adapter: group_kinds[{group!r}]: 'group' is kvstore's own manifests")
    out["group_kinds"] = parsed
    try:  # the names once, here, rather than as a miss on every key
        StateDescriptor(out["namespace"], "probe", out["model_revision"])
    except InvalidArgument as exc:
        raise ValueError(f"kvstore L2 adapter: {exc}") from None
    return out


def _key_bytes(key) -> bytes:
    """Everything an ObjectKey names but its model, unambiguously (the salt last)."""
    chunk = bytes(key.chunk_hash)
    return struct.pack("<Hqq", len(chunk), key.kv_rank, key.object_group_id) + chunk + key.cache_salt.encode()


class _Adapter:
    """kvstore behind LMCache's `L2AdapterInterface` (see the module docstring). Built by
    LMCache's plugin loader as (config, l1_memory_desc=...)."""

    def __init__(self, config, l1_memory_desc=None, *, notifier, bitmap, store_result):
        super().__init__(max_capacity_bytes=0)
        params = config.params if hasattr(config, "params") else parse_params(config)
        self.params = params
        self._store_config = StoreConfig(params["socket_path"], params["namespace"], params["timeout_s"],
                                         params["retry_after_s"])
        self._bitmap = bitmap
        self._store_result = store_result
        self._efds = {name: notifier() for name in ("store", "lookup", "load")}
        self._pool = ThreadPoolExecutor(params["io_threads"], thread_name_prefix="kvstore-l2")
        self._local = threading.local()
        self._stores: list[SafeStore] = []
        self._task_ids = itertools.count()
        self._lock = threading.Lock()
        self._done: dict[str, dict] = {"store": {}, "lookup": {}, "load": {}}
        self._locked: dict[ObjectId, int] = {}  # id -> lookups holding it (pinned while > 0)
        self._ids: dict[str, object] = {}  # model -> its id function (None: a refused name)
        # ObjectKey -> id: LMCache stores, looks up and loads the same keys (~0.3 us a hit
        # instead of ~2.5 to hash one again); emptied when full.
        self._id_cache: dict = {}
        self._lookups: list[tuple[int, list]] = []  # (task id, keys) waiting for the next lookup turn
        self._looking = False  # a lookup turn is queued or running
        self._descriptors: dict[tuple, StateDescriptor] = {}
        self._closed = False
        self.counters = {"stored": 0, "store_failed": 0, "stored_bytes": 0, "lookups": 0, "found": 0,
                         "loaded": 0, "load_missed": 0, "loaded_bytes": 0, "refused_keys": 0}

    # --- event fds --------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    # --- LMCache's calls: each returns at once, its work runs on the pool ---------------------

    def submit_store_task(self, keys, objects) -> int:
        return self._submit("store", self._store_batch, keys, objects)

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys, group_layout_descs=None) -> int:
        task_id = next(self._task_ids)
        with self._lock:
            self._lookups.append((task_id, keys))
            if self._looking:  # the running turn takes it next
                return task_id
            self._looking = True
        try:
            if self._closed:
                raise RuntimeError("closed")
            self._pool.submit(self._lookup_turns)
        except RuntimeError:  # closed, or the interpreter is exiting: the lookups miss
            with self._lock:
                queued, self._lookups, self._looking = self._lookups, [], False
            for queued_id, queued_keys in queued:
                self._finish("lookup", queued_id, self._bitmap(len(queued_keys)))
        return task_id

    def query_lookup_and_lock_result(self, task_id: int):
        with self._lock:
            return self._done["lookup"].pop(task_id, None)

    def submit_unlock(self, keys) -> None:
        try:
            self._pool.submit(self._guarded, self._unlock, keys)
        except RuntimeError:  # closed (its pins were dropped) or the interpreter is exiting (they expire)
            pass

    def submit_load_task(self, keys, objects) -> int:
        return self._submit("load", self._load_batch, keys, objects)

    def query_load_result(self, task_id: int):
        with self._lock:
            return self._done["load"].pop(task_id, None)

    def delete(self, keys) -> None:
        ids = [oid for oid in map(self._object_id, keys) if oid is not None]
        if ids:
            self._store().delete(ids)

    def report_status(self) -> dict:
        stores = list(self._stores)
        failures = sum(s.num_failures for s in stores)
        down = [s for s in stores if s.link.down]
        status = {"is_healthy": not self._closed and not (stores and len(down) == len(stores)),
                  "type": "kvstore", "namespace": self.params["namespace"],
                  "socket_path": self._store_config.socket_path, "connections": len(stores),
                  "num_failures": failures, "num_refused": sum(s.num_refused for s in stores),
                  "locked_objects": len(self._locked), **self.counters}
        last = next((s.link.last_error for s in stores if s.link.last_error), "")
        if last:
            status["last_error"] = last
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            held, self._locked = list(self._locked), {}
        if held and self._stores:
            self._stores[0].unpin(held)
        for store in self._stores:
            store.close()
        for efd in self._efds.values():
            efd.close()

    # --- the work -----------------------------------------------------------------------------

    def _submit(self, what: str, fn, *args) -> int:
        task_id = next(self._task_ids)
        try:
            if self._closed:
                raise RuntimeError("closed")
            self._pool.submit(self._run, what, task_id, fn, *args)
        except RuntimeError:  # closed, or the interpreter is exiting: the task fails, LMCache goes on
            self._finish(what, task_id, self._failed_result(what, args[0]))
        return task_id

    def _run(self, what: str, task_id: int, fn, *args) -> None:
        try:
            result = fn(*args)
        except Exception:  # noqa: BLE001 - a task must always complete; LMCache waits on its fd
            _log.exception("kvstore L2 adapter: a %s task failed", what)
            result = self._failed_result(what, args[0])
        self._finish(what, task_id, result)

    def _finish(self, what: str, task_id: int, result) -> None:
        with self._lock:
            self._done[what][task_id] = result
        if not self._closed:  # after close() its fds are gone (and nobody waits on them)
            self._efds[what].notify()

    def _failed_result(self, what: str, keys):
        return self._store_result(False, 0) if what == "store" else self._bitmap(len(keys))

    def _guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - an unlock never fails loudly; its pins expire
            _log.exception("kvstore L2 adapter: an unlock failed (its pins expire after lock_ttl_s)")

    def _store(self) -> SafeStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = SafeStore(self._store_config)
            with self._lock:
                self._stores.append(store)
        return store

    def _store_batch(self, keys, objects):
        batches: dict[StateDescriptor, list] = {}
        for key, obj in zip(keys, objects, strict=True):
            if (named := self._named(key, obj)) is not None:
                oid, desc = named
                data = obj.byte_array
                batches.setdefault(desc, []).append((oid, data, len(data)))
        stored_bytes = stored = 0
        for desc, items in batches.items():
            results = self._store().put_many([(oid, data) for oid, data, _ in items], desc)
            for ok, (_, _, size) in zip(results, items):
                stored += ok
                stored_bytes += size if ok else 0
        failed = len(keys) - stored
        with self._lock:
            self.counters["stored"] += stored
            self.counters["store_failed"] += failed
            self.counters["stored_bytes"] += stored_bytes
        return self._store_result(failed == 0, stored_bytes)

    def _lookup_turns(self) -> None:
        """Answer the queued lookups, all of them in one round trip a turn, until none is
        queued: the tasks LMCache submits together (a prefetch's, a round's in flight) share
        a send and a wakeup, the daemon's real cost per call, instead of one each."""
        while True:
            with self._lock:
                queued, self._lookups = self._lookups, []
                if not queued:
                    self._looking = False
                    return
            try:
                bitmaps = self._lookup_batches([keys for _, keys in queued])
            except Exception:  # noqa: BLE001 - a task must always complete; LMCache waits on its fd
                _log.exception("kvstore L2 adapter: a lookup failed")
                bitmaps = [self._bitmap(len(keys)) for _, keys in queued]
            for (task_id, _), bitmap in zip(queued, bitmaps):
                self._finish("lookup", task_id, bitmap)

    def _lookup_batches(self, key_lists: list[list]) -> list:
        """Per key list its bitmap of the keys held (and pinned: the pins go in the lookup's
        round trip), in one round trip."""
        wanted = [(t, i, oid) for t, keys in enumerate(key_lists)
                  for i, oid in enumerate(map(self._object_id, keys)) if oid is not None]
        ttl = self.params["lock_ttl_s"] or None
        found = self._store().contains([oid for _, _, oid in wanted], pin_ttl_s=ttl) if wanted else []
        bitmaps = [self._bitmap(len(keys)) for keys in key_lists]
        hits = [(t, i, oid) for (t, i, oid), ok in zip(wanted, found) if ok]
        for t, i, _ in hits:
            bitmaps[t].set(i)
        with self._lock:
            if ttl:
                for _, _, oid in hits:
                    self._locked[oid] = self._locked.get(oid, 0) + 1
            self.counters["lookups"] += sum(map(len, key_lists))
            self.counters["found"] += len(hits)
        return bitmaps

    def _unlock(self, keys) -> None:
        released = []
        with self._lock:
            for oid in map(self._object_id, keys):
                count = self._locked.get(oid, 0) if oid is not None else 0
                if count > 1:
                    self._locked[oid] = count - 1
                elif count == 1:
                    del self._locked[oid]
                    released.append(oid)
        if released:
            self._store().unpin(released)

    def _load_batch(self, keys, objects):
        bitmap = self._bitmap(len(keys))
        batches: dict[StateDescriptor, list] = {}
        for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
            if (named := self._named(key, obj)) is not None:
                oid, desc = named
                batches.setdefault(desc, []).append((i, oid, obj.byte_array))
        loaded = loaded_bytes = 0
        for desc, items in batches.items():
            got = self._store().get_many_into([(oid, out) for _, oid, out in items], expect=desc, exact=True)
            for ok, (i, _, out) in zip(got, items):
                if ok:
                    bitmap.set(i)
                    loaded += 1
                    loaded_bytes += len(out)
        with self._lock:
            self.counters["loaded"] += loaded
            self.counters["load_missed"] += len(keys) - loaded
            self.counters["loaded_bytes"] += loaded_bytes
        return bitmap

    # --- identity -----------------------------------------------------------------------------

    def _object_id(self, key) -> ObjectId | None:
        """The key's id; None (a miss, counted) for a model name kvstore refuses."""
        try:
            oid = self._id_cache.get(key)
        except TypeError:  # a key that does not hash (a chunk hash LMCache handed as a bytearray)
            return self._id_of(key, cache=False)
        if oid is not None:
            return oid
        return self._id_of(key)

    def _id_of(self, key, cache: bool = True) -> ObjectId | None:
        """The key's id computed (and kept, with `cache`); None for a refused model name."""
        ids = self._ids.get(key.model_name, False)
        if ids is False:
            ids = self._ids[key.model_name] = self._model_ids(key.model_name)
        if ids is None:
            with self._lock:
                self.counters["refused_keys"] += 1
            return None
        oid = ids(_key_bytes(key))
        if cache:
            if len(self._id_cache) >= ID_CACHE_KEYS:
                self._id_cache = {}
            self._id_cache[key] = oid
        return oid

    def _named(self, key, obj) -> tuple[ObjectId, StateDescriptor] | None:
        """(id, descriptor) of a key and the MemoryObj it stores from or loads into."""
        oid = self._object_id(key)
        return None if oid is None else (oid, self._descriptor(key, obj))

    def _model_ids(self, model: str):
        """engine_object_id under the model's id descriptor, its constant parts hashed once;
        None for a model name kvstore refuses."""
        try:
            desc = StateDescriptor(self.params["namespace"], model, self.params["model_revision"], Kind.KV, DType.U8)
        except InvalidArgument as exc:
            # once per model name (the answer is kept); its keys are counted in refused_keys
            _log.error("kvstore L2 adapter: objects not stored (a miss each): model %r: %s", model, exc)
            return None
        return engine_ids(desc, ENGINE)

    def _descriptor(self, key, obj) -> StateDescriptor:
        """The descriptor `obj` (a MemoryObj) describes for `key`'s group (its model name
        is one kvstore takes: the caller got the key's id)."""
        meta = obj.metadata
        dtypes = meta.dtypes or [meta.dtype]
        names = {_DTYPES.get(str(d)) for d in dtypes}
        dtype = names.pop() if len(names) == 1 and None not in names else DType.U8
        kind = self.params["group_kinds"].get(key.object_group_id, Kind.KV)
        cache_key = (key.model_name, kind, dtype)
        desc = self._descriptors.get(cache_key)
        if desc is None:
            desc = self._descriptors[cache_key] = StateDescriptor(
                self.params["namespace"], key.model_name, self.params["model_revision"], kind, dtype)
        return desc


def _build_classes(name: str) -> dict | None:
    """The adapter and its config class, built (LMCache imported) when LMCache's plugin
    loader asks for either."""
    if name not in (CLASS_NAME, CONFIG_CLASS_NAME):
        return None
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.internal_api import L2StoreResult
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
    from lmcache.v1.platform import create_event_notifier

    class KVStoreL2AdapterConfig(L2AdapterConfigBase):
        __doc__ = _HELP

        def __init__(self, **params):
            self.params = parse_params(params)

        @classmethod
        def from_dict(cls, d: dict) -> KVStoreL2AdapterConfig:
            if not isinstance(d, dict):
                raise ValueError(f"kvstore L2 adapter: adapter_params must be a dict, got {type(d).__name__}")
            return cls(**d)

        @classmethod
        def help(cls) -> str:
            return _HELP

    class KVStoreL2Adapter(_Adapter, L2AdapterInterface):
        __doc__ = _Adapter.__doc__
        config_class_name = CONFIG_CLASS_NAME

        def __init__(self, config, l1_memory_desc=None):
            super().__init__(config, l1_memory_desc, notifier=create_event_notifier, bitmap=Bitmap,
                             store_result=L2StoreResult)

    KVStoreL2Adapter.__qualname__ = CLASS_NAME
    KVStoreL2AdapterConfig.__qualname__ = CONFIG_CLASS_NAME
    return {CLASS_NAME: KVStoreL2Adapter, CONFIG_CLASS_NAME: KVStoreL2AdapterConfig}


__getattr__ = lazy_classes(globals(), _build_classes)
