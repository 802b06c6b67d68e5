"""LMCache's own parts, built on CPU, for the kvstore plug-in tests: its engine config naming
the plug-in, metadata for a tiny model (plain or hybrid), CacheEngineKeys, and MemoryObjs from
LMCache's allocator."""

import asyncio

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.utils import EngineType, normalize_and_discover_per_layer_formats
from lmcache.v1.kv_layer_groups import KVLayerGroupsManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.multiprocess.group_view import EngineGroupInfo
from lmcache.v1.storage_backend.connector import CreateConnector

PLUGIN = "kvstore"
MODEL = "test/tiny-model"
CHUNK_TOKENS = 16
# (num_layers, 2, chunk_size, num_kv_heads, head_size): a chunk is 2 x 2 x 16 x 32 bf16 = 4 KiB
KV_SHAPE = (2, 2, CHUNK_TOKENS, 2, 16)


def engine_config(socket_path: str = "", *, chunk_tokens: int = CHUNK_TOKENS, cpu_gb: float = 0.01,
                  **settings) -> LMCacheEngineConfig:
    """LMCache's config with the kvstore plug-in; `settings` become its extra_config keys.
    (bench/engines_lmcache.py passes larger chunks and CPU memory.)"""
    prefix = f"remote_storage_plugin.{PLUGIN}."
    extra = {"module_path": "kvstore.adapters.lmcache", "class_name": "KVStoreConnector", "socket_path": socket_path,
             "timeout_s": 2, "retry_after_s": 0.05, **settings}
    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_tokens, max_local_cpu_size=cpu_gb, remote_serde="naive", remote_storage_plugins=[PLUGIN],
        extra_config={prefix + k: v for k, v in extra.items()})


def yaml_config(socket_path: str) -> str:
    """An LMCache config file turning kvstore on (the keys the README documents)."""
    return f"""\
chunk_size: {CHUNK_TOKENS}
max_local_cpu_size: 0.01
remote_serde: naive
remote_storage_plugins: ["{PLUGIN}"]
extra_config:
  remote_storage_plugin.{PLUGIN}.module_path: kvstore.adapters.lmcache
  remote_storage_plugin.{PLUGIN}.class_name: KVStoreConnector
  remote_storage_plugin.{PLUGIN}.socket_path: {socket_path}
"""


def engine_metadata(kv_shape=KV_SHAPE) -> LMCacheMetadata:
    """LMCache's metadata of a model whose chunks have `kv_shape` (its third entry is the chunk size)."""
    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=kv_shape, chunk_size=kv_shape[2])


def hybrid_layer_groups() -> KVLayerGroupsManager:
    """LMCache's layer groups of a two-layer hybrid model, built from CPU tensors: layer 0
    attention KV, layer 1 recurrent (Mamba-style) state pages, as its multi-process mode
    builds them from vLLM's KV cache groups."""
    caches = [torch.zeros(2, 4, CHUNK_TOKENS, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    caches, formats = normalize_and_discover_per_layer_formats(caches, [[0], [1]], EngineType.VLLM)
    infos = [EngineGroupInfo(engine_group_id=0, layer_indices=(0,), tokens_per_block=CHUNK_TOKENS),
             EngineGroupInfo(engine_group_id=1, layer_indices=(1,), tokens_per_block=CHUNK_TOKENS,
                             sw_size_tokens=CHUNK_TOKENS, recurrent_state=True)]
    return KVLayerGroupsManager(caches, formats, infos, lmcache_tokens_per_chunk=CHUNK_TOKENS,
                                separate_object_groups=True)


def connect(daemon, loop, backend, **settings):
    """What LMCache's factory makes for `plugin://kvstore`: ours, wrapped in its
    InstrumentedRemoteConnector (which drops the caller's MemoryObj reference after put)."""
    return CreateConnector(f"plugin://{PLUGIN}", loop, backend, engine_config(daemon.socket, **settings),
                           backend.metadata, plugin_name=PLUGIN)


def run(loop, coro):
    """Run a connector coroutine on LMCache's loop (another thread), as LMCache does."""
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


def key(chunk_hash: int, worker_id: int = 0, world_size: int = 1, dtype=torch.bfloat16, model: str = MODEL):
    return CacheEngineKey(model, world_size, worker_id, chunk_hash, dtype)


def chunk(backend, seed: int, tokens: int = CHUNK_TOKENS):
    """A MemoryObj from LMCache's allocator holding seeded bf16 values; `tokens` below the chunk
    size makes a partial last chunk."""
    (shape,) = backend.metadata.get_shapes()
    shape = torch.Size([shape[0], shape[1], tokens, shape[3]])
    memory_obj = backend.allocate([shape], [torch.bfloat16], MemoryFormat.KV_2LTD)
    memory_obj.tensor.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
    return memory_obj


def put_chunk(loop, connector, backend, chunk_key, seed: int, tokens: int = CHUNK_TOKENS):
    """Put a fresh chunk as LMCache does, with the extra reference its wrapper drops after put;
    returns the MemoryObj, then holding one reference: the caller's."""
    memory_obj = chunk(backend, seed, tokens)
    memory_obj.ref_count_up()
    run(loop, connector.put(chunk_key, memory_obj))
    return memory_obj
